"""The environment's record: parsed strictly, written back equal, and the ledger of the previous
release (format 1) read as it is."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hatch_vllm_patch.record import (
    CARRIED,
    COMMAND_LINE,
    EditSession,
    EnvironmentRecord,
    FileEntry,
    RecordDamaged,
    SelectedPatch,
    Selection,
    merge_selection,
    parse_record,
    read_record,
)

ENTRY = FileEntry("vllm", "0.20.2", "a" * 64, "b" * 64, {"kv": "c" * 64}, {"kv": "a" * 64 + ":f"})
SELECTION = Selection((SelectedPatch("kv", "vllm", "vllm.v1.core.kv_cache_utils", "applied", True,
                                     "/x.py", "b" * 64, "c" * 64, "/patches/kv"),),
                      "apply", "/project", ("/project/vllm-patches",))


def test_round_trip() -> None:
    """A record renders to JSON that parses back to an equal record."""
    record = EnvironmentRecord({"/x.py": ENTRY}, SELECTION,
                               {"/y.py": EditSession("m", "vllm", "0.20.2", "d" * 64, ("kv",))})
    assert parse_record(record.render()).to_json() == record.to_json()
    assert parse_record(record.render()).same_as(record)


def test_previous_release_ledger_is_read(tmp_path: Path) -> None:
    """The format-1 ledger of hatch-vllm-patch 0.1.0 reads as files without a selection."""
    (tmp_path / ".hatch-vllm-patch.json").write_text(json.dumps({
        "format": 1, "tool": "hatch-vllm-patch", "updated": "2026-11-01T00:00:00Z",
        "files": {"/x.py": {"distribution": "vllm", "distribution_version": "0.20.2",
                            "original_sha256": "a" * 64, "patched_sha256": "b" * 64,
                            "patches": {"kv": "c" * 64}}}}))
    state = read_record(tmp_path)
    assert state.usable and state.record.selection is None
    assert state.record.files["/x.py"].patches == {"kv": "c" * 64}


@pytest.mark.parametrize("data, problem", [
    (b"[]", "does not hold a JSON object"),
    (b'{"format": 7}', "newer hatch-vllm-patch (format 7"),
    (b'{"format": "two"}', "unknown format"),
    (b'{"format": 2, "files": {"/x.py": {"patches": {}}}}', "distribution is not a string"),
    (b'{"format": 2, "selection": {"guard": "loud"}}', "'loud' is not one of"),
    (b'{"format": 2, "selection": {"patches": [{"id": "x"}]}}', "is not a patch entry"),
    (b'{"format": 2, "edits": []}', '"edits" is not an object'),
    (b"\xff", "is not valid JSON"),
])
def test_damage_is_named(data: bytes, problem: str) -> None:
    """Every structural problem is one RecordDamaged naming it (never a KeyError)."""
    with pytest.raises(RecordDamaged, match=problem.replace("(", r"\(")):
        parse_record(data)


def test_a_huge_record_is_refused_before_it_is_read(tmp_path: Path) -> None:
    """A 200 MB record is damaged by its size alone: refused in milliseconds, unread."""
    import time

    with (tmp_path / ".hatch-vllm-patch.json").open("wb") as f:
        f.truncate(200 * 10**6)  # sparse: reading it would still cost
    started = time.perf_counter()
    state = read_record(tmp_path)
    assert time.perf_counter() - started < 0.05
    assert not state.usable and "200000000 bytes, more than a record can be" in state.problem


@pytest.mark.parametrize("path, problem", [
    ("x.py", "not an absolute, normalised path"),
    ("/sp/../etc/x.py", "not an absolute, normalised path"),
    ("/etc/x.py", "lies outside the environment"),
])
def test_paths_are_validated(tmp_path: Path, path: str, problem: str) -> None:
    """A file path of the record must be absolute, normalised and inside the environment's
    roots; a path leaving them through a symlink is outside too."""
    record = {"format": 2, "edits": {path: EditSession("m", "vllm", "1", "d" * 64).to_json()}}
    with pytest.raises(RecordDamaged, match=problem):
        parse_record(json.dumps(record).encode(), ("/sp",))
    (tmp_path / "sp").mkdir()
    (tmp_path / "sp" / "link").symlink_to("/etc")
    inside = str(tmp_path / "sp" / "link" / "x.py")
    record = {"format": 2, "selection": {"patches": [
        {"id": "kv", "distribution": "vllm", "module": "m", "verdict": "applied", "ok": True,
         "file": inside}]}}
    with pytest.raises(RecordDamaged, match="lies outside the environment"):
        parse_record(json.dumps(record).encode(), (str(tmp_path / "sp"),))


def test_digests_and_session_identity_are_validated() -> None:
    """A digest that is not a sha256, or an edit session's file identity that is not three
    numbers, is damage."""
    bad_digest = {"format": 2, "files": {"/x.py": {**ENTRY.to_json(), "patched_sha256": "zz"}}}
    with pytest.raises(RecordDamaged, match="patched_sha256 is not a sha256 digest"):
        parse_record(json.dumps(bad_digest).encode())
    session = {**EditSession("m", "vllm", "1", "d" * 64).to_json(), "opened": {"inode": "1"}}
    with pytest.raises(RecordDamaged, match="opened is not an inode, size and mtime_ns"):
        parse_record(json.dumps({"format": 2, "edits": {"/y.py": session}}).encode())
    good = EditSession("m", "vllm", "1", "d" * 64, (), (5, 10, 99))
    parsed = parse_record(EnvironmentRecord(edits={"/y.py": good}).render())
    assert parsed.edits["/y.py"].opened == (5, 10, 99)


A, B = "/a/pyproject.toml", "/b/pyproject.toml"


def entry(pid: str, *selected_by: str) -> SelectedPatch:
    return SelectedPatch(pid, "vllm", "vllm.m", "applied", True, selected_by=selected_by)


def ids(entries: tuple[SelectedPatch, ...]) -> dict[str, tuple[str, ...]]:
    return {e.id: e.selected_by for e in entries}


@pytest.mark.parametrize("previous, origin, now, converge, kept, removed", [
    # the project dropped a patch: removed; another project's and the command line's stay
    ([("x", A), ("y", B), ("z", COMMAND_LINE)], A, [], True,
     {"y": (B,), "z": (COMMAND_LINE,)}, ["x"]),
    # a patch both projects selected: A drops it, B keeps it
    ([("x", A, B)], A, [], True, {"x": (B,)}, []),
    # a patch moved from A to B: B's apply adds itself, A's apply then leaves it to B
    ([("x", A)], B, ["x"], True, {"x": (A, B)}, []),
    ([("x", A, B)], A, ["w"], True, {"x": (B,), "w": (A,)}, []),
    # still selected: kept, with its selectors
    ([("x", A)], A, ["x"], True, {"x": (A,)}, []),
    # a command-line apply removes nothing, and takes over only what nobody selected
    ([("x", A)], COMMAND_LINE, ["x", "y"], False, {"x": (A,), "y": (COMMAND_LINE,)}, []),
    # create / update applying for project A: the patch is A's (no longer the command line's)
    ([("x", COMMAND_LINE), ("y", B)], COMMAND_LINE, ["x:" + A, "y:" + A, "z:" + A], False,
     {"x": (A,), "y": (B, A), "z": (A,)}, []),
    # not converging (a partial apply): nothing is removed
    ([("x", A)], A, [], False, {"x": (A,)}, []),
    # an entry whose selector is not known (no field, no project) is never removed
    ([("x",)], A, [], True, {"x": ()}, []),
])
def test_merge_selection(previous: list[tuple[str, ...]], origin: str, now: list[str],
                         converge: bool, kept: dict[str, tuple[str, ...]],
                         removed: list[str]) -> None:
    """What an apply keeps of the recorded selection, and what it removes, by who selected it."""
    before = tuple(entry(pid, *by) for pid, *by in previous)
    entries = tuple(entry(*p.split(":", 1)) for p in now)  # "id:selector": brings its own
    merged, gone = merge_selection(before, origin, entries, converge)
    assert ids(merged) == kept
    assert [e.id for e in gone] == removed


def test_merge_selection_of_carried_selections() -> None:
    """An apply of the carried selections owns every `carried by` selector: a patch whose
    carrier is gone is removed, one carried by another wheel now changes carrier, a project's
    patch is kept; re-applying the same leaves the selection equal."""
    a, b, c = (f"{CARRIED}svc-{n}" for n in "abc")
    before = (entry("x", a), entry("y", b), entry("z", A), entry("w", b, A))
    merged, gone = merge_selection(before, CARRIED, (entry("x", c),), True)
    assert ids(merged) == {"z": (A,), "w": (A,), "x": (c,)}
    assert [e.id for e in gone] == ["y"]
    again, none = merge_selection(merged, CARRIED, (entry("x", c),), True)
    assert again == merged and none == ()


def test_selected_by_round_trips_and_old_records_are_the_projects() -> None:
    """selected_by is written and read back; an entry without it (an earlier release) belongs
    to the recorded project's pyproject.toml, or to nobody known when there is no project."""
    record = EnvironmentRecord({}, SELECTION._replace(patches=(
        SELECTION.patches[0]._replace(selected_by=(A, COMMAND_LINE)),)))
    assert parse_record(record.render()).selection.patches[0].selected_by == (A, COMMAND_LINE)
    data = json.loads(EnvironmentRecord({}, SELECTION).render())
    del data["selection"]["patches"][0]["selected_by"]
    old = parse_record(json.dumps(data).encode()).selection
    assert old is not None and old.patches[0].selected_by == ("/project/pyproject.toml",)
    data["selection"]["project"] = None
    old = parse_record(json.dumps(data).encode()).selection
    assert old is not None and old.patches[0].selected_by == ()
    data["selection"]["patches"][0]["selected_by"] = "/a"
    with pytest.raises(RecordDamaged, match="is not a list of selectors"):
        parse_record(json.dumps(data).encode())


def test_entries_outside_the_roots_are_dropped_when_asked(tmp_path: Path) -> None:
    """Read with a list to collect them, well-formed entries whose paths lie outside the
    environment now (a replaced editable checkout) are left out and named; a malformed entry
    is damage wherever it points."""
    inside, outside = "/sp/a.py", "/old-checkout/b.py"
    session = EditSession("m", "vllm", "1", "d" * 64).to_json()
    record = {"format": 2, "edits": {inside: session, outside: session},
              "selection": {"patches": [
                  {"id": "kv", "distribution": "vllm", "module": "m", "verdict": "applied",
                   "ok": True, "file": outside}]}}
    dropped: list[str] = []
    parsed = parse_record(json.dumps(record).encode(), ("/sp",), dropped)
    assert list(parsed.edits) == [inside]
    assert parsed.selection is not None and parsed.selection.patches == ()
    assert len(dropped) == 2 and all(outside in d and "lies outside" in d for d in dropped)
    record["files"] = {outside: 3}
    with pytest.raises(RecordDamaged, match="is not an object"):
        parse_record(json.dumps(record).encode(), ("/sp",), [])
