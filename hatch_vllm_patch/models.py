"""A model directory's ``config.json`` -> the architectures it declares and the family it is.

Fine-tunes keep the base ``architectures`` or carry a custom name; ``model_type`` (also under
``text_config``) and ``layer_types`` containing ``"linear_attention"`` still say what they are.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

from .bounded import MAX_BYTES, MAX_DEPTH, BoundExceeded, load_json
from .errors import ConfigurationError, UsageError

# model_type -> the vLLM architecture of that family
FAMILY_BY_MODEL_TYPE: dict[str, str] = {
    "qwen3_5": "Qwen3_5ForConditionalGeneration",
    "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
    "qwen3_5_text": "Qwen3_5ForCausalLM",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
    "olmo_hybrid": "OlmoHybridForCausalLM",
}


class ModelInfo(NamedTuple):
    """What a model directory says about itself."""

    path: Path
    architectures: tuple[str, ...]
    model_type: str | None
    text_model_type: str | None
    hybrid_linear_attention: bool

    @property
    def families(self) -> tuple[str, ...]:
        """The declared architectures followed by the family they resolve to (no duplicates)."""
        names = list(self.architectures)
        for model_type in (self.model_type, self.text_model_type):
            family = FAMILY_BY_MODEL_TYPE.get(model_type or "")
            if family and family not in names:
                names.append(family)
        return tuple(names)


def _layer_types(config: dict[str, Any]) -> list[Any]:
    value = config.get("layer_types")
    return value if isinstance(value, list) else []


def read_model(path: Path, where: str = "model") -> ModelInfo:
    """Read ``<path>/config.json``; ConfigurationError (prefixed by ``where``) when unusable."""
    config_file = path / "config.json"
    try:
        data = load_json(config_file)
    except FileNotFoundError:
        raise ConfigurationError(
            [f"{where}: {config_file} does not exist (a model directory needs config.json)"]
        ) from None
    except BoundExceeded as exc:
        raise ConfigurationError([f"{where}: {config_file} is refused: {exc} (a model's "
                                  f"config.json is read up to {MAX_BYTES >> 20} MiB and "
                                  f"{MAX_DEPTH} levels deep)"]) from None
    except (OSError, ValueError) as exc:
        raise ConfigurationError([f"{where}: {config_file} is not readable JSON: {exc}"]) from None
    if not isinstance(data, dict):
        raise ConfigurationError([f"{where}: {config_file} must hold a JSON object"])
    architectures = data.get("architectures") or []
    if not isinstance(architectures, list) or not all(isinstance(a, str) for a in architectures):
        raise ConfigurationError([f"{where}: {config_file}: architectures must be a list of names"])
    text = data.get("text_config") if isinstance(data.get("text_config"), dict) else {}
    assert isinstance(text, dict)
    hybrid = "linear_attention" in _layer_types(text) + _layer_types(data)
    text_model_type = text.get("model_type") if isinstance(text.get("model_type"), str) else None
    model_type = data.get("model_type") if isinstance(data.get("model_type"), str) else None
    return ModelInfo(path, tuple(architectures), model_type, text_model_type, hybrid)


# A Hugging Face hub id, "Org/Name" with an optional "@revision"; never a path (no leading
# "." or "/", exactly one slash).
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*(@[\w./-]+)?$")


def is_hub_id(text: str) -> bool:
    return bool(_HUB_ID.fullmatch(text)) and ".." not in text


def hub_cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """Where the Hugging Face hub keeps downloaded repositories: ``$HF_HUB_CACHE``, else
    ``$HF_HOME/hub`` (``$HF_HOME`` defaults to ``$XDG_CACHE_HOME/huggingface``, that to
    ``~/.cache/huggingface``)."""
    environ = os.environ if environ is None else environ
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if environ.get(name):
            return Path(environ[name]).expanduser()
    home = environ.get("HF_HOME") or os.path.join(
        environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "huggingface")
    return Path(home).expanduser() / "hub"


def model_above(name: str, base: Path | None = None) -> str | None:
    """For a relative model path that is no directory from ``base`` (default the working
    directory): the same path from a folder above ``base`` (up to a repository root), where it
    is a model directory — ``models/x`` typed in a subfolder of the project — shown relative to
    ``base``; else None."""
    path = Path(name).expanduser()
    if path.is_absolute() or not name:
        return None
    start = (base or Path.cwd()).absolute()
    for folder in start.parents:
        if (folder / path / "config.json").is_file():
            return os.path.relpath(folder / path, start)
        if (folder / ".git").exists():
            break
    return None


def resolve_model_dir(arg: str, base: Path | None = None, *, where: str = "model",
                      environ: Mapping[str, str] | None = None) -> Path:
    """The model directory ``arg`` names: a path (relative to ``base``, default the working
    directory), or a hub id (``Qwen/Qwen3.6-35B-A3B``, ``Org/Name@revision``) whose snapshot is
    in the local Hugging Face cache — read offline, never downloaded.

    A path is returned as it is (``read_model`` says what is wrong with it); a hub id that is
    not cached raises UsageError saying where it looked."""
    path = Path(arg).expanduser()
    path = path if path.is_absolute() else (base or Path.cwd()) / path
    if path.is_dir() or not is_hub_id(arg):
        return path.resolve()
    repo, _, revision = arg.partition("@")
    cache = hub_cache_dir(environ)
    folder = cache / f"models--{repo.replace('/', '--')}"
    snapshots = folder / "snapshots"
    ref = folder / "refs" / (revision or "main")
    commit = None
    try:
        commit = ref.read_text(encoding="utf-8").strip() or None
    except (OSError, UnicodeDecodeError):
        if revision:
            commit = revision  # a commit hash given as the revision
    candidates: list[Path] = []
    if commit is not None:
        candidates = [snapshots / commit]
    elif not revision and snapshots.is_dir():  # no refs/main: the newest snapshot with a config
        candidates = sorted((d for d in snapshots.iterdir() if (d / "config.json").is_file()),
                            key=lambda d: d.stat().st_mtime, reverse=True)
    for snapshot in candidates:
        if (snapshot / "config.json").is_file():
            return snapshot
    above = model_above(arg, base)
    if above:  # a relative path typed in a subfolder, not a hub id
        raise UsageError(f"{where}: {arg!r} is not a directory here ({path}); {above} is a "
                         "model directory: pass that path")
    shown = f"{snapshots}/{commit or '*'}/config.json"
    raise UsageError(
        f"{where}: {arg!r} is not a directory ({path}) and not in the local Hugging Face cache "
        f"(looked for {shown}; the cache is $HF_HUB_CACHE, else $HF_HOME/hub: {cache}); "
        f"download it first (e.g. `hf download {repo} config.json`"
        f"{' --revision ' + revision if revision else ''}) or give the model's directory")
