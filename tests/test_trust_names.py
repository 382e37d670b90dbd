"""Patch ids are validated whole (full match, ASCII, no control characters, bounded) wherever
they enter: ``new``, ``create``, ``update``, ``apply --patch``, a project's patch folders (folder
name and ``patch.toml`` id), the record, and the markers written into a file."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from support.commands import main_in_process as vllm_patch
from support.demo import write_demo_catalog
from support.venvs import create_venv

from hatch_vllm_patch.markers import MarkerError, render_block
from hatch_vllm_patch.names import is_patch_id
from hatch_vllm_patch.record import RECORD_NAME, read_record

BAD_IDS = ["x\n", "x\r", "é", "a\x1b[31m", "", "../x", "a" * 300, "nl\n", "A-Fix", "a--b"]
# Those a folder may be named (a catalog's folder names): no "/", not empty.
BAD_FOLDER_NAMES = ["x\n", "x\r", "é", "a\x1b[31m", "a" * 200]


def tree(root: Path) -> dict[str, bytes | None]:
    """Every path under ``root`` with its bytes (None for a folder)."""
    out: dict[str, bytes | None] = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs:
            out[os.path.join(folder, name)] = None
        for name in files:
            out[os.path.join(folder, name)] = Path(folder, name).read_bytes()
    return out


def one_line_usage_error(args: list[str]) -> None:
    code, out, err = vllm_patch(*args)
    assert code == 2, (args, out, err)
    assert "Traceback" not in out + err and "\x1b" not in out + err, err
    assert len(err.strip().splitlines()) == 1, err


@pytest.fixture(scope="module")
def demo_venv(tmp_path_factory: pytest.TempPathFactory, demo_wheels: dict[str, Path]) -> Path:
    """One venv with demo-pkg for the module (every test leaves it unchanged, and checks so)."""
    return create_venv(tmp_path_factory.mktemp("names") / "venv", str(demo_wheels["1.0.0"]))


@pytest.fixture
def project(tmp_path: Path, demo_venv: Path) -> Path:
    root = tmp_path / "proj"
    write_demo_catalog(root / "vllm-patches")
    (root / "pyproject.toml").write_text(
        f'[project]\nname = "p"\n\n[tool.vllm-patch]\npython = "{demo_venv}"\n'
        'patches = ["demo-fix"]\n')
    return root


def test_good_ids_pass() -> None:
    """Kebab-case ASCII ids pass the one validator."""
    assert all(map(is_patch_id, ["demo-fix", "a", "kv-cache-page-unification", "x1-2"]))
    assert not any(map(is_patch_id, BAD_IDS))


@pytest.mark.parametrize("bad", BAD_IDS, ids=ascii)
def test_bad_ids_on_the_command_line(bad: str, project: Path, demo_venv: Path,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """new, create, update and apply --patch refuse a bad id: exit 2, one line, no traceback,
    nothing written in the project or the environment."""
    monkeypatch.chdir(project)
    site = demo_venv.parent.parent
    before, env_before = tree(project), tree(site)
    for args in (["new", bad, "--target", "demo_pkg.core:compute"], ["create", bad],
                 ["update", bad], ["update", bad, "--set-fixed-in"], ["apply", "--patch", bad]):
        one_line_usage_error(args)
    assert tree(project) == before and tree(site) == env_before


@pytest.mark.parametrize("bad", BAD_FOLDER_NAMES, ids=ascii)
def test_bad_ids_in_a_project_catalog(bad: str, project: Path, demo_venv: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A project's patch folder named with a bad id, or whose patch.toml id is bad, makes the
    configuration invalid (exit 2, escaped, no traceback); nothing is applied."""
    monkeypatch.chdir(project)
    site = demo_venv.parent.parent
    env_before = tree(site)
    folder = project / "vllm-patches" / "demo-fix"
    manifest = (folder / "patch.toml").read_text()
    renamed = folder.rename(folder.parent / bad)
    code, _, err = vllm_patch("apply")
    assert code == 2 and "\x1b" not in err and "a patch folder's name is its id" in err, err
    renamed.rename(folder)
    (folder / "patch.toml").write_text(
        manifest.replace('id = "demo-fix"', f"id = {json.dumps(bad)}"))
    code, _, err = vllm_patch("apply")
    assert code == 2 and "\x1b" not in err and "kebab-case ASCII" in err, err
    assert tree(site) == env_before


@pytest.mark.parametrize("bad", BAD_IDS, ids=ascii)
def test_no_marker_from_a_bad_id(bad: str) -> None:
    """A marker is never rendered from an id that fails."""
    with pytest.raises(MarkerError, match="not a patch id"):
        render_block(bad, b"x = 1\n")
    assert render_block("demo-fix", b"x = 1\n").startswith(b"\n# >>> hatch-vllm-patch: demo-fix ")


@pytest.mark.parametrize("bad", ["x\n", "é", "a\x1b[31m"], ids=ascii)
def test_a_record_with_a_bad_id_is_damaged(bad: str, tmp_path: Path) -> None:
    """The record's ids pass the same validator: a record naming a bad id is damaged."""
    digest = "0" * 64
    (tmp_path / RECORD_NAME).write_text(json.dumps({
        "format": 2, "tool": "hatch-vllm-patch", "edits": {},
        "files": {str(tmp_path / "m.py"): {
            "distribution": "d", "distribution_version": "1", "original_sha256": digest,
            "patched_sha256": digest, "patches": {bad: digest}, "known_shapes": {}}}}))
    read = read_record(tmp_path)
    assert read.problem is not None and "is not a patch id" in read.problem, read.problem
    assert not read.usable and not read.record.files
