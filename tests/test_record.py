"""The environment's record: parsed strictly, written back equal, and the ledger of the previous
release (format 1) read as it is."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hatch_vllm_patch.record import (
    EditSession,
    EnvironmentRecord,
    FileEntry,
    RecordDamaged,
    SelectedPatch,
    Selection,
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
