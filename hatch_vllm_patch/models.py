"""A model directory's ``config.json`` -> the architectures it declares and the family it is.

Fine-tunes keep the base ``architectures`` or carry a custom name; ``model_type`` (also under
``text_config``) and ``layer_types`` containing ``"linear_attention"`` still say what they are.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple

from .errors import ConfigurationError

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
        data = json.loads(config_file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigurationError(
            [f"{where}: {config_file} does not exist (a model directory needs config.json)"]
        ) from None
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
