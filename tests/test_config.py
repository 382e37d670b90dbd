"""[tool.vllm-patch] validation, model resolution and patch selection (pure, no environment)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from support.demo import write_demo_catalog

from hatch_vllm_patch.catalog import Catalog, load_catalog
from hatch_vllm_patch.config import Config, load_project_config
from hatch_vllm_patch.environment import choose_interpreter
from hatch_vllm_patch.errors import CatalogError, ConfigurationError, UsageError
from hatch_vllm_patch.models import read_model
from hatch_vllm_patch.selection import select, unknown_architecture_notes
from hatch_vllm_patch.trust import chosen


@pytest.fixture
def catalog(tmp_path: Path) -> Catalog:
    root = write_demo_catalog(tmp_path / "catalog")
    toml = (root / "demo-fix" / "patch.toml").read_text()
    (root / "demo-fix" / "patch.toml").write_text(
        toml.replace('["DemoForCausalLM"]', '["Qwen3_5MoeForConditionalGeneration"]'))
    return load_catalog(root)


def load_config(project_dir: Path, catalog: Catalog) -> Config | None:
    """The project's configuration, the project named by the user's command."""
    return load_project_config(chosen(project_dir), catalog)


def project(tmp_path: Path, table: str) -> Path:
    root = tmp_path / "proj"
    root.mkdir(exist_ok=True)
    (root / "pyproject.toml").write_text(textwrap.dedent(table))
    return root


def model(path: Path, **config: object) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_no_table_means_no_config(tmp_path: Path, catalog: Catalog) -> None:
    """A project without [tool.vllm-patch] has no config (and no pyproject is fine too)."""
    assert load_config(project(tmp_path, "[project]\nname='x'\n"), catalog) is None
    assert load_config(tmp_path / "nowhere", catalog) is None


def test_every_error_is_reported_with_its_toml_path(tmp_path: Path, catalog: Catalog) -> None:
    """One pass collects all errors, each prefixed with its full TOML path."""
    root = project(tmp_path, """
        [tool.vllm-patch]
        python = 3
        models = "one"
        extra = true
        [tool.vllm-patch.architectures]
        A = ["demo-fix"]
        [tool.vllm-patch.architectures.B]
        patches = ["demo-fix", "demo-fix", "nope"]
        colour = "red"
        """)
    with pytest.raises(ConfigurationError) as info:
        load_config(root, catalog)
    assert info.value.errors == [
        "tool.vllm-patch.extra: unknown key (expected one of: architectures, guard, models, "
        "patch-dir, patches, python)",
        "tool.vllm-patch.python: expected a non-empty string, found an integer",
        "tool.vllm-patch.models: expected an array of paths, found a string",
        "tool.vllm-patch.architectures.A: expected a table (e.g. patches = [...]), found an array",
        "tool.vllm-patch.architectures.B.colour: unknown key (expected: patches)",
        "tool.vllm-patch.architectures.B.patches[1]: 'demo-fix' is listed twice",
        "tool.vllm-patch.architectures.B.patches[2]: unknown patch 'nope' "
        "(known patches: demo-fix)",
    ]
    assert str(root / "pyproject.toml") in str(info.value)


def test_invalid_toml_is_a_configuration_error(tmp_path: Path, catalog: Catalog) -> None:
    """A pyproject.toml that does not parse is reported, not raised as a traceback."""
    root = project(tmp_path, "[tool.vllm-patch\n")
    with pytest.raises(ConfigurationError, match="not valid TOML"):
        load_config(root, catalog)


def test_architecture_table_selects_explicit_or_default_patches(tmp_path: Path,
                                                                catalog: Catalog) -> None:
    """An architecture table selects its listed patches, or the catalog's when none are listed."""
    explicit = load_config(project(tmp_path, """
        [tool.vllm-patch.architectures.Qwen3_5MoeForConditionalGeneration]
        patches = []
        """), catalog)
    assert select(catalog, explicit).patches == ()
    default = load_config(project(tmp_path, """
        [tool.vllm-patch.architectures.Qwen3_5MoeForConditionalGeneration]
        """), catalog)
    chosen = select(catalog, default)
    assert [p.id for p in chosen.patches] == ["demo-fix"]
    assert chosen.why["demo-fix"] == ("Qwen3_5MoeForConditionalGeneration (catalog default)",)


def test_fine_tune_resolves_through_model_type(tmp_path: Path, catalog: Catalog) -> None:
    """A custom architecture name resolves to its family through model_type."""
    model(tmp_path / "proj" / "ft", architectures=["MyChat"], model_type="qwen3_5_moe")
    config = load_config(project(tmp_path, """
        [tool.vllm-patch]
        models = ["ft"]
        """), catalog)
    assert config is not None and config.models == ((tmp_path / "proj" / "ft").resolve(),)
    chosen = select(catalog, config)
    assert [p.id for p in chosen.patches] == ["demo-fix"]
    assert "via MyChat in " in chosen.why["demo-fix"][0]


