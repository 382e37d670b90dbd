"""The three-way merge of `update`: both sides' changes carried when they touch different
lines, the same change once, a conflict marked like git's (ours, base, theirs)."""

from __future__ import annotations

from hatch_vllm_patch.authoring.merge import has_conflict_markers, merge3

BASE = "def f(x):\n    a = 1\n    b = 2\n    c = 3\n    return a + b + c\n"
LABELS = {"ours_label": "patch", "base_label": "base", "theirs_label": "installed"}


def test_changes_on_different_lines_merge_cleanly() -> None:
    """Ours changes `a`, theirs changes `c`: both are in the result, no marker."""
    ours = BASE.replace("a = 1", "a = 10")
    theirs = BASE.replace("c = 3", "c = 30").replace("def f(x):", "def f(x, y=0):")
    merged = merge3(BASE, ours, theirs, **LABELS)
    assert merged.conflicts == 0
    assert merged.text == BASE.replace("a = 1", "a = 10").replace("c = 3", "c = 30").replace(
        "def f(x):", "def f(x, y=0):")
    assert has_conflict_markers(merged.text) == []


def test_the_same_change_on_both_sides_is_taken_once() -> None:
    """Upstream made the patch's own change: the result is that code, once."""
    both = BASE.replace("b = 2", "b = 20")
    assert merge3(BASE, both, both, **LABELS) == (both, 0)


def test_a_conflict_is_marked_with_both_versions_and_the_base() -> None:
    """Both sides change `b` differently: one region between markers, ours first."""
    ours, theirs = BASE.replace("b = 2", "b = 20"), BASE.replace("b = 2", "b = 200")
    merged = merge3(BASE, ours, theirs, **LABELS)
    assert merged.conflicts == 1
    assert ("<<<<<<< patch\n    b = 20\n||||||| base\n    b = 2\n=======\n    b = 200\n"
            ">>>>>>> installed\n") in merged.text
    assert has_conflict_markers(merged.text) == [3, 5, 7, 9]
