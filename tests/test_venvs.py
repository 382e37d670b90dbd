"""The tests' cache of base environments (tests/support/venvs.py): built once, renamed into place
only when complete, cloned as hardlinks for a test to write in, never changed by what a clone does,
and built again when a test did change it."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support import venvs
from support.commands import cli
from support.venvs import Recipe, base_environment, base_problem, cloned_environment, site_packages


@pytest.fixture
def env_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty cache of base environments for this test alone."""
    cache = tmp_path / "envs"
    monkeypatch.setattr(venvs, "ENV_CACHE", cache)
    return cache


@pytest.fixture
def demo_recipe(demo_wheels: dict[str, Path]) -> Recipe:
    """demo-pkg 1.0.0 from its local wheel only (no index)."""
    return Recipe("demo-pkg", "1.0.0", "none", venvs._python_version(),
                  sources=("--no-index", "--find-links", str(demo_wheels["1.0.0"].parent)))


def core(python: Path) -> Path:
    return site_packages(python.parent.parent) / "demo_pkg" / "core.py"


def call(python: Path, catalog: Path, operation: str) -> tuple[str, int]:
    proc = cli(operation, "--python", str(python), "--patch", "demo-fix", "--json",
               catalog=catalog)
    [outcome] = json.loads(proc.stdout)["patches"]
    return outcome["verdict"], proc.returncode


def test_a_clone_writes_never_reach_the_base(env_cache: Path, demo_recipe: Recipe,
                                             demo_catalog: Path, tmp_path: Path) -> None:
    """apply and revert in a hardlinked clone leave the base's file (bytes and inode) and the
    base itself as built; a second request reuses the base without building it again."""
    base = base_environment(demo_recipe)
    assert base.parent.parent == env_cache / demo_recipe.name
    target = core(base)
    before, original = target.stat(), target.read_bytes()
    clone = cloned_environment(demo_recipe, tmp_path / "clone")
    assert os.path.samestat(core(clone).stat(), before), "not a hardlink: the test proves nothing"
    assert (clone.parent.parent / "pyvenv.cfg").read_text().count("relocatable = true") == 1

    assert call(clone, demo_catalog, "apply") == ("applied", 0)
    assert b"hatch-vllm-patch: demo-fix" in core(clone).read_bytes()
    assert os.path.samestat(target.stat(), before) and target.read_bytes() == original
    assert base_problem(base.parent.parent) is None
    assert call(clone, demo_catalog, "revert") == ("reverted", 0)
    assert core(clone).read_bytes() == original

    manifest = (base.parent.parent / venvs.BASE_MANIFEST).stat()
    assert base_environment(demo_recipe) == base
    assert (base.parent.parent / venvs.BASE_MANIFEST).stat().st_mtime_ns == manifest.st_mtime_ns


