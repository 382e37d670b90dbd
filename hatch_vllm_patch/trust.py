"""The ownership rule: what may be read as code or configuration when the user's own command did
not name it.

A project folder, a patch folder, a replacement catalog (``$HATCH_VLLM_PATCH_CATALOG``) or the
environment's record, named by the record, by an installed distribution or by an environment
variable, is read only when

- it, and every file of it that is read, is owned by the current user or by root;
- none of them is writable by group or others;
- no symlink leads out of the folder (a file read from a folder must resolve inside it);
- every parent directory is owned by the current user or root and is not writable by group or
  others unless it is sticky (``/tmp``): otherwise another user could swap the folder for theirs.
  This is the check git's ``safe.directory`` makes for a repository, applied to the whole path.

Anything else is refused with :class:`UntrustedPath`, one line naming the path, its owner and mode,
and how to trust it: make it yours (or root's) and not writable by others, or name it (or a folder
above it) in ``$HATCH_VLLM_PATCH_TRUST`` (absolute paths, ``:``-separated), as
``git config safe.directory`` does.

Import-light: the guard asks it about the record in every vLLM process (a few ``lstat`` calls).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from .errors import CatalogError

TRUST_ENV = "HATCH_VLLM_PATCH_TRUST"


class UntrustedPath(CatalogError):
    """A path that fails the ownership rule; the message is one line, with the way to trust it.
    (A CatalogError: what it refuses to read is patch code or the configuration naming it.)"""


def explicitly_trusted(path: Path | str) -> bool:
    """Is ``path`` (or a folder above it) named in ``$HATCH_VLLM_PATCH_TRUST``?"""
    raw = os.environ.get(TRUST_ENV, "")
    if not raw:
        return False
    real = os.path.realpath(path)
    for entry in raw.split(os.pathsep):
        if not entry or not os.path.isabs(entry):
            continue  # a relative entry would mean something else in each working directory
        root = os.path.realpath(entry)
        if real == root or real.startswith(root.rstrip(os.sep) + os.sep):
            return True
    return False


def _owner(uid: int) -> str:
    import pwd

    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def _refuse(what: str, path: str, st: os.stat_result, problem: str) -> UntrustedPath:
    return UntrustedPath(
        f"hatch-vllm-patch refuses {what} {path}: owned by {_owner(st.st_uid)}, mode "
        f"{stat.S_IMODE(st.st_mode):04o}: {problem}; to trust it, make it owned by "
        f"{_owner(os.geteuid())} or root and not writable by group or others "
        f"(chown, chmod go-w), or name it in ${TRUST_ENV}")


def _problem(st: os.stat_result, *, parent: bool) -> str | None:
    if st.st_uid not in (os.geteuid(), 0):
        return "not owned by this user or root"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        if parent and stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX:
            return None  # sticky (/tmp): others cannot rename or replace what is inside
        return "writable by group or others"
    return None


def _stat(path: str, what: str) -> os.stat_result:
    try:
        return os.lstat(path)
    except OSError as exc:
        raise UntrustedPath(f"hatch-vllm-patch cannot check {what} {path}: "
                            f"{exc.strerror or exc}") from None


def _components(path: str) -> list[str]:
    """``/``, ``/a``, ``/a/b``, ... up to (not including) ``path`` itself."""
    out = []
    parent = os.path.dirname(path)
    while True:
        out.append(parent)
        above = os.path.dirname(parent)
        if above == parent:
            return out[::-1]
        parent = above


def check_parents(path: Path | str, what: str) -> None:
    """Every directory above ``path`` passes the rule (sticky directories allowed), along the
    path as given and along the path it resolves to; a symlink on the way must be owned by this
    user or root (its target is then checked on the resolved path)."""
    given = os.path.abspath(path)
    chains = [given] if os.path.realpath(given) == given else [given, os.path.realpath(given)]
    for chain in chains:
        for parent in _components(chain):
            st = _stat(parent, f"a folder above {what}")
            if stat.S_ISLNK(st.st_mode):
                problem = (None if st.st_uid in (os.geteuid(), 0)
                           else "a symlink not owned by this user or root")
            else:
                problem = _problem(st, parent=True)
            if problem is not None and not explicitly_trusted(parent):
                raise _refuse(f"a folder above {what}", parent, st, problem)


def check_folder(folder: Path | str, what: str) -> None:
    """``folder`` and every directory above it (see :func:`check_parents`)."""
    if explicitly_trusted(folder):
        return
    given = os.path.abspath(folder)
    if os.path.islink(given):
        link = _stat(given, what)
        if link.st_uid not in (os.geteuid(), 0):
            raise _refuse(what, given, link, "a symlink not owned by this user or root")
    real = os.path.realpath(given)
    st = _stat(real, what)
    if not stat.S_ISDIR(st.st_mode):
        raise UntrustedPath(f"hatch-vllm-patch refuses {what} {folder}: not a directory")
    problem = _problem(st, parent=False)
    if problem is not None:
        raise _refuse(what, real, st, problem)
    check_parents(given, what)


def check_file(path: Path | str, what: str, inside: Path | str | None = None) -> None:
    """A file that is read: a regular file (never a symlink), owned by this user or root and
    not writable by others. With ``inside`` (an already checked folder) it must lie inside that
    folder (no absolute or ``..`` path); without, its parents are checked too."""
    if explicitly_trusted(path):
        return
    given = os.path.abspath(path)
    st = _stat(given, what)
    if stat.S_ISLNK(st.st_mode):
        raise _refuse(what, given, st, f"a symlink (to {os.path.realpath(given)})")
    if inside is not None:
        root = os.path.realpath(inside).rstrip(os.sep) + os.sep
        if not os.path.realpath(given).startswith(root):
            raise UntrustedPath(f"hatch-vllm-patch refuses {what} {path}: it lies outside "
                                f"{inside}; keep it a plain file inside the folder")
    if not stat.S_ISREG(st.st_mode):
        raise UntrustedPath(f"hatch-vllm-patch refuses {what} {path}: not a regular file")
    problem = _problem(st, parent=False)
    if problem is not None:
        raise _refuse(what, given, st, problem)
    if inside is None:
        check_parents(given, what)


def require_absolute(value: str, variable: str) -> Path:
    """An environment variable's path must be absolute: a relative one would name a different
    folder in each process's working directory."""
    if not os.path.isabs(value):
        raise UntrustedPath(f"${variable}={value} is a relative path: it would be read from each "
                            "process's working directory; give an absolute path")
    return Path(value)
