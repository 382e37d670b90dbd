"""Patch ids: one validator for every place an id enters (``new``, ``create``, a catalog's
folder names and ``patch.toml`` ids, the record, ``--patch``, the markers written into a file).

An id is kebab-case ASCII, matched whole: ``re.match`` with ``$`` would accept ``'x\\n'``, which
written into a marker breaks the target module, and made into a folder breaks the project.
Import-light (``re`` only): the guard and the markers use it.
"""

from __future__ import annotations

import re

MAX_ID_LENGTH = 100
_PATCH_ID = re.compile(r"[a-z0-9]+(?:-[a-z0-9]+)*")
ID_RULE = ("a patch id is kebab-case ASCII (lowercase letters, digits and single hyphens, at "
           f"most {MAX_ID_LENGTH} characters), e.g. clearer-kv-memory-error")


def is_patch_id(value: object) -> bool:
    """Is ``value`` a patch id, whole (full match, ASCII, no control character, bounded)?"""
    return (isinstance(value, str) and 0 < len(value) <= MAX_ID_LENGTH and value.isascii()
            and _PATCH_ID.fullmatch(value) is not None)


def shown(value: object, limit: int = 60) -> str:
    """``value`` quoted for a message: escaped (control characters and non-ASCII as ``\\x..``),
    cut to ``limit`` characters."""
    text = value if isinstance(value, str) else str(value)
    cut = text[:limit]
    return ascii(cut) + ("..." if len(text) > limit else "")
