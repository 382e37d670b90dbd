"""The effects: atomic writes, stale bytecode, leftovers of killed runs, and the locks.

Every write goes to a temporary file in the target's directory and is moved over the target with
``os.replace``. uv installs files as hardlinks into its cache: writing through the existing inode
(``open(path, "w")``) would silently change the cache and every other environment linked to it.

Locks are taken on directories (``flock`` of the directory itself, by real path): the directory
of each file we write and the directory of the environment's record. One file can belong to two
environments (a ``.pth`` into a parent environment, one editable checkout), so a lock per
environment would not serialise two writers of that file; a lock on its real directory does. No
lock file is created, so a read-only environment can still be locked for reading, and nothing is
left behind in the packages we patch.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

from .errors import TargetEnvironmentError

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


def write_atomic(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` through a new inode, keeping the file's permission bits."""
    import tempfile

    try:
        mode = stat.S_IMODE(path.stat().st_mode)
    except FileNotFoundError:
        mode = 0o644
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=TEMP_SUFFIX, dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


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


def replace_module_file(path: Path, data: bytes, pycache_prefix: str | None = None) -> None:
    """The one way a module file is written: leftovers of killed runs removed, ``data``
    written atomically (a new inode: uv's cache never sees it), the stale bytecode dropped."""
    remove_stale_temps(path.parent)
    write_atomic(path, data)
    drop_bytecode(path, pycache_prefix)


def replace_module_files(writes: Sequence[tuple[Path, bytes, bytes]],
                         pycache_prefix: str | None = None) -> None:
    """Write several module files as one change: ``writes`` is (path, new bytes, bytes now).
    When a write fails, the files written before it get their bytes back and the OSError is
    raised (its ``filename`` names the file): all of them change, or none."""
    done: list[tuple[Path, bytes]] = []
    for path, new, old in writes:
        try:
            replace_module_file(path, new, pycache_prefix)
        except OSError as exc:
            for written, before in reversed(done):
                replace_module_file(written, before, pycache_prefix)
            if exc.filename is None:
                exc.filename = str(path)
            raise
        done.append((path, old))


def lock_timeout(environ: dict[str, str] | None = None) -> float:
    """``$HATCH_VLLM_PATCH_LOCK_TIMEOUT`` seconds (default 60)."""
    raw = (environ if environ is not None else os.environ).get(LOCK_TIMEOUT_ENV, "")
    try:
        value = float(raw) if raw.strip() else DEFAULT_LOCK_TIMEOUT
    except ValueError:
        return DEFAULT_LOCK_TIMEOUT
    return max(value, 0.0)


@contextlib.contextmanager
def locked(
    directories: Iterable[Path | str],
    *,
    exclusive: bool,
    timeout: float | None = None,
    on_wait: Callable[[str], None] | None = None,
) -> Iterator[None]:
    """Hold ``flock`` on each directory (by real path, in one global order, so two runs never
    deadlock). Exclusive for writers, shared for readers.

    A writer that cannot open a directory raises :class:`LockError` and writes nothing; a reader
    goes on without that lock (it changes nothing). After 2 s of waiting ``on_wait`` is told
    what is waited for; after ``timeout`` seconds :class:`LockError` is raised.
    """
    if fcntl is None:  # pragma: no cover
        yield
        return
    limit = lock_timeout() if timeout is None else timeout
    real = sorted({os.path.realpath(d) for d in directories})
    held: list[int] = []
    try:
        for directory in real:
            try:
                fd = os.open(directory, os.O_RDONLY)
            except OSError as exc:
                if not exclusive:
                    continue
                raise LockError(f"cannot lock {directory}: {exc.strerror or exc}") from None
            held.append(fd)
            _acquire(fd, directory, exclusive, limit, on_wait)
        yield
    finally:
        for fd in reversed(held):
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


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