def test_bases_share_their_bytecode(env_cache: Path, demo_recipe: Recipe,
                                    tmp_path: Path) -> None:
    """Two bases of the same files hold one .pyc per module (hardlinks into the store), a
    clone's import uses it as it is (not compiled again) and its functions report the clone's
    own path; the store keeps nothing that no base links."""
    other = dataclasses.replace(demo_recipe, uninstalled=("no-such-package",))
    one, two = base_environment(demo_recipe), base_environment(other)
    assert one != two

    def pyc(python: Path) -> Path:
        [compiled] = (core(python).parent / "__pycache__").glob("core.*.pyc")
        return compiled

    assert os.path.samefile(pyc(one), pyc(two)) and pyc(one).stat().st_nlink == 3
    clone = cloned_environment(demo_recipe, tmp_path / "clone")
    before = pyc(clone).stat()
    code = ("import inspect, demo_pkg.core as m; print(m.__file__); "
            "print({f.__code__.co_filename for f in vars(m).values() if inspect.isfunction(f)"
            " and f.__module__ == m.__name__})")
    out = subprocess.run([str(clone), "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.splitlines() == [str(core(clone)), repr({str(core(clone))})], out
    assert os.path.samestat(pyc(clone).stat(), before)  # read, not written again
    venvs._remove(two.parent.parent)
    venvs.prune_bytecode()
    assert pyc(one).stat().st_nlink == 3  # the store's file, base one's and the clone's


def test_a_base_from_before_the_store_is_compiled_again(env_cache: Path,
                                                        demo_recipe: Recipe) -> None:
    """A base whose manifest lacks the shared-bytecode mark (built by an older checkout) is
    compiled again once, its .pyc files linked into the store, and kept (not rebuilt)."""
    base = base_environment(demo_recipe).parent.parent
    manifest = json.loads((base / venvs.BASE_MANIFEST).read_text())
    del manifest[venvs.SHARED_BYTECODE]
    (base / venvs.BASE_MANIFEST).write_text(json.dumps(manifest))
    [compiled] = (core(venvs.venv_python(base)).parent / "__pycache__").glob("core.*.pyc")
    compiled.unlink()
    inode = (base / "pyvenv.cfg").stat().st_ino
    assert base_environment(demo_recipe).parent.parent == base
    assert (base / "pyvenv.cfg").stat().st_ino == inode  # the same base
    assert json.loads((base / venvs.BASE_MANIFEST).read_text())[venvs.SHARED_BYTECODE]
    assert compiled.stat().st_nlink == 2  # and the store's


# Two processes (as two xdist workers) asking for one base at once.
CONCURRENT = """\
import os, sys
from support import venvs
recipe = venvs.Recipe("demo-pkg", "1.0.0", "none", venvs._python_version(),
                      sources=("--no-index", "--find-links", sys.argv[1]))
base = venvs.base_environment(recipe).parent.parent
print(os.stat(base / venvs.BASE_MANIFEST).st_ino)
"""


def test_two_processes_share_one_build(tmp_path: Path, demo_wheels: dict[str, Path]) -> None:
    """Two processes asking for the same base at once get the same one, built once."""
    env = {**os.environ, "HATCH_VLLM_PATCH_ENV_CACHE": str(tmp_path / "envs"),
           "PYTHONPATH": str(Path(__file__).parent)}
    wheels = str(demo_wheels["1.0.0"].parent)
    procs = [subprocess.Popen([sys.executable, "-c", CONCURRENT, wheels], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outputs = [proc.communicate(timeout=300) for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], outputs
    [first], [second] = (out.split() for out, _ in outputs)
    assert first == second
    assert len([p for p in (tmp_path / "envs").iterdir() if not p.name.startswith(".")]) == 1


def test_a_base_a_test_wrote_to_is_built_again(env_cache: Path, demo_recipe: Recipe,
                                               demo_catalog: Path) -> None:
    """A base patched in place (the tool's record in site-packages), or with a file added to
    site-packages, is found out and built again, pristine."""
    base = base_environment(demo_recipe)
    assert call(base, demo_catalog, "apply") == ("applied", 0)
    assert "a test wrote to it" in str(base_problem(base.parent.parent))
    again = base_environment(demo_recipe)
    assert base_problem(again.parent.parent) is None
    assert not (site_packages(again.parent.parent) / venvs.TOOL_RECORD).exists()
    assert b"hatch-vllm-patch" not in core(again).read_bytes()

    (site_packages(again.parent.parent) / "stray.pth").write_text("")
    assert "site-packages changed: stray.pth" in str(base_problem(again.parent.parent))
    assert base_problem(base_environment(demo_recipe).parent.parent) is None


def test_a_module_that_differs_from_record_is_found(env_cache: Path, demo_recipe: Recipe
                                                    ) -> None:
    """A module of the distribution whose bytes differ from RECORD (written in place: here
    after breaking the hardlink, so uv's cache keeps its bytes) makes the base stale."""
    base = base_environment(demo_recipe)
    target = core(base)
    text = target.read_text()
    target.unlink()
    target.write_text(text + "# changed\n")
    assert str(base_problem(base.parent.parent)) == "modules differ from RECORD: demo_pkg/core.py"


def test_a_failed_build_leaves_no_base(env_cache: Path, demo_recipe: Recipe) -> None:
    """A build that fails leaves neither a base nor its half-built folder; the half-built folder
    of a crashed earlier build is removed by the next build and never taken for a base."""
    missing = Recipe("demo-pkg", "9.9.9", "none", demo_recipe.python,
                     sources=demo_recipe.sources)
    with pytest.raises(AssertionError, match="command failed"):
        base_environment(missing)
    assert sorted(p.name for p in env_cache.iterdir()) == [f".{missing.name}.lock"]

    crashed = env_cache / f".building-{demo_recipe.name}-crashed" / "venv"
    crashed.mkdir(parents=True)
    base = base_environment(demo_recipe)
    assert base_problem(base.parent.parent) is None
    assert not crashed.parent.exists()


@pytest.mark.slow
def test_real_vllm_clone_leaves_the_base(tmp_path: Path) -> None:
    """In a clone of the cached vLLM 0.20.2 base, applying and reverting a real patch changes
    neither the bytes nor the inode of the base's file, and the base stays pristine."""
    python = venvs.vllm_venv(tmp_path / "venv", "0.20.2")
    base = venvs.base_environment(venvs.vllm_recipe("0.20.2")).parent.parent
    rel = Path("vllm") / "v1" / "core" / "sched" / "scheduler.py"
    target = site_packages(base) / rel
    before, original = target.stat(), target.read_bytes()
    assert os.path.samestat((site_packages(python.parent.parent) / rel).stat(), before)

    patch = "mamba-split-external-kv"
    applied = cli("apply", "--python", str(python), "--patch", patch, check=True)
    assert "applied" in applied.stdout
    assert (site_packages(python.parent.parent) / rel).read_bytes() != original
    assert os.path.samestat(target.stat(), before) and target.read_bytes() == original
    assert base_problem(base) is None
    cli("revert", "--python", str(python), "--patch", patch, check=True)
    assert (site_packages(python.parent.parent) / rel).read_bytes() == original


def test_wheel_without_compiled_code_keeps_every_other_member(tmp_path: Path) -> None:
    """The wheel cache's copy leaves out the ELF members (a shared library, an executable) and
    keeps every other member byte for byte, in order, RECORD included."""
    import zipfile

    members = {"pkg/__init__.py": b"x = 1\n", "pkg/_C.abi3.so": b"\x7fELF\x02\x01rest",
               "pkg/tool": b"\x7fELF\x02\x01binary", "pkg/data.json": b"{}",
               "pkg-1.0.dist-info/RECORD": b"pkg/__init__.py,sha256=abc,6\n"}
    wheel = tmp_path / "pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as out:
        for name, data in members.items():
            out.writestr(name, data, compress_type=zipfile.ZIP_DEFLATED)
    dest = tmp_path / "slim" / wheel.name
    venvs.write_without_compiled_code(wheel, dest)
    with zipfile.ZipFile(dest) as slim:
        kept = {info.filename: slim.read(info) for info in slim.infolist()}
    assert list(kept) == ["pkg/__init__.py", "pkg/data.json", "pkg-1.0.dist-info/RECORD"]
    assert all(kept[name] == members[name] for name in kept)


@pytest.mark.slow
def test_cached_release_wheel_installs_the_released_files(tmp_path: Path) -> None:
    """A release venv of vLLM 0.20.2 made from the wheel cache holds every file of the
    release's RECORD with its released digest, but the compiled code (ELF files) alone."""
    import base64
    import csv
    import hashlib
    import zipfile

    wheel = venvs.cached_wheel("vllm", "0.20.2")
    with zipfile.ZipFile(wheel) as whl:
        [record] = [n for n in whl.namelist() if n.endswith(".dist-info/RECORD")]
        lines = whl.read(record).decode().splitlines()
    sp = site_packages(venvs.release_venv(tmp_path / "venv", "vllm", "0.20.2").parent.parent)
    missing, checked = [], 0
    for rel, digest, _ in csv.reader(lines):
        if not digest:
            continue  # RECORD itself
        path = sp / rel
        if not path.is_file():
            missing.append(rel)
            continue
        actual = base64.urlsafe_b64encode(hashlib.sha256(path.read_bytes()).digest())
        assert actual.rstrip(b"=").decode() == digest.removeprefix("sha256="), rel
        checked += 1
    assert checked > 1700, checked  # 0.20.2's RECORD: 1723 .py files among the rest
    assert missing and all(rel.endswith(".so") or rel == "vllm/vllm-rs" for rel in missing), \
        missing
