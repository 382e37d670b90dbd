"""The model folder, read as foreign data: unregistered fine-tunes, remote code, a native copy, why
vLLM could not inspect a class.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..environment import last_line, run_target_python
from ..errors import UsageError
from ..models import FAMILY_BY_MODEL_TYPE, read_model


def unregistered_override(model_dir: Path, registered: Sequence[str] | None
                          ) -> tuple[dict[str, Any] | None, str | None]:
    """For a fine-tune whose architecture vLLM does not register, the base architecture its
    ``model_type`` names (as ``--hf-overrides '{"architectures": [...]}'``), with a note."""
    info = read_model(model_dir, "--model")
    if registered is None or not info.architectures:
        return None, None
    if any(a in registered for a in info.architectures):
        return None, None
    for model_type in (info.model_type, info.text_model_type):
        family = FAMILY_BY_MODEL_TYPE.get(model_type or "")
        if family and family in registered:
            override = {"architectures": [family]}
            return override, (
                f"vLLM does not register {', '.join(info.architectures)}; doctor ran it as "
                f"{family} (model_type {model_type}), as `vllm serve --hf-overrides "
                f"'{json.dumps(override)}'` does: pass that option when you serve it")
    return None, None


def refuse_unregistered(architectures: Sequence[str], registered: Sequence[str] | None,
                        model: str, where: str) -> None:
    """UsageError when the installed vLLM registers none of ``architectures`` (a misspelt
    name, with its model_type naming no family it registers): vLLM would not run this model's
    own class, so no verdict about it can be given."""
    if registered is None or not architectures or any(a in registered for a in architectures):
        return
    import difflib

    close = [c for a in architectures
             for c in difflib.get_close_matches(a, registered, n=2, cutoff=0.8)]
    hint = f" (did you mean {' or '.join(dict.fromkeys(close))}?)" if close else ""
    raise UsageError(f"--model {model}: the installed vLLM registers no architecture "
                     f"{', '.join(architectures)} of {where}{hint}, and its model_type names no "
                     "family it does: fix the name, or pass --hf-overrides "
                     "'{\"architectures\": [\"NAME\"]}' with a registered one")


# vLLM inspects a model class in a subprocess of its own and shows only this line, not why.
INSPECTION_FAILED = "failed to be inspected"
# Imports that a model module makes and an environment may lack, by the architecture's prefix,
# with why the module needs it: tried one by one in the target when the inspection failed.
INSPECTION_IMPORTS = {
    "Qwen3_5": (("torchvision", "vLLM's qwen3_5.py imports transformers' Qwen2-VL image "
                 "processor, which imports torchvision"),),
}


def inspection_cause(python: Path, architecture: str, module: str | None,
                     timeout: float) -> str:
    """Why vLLM could not inspect ``architecture``: the import that fails in the target (tried
    from :data:`INSPECTION_IMPORTS`) and its fix, else how to see the hidden error."""
    for prefix, imports in INSPECTION_IMPORTS.items():
        if not architecture.startswith(prefix):
            continue
        for name, why in imports:
            proc = run_target_python(python, ["-c", f"import {name}"], timeout=timeout,
                                     what=f"import {name}")
            if proc.returncode != 0:
                return (f"vLLM could not inspect {architecture}: `import {name}` fails in "
                        f"{python} ({last_line(proc.stderr)}); {why}. Fix: install the "
                        f"{name} build that matches the installed torch (for a CPU torch, from "
                        f"https://download.pytorch.org/whl/cpu); for doctor alone a stand-in "
                        f"package is enough (docs/how-to/cpu-build.md)")
    shown = module or "vllm.model_executor.models.<the model's module>"
    return (f"vLLM inspects {architecture} in a subprocess and hides its error: "
            f"`{python} -c \"import {shown}\"` shows it")


def remote_code_of(model_dir: Path) -> bool:
    """Does the model's config.json name remote code (``auto_map``)?"""
    from ..bounded import load_json

    try:
        data = load_json(model_dir / "config.json")
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and bool(data.get("auto_map"))


MAX_NATIVE_FILE = 8 << 20  # a tokenizer.json of a large vocabulary is a few MiB
MAX_NATIVE_TOTAL = 64 << 20


def native_copy(model_dir: Path, folder: Path) -> Path:
    """The model's JSON files in ``folder``, config.json without ``auto_map``: what doctor
    loads when vLLM registers the architecture itself (no weights, no code are copied).

    The model folder is foreign data: only its regular ``*.json`` files are read, each opened
    non-blocking and checked with ``fstat`` (a FIFO, ``/dev/zero``, a directory are refused),
    at most 8 MiB each and 64 MiB together; a symlink must stay inside the folder (or, for a
    Hugging Face cache snapshot, inside the model's cache folder, where its blobs are). Every
    refusal is a UsageError naming the file; ``folder`` is the caller's to remove."""
    from ..bounded import BoundExceeded, loads_json, read_regular

    roots = [model_dir.resolve()]
    if model_dir.parent.name == "snapshots":  # <cache>/models--org--name/snapshots/<rev>
        roots.append(model_dir.parent.parent.resolve())
    target = folder / model_dir.name
    target.mkdir()
    total = 0
    for source in sorted(model_dir.glob("*.json")):
        real = source.resolve()
        if not any(real == r or r in real.parents for r in roots):
            raise UsageError(f"{source}: a model file must lie inside the model folder; it "
                             f"leads to {real}: remove the link, or copy the file into "
                             f"{model_dir}")
        try:
            raw = read_regular(source, MAX_NATIVE_FILE)
            total += len(raw)
            if total > MAX_NATIVE_TOTAL:
                raise BoundExceeded(f"the model's JSON files together exceed "
                                    f"{MAX_NATIVE_TOTAL >> 20} MiB")
            text = raw.decode("utf-8")
            if source.name == "config.json":
                data = loads_json(text)
                if not isinstance(data, dict):
                    raise ValueError("it does not hold a JSON object")
                data.pop("auto_map", None)
                text = json.dumps(data, indent=1)
        except UnicodeDecodeError as exc:
            raise UsageError(f"{source}: a model's JSON file must be UTF-8 text; found a "
                             f"byte that is not ({exc.reason} at {exc.start}): fix or remove "
                             "the file") from None
        except (OSError, ValueError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
            raise UsageError(f"{source}: refused as a model file: {reason}; doctor reads "
                             f"regular JSON files of at most {MAX_NATIVE_FILE >> 20} MiB: fix "
                             "or remove it") from None
        (target / source.name).write_text(text, encoding="utf-8")
    return target
