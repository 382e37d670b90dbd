"""In-place TOML edits: `update`'s patch.toml changes and `create`'s selection in pyproject.toml
keep everything else of the hand-written file."""

from __future__ import annotations

import difflib
from pathlib import Path

from hatch_vllm_patch import _toml
from hatch_vllm_patch.authoring.render import ManifestTarget, render_manifest
from hatch_vllm_patch.authoring.toml_edit import edit_manifest, select_in_pyproject

A, B, C, D = ("a" * 64, "b" * 64, "c" * 64, "d" * 64)


def manifest(version: str, f: list[str], h: list[str], fixed_in: str | None) -> str:
    targets = [ManifestTarget("vllm", "vllm.a", version, {"f": f, "g": [B]}, (), "vllm.a.py"),
               ManifestTarget("vllm", "vllm.b", version, {"h": h}, ("X",), "vllm.b.py")]
    return render_manifest("p", targets=targets, summary="s", why="generated why",
                           removal="r", fixed_in=fixed_in, made_by="update")


def test_update_changes_only_the_keys_it_computes() -> None:
    """A hand-written patch.toml over two targets (a header comment, a reflowed removal, its own
    description) takes the new versions, digests and fixed-in; every other line stays as it
    was, and the computed tables equal the drafted ones."""
    hand = ("# Our fix: keep this header.\n"
            + manifest("0.20.2", [A], [C], None)
            .replace('removal = "r"', 'removal = """\nWhen upstream\nfixes it.\n"""')
            .replace('description = "generated why"', "description = 'Ours.'"))
    drafted = manifest("0.22.1", [A, D], [C, D], "0.30.0")
    edited = edit_manifest(hand, drafted)
    changed = [line for line in difflib.ndiff(hand.splitlines(), edited.splitlines())
               if line[:1] in "+-"]
    assert changed and all(any(key in line for key in ("version = ", '"f" = ', "shapes = ",
                                                         "fixed-in = ")) for line in changed), \
        changed
    ours, theirs = _toml.loads(edited), _toml.loads(drafted)
    assert ours["targets"] == theirs["targets"] and ours["applies"] == theirs["applies"]
    assert ours["removal"] == "When upstream\nfixes it.\n" and ours["description"] == "Ours."
    assert edited.startswith("# Our fix: keep this header.\n")
    assert edit_manifest(edited, drafted) == edited


def test_create_selects_in_pyproject_keeping_the_file(tmp_path: Path) -> None:
    """The id is appended to [tool.vllm-patch] patches (its comments kept), or the key or the
    whole table is added before any sub-table; a listed id writes nothing."""
    cases = {
        '[project]\nname = "x"  # ours\n\n[tool.vllm-patch]\npatches = [\n  "a",  # first\n]\n':
            '[project]\nname = "x"  # ours\n\n[tool.vllm-patch]\npatches = [\n  "a",  # first\n'
            '  "new",\n]\n',
        '[tool.vllm-patch]\nguard = "warn"\n\n[tool.vllm-patch.architectures.Foo]\npatches = []\n':
            '[tool.vllm-patch]\nguard = "warn"\npatches = ["new"]\n\n'
            '[tool.vllm-patch.architectures.Foo]\npatches = []\n',
        '[project]\nname = "x"\n':
            '[project]\nname = "x"\n\n[tool.vllm-patch]\npatches = ["new"]\n',
    }
    path = tmp_path / "pyproject.toml"
    for before, after in cases.items():
        path.write_text(before)
        assert select_in_pyproject(path, "new")
        assert path.read_text() == after
        assert _toml.loads(after)  # still TOML
        assert not select_in_pyproject(path, "new") and path.read_text() == after
