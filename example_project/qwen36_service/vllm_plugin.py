"""A vLLM general plugin that makes an unpatched vLLM visible in the server log.

vLLM calls every ``vllm.general_plugins`` entry point in each of its processes (API server,
engine core, workers) before it builds a model. uv hides build output unless run with ``-v``, so
a patch the build hook had to refuse (vLLM code of a shape it does not know, a modified file)
would otherwise go unnoticed until the server fails. This check only reads files (no vLLM import,
one short subprocess) and never stops the server.
"""

from __future__ import annotations

import logging
import sys

PATCHES = ("kv-cache-page-unification",)


def check_patches() -> None:
    """Log an error for each of :data:`PATCHES` that is not in place in this environment."""
    logger = logging.getLogger("vllm.qwen36_service")  # vLLM's own logger shows it
    try:
        import hatch_vllm_patch

        report = hatch_vllm_patch.verify(python=sys.executable, patches=PATCHES)
    except Exception as exc:  # the check itself must never take the server down
        logger.warning("hatch-vllm-patch: could not verify the vLLM patches: %s", exc)
        return
    for outcome in report.outcomes:
        if not outcome.ok:
            logger.error(
                "hatch-vllm-patch: %s is %s in this vLLM (%s); next: %s",
                outcome.patch_id, outcome.verdict.value, outcome.reason,
                outcome.next_step or "uv run vllm-patch verify",
            )
