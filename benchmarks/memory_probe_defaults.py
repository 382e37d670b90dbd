"""In-environment helper of ``benchmarks/memory.py``: the defaults of config classes whose
defaults are a model of the table (transformers' Qwen3NextConfig, vLLM's NemotronHConfig), so
memory.py can say whether they equal the dimensions it writes.

``python memory_probe_defaults.py JOB.json OUT.json``. Not meant to be run by hand. The KV
pages themselves come from doctor's probe, ``hatch_vllm_patch/_kv_probe.py``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _error(exc: BaseException) -> str:
    text = " ".join(line.strip() for line in str(exc).strip().splitlines())
    return f"{type(exc).__name__}: {text[:400]}" if text else type(exc).__name__


def main() -> int:
    job = json.loads(Path(sys.argv[1]).read_text(encoding="utf-8"))
    out = Path(sys.argv[2])
    text = json.dumps({"config_defaults": job_defaults(job)}, indent=1)
    # A new file of a random name created exclusively, then renamed (files.write_atomic's rule;
    # this script runs in the target environment, without hatch_vllm_patch).
    import secrets

    tmp = out.with_name(f".{out.name}.{secrets.token_hex(8)}.hvp-tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, out)
    return 0


def job_defaults(job: dict[str, Any]) -> dict[str, Any]:
    """For models whose dimensions are also a config class's defaults: the class's values of
    the fields that memory.py wrote, so memory.py can say whether they agree."""
    import importlib

    result: dict[str, Any] = {}
    for model in job["models"]:
        check = model.get("defaults_of")
        if not check:
            continue
        module_name, _, class_name = check.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
            instance = cls()
        except Exception as exc:
            result[model["name"]] = {"class": check, "error": _error(exc)}
            continue
        fields = {field: getattr(instance, field, "<absent>") for field in model["fields"]}
        result[model["name"]] = {"class": check, "values": fields}
    return result


if __name__ == "__main__":
    sys.exit(main())
