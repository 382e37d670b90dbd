"""Foreign data read with bounds, and shown escaped.

JSON and TOML written by someone else (a model's ``config.json``, a project's ``pyproject.toml``,
a patch's ``patch.toml``, a distribution's carried selection, the record) are read only up to a
size and a nesting depth: a file nested 200,000 deep must be one clear error naming it, not a
``RecursionError`` (the parsers recurse). Text from such files (an architecture name, a path) is
escaped before it reaches a terminal: :func:`escape_controls`.

Import-light (``json``, ``os``, ``stat`` only): the guard reads the record with it.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

MAX_BYTES = 8 << 20  # config.json files with big label maps stay well under it
MAX_DEPTH = 100


class BoundExceeded(ValueError):
    """The data is larger, or nested deeper, than foreign data may be."""


def read_regular(path: Path, max_bytes: int) -> bytes:
    """The bytes of ``path``, a regular file of at most ``max_bytes`` (:class:`BoundExceeded`
    otherwise, OSError as is). Opened non-blocking and checked with ``fstat`` on the open file
    before a byte is read: a FIFO, a device (``/dev/zero``), a socket or a directory planted
    under the expected name is refused at once instead of hanging or reading without end."""
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags)
    # One owner of the descriptor, closed once: handing it to a file object mid-way left a
    # window where a Ctrl-C made both close it (EBADF, reported as an unreadable file).
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise BoundExceeded(f"not a regular file ({_kind(info.st_mode)})")
        if info.st_size > max_bytes:
            raise BoundExceeded(f"larger than {_size(max_bytes)} ({info.st_size} bytes)")
        chunks: list[bytes] = []
        left = max_bytes + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise BoundExceeded(f"larger than {_size(max_bytes)}")
    return data


def _size(max_bytes: int) -> str:
    return f"{max_bytes >> 20} MiB" if max_bytes >= 1 << 20 else f"{max_bytes} bytes"


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a file"


_read = read_regular


def check_depth(value: Any, max_depth: int = MAX_DEPTH) -> Any:
    """``value`` when its lists and objects nest at most ``max_depth`` deep (walked without
    recursion), else :class:`BoundExceeded`."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = list(item.values())
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > max_depth:
            raise BoundExceeded(f"nested deeper than {max_depth} levels")
        stack += [(c, depth + 1) for c in children if isinstance(c, (dict, list))]
    return value


def loads_json(text: str | bytes, max_depth: int = MAX_DEPTH) -> Any:
    """``json.loads`` with the depth bound (``ValueError`` for bad JSON, too)."""
    try:
        return check_depth(json.loads(text), max_depth)
    except RecursionError:
        raise BoundExceeded(f"nested deeper than {max_depth} levels") from None


def load_json(path: Path, *, max_bytes: int = MAX_BYTES, max_depth: int = MAX_DEPTH) -> Any:
    """The JSON in ``path``, bounded: ``OSError``, ``UnicodeDecodeError`` or ``ValueError``
    (:class:`BoundExceeded` for the bounds), the message without the path."""
    return loads_json(_read(path, max_bytes).decode("utf-8"), max_depth)


def load_toml(path: Path, *, max_bytes: int = 1 << 20, max_depth: int = MAX_DEPTH
              ) -> dict[str, Any]:
    """The TOML in ``path``, bounded (a ``pyproject.toml``, a ``patch.toml``): ``OSError``,
    ``UnicodeDecodeError``, ``TOMLDecodeError`` or :class:`BoundExceeded`."""
    from . import _toml

    text = _read(path, max_bytes).decode("utf-8")
    try:
        data = _toml.loads(text)
    except RecursionError:
        raise BoundExceeded(f"nested deeper than {max_depth} levels") from None
    return check_depth(data, max_depth)  # type: ignore[no-any-return]


_KEEP = {"\n", "\t"}
_BIDI = {chr(c) for c in (*range(0x202A, 0x202F), *range(0x2066, 0x206A))}


def escape_controls(text: str) -> str:
    """``text`` with control characters (terminal escapes, carriage returns, C1 controls, bidi
    overrides) shown as ``\\x1b``-style escapes; newlines and tabs kept."""
    if text.isprintable() or not any(_unsafe(ch) for ch in text):
        return text
    return "".join(ascii(ch)[1:-1] if _unsafe(ch) else ch for ch in text)


def _unsafe(ch: str) -> bool:
    code = ord(ch)
    return ((code < 0x20 and ch not in _KEEP) or 0x7F <= code <= 0x9F or ch in _BIDI)
