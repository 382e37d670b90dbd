"""Foreign data is bounded and escaped: a model's config.json (``status --model``, a project's
``models = [...]``, doctor) and a project's TOML are read with size and depth limits, one clear
error naming the file; control characters from them are escaped in text output."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from support.commands import cli

from hatch_vllm_patch.bounded import MAX_BYTES, BoundExceeded, escape_controls, load_json

DEEP = "[" * 200_000 + "]" * 200_000


def model_dir(root: Path, text: str) -> Path:
    root.mkdir(parents=True)
    (root / "config.json").write_text(text)
    return root


@pytest.fixture(params=["deep", "huge"])
def bad_model(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    """A config.json nested 200,000 deep, or larger than the bound."""
    if request.param == "deep":
        return model_dir(tmp_path / "deep", '{"architectures": ' + DEEP + "}")
    return model_dir(tmp_path / "huge", json.dumps({"architectures": ["X"],
                                                    "pad": "a" * (MAX_BYTES + 10)}))


def clear_error(proc: object, config: Path, as_json: bool) -> None:
    out, err = proc.stdout, proc.stderr  # type: ignore[attr-defined]
    assert proc.returncode == 2, out + err  # type: ignore[attr-defined]
    assert "Traceback" not in out + err and "RecursionError" not in out + err, err
    if as_json:
        doc = json.loads(out)
        assert any(str(config) in e for e in doc["errors"]), doc
    else:
        assert str(config) in err and len(err.strip().splitlines()) == 1, err


def test_status_model_refuses_deep_and_huge_configs(bad_model: Path, demo_catalog: Path) -> None:
    """status --model: exit 2 naming the config.json, text and --json (never empty stdout)."""
    for as_json in (False, True):
        args = ["status", "--model", str(bad_model), "--python", sys.executable]
        proc = cli(*args, *(["--json"] if as_json else []), catalog=demo_catalog)
        clear_error(proc, bad_model / "config.json", as_json)


def test_project_models_refuse_deep_and_huge_configs(bad_model: Path, tmp_path: Path,
                                                     demo_catalog: Path) -> None:
    """A project's models = [...] naming such a model: exit 2 naming the config.json."""
    project = tmp_path / "proj"
    project.mkdir()
    (project / "pyproject.toml").write_text(
        f'[tool.vllm-patch]\npython = "{sys.executable}"\nmodels = ["{bad_model}"]\n')
    for as_json in (False, True):
        proc = cli("status", *(["--json"] if as_json else []), cwd=project, catalog=demo_catalog)
        clear_error(proc, bad_model / "config.json", as_json)


def test_doctor_refuses_the_config_before_starting_anything(bad_model: Path,
                                                            tmp_path: Path) -> None:
    """doctor reads the model's config.json (bounded) before it asks any environment: with an
    interpreter that does not exist, the error is still the config's."""
    proc = cli("doctor", "--model", str(bad_model), "--python", str(tmp_path / "no-python"),
               "--json")
    clear_error(proc, bad_model / "config.json", True)


def test_deep_toml_is_a_configuration_error(tmp_path: Path, demo_catalog: Path) -> None:
    """A pyproject.toml nested deeper than the parser can follow: exit 2 naming it."""
    project = tmp_path / "proj"
    project.mkdir()
    (project / "pyproject.toml").write_text(
        "[tool.vllm-patch]\npatches = " + "[" * 5000 + "]" * 5000 + "\n")
    proc = cli("status", cwd=project, catalog=demo_catalog)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert str(project / "pyproject.toml") in proc.stderr, proc.stderr


def test_bounds_of_the_reader(tmp_path: Path) -> None:
    """The reader takes what is within the bounds and names the bound it refuses."""
    ok = tmp_path / "ok.json"
    ok.write_text(json.dumps({"a": [[[1]]]}))
    assert load_json(ok) == {"a": [[[1]]]}
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 150 + "]" * 150)  # within the parser, beyond the bound
    with pytest.raises(BoundExceeded, match="nested deeper than 100"):
        load_json(deep)


def test_escape_sequences_in_architectures_are_printed_escaped(tmp_path: Path,
                                                               demo_catalog: Path) -> None:
    """An architecture name carrying terminal escapes reaches the text output escaped."""
    model = model_dir(tmp_path / "m", json.dumps(
        {"architectures": ["Evil\x1b[2J\x1b[31mForCausalLM\r"]}))
    proc = cli("status", "--model", str(model), "--python", sys.executable,
               catalog=demo_catalog)
    out = proc.stdout + proc.stderr
    assert "\x1b" not in out and "\r" not in out, out
    assert "Evil\\x1b[2J\\x1b[31mForCausalLM\\r" in out, out
    assert escape_controls("é\tok\n") == "é\tok\n"


def test_a_ctrl_c_while_reading_stays_a_ctrl_c(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A Ctrl-C that lands while a bounded read holds its descriptor reaches the caller as the
    Ctrl-C (never an OSError from closing the descriptor twice, which the catalog reported as an
    unreadable block), and the descriptor is closed once."""
    import os

    from hatch_vllm_patch import bounded

    target = tmp_path / "block.py"
    target.write_text("x = 1\n")
    closed: list[int] = []
    real_close = os.close

    def interrupted_read(fd: int, n: int) -> bytes:
        raise KeyboardInterrupt

    def counted_close(fd: int) -> None:
        closed.append(fd)
        real_close(fd)

    monkeypatch.setattr(bounded.os, "read", interrupted_read)
    monkeypatch.setattr(bounded.os, "close", counted_close)
    with pytest.raises(KeyboardInterrupt):
        bounded.read_regular(target, 1 << 20)
    assert len(closed) == 1
