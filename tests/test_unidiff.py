"""Unified diffs parsed as git and GitHub write them, applied with zero fuzz: offsets are fine,
a context line that differs is refused naming the hunk and the line."""

from __future__ import annotations

import difflib

import pytest

from hatch_vllm_patch.authoring.unidiff import DiffError, apply_hunks, parse_diff

OLD = "".join(f"line {i}\n" for i in range(1, 41))
NEW = OLD.replace("line 5\n", "line five\n").replace("line 30\n", "line 30\nline 30b\n")


def git_diff(old: str, new: str, path: str = "vllm/x.py") -> str:
    body = "".join(difflib.unified_diff(old.splitlines(keepends=True),
                                        new.splitlines(keepends=True),
                                        fromfile=f"a/{path}", tofile=f"b/{path}"))
    return f"diff --git a/{path} b/{path}\nindex 1234567..89abcde 100644\n{body}"


def test_a_git_diff_applies_exactly() -> None:
    """A git diff of two hunks gives the new text; paths lose a/ and b/."""
    [file] = parse_diff(git_diff(OLD, NEW))
    assert file.path == "vllm/x.py" and len(file.hunks) == 2
    assert apply_hunks(OLD, file, "d") == NEW


def test_line_offsets_are_fine() -> None:
    """The same hunks on a file with lines added above them still apply where the context
    is."""
    shifted = "new top\n" * 7 + OLD
    [file] = parse_diff(git_diff(OLD, NEW))
    assert apply_hunks(shifted, file, "d") == "new top\n" * 7 + NEW


def test_several_files_and_no_newline_at_end() -> None:
    """Two files in one diff (a GitHub .diff), one ending without a newline."""
    text = git_diff(OLD, NEW) + ("diff --git a/docs/y.md b/docs/y.md\n--- a/docs/y.md\n"
                                 "+++ b/docs/y.md\n@@ -1,2 +1,2 @@\n a\n-b\n"
                                 "\\ No newline at end of file\n+c\n"
                                 "\\ No newline at end of file\n")
    files = parse_diff(text)
    assert [f.path for f in files] == ["vllm/x.py", "docs/y.md"]
    assert apply_hunks("a\nb", files[1], "d") == "a\nc"


def test_a_context_line_that_differs_is_refused_with_the_hunk() -> None:
    """Zero fuzz: one context line changed in the installed file refuses the hunk, naming it
    and the first line that differs."""
    [file] = parse_diff(git_diff(OLD, NEW))
    installed = OLD.replace("line 28\n", "line 28 (changed)\n")
    with pytest.raises(DiffError) as info:
        apply_hunks(installed, file, "fix.diff: vllm/x.py")
    message = str(info.value)
    assert "hunk 2 (@@ -28,6 +28,7 @@) does not match" in message, message
    assert "line 28: the hunk expects 'line 28', the installed file has 'line 28 (changed)'" \
        in message
    assert "+line 30b" in message and "nothing was written" in message


def test_text_that_is_not_a_diff_is_refused() -> None:
    """No file header: one clear error."""
    with pytest.raises(DiffError, match="holds no file of a unified diff"):
        parse_diff("hello\n", "notes.txt")
