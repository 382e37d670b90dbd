"""The effects: atomic writes, stale bytecode, leftovers of killed runs, and the locks.

Every write goes to a temporary file in the target's directory and is moved over the target with
``os.replace``. uv installs files as hardlinks into its cache: writing through the existing inode
(``open(path, "w")``) would silently change the cache and every other environment linked to it.

Locks are lock files, one per site-packages: ``<site-packages>/.hatch-vllm-patch.lock``, the
top of the site-packages holding each file we write, and of the environment whose record we
write (never inside vLLM's own folders). One file can belong to two environments (a ``.pth``
into a parent environment), so a lock per environment would not serialise two writers of that
file; the lock of the site-packages the file lies in does. A lock file is created ``0600`` by
the first writer (the environment's owner), opened without following a symlink and refused
when it is a symlink, not a regular file, or open to group or others: no other local user can
open it, so none can hold it (a ``flock`` on a directory, as before, could be held by anyone
who could open the directory). Files outside any site-packages (an editable checkout) are
covered by the lock of the environment that writes them. A whole ``revert`` that leaves nothing
of ours removes the lock file while holding it (:func:`remove_lock_file`); whoever waited on it
locks the file the name leads to afterwards. A user who cannot open the lock file
and cannot write its directory either reads (and fails to write) without it: it cannot change
anything there.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path

from .errors import TargetEnvironmentError, UsageError

try:  # POSIX; elsewhere the locks are no-ops
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None  # type: ignore[assignment]

TEMP_SUFFIX = ".hvp-tmp"
LOCK_TIMEOUT_ENV = "HATCH_VLLM_PATCH_LOCK_TIMEOUT"
DEFAULT_LOCK_TIMEOUT = 60.0  # seconds; a holder needs milliseconds, so this means a stuck run
LOCK_NOTICE_AFTER = 2.0


class LockError(TargetEnvironmentError):
    """A lock could not be taken (timed out, or the directory cannot be opened)."""


class TargetChanged(TargetEnvironmentError):
    """The file was replaced or changed (by an installer) between our read and our write."""


class FileIdentity:
    """Which file was read: inode, size, mtime (ns) and the sha256 of the bytes read."""

    __slots__ = ("inode", "mtime_ns", "sha256", "size")

    def __init__(self, inode: int, size: int, mtime_ns: int, sha256: str) -> None:
        self.inode, self.size, self.mtime_ns, self.sha256 = inode, size, mtime_ns, sha256

    def same_stat(self, info: os.stat_result) -> bool:
        return (info.st_ino, info.st_size, info.st_mtime_ns) == (
            self.inode, self.size, self.mtime_ns)


def read_identified(path: Path) -> tuple[bytes, FileIdentity]:
    """The bytes of ``path`` and the identity of the file they were read from."""
    import hashlib

    with open(path, "rb") as f:
        info = os.fstat(f.fileno())
        data = f.read()
    return data, FileIdentity(info.st_ino, info.st_size, info.st_mtime_ns,
                              hashlib.sha256(data).hexdigest())


# Called with the target just before it is replaced (tests use it to play an installer).
_before_replace: Callable[[Path], None] | None = None


def current_umask() -> int:
    """This process's umask (read from /proc where it can be, without changing it)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


_EXCLUSIVE = (os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
              | getattr(os, "O_CLOEXEC", 0))


def create_exclusive(folder: Path, name: str) -> tuple[int, str]:
    """A new file ``<folder>/.<name>.<random>.hvp-tmp``, mode 0600, opened for writing with
    ``O_CREAT | O_EXCL | O_NOFOLLOW``: never a file or a symlink someone planted under a name
    they could guess (that name is retried, never followed). Returns the descriptor and path."""
    import secrets

    for _ in range(100):
        tmp = os.path.join(folder, f".{name}.{secrets.token_hex(8)}{TEMP_SUFFIX}")
        try:
            return os.open(tmp, _EXCLUSIVE, 0o600), tmp
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no free temporary name", str(folder))