def test_fine_tune_resolves_through_text_config(tmp_path: Path) -> None:
    """model_type under text_config and linear_attention layer types are read too."""
    info = read_model(model(tmp_path / "m", architectures=["X"], model_type="custom_vl",
                            text_config={"model_type": "qwen3_5_text",
                                         "layer_types": ["linear_attention", "full_attention"]}))
    assert info.families == ("X", "Qwen3_5ForCausalLM")
    assert info.hybrid_linear_attention


def test_custom_architecture_table_uses_the_models_family(tmp_path: Path,
                                                          catalog: Catalog) -> None:
    """A table keyed by a fine-tune's own name gets its family's patches via the model dir."""
    model(tmp_path / "proj" / "ft", architectures=["MyChat"], model_type="qwen3_5_moe")
    config = load_config(project(tmp_path, """
        [tool.vllm-patch]
        models = ["ft"]
        [tool.vllm-patch.architectures.MyChat]
        """), catalog)
    assert [p.id for p in select(catalog, config).patches] == ["demo-fix"]


def test_unknown_hybrid_gets_a_note(tmp_path: Path, catalog: Catalog) -> None:
    """A hybrid model of an unknown family selects nothing and says how to select."""
    path = model(tmp_path / "m", architectures=["Mystery"], model_type="mystery",
                 layer_types=["linear_attention", "full_attention"])
    chosen = select(catalog, None, models=[path])
    assert chosen.patches == ()
    assert any("linear_attention layers" in n for n in chosen.notes)


def test_command_line_overrides_config(tmp_path: Path, catalog: Catalog) -> None:
    """--patch / --architecture replace the project's selection; unknown ids are usage errors."""
    config = load_config(project(tmp_path, """
        [tool.vllm-patch.architectures.Qwen3_5MoeForConditionalGeneration]
        patches = []
        """), catalog)
    assert [p.id for p in select(catalog, config, patches=["demo-fix"]).patches] == ["demo-fix"]
    with pytest.raises(UsageError, match="did you mean demo-fix"):
        select(catalog, config, patches=["demo-fx"])


def test_unknown_architecture_notes_offer_close_matches() -> None:
    """Names the registry lacks are reported with the closest registered names."""
    notes = unknown_architecture_notes(["Qwen3NextForCausalLm", "LlamaForCausalLM"],
                                       ["Qwen3NextForCausalLM", "LlamaForCausalLM"])
    assert notes == ["architecture 'Qwen3NextForCausalLm' is not registered by the installed "
                     "vLLM; did you mean Qwen3NextForCausalLM?"]


def test_interpreter_choice_order(tmp_path: Path) -> None:
    """--python, config python, $UV_PROJECT_ENVIRONMENT, .venv, then the running interpreter."""
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    env = {"UV_PROJECT_ENVIRONMENT": "uvenv"}
    assert choose_interpreter(tmp_path, "/x/python", "cfg", env).reason == "given with --python"
    assert choose_interpreter(tmp_path, None, "cfg", env).python == tmp_path / "cfg"
    assert choose_interpreter(tmp_path, None, None, env).python == tmp_path / "uvenv"
    dot = choose_interpreter(tmp_path, None, None, {})
    assert dot.reason == "the project's .venv" and dot.python == tmp_path / ".venv"
    assert choose_interpreter(tmp_path / "none", None, None, {}).reason == \
        "the running interpreter"


def test_malformed_catalog_is_reported(tmp_path: Path) -> None:
    """A broken patch folder is reported with file and field, every problem at once."""
    folder = tmp_path / "cat" / "bad-patch"
    folder.mkdir(parents=True)
    (folder / "patch.toml").write_text('id = "other"\nsurprise = 1\n[target]\nmodule = "a b"\n')
    with pytest.raises(CatalogError) as info:
        load_catalog(tmp_path / "cat")
    text = str(info.value)
    for expected in ("unknown key 'surprise'", "must equal the folder name",
                     "target.module 'a b' is not a dotted module path", "block.py is missing",
                     "needs `shapes`"):
        assert expected in text


def test_table_reached_through_a_model_is_one_reason(tmp_path: Path, catalog: Catalog) -> None:
    """A model whose family has its own table (the example project's setup) gives one reason
    per patch, naming the table and the model; the architecture is listed once."""
    model(tmp_path / "proj" / "ft", architectures=["MyChat"], model_type="qwen3_5_moe")
    config = load_config(project(tmp_path, """
        [tool.vllm-patch]
        models = ["ft"]
        [tool.vllm-patch.architectures.Qwen3_5MoeForConditionalGeneration]
        patches = ["demo-fix"]
        """), catalog)
    chosen = select(catalog, config)
    assert [p.id for p in chosen.patches] == ["demo-fix"]
    [reason] = chosen.why["demo-fix"]
    assert reason.startswith("Qwen3_5MoeForConditionalGeneration ([tool.vllm-patch.architectures."
                             "Qwen3_5MoeForConditionalGeneration], via MyChat in "), reason
    assert chosen.architectures.count("Qwen3_5MoeForConditionalGeneration") == 1
