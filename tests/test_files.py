"""Module writes: one function writes a module file (new inode, bytecode dropped), and several
files of one patch are written all together or not at all."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from hatch_vllm_patch.files import replace_module_file, replace_module_files


def test_a_module_write_gets_a_new_inode_and_drops_its_bytecode(tmp_path: Path) -> None:
    """The cache's inode (a hardlink) is never written through; a stale .pyc is removed."""
    module = tmp_path / "mod.py"
    module.write_text("x = 1\n")
    linked = tmp_path / "cache-copy.py"
    os.link(module, linked)
    stale = Path(importlib.util.cache_from_source(str(module)))
    stale.parent.mkdir()
    stale.write_bytes(b"stale")
    replace_module_file(module, b"x = 2\n")
    assert module.read_text() == "x = 2\n" and linked.read_text() == "x = 1\n"
    assert not stale.exists()


def test_a_failed_write_puts_the_earlier_files_back(tmp_path: Path) -> None:
    """When the second file cannot be written, the first gets its bytes back and the error
    names the file that failed."""
    first = tmp_path / "a.py"
    first.write_bytes(b"old a\n")
    missing = tmp_path / "gone" / "b.py"  # its directory does not exist: the write fails
    with pytest.raises(OSError) as info:
        replace_module_files([(first, b"new a\n", b"old a\n"), (missing, b"new b\n", b"")])
    assert first.read_bytes() == b"old a\n"
    assert "b.py" in str(info.value.filename)
    replace_module_files([(first, b"new a\n", b"old a\n")])
    assert first.read_bytes() == b"new a\n"