def write_atomic(path: Path, data: bytes | str, *, expected: FileIdentity | None = None
                 ) -> None:
    """Replace ``path`` with ``data`` (``str``: as UTF-8) through a new inode created exclusively
    (:func:`create_exclusive`) in its folder, fsynced, then ``os.replace``: every file
    hatch-vllm-patch writes, in site-packages or out of it (the record, patch folders, caches,
    outputs), goes through here. The file's mode, owner and group are kept (a new file gets the
    mode the umask gives, and, written by root, the owner and group of its folder). With
    ``expected``, just before the replace the target must still be that file (inode, size,
    mtime and hash): otherwise :class:`TargetChanged` is raised and nothing is written."""
    if isinstance(data, str):
        data = data.encode("utf-8")
    try:
        info: os.stat_result | None = path.stat()
    except FileNotFoundError:
        info = None
    mode = stat.S_IMODE(info.st_mode) if info is not None else 0o666 & ~current_umask()
    fd, tmp = create_exclusive(path.parent, path.name)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
            if info is not None:
                _keep_owner(f.fileno(), info)
            elif os.geteuid() == 0:  # root adding a file to a user's folder: theirs too
                _keep_owner(f.fileno(), os.stat(path.parent))
        os.chmod(tmp, mode)
        if expected is not None:
            if _before_replace is not None:
                _before_replace(path)
            _still(path, expected)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _keep_owner(fd: int, info: os.stat_result) -> None:
    """Give the new inode the old file's owner and group (as far as this user may)."""
    if (info.st_uid, info.st_gid) == (os.geteuid(), os.getegid()):
        return
    try:
        os.fchown(fd, info.st_uid, info.st_gid)
    except OSError:
        with contextlib.suppress(OSError):
            os.fchown(fd, -1, info.st_gid)  # a group of ours: keep at least that


def _still(path: Path, expected: FileIdentity) -> None:
    import hashlib

    try:
        info = path.stat()
        same = expected.same_stat(info) and hashlib.sha256(
            path.read_bytes()).hexdigest() == expected.sha256
    except FileNotFoundError:
        same = False
    if not same:
        raise TargetChanged(f"{path} was replaced or changed while hatch-vllm-patch was "
                            "writing it (an installer, e.g. pip or uv, running at the same "
                            "time); nothing was written to it")


def remove_stale_temps(directory: Path) -> list[Path]:
    """Remove our temporary files left in ``directory`` by a killed run (call under its lock)."""
    removed: list[Path] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        if name.startswith(".") and name.endswith(TEMP_SUFFIX):
            with contextlib.suppress(OSError):
                os.unlink(directory / name)
                removed.append(directory / name)
    return removed


def bytecode_locations(module_file: Path, pycache_prefix: str | None) -> list[Path]:
    """Every place an interpreter may keep bytecode of ``module_file``: ``__pycache__`` beside
    it, and under ``pycache_prefix`` (``PYTHONPYCACHEPREFIX``) by its path and by its real path."""
    places = [module_file.parent / "__pycache__"]
    if pycache_prefix:
        for path in {os.path.abspath(module_file), os.path.realpath(module_file)}:
            head = os.path.dirname(path)
            places.append(Path(pycache_prefix) / head.lstrip(os.sep))
    return places


def drop_bytecode(module_file: Path, pycache_prefix: str | None = None) -> list[Path]:
    """Remove the cached bytecode of ``module_file`` (any interpreter tag, any optimisation)."""
    removed = []
    for cache in bytecode_locations(module_file, pycache_prefix):
        for pyc in cache.glob(f"{module_file.stem}.*.pyc"):
            with contextlib.suppress(FileNotFoundError):
                pyc.unlink()  # unlinking drops this environment's link only, never the cache's
                removed.append(pyc)
    return removed


def replace_module_file(path: Path, data: bytes, pycache_prefix: str | None = None, *,
                        expected: FileIdentity | None = None) -> None:
    """The one way a module file is written: leftovers of killed runs removed, ``data``
    written atomically (a new inode: uv's cache never sees it; owner, group and mode kept),
    the stale bytecode dropped. With ``expected`` the file must still be the one read
    (:class:`TargetChanged` otherwise, nothing written)."""
    remove_stale_temps(path.parent)
    write_atomic(path, data, expected=expected)
    drop_bytecode(path, pycache_prefix)


