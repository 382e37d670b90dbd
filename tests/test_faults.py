"""Faults, tried from outside as an operator meets them: SIGKILLs in the middle of writes,
concurrent runs, two environments sharing one file, an unprivileged user in a root-owned
environment, a full disk, a damaged record, blocks of patches the catalog does not know, stale
bytecode under PYTHONPYCACHEPREFIX, closed pipes and ASCII-only terminals.

Everything runs the real CLI in real subprocesses against real wheels installed in real venvs.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.commands import cli
from support.demo import DEMO_SOURCE, write_demo_catalog, write_demo_project
from support.machine import mounted_tmpfs
from support.venvs import (
    UV,
    cached_wheel,
    create_venv,
    record_sha256,
    repetitions,
    run,
    site_packages,
)

RECORD = ".hatch-vllm-patch.json"
OTHER_BLOCK = textwrap.dedent(
    """\
    if "_hvp_other_original" not in globals():
        _hvp_other_original = other

    def other():
        return "patched: " + _hvp_other_original()
    """
)


def other_digest(source: str) -> str:
    lines = source.splitlines(keepends=True)
    start = next(i for i, line in enumerate(lines) if line.startswith("def other"))
    return hashlib.sha256("".join(lines[start:start + 2]).encode()).hexdigest()


def two_patch_catalog(root: Path) -> Path:
    """demo-fix (compute) and demo-other (other), both on demo_pkg/core.py."""
    write_demo_catalog(root)
    folder = root / "demo-other"
    folder.mkdir()
    (folder / "patch.toml").write_text(textwrap.dedent(f"""\
        id = "demo-other"
        summary = "A second patch on the same file"
        architectures = ["DemoForCausalLM"]

        [target]
        distribution = "demo-pkg"
        module = "demo_pkg.core"
        symbol = "other"

        [applies]
        shapes = ["{other_digest(DEMO_SOURCE)}"]
        """))
    (folder / "block.py").write_text(OTHER_BLOCK)
    return root


def record_of(python: Path) -> dict[str, object]:
    data = json.loads((site_packages(python.parent.parent) / RECORD).read_text())
    assert isinstance(data, dict)
    return data


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def blocks_in(content: bytes) -> list[str]:
    marker = b"# >>> hatch-vllm-patch: "
    return [line.split(b" ")[3].decode() for line in content.splitlines()
            if line.startswith(marker)]


def temps(directory: Path) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.endswith(".hvp-tmp"))


def check_record_matches_file(python: Path, target: Path, original: bytes) -> None:
    """The ledger entry of ``target`` says exactly what the file holds (or nothing)."""
    content = target.read_bytes()
    assert content.startswith(original), "the original bytes were changed"
    files = record_of(python)["files"]
    assert isinstance(files, dict)
    entry = files.get(str(target))
    ids = blocks_in(content)
    if not ids:
        assert entry is None, f"a stale ledger entry for an unpatched file: {entry}"
        return
    assert entry is not None, f"the ledger lost the entry of a file patched with {ids}"
    assert sorted(entry["patches"]) == sorted(ids)
    assert entry["patched_sha256"] == sha(content)
    assert entry["original_sha256"] == sha(original)


# --- SIGKILL ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def big_demo_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """demo-pkg whose core.py is 2 MB (a large string after the functions): writing it takes
    long enough for a kill to land between the temporary file and the replace."""
    padding = '\n_PADDING = """' + ("x" * 79 + "\n") * (2 * 1024 * 1024 // 80) + '"""\n'
    project = write_demo_project(tmp_path_factory.mktemp("big"), "1.0.0", DEMO_SOURCE + padding)
    out = tmp_path_factory.mktemp("big-wheel")
    run([UV, "build", "--wheel", "--quiet", "--out-dir", str(out), str(project)])
    return next(out.glob("*.whl"))


@pytest.mark.slow
def test_sigkill_at_random_moments_never_leaves_a_broken_file(tmp_path: Path,
                                                              big_demo_wheel: Path) -> None:
    """120 SIGKILLs of apply/revert (80 of them as soon as a temporary file of the target or of
    the record appears): the target is always the original or the patched file, leftovers are
    removed by the next write, and complete runs restore the RECORD bytes."""
    python = create_venv(tmp_path / "venv", str(big_demo_wheel))
    catalog = write_demo_catalog(tmp_path / "catalog")
    sp = site_packages(tmp_path / "venv")
    pkg = sp / "demo_pkg"
    target = pkg / "core.py"
    original = target.read_bytes()
    env = {**os.environ, "HATCH_VLLM_PATCH_CATALOG": str(catalog)}

    def start(op: str) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [sys.executable, "-m", "hatch_vllm_patch", op, "--python", str(python),
             "--patch", "demo-fix"], env=env, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL)

    def complete(op: str) -> None:
        proc = start(op)
        assert proc.wait(timeout=120) == 0, f"{op} failed after kills"

    complete("apply")
    patched = target.read_bytes()
    complete("revert")
    assert target.read_bytes() == original
    timed = time.monotonic()
    complete("apply")
    duration = time.monotonic() - timed
    complete("revert")

    rng = random.Random(20261130)
    kills = {"random": 0, "target write": 0, "record write": 0}
    inside = 0  # kills after which one of our temporary files was still there
    kills_total = repetitions(120, 480)
    for i in range(kills_total):
        op = "apply" if target.read_bytes() == original else "revert"
        proc = start(op)
        if i % 3 == 0:
            kind = "random"
            time.sleep(rng.uniform(0, duration * 1.1))
        else:
            kind = "target write" if i % 3 == 1 else "record write"
            watch = pkg if kind == "target write" else sp
            deadline = time.monotonic() + 60
            while proc.poll() is None and time.monotonic() < deadline and not temps(watch):
                time.sleep(0.0002)
            time.sleep(rng.uniform(0, 0.004))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        kills[kind] += 1
        left = temps(pkg) + temps(sp)
        inside += bool(left)
        content = target.read_bytes()
        assert content in (original, patched), f"kill {i} ({kind}) left a third state"
        if i % 20 == 19:  # the next complete runs recover, byte for byte, and clean up
            complete("apply")
            assert target.read_bytes() == patched
            check_record_matches_file(python, target, original)
            complete("revert")  # writes in both directories: our leftovers go
            assert target.read_bytes() == original and not temps(pkg) and not temps(sp)
            assert sha(original) == record_sha256(sp, "demo-pkg", "demo_pkg/core.py")
            check_record_matches_file(python, target, original)
    compile(patched, str(target), "exec")
    assert inside >= kills_total // 6, (
        f"only {inside} of {kills_total} kills landed inside a write ({kills})")


# --- concurrency ------------------------------------------------------------------------------

@pytest.mark.slow
def test_eight_concurrent_runs_keep_file_verdicts_and_ledger_consistent(
        tmp_path: Path, demo_wheels: dict[str, Path]) -> None:
    """20 rounds of 8 processes mixing apply/revert/verify of two patches on one file: no
    update is lost, verify never sees a half state, and the ledger always matches the file."""
    python = create_venv(tmp_path / "venv", str(demo_wheels["1.0.0"]))
    catalog = two_patch_catalog(tmp_path / "catalog")
    target = site_packages(tmp_path / "venv") / "demo_pkg" / "core.py"
    original = target.read_bytes()
    env = {**os.environ, "HATCH_VLLM_PATCH_CATALOG": str(catalog)}
    rng = random.Random(7)
    for round_ in range(repetitions(20, 80)):
        if round_ % 3 == 0:
            ops = [("apply", "demo-fix"), ("apply", "demo-other")] * 4
        elif round_ % 3 == 1:
            ops = [("revert", "demo-fix"), ("revert", "demo-other")] * 4
        else:
            ops = [(rng.choice(["apply", "revert", "verify"]),
                    rng.choice(["demo-fix", "demo-other"])) for _ in range(8)]
        procs = [(op, pid, subprocess.Popen(
            [sys.executable, "-m", "hatch_vllm_patch", op, "--python", str(python),
             "--patch", pid, "--json"], env=env, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True)) for op, pid in ops]
        for op, pid, proc in procs:
            out, err = proc.communicate(timeout=300)
            assert "Traceback" not in err, err
            patches = json.loads(out)["patches"]
            [outcome] = [o for o in patches if o["id"] == pid]
            # the other patch's block, when there, is listed as present but not selected
            assert all(o["verdict"] == "not-selected" for o in patches if o["id"] != pid)
            fine = {"apply": {"applied", "already-applied"}, "revert": {"reverted", "not-applied"},
                    "verify": {"applied", "missing"}}[op]
            assert outcome["verdict"] in fine, (op, outcome)
            assert proc.returncode == (1 if outcome["verdict"] == "missing" else 0)
        content = target.read_bytes()
        if round_ % 3 == 0:
            assert sorted(blocks_in(content)) == ["demo-fix", "demo-other"], "an apply was lost"
        elif round_ % 3 == 1:
            assert content == original, "a revert was lost"
        check_record_matches_file(python, target, original)


@pytest.mark.slow
def test_two_environments_sharing_one_file_never_lose_a_block(
        tmp_path: Path, demo_wheels: dict[str, Path]) -> None:
    """A child venv reaching the parent's site-packages through a .pth and the parent itself
    patch the same file at once, 20 times: both blocks are always there afterwards."""
    parent = create_venv(tmp_path / "parent", str(demo_wheels["1.0.0"]))
    child = create_venv(tmp_path / "child")
    parent_sp = site_packages(tmp_path / "parent")
    (site_packages(tmp_path / "child") / "parent.pth").write_text(f"{parent_sp}\n")
    catalog = two_patch_catalog(tmp_path / "catalog")
    target = parent_sp / "demo_pkg" / "core.py"
    original = target.read_bytes()
    env = {**os.environ, "HATCH_VLLM_PATCH_CATALOG": str(catalog)}
    for _ in range(20):
        procs = [subprocess.Popen(
            [sys.executable, "-m", "hatch_vllm_patch", "apply", "--python", str(python),
             "--patch", pid], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            for python, pid in ((parent, "demo-fix"), (child, "demo-other"))]
        for proc in procs:
            _, err = proc.communicate(timeout=300)
            assert proc.returncode == 0, err
        assert sorted(blocks_in(target.read_bytes())) == ["demo-fix", "demo-other"]
        run([sys.executable, "-m", "hatch_vllm_patch", "revert", "--python", str(parent)],
            env={"HATCH_VLLM_PATCH_CATALOG": str(catalog)})
        assert target.read_bytes() == original


def test_lock_wait_is_announced_and_bounded(demo_venv: Path, demo_catalog: Path) -> None:
    """A held lock: after ~2 s the run says what it waits for, gives up at the documented limit
    with one clear line, and writes nothing."""
    import fcntl

    sp = site_packages(demo_venv.parent.parent)
    target = sp / "demo_pkg" / "core.py"
    before = target.read_bytes()
    fd = os.open(sp / ".hatch-vllm-patch.lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        started = time.monotonic()
        proc = cli("apply", "--python", str(demo_venv), "--patch", "demo-fix",
                   catalog=demo_catalog, env={"HATCH_VLLM_PATCH_LOCK_TIMEOUT": "4"})
        waited = time.monotonic() - started
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "waiting for another hatch-vllm-patch run to release" in proc.stderr
    assert "gave up after 4 s waiting for the lock" in proc.stderr
    assert 4 <= waited < 30
    assert target.read_bytes() == before and not (sp / RECORD).exists()


# --- an unprivileged user in an environment built by root ------------------------------------

SYSTEM_PYTHON = Path("/usr/bin/python3")


def as_nobody(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(cwd), "LANG": "C.UTF-8"}
    return subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *cmd],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=300,
                          check=False)


@pytest.fixture
def world_readable_dir() -> Iterator[Path]:
    """A directory that uid 65534 can enter (pytest's own temporary directories are 0700)."""
    path = Path(tempfile.mkdtemp(prefix="hvp-nobody-", dir="/tmp"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv")
                    or not SYSTEM_PYTHON.exists(),
                    reason="needs root, setpriv and a system Python to drop privileges to")
def test_unprivileged_user_in_a_root_owned_vllm_environment(world_readable_dir: Path,
                                                            project_wheel: Path) -> None:
    """Built as root, run as uid 65534: verify and an apply with nothing to do exit 0 and write
    nothing; an apply that must write exits 1 with one clear line; an unreadable record or file
    is reported, never a traceback."""
    venv = world_readable_dir / "venv"
    run([UV, "venv", "--quiet", "--python", str(SYSTEM_PYTHON), str(venv)])
    python = venv / "bin" / "python"
    run([UV, "pip", "install", "--quiet", "--no-deps", "--no-cache", "--python", str(python),
         str(cached_wheel("vllm", "0.20.2"))])
    run([UV, "pip", "install", "--quiet", "--python", str(python), str(project_wheel)])
    work = world_readable_dir / "work"
    work.mkdir()
    work.chmod(0o777)
    sp = site_packages(venv)
    target = sp / "vllm" / "v1" / "core" / "kv_cache_utils.py"
    original = target.read_bytes()
    patch = ["--patch", "kv-cache-page-unification"]

    def as_root(op: str) -> None:
        run([str(python), "-m", "hatch_vllm_patch", op, *patch], cwd=work)

    def nobody(op: str, *extra: str) -> subprocess.CompletedProcess[str]:
        proc = as_nobody([str(python), "-m", "hatch_vllm_patch", op, *patch, *extra], work)
        assert "Traceback" not in proc.stderr, proc.stderr
        return proc

    def snapshot() -> dict[str, tuple[int, int]]:
        return {str(p): (p.stat().st_ino, p.stat().st_mtime_ns)
                for p in (target, sp / RECORD) if p.exists()}

    as_root("apply")
    state = snapshot()
    assert nobody("verify").returncode == 0
    applied = nobody("apply")
    assert applied.returncode == 0, applied.stdout + applied.stderr
    assert "already-applied" in applied.stdout
    assert nobody("status").returncode == 0
    assert snapshot() == state, "a run with nothing to write wrote something"

    (sp / RECORD).chmod(0o600)  # root's own record, unreadable for the user
    proc = nobody("verify")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "treating it as no history" in proc.stdout
    (sp / RECORD).chmod(0o644)

    as_root("revert")
    assert target.read_bytes() == original
    state = snapshot()
    refused = nobody("apply")
    assert refused.returncode == 1, refused.stdout + refused.stderr
    lines = [line for line in refused.stdout.splitlines() if "could not write" in line]
    assert len(lines) == 1 and "Permission denied" in lines[0], refused.stdout
    assert snapshot() == state and target.read_bytes() == original
    assert not temps(target.parent) and not temps(sp)

    target_mode = target.stat().st_mode
    target.chmod(0o600)
    try:
        unreadable = nobody("verify")
    finally:
        target.chmod(target_mode)
    assert unreadable.returncode == 1
    assert "cannot read" in unreadable.stdout and "cannot write" not in unreadable.stdout


# --- a full disk --------------------------------------------------------------------------------

@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 2 MB tmpfs (root only), unmounted afterwards."""
    with mounted_tmpfs(tmp_path / "tmpfs", "2m") as mount:
        yield mount


def fill(directory: Path) -> None:
    """Fill the file system of ``directory`` to the last byte."""
    fd = os.open(directory / "filler", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        for size in (65536, 4096, 1):
            with contextlib.suppress(OSError):
                while True:
                    os.write(fd, b"\0" * size)
    finally:
        os.close(fd)


def test_full_disk_during_the_target_write(tmp_path: Path, small_tmpfs: Path,
                                           demo_catalog: Path) -> None:
    """The module's file system is full: the patch is an error, the file is untouched, no
    temporary file is left, the record is not changed, exit 1."""
    checkout = write_demo_project(small_tmpfs / "checkout")
    python = create_venv(tmp_path / "venv")
    run([UV, "pip", "install", "--quiet", "--python", str(python), "-e", str(checkout)])
    target = checkout / "demo_pkg" / "core.py"
    before = target.read_bytes()
    fill(small_tmpfs)
    proc = cli("apply", "--python", str(python), "--patch", "demo-fix", catalog=demo_catalog)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "error" in proc.stdout and "No space left on device" in proc.stdout
    assert target.read_bytes() == before and not temps(target.parent)
    assert not (site_packages(tmp_path / "venv") / RECORD).exists()


def test_full_disk_during_the_record_write(tmp_path: Path, small_tmpfs: Path,
                                           demo_catalog: Path) -> None:
    """The environment's file system is full but the module's is not: the report says the patch
    was applied and, on its own line, that the record could not be saved; exit 1."""
    checkout = write_demo_project(tmp_path / "checkout")
    venv = small_tmpfs / "venv"
    run([UV, "venv", "--quiet", str(venv)])
    python = venv / "bin" / "python"
    run([UV, "pip", "install", "--quiet", "--link-mode", "copy", "--python", str(python),
         "-e", str(checkout)])
    fill(small_tmpfs)
    proc = cli("apply", "--python", str(python), "--patch", "demo-fix", catalog=demo_catalog)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "applied   demo-fix" in proc.stdout
    assert "error: could not save the environment's record" in proc.stdout
    assert blocks_in((checkout / "demo_pkg" / "core.py").read_bytes()) == ["demo-fix"]
    assert not temps(site_packages(venv))


# --- the record -------------------------------------------------------------------------------

DAMAGE = {
    "a directory": None,
    "not JSON": b"{ half a record",
    "files is a list": json.dumps({"format": 2, "files": []}).encode(),
    "an entry is a number": json.dumps({"format": 2, "files": {"/x.py": 3}}).encode(),
    "a newer format": json.dumps({"format": 99, "files": {}}).encode(),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_record(demo_venv: Path, demo_catalog: Path, damage: str) -> None:
    """Read-only commands treat a damaged record as no history, in one line; apply refuses,
    naming the file, and writes nothing."""
    sp = site_packages(demo_venv.parent.parent)
    path = sp / RECORD
    content = DAMAGE[damage]
    if content is None:
        path.mkdir()
    else:
        path.write_bytes(content)
    target = sp / "demo_pkg" / "core.py"
    before = target.read_bytes()
    for op in ("verify", "status"):
        proc = cli(op, "--python", str(demo_venv), "--patch", "demo-fix", catalog=demo_catalog)
        assert "Traceback" not in proc.stderr, proc.stderr
        assert proc.returncode == (1 if op == "verify" else 0)
        notes = [line for line in proc.stdout.splitlines() if "treating it as no history" in line]
        assert len(notes) == 1 and str(path) in notes[0], proc.stdout
    proc = cli("apply", "--python", str(demo_venv), "--patch", "demo-fix", catalog=demo_catalog)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert str(path) in proc.stderr and "move that file away" in proc.stderr
    assert target.read_bytes() == before
    assert (path.is_dir() if content is None else path.read_bytes() == content)


def test_apply_with_nothing_to_write_writes_nothing(demo_venv: Path, demo_catalog: Path) -> None:
    """A second apply and a refusal leave the record's bytes and inode alone."""
    sp = site_packages(demo_venv.parent.parent)
    assert cli("apply", "--python", str(demo_venv), "--patch", "demo-fix",
               catalog=demo_catalog).returncode == 0
    stat = (sp / RECORD).stat()
    again = cli("apply", "--python", str(demo_venv), "--patch", "demo-fix", catalog=demo_catalog)
    assert again.returncode == 0
    assert (sp / RECORD).stat().st_ino == stat.st_ino
    assert (sp / RECORD).stat().st_mtime_ns == stat.st_mtime_ns


def test_leftovers_of_killed_runs_are_removed_by_the_next_write(demo_venv: Path,
                                                                demo_catalog: Path) -> None:
    """Temporary files of ours left in the target's directory and in site-packages go with the
    next run that writes there; other files are kept."""
    sp = site_packages(demo_venv.parent.parent)
    ours = [sp / "demo_pkg" / ".core.py.abc123.hvp-tmp", sp / f".{RECORD}.x1y2.hvp-tmp"]
    for path in ours:
        path.write_text("partial")
    theirs = sp / "demo_pkg" / ".core.py.keep"
    theirs.write_text("not ours")
    assert cli("apply", "--python", str(demo_venv), "--patch", "demo-fix",
               catalog=demo_catalog).returncode == 0
    assert not any(p.exists() for p in ours) and theirs.exists()


def test_blocks_of_a_patch_the_catalog_does_not_know(tmp_path: Path, demo_venv: Path) -> None:
    """A block left by a renamed patch is named by status and verify, blocks apply (nothing is
    stacked on it), and revert of everything restores the RECORD bytes."""
    old = write_demo_catalog(tmp_path / "old")
    (old / "demo-fix").rename(old / "demo-fix-v0")
    toml = old / "demo-fix-v0" / "patch.toml"
    toml.write_text(toml.read_text().replace('id = "demo-fix"', 'id = "demo-fix-v0"'))
    new = write_demo_catalog(tmp_path / "new")
    sp = site_packages(demo_venv.parent.parent)
    target = sp / "demo_pkg" / "core.py"
    original = target.read_bytes()
    assert cli("apply", "--python", str(demo_venv), "--patch", "demo-fix-v0",
               catalog=old).returncode == 0
    left = target.read_bytes()

    status = cli("status", "--python", str(demo_venv), "--json", catalog=new)
    verdicts = {p["id"]: p["verdict"] for p in json.loads(status.stdout)["patches"]}
    assert status.returncode == 0
    assert verdicts == {"demo-fix": "missing", "demo-fix-v0": "unknown-patch"}
    verify = cli("verify", "--python", str(demo_venv), "--patch", "demo-fix", catalog=new)
    assert verify.returncode == 1 and "unknown-patch  demo-fix-v0" in verify.stdout
    apply = cli("apply", "--python", str(demo_venv), "--patch", "demo-fix", "--json",
                catalog=new)
    verdicts = {p["id"]: p["verdict"] for p in json.loads(apply.stdout)["patches"]}
    assert apply.returncode == 1
    assert verdicts == {"demo-fix": "blocked", "demo-fix-v0": "unknown-patch"}
    assert target.read_bytes() == left

    revert = cli("revert", "--python", str(demo_venv), "--json", catalog=new)
    verdicts = {p["id"]: p["verdict"] for p in json.loads(revert.stdout)["patches"]}
    assert revert.returncode == 0 and verdicts == {"demo-fix": "not-applied",
                                                    "demo-fix-v0": "reverted"}
    assert target.read_bytes() == original
    assert sha(original) == record_sha256(sp, "demo-pkg", "demo_pkg/core.py")
    assert cli("apply", "--python", str(demo_venv), "--patch", "demo-fix",
               catalog=new).returncode == 0


def test_stale_bytecode_under_pycache_prefix_is_dropped(tmp_path: Path, demo_venv: Path,
                                                        demo_catalog: Path) -> None:
    """With PYTHONPYCACHEPREFIX, an unchecked-hash .pyc of the original would keep running after
    apply; apply removes it, so the patched code runs."""
    prefix = tmp_path / "pycache"
    env = {"PYTHONPYCACHEPREFIX": str(prefix)}
    target = site_packages(demo_venv.parent.parent) / "demo_pkg" / "core.py"
    run([str(demo_venv), "-m", "compileall", "-q", "--invalidation-mode", "unchecked-hash",
         str(target)], env=env)
    cached = list(prefix.rglob("core.*.pyc"))
    assert cached, "compileall wrote no bytecode under the prefix"
    assert cli("apply", "--python", str(demo_venv), "--patch", "demo-fix", catalog=demo_catalog,
               env=env).returncode == 0
    assert not any(p.exists() for p in cached)
    behaviour = run([str(demo_venv), "-c", "import demo_pkg.core as m; print(m.compute([]))"],
                    env=env)
    assert behaviour.stdout.strip() == "0"


# --- output plumbing ----------------------------------------------------------------------------

def test_closed_pipe_gives_no_traceback_and_keeps_the_exit_code(demo_venv: Path,
                                                                demo_catalog: Path) -> None:
    """stdout closed by the reader (`status | head -1`): no traceback, the exit code follows
    the verdicts (status 0, verify of a missing patch 1)."""
    for op, expected in (("status", 0), ("verify", 1)):
        proc = subprocess.Popen(
            [sys.executable, "-m", "hatch_vllm_patch", op, "--python", str(demo_venv),
             "--patch", "demo-fix"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env={**os.environ, "HATCH_VLLM_PATCH_CATALOG": str(demo_catalog)})
        assert proc.stdout is not None and proc.stderr is not None
        proc.stdout.close()
        err = proc.stderr.read().decode()
        assert proc.wait(timeout=120) == expected, err
        assert "Traceback" not in err and "BrokenPipe" not in err


def test_ascii_only_stdout(demo_venv: Path, demo_catalog: Path) -> None:
    """PYTHONIOENCODING=ascii: the file is patched, the report is printed, exit 0."""
    proc = cli("apply", "--python", str(demo_venv), "--patch", "demo-fix", catalog=demo_catalog,
               env={"PYTHONIOENCODING": "ascii"})
    assert proc.returncode == 0 and "Traceback" not in proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "vllm-patch apply: 1 applied - OK"


def test_crafted_record_cannot_make_revert_or_create_write_outside(
        demo_venv: Path, demo_catalog: Path, tmp_path: Path) -> None:
    """A record naming a file outside the environment (with one of our blocks in it, or as a
    file open for editing with a pristine copy): that entry is ignored and named, revert drops
    it from the record, create finds nothing to make a patch of, and the outside file keeps its
    bytes."""
    sp = site_packages(demo_venv.parent.parent)
    outside = tmp_path / "outside" / "victim.py"
    outside.parent.mkdir()
    block = b"# >>> hatch-vllm-patch: demo-old sha256=" + b"0" * 64 + b"\nx = 1\n" \
        b"# <<< hatch-vllm-patch: demo-old\n"
    outside.write_bytes(b"secret = 1\n" + block)
    before = outside.read_bytes()
    pristine = b"planted = 1\n"
    digest = sha(pristine)
    (sp / ".hatch-vllm-patch-edits").mkdir()
    (sp / ".hatch-vllm-patch-edits" / f"{digest}.py").write_bytes(pristine)
    entry = {"distribution": "demo-pkg", "distribution_version": "1.0.0",
             "original_sha256": sha(b"secret = 1\n"), "patched_sha256": sha(before),
             "patches": {"demo-old": "0" * 64}}
    session = {"module": "demo_pkg.core", "distribution": "demo-pkg", "version": "1.0.0",
               "pristine_sha256": digest, "removed": []}
    for record in ({"format": 2, "files": {str(outside): entry}},
                   {"format": 2, "edits": {str(outside): session}}):
        (sp / RECORD).write_text(json.dumps(record))
        reverted = cli("revert", "--python", str(demo_venv), catalog=demo_catalog)
        assert reverted.returncode == 0 and "Traceback" not in reverted.stderr
        assert "lies outside the environment" in reverted.stdout, reverted.stdout
        # dropped from the record, which then holds nothing: removed with its lock
        assert not (sp / RECORD).exists() and not (sp / ".hatch-vllm-patch.lock").exists()
        (sp / RECORD).write_text(json.dumps(record))
        project = tmp_path / "project"
        project.mkdir(exist_ok=True)
        (project / "pyproject.toml").write_text("[tool.vllm-patch]\n")
        created = cli("create", "stolen", "--python", str(demo_venv), cwd=project,
                      catalog=demo_catalog)
        assert created.returncode != 0 and "Traceback" not in created.stderr
        assert outside.read_bytes() == before
        assert not (project / "vllm-patches" / "stolen").exists()
