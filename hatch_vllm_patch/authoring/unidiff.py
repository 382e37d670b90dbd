"""Unified diffs (``git diff``, ``gh pr diff``, a GitHub ``.diff``): parsed, and applied to a
text with zero fuzz — every context and removed line must match exactly; only the position may
differ from the hunk's line numbers. Pure: text in, text out, :class:`DiffError` naming the hunk
and the first line that differs."""

from __future__ import annotations

import re
from typing import NamedTuple

from ..errors import UsageError

_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")
NO_FILE = "/dev/null"


class DiffError(UsageError):
    """A diff that does not parse, or does not apply exactly."""


class Hunk(NamedTuple):
    header: str  # the "@@ -a,b +c,d @@ ..." line
    old_start: int  # 1-based
    lines: tuple[tuple[str, str], ...]  # (" " | "-" | "+", text with its line ending)

    @property
    def old(self) -> list[str]:
        return [text for tag, text in self.lines if tag != "+"]

    @property
    def new(self) -> list[str]:
        return [text for tag, text in self.lines if tag != "-"]

    def render(self) -> str:
        return self.header + "\n" + "".join(tag + text if text.endswith("\n") else
                                            f"{tag}{text}\n\\ No newline at end of file\n"
                                            for tag, text in self.lines)


class FileDiff(NamedTuple):
    old_path: str  # as written, without a/ (NO_FILE: the diff creates it)
    new_path: str  # without b/ (NO_FILE: the diff deletes it)
    hunks: tuple[Hunk, ...]
    binary: bool = False

    @property
    def path(self) -> str:
        return self.new_path if self.new_path != NO_FILE else self.old_path


def _strip(path: str, prefix: str) -> str:
    path = path.split("\t")[0].strip()
    if path == NO_FILE:
        return path
    if path.startswith('"') and path.endswith('"'):
        path = path[1:-1]
    return path[len(prefix):] if path.startswith(prefix) else path


def parse_diff(text: str, name: str = "the diff") -> list[FileDiff]:
    """Every file of a unified diff, in order; :class:`DiffError` for text that is not one."""
    lines = text.splitlines(keepends=True)
    files: list[FileDiff] = []
    i = 0
    old_path = new_path = None
    binary = False
    hunks: list[Hunk] = []

    def flush() -> None:
        nonlocal old_path, new_path, hunks, binary
        if old_path is not None and new_path is not None:
            files.append(FileDiff(old_path, new_path, tuple(hunks), binary))
        old_path = new_path = None
        hunks, binary = [], False

    while i < len(lines):
        line = lines[i]
        if line.startswith("diff --git "):
            flush()
            parts = line.rstrip("\n").split(" ")
            if len(parts) >= 4:  # known now, for a binary file or a pure rename
                old_path, new_path = _strip(parts[2], "a/"), _strip(parts[3], "b/")
            i += 1
            continue
        if line.startswith("Binary files ") or line.startswith("GIT binary patch"):
            binary = True
            i += 1
            continue
        if line.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ "):
            if hunks:
                flush()
            old_path = _strip(line[4:].rstrip("\n"), "a/")
            new_path = _strip(lines[i + 1][4:].rstrip("\n"), "b/")
            i += 2
            continue
        match = _HUNK.match(line)
        if match:
            if old_path is None or new_path is None:
                raise DiffError(f"{name}, line {i + 1}: a hunk before any file header "
                                "(--- a/... +++ b/...)")
            old_len = int(match.group(2) or "1")
            new_len = int(match.group(4) or "1")
            body: list[tuple[str, str]] = []
            i += 1
            seen_old = seen_new = 0
            while i < len(lines) and (seen_old < old_len or seen_new < new_len):
                current = lines[i]
                if current.startswith("\\"):  # "\ No newline at end of file"
                    if body:
                        tag, last = body[-1]
                        body[-1] = (tag, last.rstrip("\n"))
                    i += 1
                    continue
                kind = current[:1] if current[:1] in {" ", "-", "+"} else (
                    " " if current in {"\n", "\r\n"} else None)
                if kind is None:
                    raise DiffError(f"{name}, line {i + 1}: expected a hunk line (' ', '-' or "
                                    f"'+'), found {current.rstrip()!r}")
                text_part = current[1:] if current[:1] in {" ", "-", "+"} else current
                body.append((kind, text_part))
                seen_old += kind != "+"
                seen_new += kind != "-"
                i += 1
            while i < len(lines) and lines[i].startswith("\\"):
                if not body:  # "\ No newline" after an empty hunk: it marks no line
                    raise DiffError(f"{name}, line {i + 1}: {lines[i].rstrip()!r} follows the "
                                    f"hunk {line.strip()!r}, which holds no line")
                tag, last = body[-1]
                body[-1] = (tag, last.rstrip("\n"))
                i += 1
            if seen_old != old_len or seen_new != new_len:
                raise DiffError(f"{name}: hunk {line.strip()!r} of {new_path} is cut short")
            hunks.append(Hunk(line.rstrip("\n"), int(match.group(1)), tuple(body)))
            continue
        i += 1  # index, mode, similarity lines, commit messages, e-mail headers
    flush()
    if not files:
        raise DiffError(f"{name} holds no file of a unified diff (no '--- a/...' and '+++ "
                        "b/...' lines)")
    return files


def apply_hunks(text: str, diff: FileDiff, name: str) -> str:
    """``text`` with every hunk of ``diff`` applied, exactly; :class:`DiffError` naming the
    first hunk that does not match, its text, and the first line that differs."""
    lines = text.splitlines(keepends=True)
    out: list[str] = []
    position = 0  # next line of ``lines`` not yet copied
    offset = 0
    for number, hunk in enumerate(diff.hunks, 1):
        old = hunk.old
        expected = max(hunk.old_start - 1 + offset, position) if old else hunk.old_start + offset
        start = _find(lines, old, expected, position)
        if start is None:
            raise DiffError(_mismatch(lines, hunk, number, expected, name))
        out += lines[position:start]
        out += hunk.new
        position = start + len(old)
        offset = start - (hunk.old_start - 1)
    out += lines[position:]
    return "".join(out)


def _find(lines: list[str], old: list[str], expected: int, floor: int) -> int | None:
    """The start nearest ``expected`` (not before ``floor``) where ``old`` matches exactly."""
    if not old:
        return min(max(expected, floor), len(lines))
    last = len(lines) - len(old)
    for distance in range(0, max(last, 0) + len(lines) + 1):
        for start in {expected - distance, expected + distance}:
            if floor <= start <= last and lines[start:start + len(old)] == old:
                return start
        if expected - distance < floor and expected + distance > last:
            break
    return None


def _mismatch(lines: list[str], hunk: Hunk, number: int, expected: int, name: str) -> str:
    old = hunk.old
    differs = ""
    for k, want in enumerate(old):
        index = expected + k
        found = lines[index] if 0 <= index < len(lines) else None
        if found != want:
            shown = "the end of the file" if found is None else repr(found.rstrip("\n"))
            differs = (f"the first line that differs is line {index + 1}: the hunk expects "
                       f"{want.rstrip(chr(10))!r}, the installed file has {shown}")
            break
    return (f"{name}: hunk {number} ({hunk.header}) does not match the installed file, "
            f"anywhere (zero fuzz: context must match exactly); {differs}; nothing was "
            f"written. The hunk:\n{hunk.render()}")