def replace_module_files(writes: Sequence[tuple[Path, bytes, bytes]],
                         pycache_prefix: str | None = None, *,
                         expected: Mapping[str, FileIdentity] | None = None) -> None:
    """Write several module files as one change: ``writes`` is (path, new bytes, bytes now).
    ``expected`` maps ``str(path)`` to the identity of the file read: each is re-checked
    just before its replace. When a write fails (an OSError, or :class:`TargetChanged`),
    the files written before it get their bytes back and the error is raised (an OSError's
    ``filename`` names the file): all of them change, or none."""
    identities = expected or {}
    done: list[tuple[Path, bytes]] = []
    for path, new, old in writes:
        try:
            replace_module_file(path, new, pycache_prefix, expected=identities.get(str(path)))
        except (OSError, TargetChanged) as exc:
            for written, before in reversed(done):
                replace_module_file(written, before, pycache_prefix)
            if isinstance(exc, OSError) and exc.filename is None:
                exc.filename = str(path)
            raise
        done.append((path, old))


def lock_timeout(environ: Mapping[str, str] | None = None) -> float:
    """``$HATCH_VLLM_PATCH_LOCK_TIMEOUT`` seconds (default 60); LockError naming the variable
    when it is set to something that is not a number of seconds."""
    raw = (environ if environ is not None else os.environ).get(LOCK_TIMEOUT_ENV, "")
    if not raw.strip():
        return DEFAULT_LOCK_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if value != value or value in (float("inf"), float("-inf")) or value < 0:
        raise UsageError(f"${LOCK_TIMEOUT_ENV}={raw!r} is not a number of seconds: set it to "
                         f"e.g. 60 (the default), or unset it")
    return value


LOCK_NAME = ".hatch-vllm-patch.lock"
_TOPS = ("site-packages", "dist-packages")


def lock_file_of(directory: Path | str, environment: Path | str) -> str:
    """The lock file that covers writes in ``directory``: at the top of the site-packages it
    lies in (by real path), else (an editable checkout) that of ``environment``."""
    real = os.path.realpath(directory)
    head = real
    while True:
        if os.path.basename(head) in _TOPS:
            return os.path.join(head, LOCK_NAME)
        parent = os.path.dirname(head)
        if parent == head:
            return os.path.join(os.path.realpath(environment), LOCK_NAME)
        head = parent


@contextlib.contextmanager
def locked(
    directories: Iterable[Path | str],
    *,
    exclusive: bool,
    environment: Path | str | None = None,
    timeout: float | None = None,
    on_wait: Callable[[str], None] | None = None,
) -> Iterator[None]:
    """Hold the lock files covering ``directories`` (see the module's docstring; in one global
    order, so two runs never deadlock). Exclusive for writers, shared for readers.
    ``environment`` is the site-packages whose lock covers directories outside any
    site-packages (default: the first directory).

    A writer that cannot open a lock file it could create raises :class:`LockError` and writes
    nothing; a reader goes on without that lock (it changes nothing). After 2 s of waiting
    ``on_wait`` is told what is waited for; after ``timeout`` seconds :class:`LockError` is
    raised.
    """
    if fcntl is None:  # pragma: no cover
        yield
        return
    limit = lock_timeout() if timeout is None else timeout
    given = [str(d) for d in directories]
    home = environment if environment is not None else (given[0] if given else None)
    files = sorted({lock_file_of(d, home or d) for d in given})
    held: list[int] = []
    try:
        for name in files:
            while True:
                fd = _open_lock(name, exclusive)
                if fd is None:
                    break
                held.append(fd)
                _acquire(fd, name, exclusive, limit, on_wait)
                if _still_named(fd, name):
                    break
                # The holder we waited for removed the lock file (a revert that left nothing
                # of ours, :func:`remove_lock_file`): this lock is on a file nobody else will
                # open again; take the one that the name leads to now.
                held.pop()
                with contextlib.suppress(OSError):
                    fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)
        yield
    finally:
        for fd in reversed(held):
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


