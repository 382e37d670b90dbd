"""The three-way merge of ``update``, symbol by symbol: the patch's change (base -> patched)
carried onto the installed pristine symbol (base -> installed). Pure text; a conflict is marked
the way git marks one, so an editor and a reader know it."""

from __future__ import annotations

import difflib
from typing import NamedTuple

OURS_MARK = "<<<<<<< "
BASE_MARK = "||||||| "
SPLIT_MARK = "======="
THEIRS_MARK = ">>>>>>> "


class Merged(NamedTuple):
    text: str
    conflicts: int  # regions both sides changed differently (marked in ``text``)


def _changes(base: list[str], other: list[str]) -> list[tuple[int, int, list[str]]]:
    """(start, end, replacement) in ``base`` coordinates for every change to ``other``."""
    matcher = difflib.SequenceMatcher(a=base, b=other, autojunk=False)
    return [(i1, i2, other[j1:j2]) for tag, i1, i2, j1, j2 in matcher.get_opcodes()
            if tag != "equal"]


def _apply(base: list[str], lo: int, hi: int, changes: list[tuple[int, int, list[str]]]
           ) -> list[str]:
    """``base[lo:hi]`` with the ``changes`` that fall inside it applied."""
    out: list[str] = []
    at = lo
    for start, end, lines in changes:
        out += base[at:start]
        out += lines
        at = end
    out += base[at:hi]
    return out


def merge3(base: str, ours: str, theirs: str, *, ours_label: str, base_label: str,
           theirs_label: str) -> Merged:
    """``base`` with the changes of both ``ours`` and ``theirs``; where both changed the same
    lines differently, the two versions between conflict markers (ours first)."""
    b = base.splitlines(keepends=True)
    mine, yours = _changes(b, ours.splitlines(keepends=True)), _changes(
        b, theirs.splitlines(keepends=True))
    tagged = sorted([(s, e, lines, 0) for s, e, lines in mine]
                    + [(s, e, lines, 1) for s, e, lines in yours], key=lambda c: (c[0], c[1]))
    out: list[str] = []
    conflicts = 0
    at = 0
    i = 0
    while i < len(tagged):
        lo, hi = tagged[i][0], tagged[i][1]
        group = [tagged[i]]
        i += 1
        # Changes that overlap (or touch the same point) are one region.
        while i < len(tagged) and (tagged[i][0] < hi or tagged[i][0] == lo
                                   or (tagged[i][0] == hi and tagged[i][1] == hi)):
            hi = max(hi, tagged[i][1])
            group.append(tagged[i])
            i += 1
        out += b[at:lo]
        sides = {side for *_, side in group}
        side_text = [_apply(b, lo, hi, [(s, e, ls) for s, e, ls, sd in group if sd == k])
                     for k in (0, 1)]
        if len(sides) == 1 or side_text[0] == side_text[1]:
            out += side_text[0] if 0 in sides else side_text[1]
        else:
            conflicts += 1
            out += [f"{OURS_MARK}{ours_label}\n", *_terminated(side_text[0]),
                    f"{BASE_MARK}{base_label}\n", *_terminated(b[lo:hi]),
                    f"{SPLIT_MARK}\n", *_terminated(side_text[1]),
                    f"{THEIRS_MARK}{theirs_label}\n"]
        at = hi
    out += b[at:]
    return Merged("".join(out), conflicts)


def _terminated(lines: list[str]) -> list[str]:
    if lines and not lines[-1].endswith("\n"):
        return [*lines[:-1], lines[-1] + "\n"]
    return lines


def has_conflict_markers(text: str) -> list[int]:
    """The lines (1-based) that hold a conflict marker of ours."""
    return [n for n, line in enumerate(text.splitlines(), 1)
            if line.startswith((OURS_MARK, THEIRS_MARK, BASE_MARK)) or line == SPLIT_MARK]
