"""patch.toml with [[targets]]: one patch over several modules, each target with its own
shapes and block; what is wrong with such a folder is named with its TOML path."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.demo import DIGEST_A, TWO_TARGETS, write

from hatch_vllm_patch.catalog import load_patch_folders
from hatch_vllm_patch.errors import CatalogError
from hatch_vllm_patch.trust import chosen


def test_two_targets_make_one_patch_with_a_part_per_module(tmp_path: Path) -> None:
    """Each [[targets]] entry is a part: its module, symbols, shapes, adds and block file."""
    root = write(tmp_path, TWO_TARGETS, {"demo_pkg.core.py": "def compute(v):\n    return 0\n",
                                         "extra-block.py": "def limit():\n    return 1\n"})
    patch = load_patch_folders(chosen(root))["two-fix"]
    assert [m.target.module for m in patch.parts] == ["demo_pkg.core", "demo_pkg.extra"]
    core, extra = patch.parts
    assert core.block_name == "demo_pkg.core.py" and core.symbol_shapes == {
        "compute": frozenset({DIGEST_A})}
    assert extra.block == "def limit():\n    return 1\n" and extra.target.adds == ("LIMIT",)
    assert extra.symbol_shapes["helper"] == frozenset({"absent"})
    assert all(m.id == "two-fix" and m.parts == (m,) for m in patch.parts)


@pytest.mark.parametrize("change, problem", [
    (lambda t: t + '\n[target]\nmodule = "x.y"\n', "[[targets]] carries each target's shapes"),
    (lambda t: t.replace('module = "demo_pkg.extra"', 'module = "demo_pkg.core"'),
     "[[targets]] names demo_pkg.core twice"),
    (lambda t: t.replace('block = "extra-block.py"', 'block = "../escape.py"'),
     "targets[1].block must be a file name in the folder"),
    (lambda t: t.replace(f'shapes = ["{DIGEST_A}"]', ""), "targets[0] needs `shapes`"),
    (lambda t: t.replace('helper = ["absent"]', ""), "targets[1].shapes.helper: missing"),
])
def test_what_is_wrong_with_targets_is_named(tmp_path: Path, change: object,
                                             problem: str) -> None:
    """A [target] beside [[targets]], a module twice, a block outside the folder, missing
    shapes: each named with its TOML path."""
    assert callable(change)
    root = write(tmp_path, change(TWO_TARGETS), {"demo_pkg.core.py": "pass\n",
                                                 "extra-block.py": "pass\n"})
    with pytest.raises(CatalogError) as info:
        load_patch_folders(chosen(root))
    assert problem in str(info.value), str(info.value)


def test_a_missing_block_file_is_named(tmp_path: Path) -> None:
    """Each target's block must exist."""
    root = write(tmp_path, TWO_TARGETS, {"demo_pkg.core.py": "pass\n"})
    with pytest.raises(CatalogError, match=r"extra-block\.py is missing"):
        load_patch_folders(chosen(root))


def test_catalog_digest_follows_the_files(tmp_path: Path) -> None:
    """Two copies of a catalog have one digest; a changed byte of a block or a new file changes
    it; a `__pycache__` folder or a dotfile does not."""
    import shutil

    from support import REPO

    from hatch_vllm_patch.catalog import catalog_digest, load_catalog

    def digest(root: Path) -> str:
        return catalog_digest(load_patch_folders(chosen(root)))

    copy = tmp_path / "copy"
    shutil.copytree(REPO / "patches", copy, ignore=shutil.ignore_patterns("__pycache__"))
    first = digest(copy)
    assert first == catalog_digest(load_catalog(REPO / "patches"))
    block = next(copy.glob("*/block.py"))
    (block.parent / "__pycache__").mkdir(exist_ok=True)
    (block.parent / "__pycache__" / "block.cpython-311.pyc").write_bytes(b"x")
    (block.parent / ".block.py.swp").write_bytes(b"x")
    assert digest(copy) == first
    block.write_bytes(block.read_bytes() + b"\n")
    changed = digest(copy)
    assert changed != first
    (block.parent / "NOTES").write_text("a note\n")
    assert digest(copy) not in (first, changed)
