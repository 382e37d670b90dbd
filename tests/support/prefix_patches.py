"""The prefix-caching patches (hybrid-prefix-mamba-block, hybrid-prefix-drafter-window,
mamba-all-mode-chunk-align): which of them claim a release, and the blocks each executes in
vLLM's modules, as vLLM's own tests and the scenario scripts take them."""

from __future__ import annotations

from packaging.version import Version

from support import REPO
from support.release_shapes import expected

PATCHES = REPO / "patches"
MAMBA = "hybrid-prefix-mamba-block"
WINDOW = "hybrid-prefix-drafter-window"
CHUNK = "mamba-all-mode-chunk-align"
# What each patch executes in vLLM's modules: (module, the function its block wraps, block).
# hybrid-prefix-drafter-window wraps the grouping in kv_cache_utils (0.27 - 0.32) or
# kv_cache_planning (0.33+).
_WINDOW_MODULE = {True: "vllm.v1.core.kv_cache_planning", False: "vllm.v1.core.kv_cache_utils"}


def blocks(patch: str, version: str) -> list[list[str]]:
    if patch == MAMBA:
        return [["vllm.v1.core.sched.scheduler", "Scheduler._mamba_block_aligned_split",
                 str(PATCHES / MAMBA / "scheduler_block.py")],
                ["vllm.v1.worker.gpu.model_states.mamba_hybrid",
                 "MambaHybridModelState.add_request", str(PATCHES / MAMBA / "worker_block.py")]]
    if patch == WINDOW:
        module = _WINDOW_MODULE[Version(version) >= Version("0.33.0")]
        return [[module, "_get_kv_cache_groups_uniform_page_size",
                 str(PATCHES / WINDOW / "block.py")]]
    return [["vllm.model_executor.models.config", "MambaModelConfig.verify_and_update_config",
             str(PATCHES / CHUNK / "block.py")]]


def claims(version: str) -> list[str]:
    """The prefix patches that claim ``version``: the ones `vllm-patch verify` calls missing
    (applicable, not applied) on its files as released (tests/test_release_shapes.py)."""
    return [p for p in (MAMBA, WINDOW, CHUNK) if expected(p, version) == "missing"]


def other_blocks(patch: str, version: str) -> list[str]:
    """The blocks of the prefix patches other than ``patch`` that claim ``version``, as the
    scenario scripts take them (``MODULE=BLOCK.py``): what a project that applies them too runs."""
    return [f"{module}={path}" for other in claims(version) if other != patch
            for module, _, path in blocks(other, version)]