def _still_named(fd: int, name: str) -> bool:
    """Whether ``name`` still leads to the lock file open as ``fd``."""
    try:
        now = os.stat(name, follow_symlinks=False)
    except OSError:
        return False
    info = os.fstat(fd)
    return (now.st_dev, now.st_ino) == (info.st_dev, info.st_ino)


def remove_lock_file(directory: Path | str) -> None:
    """Remove the lock file covering ``directory`` (its site-packages'). Call only while
    holding it exclusively, as the last step under it: a run that waited on it finds, once it
    gets it, that the name no longer leads to it and takes the lock file made anew
    (:func:`locked`), so two runs never both hold "the" lock."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(lock_file_of(directory, directory))


def _open_lock(name: str, exclusive: bool) -> int | None:
    """The lock file ``name`` opened (created ``0600`` when missing and its directory is
    writable), never through a symlink; None when this run goes on without it."""
    flags = os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    fd = None
    problem: OSError | None = None
    for mode in (os.O_RDWR | os.O_CREAT, os.O_RDONLY):
        try:
            fd = os.open(name, mode | flags, 0o600)
            break
        except OSError as exc:
            problem = exc
            if exc.errno == errno.ELOOP:
                break
    if fd is None:
        assert problem is not None
        directory = os.path.dirname(name)
        if not exclusive or (problem.errno in (errno.EACCES, errno.EPERM, errno.EROFS,
                                               errno.ENOENT)
                             and not os.access(directory, os.W_OK)):
            return None  # a reader, or a writer that cannot write there anyway
        why = ("it is a symlink" if problem.errno == errno.ELOOP
               else problem.strerror or str(problem))
        raise LockError(f"cannot lock {name}: {why}; remove it (hatch-vllm-patch creates it "
                        "again, 0600) and run again")
    info = os.fstat(fd)
    try:
        owner = os.stat(os.path.dirname(name))  # the environment's owner
    except OSError:
        owner = info
    if os.geteuid() == 0 and info.st_uid != owner.st_uid:
        with contextlib.suppress(OSError):  # root working in a user's environment: theirs
            os.fchown(fd, owner.st_uid, owner.st_gid)
            info = os.fstat(fd)
    bad = None
    if not stat.S_ISREG(info.st_mode):
        bad = "it is not a regular file"
    elif info.st_uid not in (owner.st_uid, 0):
        bad = (f"it is owned by uid {info.st_uid}, not by the owner of its folder "
               f"(uid {owner.st_uid}) or root")
    elif info.st_mode & 0o077:
        if info.st_uid == os.geteuid() or os.geteuid() == 0:
            with contextlib.suppress(OSError):
                os.fchmod(fd, 0o600)
        if os.fstat(fd).st_mode & 0o077:
            bad = f"its mode {stat.S_IMODE(info.st_mode):04o} lets other users open it"
    if bad is None:
        return fd
    os.close(fd)
    if not exclusive:
        return None
    raise LockError(f"cannot lock {name}: {bad}, so another user could hold it; remove it "
                    "(hatch-vllm-patch creates it again, 0600) and run again")


def _acquire(fd: int, directory: str, exclusive: bool, limit: float,
             on_wait: Callable[[str], None] | None) -> None:
    mode = (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB
    start = time.monotonic()
    told = False
    delay = 0.01
    while True:
        try:
            fcntl.flock(fd, mode)
            return
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                if not exclusive:
                    return  # a file system without flock: readers go on
                raise LockError(f"cannot lock {directory}: {exc.strerror or exc}") from None
        waited = time.monotonic() - start
        if waited >= limit:
            raise LockError(
                f"gave up after {limit:.0f} s waiting for the lock on {directory}: another "
                "hatch-vllm-patch run (or a vLLM process healing its patches) holds it; if no "
                f"such run is alive, retry; ${LOCK_TIMEOUT_ENV} sets the wait"
            )
        if not told and waited >= LOCK_NOTICE_AFTER and on_wait is not None:
            on_wait(f"waiting for another hatch-vllm-patch run to release {directory} "
                    f"(giving up after {limit:.0f} s)")
            told = True
        time.sleep(delay)
        delay = min(delay * 2, 0.2)
