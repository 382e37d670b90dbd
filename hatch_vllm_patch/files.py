"""The effects: atomic writes, stale bytecode, the environment lock and the ledger.

Every write goes to a temporary file in the target's directory and is moved over the target with
``os.replace``. uv installs files as hardlinks into its cache: writing through the existing inode
(``open(path, "w")``) would silently change the cache and every other environment linked to it.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

try:  # POSIX only; on other systems the lock is a no-op
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None  # type: ignore[assignment]

LEDGER_NAME = ".hatch-vllm-patch.json"
LOCK_NAME = ".hatch-vllm-patch.lock"
LEDGER_FORMAT = 1


def write_atomic(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` through a new inode, keeping the file's permission bits."""
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
    except FileNotFoundError:
        mode = 0o644
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".hvp-tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def drop_bytecode(module_file: Path) -> list[Path]:
    """Remove the cached bytecode of ``module_file`` (any interpreter tag, any optimisation)."""
    removed = []
    cache = module_file.parent / "__pycache__"
    for pyc in cache.glob(f"{module_file.stem}.*.pyc"):
        with contextlib.suppress(FileNotFoundError):
            pyc.unlink()  # unlinking drops this environment's link only, never the cache's inode
            removed.append(pyc)
    return removed


@contextlib.contextmanager
def environment_lock(directory: Path) -> Iterator[None]:
    """Serialise patching of one environment (two ``uv run`` at once must not interleave)."""
    if fcntl is None:  # pragma: no cover
        yield
        return
    path = directory / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        # A read-only environment: nothing can be written, so nothing needs serialising; a
        # write the plan still asks for fails on its own and is reported per patch.
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


@dataclass(frozen=True)
class LedgerEntry:
    """What we know about one file we patched."""

    path: str
    distribution: str
    distribution_version: str
    original_sha256: str
    patched_sha256: str
    patches: dict[str, str]  # patch id -> block sha256

    def to_json(self) -> dict[str, Any]:
        return {
            "distribution": self.distribution,
            "distribution_version": self.distribution_version,
            "original_sha256": self.original_sha256,
            "patched_sha256": self.patched_sha256,
            "patches": dict(sorted(self.patches.items())),
        }


class Ledger:
    """A small JSON state file in the environment: original and patched sha256 per file."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / LEDGER_NAME
        self.entries: dict[str, LedgerEntry] = {}
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (FileNotFoundError, ValueError):
            data = {}  # a missing or damaged ledger only loses history; the files are the truth
        if isinstance(data, dict) and data.get("format") == LEDGER_FORMAT:
            for path, raw in data.get("files", {}).items():
                try:
                    self.entries[path] = LedgerEntry(
                        path=path,
                        distribution=str(raw["distribution"]),
                        distribution_version=str(raw["distribution_version"]),
                        original_sha256=str(raw["original_sha256"]),
                        patched_sha256=str(raw["patched_sha256"]),
                        patches={str(k): str(v) for k, v in raw.get("patches", {}).items()},
                    )
                except (KeyError, TypeError, AttributeError):
                    continue

    def get(self, path: Path | str) -> LedgerEntry | None:
        return self.entries.get(str(path))

    def record(self, entry: LedgerEntry) -> None:
        if entry.patches:
            self.entries[entry.path] = entry
        else:
            self.entries.pop(entry.path, None)

    def save(self) -> None:
        if not self.entries and not self.path.exists():
            return
        data = {
            "format": LEDGER_FORMAT,
            "tool": "hatch-vllm-patch",
            "updated": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "files": {p: e.to_json() for p, e in sorted(self.entries.items())},
        }
        write_atomic(self.path, (json.dumps(data, indent=2) + "\n").encode("utf-8"))
