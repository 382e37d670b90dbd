"""The effects of files.py: lock files no other user can hold, writes that keep owner, group and
mode (new files follow the umask), the re-check against an installer racing our write, and
module writes (one function writes a module file: new inode, bytecode dropped; several files of
one patch are written all together or not at all)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.commands import cli
from support.venvs import UV, run, site_packages

from hatch_vllm_patch import files
from hatch_vllm_patch.files import (
    LOCK_NAME,
    LockError,
    TargetChanged,
    locked,
    read_identified,
    replace_module_file,
    replace_module_files,
    write_atomic,
)

NOBODY = 65534
needs_setpriv = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"),
                                   reason="needs root and setpriv to act as another user")


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory that uid 65534 can enter (pytest's own temporary directories are 0700)."""
    path = Path(tempfile.mkdtemp(prefix="hvp-files-", dir="/tmp"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


HOLDER = textwrap.dedent("""\
    import fcntl, os, sys
    held = []
    for path in sys.argv[1:]:
        try:
            fd = os.open(path, os.O_RDONLY)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            held.append(path)
        except OSError as exc:
            print("REFUSED", path, exc.strerror, flush=True)
    print("HOLDING", *held, flush=True)
    sys.stdin.read()
    """)


@needs_setpriv
def test_another_user_cannot_hold_any_lock(shared_dir: Path, demo_wheels: dict[str, Path],
                                           demo_catalog: Path) -> None:
    """uid 65534 holds every lock it can open (the folders, as the old locks were) and cannot
    open the lock file (0600, root's): root's apply neither waits nor fails."""
    from support.venvs import create_venv

    python = create_venv(shared_dir / "venv", str(demo_wheels["1.0.0"]))
    sp = site_packages(shared_dir / "venv")
    assert cli("verify", "--python", str(python), "--patch", "demo-fix",
               catalog=demo_catalog).returncode == 1
    assert cli("apply", "--python", str(python), "--patch", "demo-fix",
               catalog=demo_catalog).returncode == 0
    lock = sp / LOCK_NAME
    info = lock.stat()
    assert (info.st_mode & 0o777, info.st_uid) == (0o600, 0)
    cli("revert", "--python", str(python), "--patch", "demo-fix", catalog=demo_catalog)
    targets = [str(p) for p in (sp, sp / "demo_pkg", lock)]
    holder = subprocess.Popen(
        ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
         sys.executable, "-c", HOLDER, *targets], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True, cwd="/")
    try:
        assert holder.stdout is not None
        lines = [holder.stdout.readline(), holder.stdout.readline()]
        assert lines[0].startswith(f"REFUSED {lock} Permission denied"), lines
        assert lines[1].split() == ["HOLDING", str(sp), str(sp / "demo_pkg")], lines
        started = time.monotonic()
        proc = cli("apply", "--python", str(python), "--patch", "demo-fix",
                   catalog=demo_catalog, env={"HATCH_VLLM_PATCH_LOCK_TIMEOUT": "5"})
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert time.monotonic() - started < 5 and "waiting" not in proc.stderr
    finally:
        holder.communicate(input="", timeout=30)


def test_lock_file_is_refused_when_others_could_hold_it(tmp_path: Path) -> None:
    """A symlinked lock file is refused for a writer (one line naming it) and never followed;
    a lock file of ours open to others is made 0600 before it is used."""
    sp = tmp_path / "site-packages"
    sp.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_text("")
    (sp / LOCK_NAME).symlink_to(elsewhere)
    with pytest.raises(LockError, match="it is a symlink"), locked([sp], exclusive=True):
        pass
    with locked([sp], exclusive=False):  # a reader goes on without it
        pass
    (sp / LOCK_NAME).unlink()
    (sp / LOCK_NAME).write_text("")
    (sp / LOCK_NAME).chmod(0o666)
    with locked([sp / "pkg"], exclusive=True, environment=sp):
        assert (sp / LOCK_NAME).stat().st_mode & 0o777 == 0o600
    assert elsewhere.read_text() == ""


@needs_setpriv
def test_root_write_keeps_the_users_owner_group_and_mode(tmp_path: Path) -> None:
    """root replacing a user's file leaves it the user's (owner, group, mode); a new file gets
    the mode the umask gives, not a fixed one, and, in a user's folder, the user's owner."""
    target = tmp_path / "module.py"
    target.write_text("old\n")
    os.chown(target, NOBODY, NOBODY)
    target.chmod(0o640)
    write_atomic(target, b"new\n")
    info = target.stat()
    assert (info.st_uid, info.st_gid, info.st_mode & 0o777) == (NOBODY, NOBODY, 0o640)
    assert target.read_bytes() == b"new\n"
    old = os.umask(0o027)
    try:
        write_atomic(tmp_path / "fresh.py", b"x")
    finally:
        os.umask(old)
    assert (tmp_path / "fresh.py").stat().st_mode & 0o777 == 0o640
    users = tmp_path / "users-folder"
    users.mkdir()
    os.chown(users, NOBODY, NOBODY)
    write_atomic(users / "new.json", b"{}")
    info = (users / "new.json").stat()
    assert (info.st_uid, info.st_gid) == (NOBODY, NOBODY)


def test_lock_timeout_that_is_not_a_number(demo_venv: Path, demo_catalog: Path) -> None:
    """A HATCH_VLLM_PATCH_LOCK_TIMEOUT that is not a number of seconds is one usage line
    naming it (exit 2), not a silent default."""
    proc = cli("apply", "--python", str(demo_venv), "--patch", "demo-fix", catalog=demo_catalog,
               env={"HATCH_VLLM_PATCH_LOCK_TIMEOUT": "soon"})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "$HATCH_VLLM_PATCH_LOCK_TIMEOUT='soon' is not a number of seconds" in proc.stderr


# An apply whose target an installer replaces between our read and our write (the hook runs
# just before os.replace; the replacement is a real `uv pip install --reinstall`).
RACE = textwrap.dedent("""\
    import json, subprocess, sys
    from pathlib import Path
    import hatch_vllm_patch.files as files
    from hatch_vllm_patch import operations

    python, wheel, times = sys.argv[1], sys.argv[2], int(sys.argv[3])
    calls = []

    def installer(path):
        calls.append(path.stat().st_ino)
        if len(calls) <= times:
            subprocess.run([{uv!r}, "pip", "install", "--quiet", "--reinstall", "--no-cache",
                            "--no-deps",
                            "--python", python, wheel], check=True)

    files._before_replace = installer
    report = operations.apply(python=python, patches=["demo-fix"])
    [outcome] = report.outcomes
    print(json.dumps({{"verdict": outcome.verdict.value, "reason": outcome.reason,
                       "calls": len(calls)}}))
    """)


@pytest.mark.parametrize("times", [1, 2])
def test_installer_replacing_the_file_between_read_and_write(
        demo_venv: Path, demo_catalog: Path, demo_wheels: dict[str, Path], tmp_path: Path,
        times: int) -> None:
    """An installer replacing the target after our read: nothing is written over its file;
    once, the apply retries on the installer's file and applies; every time, it reports the
    race (error) and leaves the installer's file as it is."""
    target = site_packages(demo_venv.parent.parent) / "demo_pkg" / "core.py"
    program = tmp_path / "race.py"
    program.write_text(RACE.format(uv=UV))
    proc = run([sys.executable, str(program), str(demo_venv), str(demo_wheels["1.0.0"]),
                str(times)], env={"HATCH_VLLM_PATCH_CATALOG": str(demo_catalog)})
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    content = target.read_bytes()
    if times == 1:
        assert result["verdict"] == "applied" and result["calls"] == 2, result
        assert b"# >>> hatch-vllm-patch: demo-fix" in content
    else:
        assert result["verdict"] == "error" and result["calls"] == 2, result
        assert "was replaced or changed while hatch-vllm-patch was writing it" in \
            result["reason"]
        assert b"hatch-vllm-patch" not in content  # the installer's file, untouched


def test_patch_folders_follow_the_umask(tmp_path: Path) -> None:
    """A folder made by create/new and its files get the modes the umask gives (not 0700)."""
    from hatch_vllm_patch.authoring import write_patch_folder

    old = os.umask(0o022)
    try:
        folder = write_patch_folder(tmp_path / "vllm-patches", "demo", {"block.py": "x = 1\n"})
    finally:
        os.umask(old)
    assert folder.stat().st_mode & 0o777 == 0o755
    assert (folder / "block.py").stat().st_mode & 0o777 == 0o644


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


def test_several_files_are_rechecked_and_put_back_when_an_installer_replaced_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """replace_module_files re-checks each file against the identity it was read with: when an
    installer replaced the second file meanwhile, TargetChanged is raised, the first file gets
    its bytes back, and the installer's file is left as it is."""
    first, second = tmp_path / "a.py", tmp_path / "b.py"
    first.write_bytes(b"old a\n")
    second.write_bytes(b"old b\n")
    read = {str(p): read_identified(p) for p in (first, second)}

    def installer(path: Path) -> None:
        if path == second:
            tmp = tmp_path / "installer.tmp"
            tmp.write_bytes(b"installer's b\n")
            os.replace(tmp, second)

    monkeypatch.setattr(files, "_before_replace", installer)
    with pytest.raises(TargetChanged):
        replace_module_files([(first, b"new a\n", read[str(first)][0]),
                              (second, b"new b\n", read[str(second)][0])],
                             expected={k: v[1] for k, v in read.items()})
    assert first.read_bytes() == b"old a\n"
    assert second.read_bytes() == b"installer's b\n"
    monkeypatch.setattr(files, "_before_replace", None)
    read = {str(p): read_identified(p) for p in (first, second)}
    replace_module_files([(first, b"new a\n", read[str(first)][0]),
                          (second, b"new b\n", read[str(second)][0])],
                         expected={k: v[1] for k, v in read.items()})
    assert (first.read_bytes(), second.read_bytes()) == (b"new a\n", b"new b\n")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file to another user")
def test_several_files_keep_their_owner_group_and_mode(tmp_path: Path) -> None:
    """Each file written by replace_module_files keeps the owner, group and mode it had."""
    paths = [tmp_path / "a.py", tmp_path / "b.py"]
    for i, path in enumerate(paths):
        path.write_bytes(b"old\n")
        os.chown(path, NOBODY, NOBODY)
        path.chmod(0o640 + i)
    replace_module_files([(p, b"new\n", b"old\n") for p in paths])
    for i, path in enumerate(paths):
        info = path.stat()
        assert (info.st_uid, info.st_gid, info.st_mode & 0o777) == (NOBODY, NOBODY, 0o640 + i)
        assert path.read_bytes() == b"new\n"


def test_a_run_waiting_on_a_removed_lock_file_takes_the_new_one(tmp_path: Path) -> None:
    """A writer that waited on a lock file its holder removed (a revert that left nothing) locks
    the file the name leads to afterwards, so two runs never both hold the lock."""
    import fcntl
    import threading

    sp = tmp_path / "site-packages"
    sp.mkdir()
    lock = sp / LOCK_NAME
    waiting, got = threading.Event(), threading.Event()
    seen: list[tuple[int, bool]] = []

    def second() -> None:
        waiting.set()
        with locked([sp], exclusive=True, timeout=20):
            # a third run opening the name now must not get the lock while this one holds it
            fd = os.open(lock, os.O_RDWR)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                free = True
            except BlockingIOError:
                free = False
            finally:
                os.close(fd)
            seen.append((lock.stat().st_ino, free))
            got.set()

    with locked([sp], exclusive=True):
        thread = threading.Thread(target=second)
        thread.start()
        waiting.wait(10)
        time.sleep(0.3)  # the second run is polling the first lock file by now
        files.remove_lock_file(sp)
    assert got.wait(20)
    thread.join(20)
    [(inode, free)] = seen
    assert lock.exists() and not free  # the second run holds the lock file that is there
    assert inode == lock.stat().st_ino  # (the inode number itself may be reused)
