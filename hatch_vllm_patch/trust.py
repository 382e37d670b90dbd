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

import enum
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


# --- the gate: a path the rule admitted --------------------------------------------------------

class Rule(enum.Enum):
    """How a path came to be read, and so what it must pass."""

    #: named by the user's own command (``--project``, ``--python``, the working directory's own
    #: project, a folder given to ``check``) or shipped with hatch-vllm-patch: read as is.
    CHOSEN = "chosen"
    #: named by a project the user chose (its ``python`` key, ``.venv``, ``patch-dir``): read
    #: unless another user owns it.
    OWNER = "owner"
    #: named by anything else (a project found above the working directory, the record, a
    #: distribution, an environment variable): the whole ownership rule, parents included.
    RULE = "rule"

    @property
    def for_named(self) -> Rule:
        """The rule for what a path admitted by this rule names in turn."""
        return Rule.RULE if self is Rule.RULE else Rule.OWNER


_KEY = object()


class AdmittedPath:
    """A path the ownership rule admitted, with the rule it passed. Only the ``admit_*``
    functions of this module construct one; readers of code and configuration take this type,
    never a raw path, so a new reader cannot forget to ask."""

    __slots__ = ("path", "rule")
    path: Path
    rule: Rule

    def __init__(self, path: Path, rule: Rule, key: object) -> None:
        if key is not _KEY:
            raise TypeError("an AdmittedPath is made by trust.admit_*, never directly")
        object.__setattr__(self, "path", Path(path))
        object.__setattr__(self, "rule", rule)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("an AdmittedPath is immutable")

    def __fspath__(self) -> str:
        return str(self.path)

    def __str__(self) -> str:
        return str(self.path)

    def __repr__(self) -> str:
        return f"AdmittedPath({str(self.path)!r}, {self.rule.name})"

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, AdmittedPath) and other.path == self.path
                and other.rule is self.rule)

    def __hash__(self) -> int:
        return hash((self.path, self.rule))

    def member(self, path: Path | str, what: str) -> None:
        """A file or folder read from this admitted folder passes the folder's rule: nothing
        for a chosen folder, its owner for :attr:`Rule.OWNER`, the whole rule (a plain file
        inside the folder) for :attr:`Rule.RULE`."""
        if self.rule is Rule.RULE:
            if os.path.isdir(path) and not os.path.islink(path):
                check_folder(path, what)
            else:
                check_file(path, what, inside=self.path)
        elif self.rule is Rule.OWNER:
            check_owner(path, what)


def chosen(path: Path | str) -> AdmittedPath:
    """A path the user's own command named (or one shipped with hatch-vllm-patch): admitted as
    the user's choice, without a check."""
    return AdmittedPath(Path(path), Rule.CHOSEN, _KEY)


def check_owner(path: Path | str, what: str) -> None:
    """``path`` (and, for a symlink, the link and what it leads to) is not owned by another
    user: owned by this user or root, or named in ``$HATCH_VLLM_PATCH_TRUST``."""
    if explicitly_trusted(path):
        return
    given = os.path.abspath(path)
    for name in dict.fromkeys((given, os.path.realpath(given))):
        try:
            st = os.lstat(name)
        except FileNotFoundError:
            continue  # what does not exist runs nothing; its reader says it is missing
        except OSError as exc:
            raise UntrustedPath(f"hatch-vllm-patch cannot check {what} {name}: "
                                f"{exc.strerror or exc}") from None
        if st.st_uid not in (os.geteuid(), 0):
            raise _refuse(what, name, st, "owned by another user")


def admit_folder(path: Path | str, what: str, rule: Rule) -> AdmittedPath:
    """``path`` under ``rule`` (see :class:`Rule`), or :class:`UntrustedPath`."""
    if rule is Rule.RULE:
        check_folder(path, what)
    elif rule is Rule.OWNER:
        check_owner(path, what)
    return AdmittedPath(Path(path), rule, _KEY)


def admit_project(path: Path | str, what: str, rule: Rule) -> AdmittedPath:
    """A project folder and its ``pyproject.toml`` under ``rule``."""
    admitted = admit_folder(path, what, rule)
    source = Path(path) / "pyproject.toml"
    if rule is not Rule.CHOSEN and (source.exists() or source.is_symlink()):
        admitted.member(source, f"{what}'s pyproject.toml")
    return admitted


def admit_interpreter(python: Path | str, what: str, rule: Rule) -> AdmittedPath:
    """An interpreter that will be run: the file (and what a symlink leads to), and when it
    lies in a virtual environment the environment's folder, ``bin`` and ``pyvenv.cfg``, under
    ``rule``. A base interpreter a venv links to (``/usr/bin/python3``) is root's."""
    path = Path(os.path.abspath(python))
    if rule is Rule.CHOSEN:
        return AdmittedPath(path, rule, _KEY)
    env = path.parent.parent
    parts = [path.parent, path]
    if (env / "pyvenv.cfg").exists() or (env / "pyvenv.cfg").is_symlink():
        parts = [env, env / "pyvenv.cfg", *parts]
    for part in parts:
        if rule is Rule.OWNER:
            check_owner(part, what)
            continue
        if part.is_dir() and not part.is_symlink():
            check_folder(part, what)
            continue
        st = _stat(str(part), what) if part.exists() or part.is_symlink() else None
        if st is None:
            continue  # not there: the interpreter is reported missing when it is run
        if stat.S_ISLNK(st.st_mode):
            if st.st_uid not in (os.geteuid(), 0) and not explicitly_trusted(part):
                raise _refuse(what, str(part), st, "a symlink not owned by this user or root")
            real = os.path.realpath(part)
            target = _stat(real, what)
            problem = _problem(target, parent=False)
            if problem is not None and not explicitly_trusted(real):
                raise _refuse(what, real, target, problem)
            check_parents(real, what)
        else:
            check_file(part, what)
    return AdmittedPath(path, rule, _KEY)
