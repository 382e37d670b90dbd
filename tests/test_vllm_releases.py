"""Catalog patches against the real files of vLLM releases 0.16.0 … 0.34.0
(kv-cache-page-unification, the four *-spec-conv-state patches, mamba-split-external-kv,
mamba-all-mode-chunk-align).

A release's real wheel (kept in a wheel cache between runs) is installed with
``uv pip install --no-deps`` (real RECORD, real files) and driven through the CLI as a user
would: verify, diff, apply, apply again, verify, revert, verify. That round trip runs on the
releases where one of these patches starts or ends a shape (release_shapes.BOUNDARIES), each
patch on its own boundaries; every release's wheel is checked without installing it
(tests/test_release_shapes.py), and ``HATCH_VLLM_PATCH_EXHAUSTIVE=1`` round-trips every patch on
every release.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from pathlib import Path

import pytest
from packaging.version import Version
from support.commands import cli
from support.page_promotion import HOME, refused_before_029, release_round_trip
from support.release_shapes import RELEASES, at_boundary, round_trip_releases
from support.venvs import record_sha256, release_venv, site_packages

from hatch_vllm_patch.catalog import load_catalog
from hatch_vllm_patch.engine import symbol_digest

PATCH = "kv-cache-page-unification"
MODULE = "vllm/v1/core/kv_cache_utils.py"

# Every release on PyPI in the range, and what KNOWLEDGE §1 (re-measured) predicts for it:
# 0.16.0-0.23.0 the original buggy function; 0.24-0.25.1 pads attention only behind a backend
# flag; 0.26-0.28 pads Mamba but still raises on S1 without the flag -> all patched.
# 0.29.0 carries the function 0.30.0 fixed, 0.33.0 moved it to kv_cache_planning.py (0.34.0: the
# same function there) -> not needed.
PATCHED = ["0.16.0", "0.17.0", "0.17.1", "0.18.0", "0.18.1", "0.19.0", "0.19.1", "0.20.0",
           "0.20.1", "0.20.2", "0.21.0", "0.22.0", "0.22.1", "0.23.0", "0.24.0", "0.25.0",
           "0.25.1", "0.26.0", "0.27.0", "0.27.1", "0.28.0"]
NOT_NEEDED = ["0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0"]

pytestmark = pytest.mark.slow


def step(python: Path, op: str) -> tuple[int, dict[str, object]]:
    proc = cli(op, "--python", str(python), "--patch", PATCH, "--json")
    assert "Traceback" not in proc.stderr, proc.stderr
    data = json.loads(proc.stdout)
    patches = data["patches"]
    assert isinstance(patches, list) and len(patches) == 1
    return proc.returncode, patches[0]


@pytest.fixture
def release(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Path, Path]:
    """(python, site-packages) of a venv holding the real files of one vLLM release."""
    python = release_venv(tmp_path / "venv", "vllm", request.param)
    return python, site_packages(tmp_path / "venv")


def buggy_round_trip(python: Path, sp: Path, tmp_path: Path) -> None:
    """Buggy releases: apply, idempotent re-apply, verify, and revert to the RECORD bytes."""
    target = sp / MODULE
    original = target.read_bytes()
    assert hashlib.sha256(original).hexdigest() == record_sha256(sp, "vllm", MODULE)
    assert symbol_digest(original.decode(), "unify_kv_cache_spec_page_size") in \
        load_catalog()[PATCH].shapes
    twin = tmp_path / "twin.py"
    os.link(target, twin)  # another link to the installed inode, as uv's cache holds one

    assert step(python, "verify")[0] == 1
    code, diff = step(python, "diff")
    assert code == 0 and "+# >>> hatch-vllm-patch: kv-cache-page-unification" in str(diff["diff"])
    assert target.read_bytes() == original

    code, out = step(python, "apply")
    assert (code, out["verdict"]) == (0, "applied"), out
    patched = target.read_bytes()
    assert patched.startswith(original) and patched != original
    assert twin.read_bytes() == original, "the write went through the shared inode"
    compile(patched, str(target), "exec")

    code, out = step(python, "apply")
    assert (code, out["verdict"]) == (0, "already-applied")
    assert target.read_bytes() == patched
    code, out = step(python, "verify")
    assert (code, out["verdict"]) == (0, "applied")

    code, out = step(python, "revert")
    assert (code, out["verdict"]) == (0, "reverted")
    assert hashlib.sha256(target.read_bytes()).hexdigest() == record_sha256(sp, "vllm", MODULE)
    code, out = step(python, "verify")
    assert (code, out["verdict"]) == (1, "missing")


def fixed_not_needed(python: Path, sp: Path) -> None:
    """Releases with the upstream fix: not-needed for apply and verify, nothing written."""
    files = {p: p.read_bytes() for p in (sp / "vllm/v1/core").glob("*.py")}
    for op in ("apply", "verify", "revert"):
        code, out = step(python, op)
        assert code == 0, out
        assert out["verdict"] in {"not-needed", "not-applied"}, out
        if out["verdict"] == "not-needed":  # and not by the version alone: the code is known
            assert "is a fixed shape the patch knows" in str(out["reason"]), out
    assert {p: p.read_bytes() for p in files} == files


@pytest.mark.parametrize("release", ["0.20.2"], indirect=True)
def test_edited_function_with_matching_record_is_an_unknown_shape(release: tuple[Path, Path]
                                                                  ) -> None:
    """A build whose function differs from every known shape (RECORD agrees) is refused."""
    python, sp = release
    target = sp / MODULE
    text = target.read_text().replace(
        "    max_page_size = max(page_sizes)\n",
        "    max_page_size = max(page_sizes)  # a fork's change\n", 1)
    os.unlink(target)  # new inode: never write through uv's cache
    target.write_text(text)
    record = next(sp.glob("vllm-*.dist-info")) / "RECORD"
    digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=")
    lines = [f"{MODULE},sha256={digest.decode()},{len(text.encode())}"
             if line.startswith(f"{MODULE},") else line
             for line in record.read_text().splitlines()]
    os.unlink(record)
    record.write_text("\n".join(lines) + "\n")

    code, out = step(python, "apply")
    assert (code, out["verdict"]) == (1, "unknown-shape"), out
    assert "does not know" in str(out["reason"])
    assert target.read_text() == text


@pytest.mark.parametrize("release", ["0.20.2"], indirect=True)
def test_architecture_selection_and_registry_warning(release: tuple[Path, Path]) -> None:
    """--architecture selects the catalog default; a misspelt one is named with close matches."""
    python, _ = release
    proc = cli("verify", "--python", str(python), "--architecture",
               "Qwen3_5MoeForConditionalGeneration", "--json")
    data = json.loads(proc.stdout)
    verdicts = {p["id"]: p["verdict"] for p in data["patches"]}
    assert verdicts == {PATCH: "missing", "neuron-platform-prefix-caching": "not-installed",
                        "neuron-runner-kv-spec": "not-installed"}
    assert data["notes"] == []
    proc = cli("verify", "--python", str(python), "--architecture",
               "Qwen3_5MoeForConditionalGenration")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "no patches selected" in proc.stderr
    assert ("'Qwen3_5MoeForConditionalGenration' is not registered by the installed vLLM; "
            "did you mean Qwen3_5MoeForConditionalGeneration") in proc.stderr.splitlines()[0]


# --- patches of hybrid models: the Mamba-2 state (*-spec-conv-state), the scheduler's split ---

SPEC_PATCHES = {  # patch id -> its module file
    "falcon-h1-spec-conv-state": "vllm/model_executor/models/falcon_h1.py",
    "granitemoehybrid-spec-conv-state": "vllm/model_executor/models/granitemoehybrid.py",
    "zamba2-spec-conv-state": "vllm/model_executor/models/zamba2.py",
}
# get_mamba_state_shape_from_config passes no num_spec through 0.31.0 (two known shapes: 0.16.0-
# 0.30.0 and 0.31.0's blank docstring line); 0.32.0 passes it (fixed-in, fixed shape; 0.33.0 and
# 0.34.0 keep 0.32.0's method).
SPEC_PATCHED = [*PATCHED, "0.29.0", "0.30.0", "0.31.0"]
SPEC_FIXED = ["0.32.0", "0.33.0", "0.34.0"]
BAMBA_PATCHES = {"bamba-spec-conv-state": "vllm/model_executor/models/bamba.py"}
# Bamba is in vLLM 0.16.0-0.23.0 only (0.24.0 removed bamba.py): no fixed release; removed-in
# 0.24.0 makes it not-applicable there.
BAMBA_PATCHED = PATCHED[:PATCHED.index("0.23.0") + 1]
SPLIT_PATCHES = {"mamba-split-external-kv": "vllm/v1/core/sched/scheduler.py"}
# Scheduler._mamba_block_aligned_split asserts no external tokens through 0.22.1 (0.34.0's method
# is 0.33.0's, a known fixed shape).
SPLIT_PATCHED = PATCHED[:PATCHED.index("0.22.1") + 1]
SPLIT_FIXED = [*PATCHED[PATCHED.index("0.23.0"):], *NOT_NEEDED]

CHUNK_PATCHES = {"mamba-all-mode-chunk-align": "vllm/model_executor/models/config.py"}
# mamba_cache_mode "all" drops the chunk alignment of a user's --mamba-block-size in every
# release that has the mode; the patch claims 0.28.0 - 0.31.0 (two shapes of its target) and
# 0.32.0 removed the mode (not-needed). Older releases carry the target in shapes never checked.
CHUNK_PATCHED = ["0.28.0", "0.29.0", "0.30.0", "0.31.0"]


def group_step(python: Path, op: str, patches: dict[str, str]
               ) -> tuple[int, dict[str, dict[str, object]]]:
    args = [a for p in patches for a in ("--patch", p)]
    proc = cli(op, "--python", str(python), *args, "--json")
    assert "Traceback" not in proc.stderr, proc.stderr
    outcomes = {p["id"]: p for p in json.loads(proc.stdout)["patches"]}
    assert set(outcomes) == set(patches), outcomes
    return proc.returncode, outcomes


def verdicts(outcomes: dict[str, dict[str, object]]) -> set[object]:
    return {o["verdict"] for o in outcomes.values()}


def patched_round_trip(python: Path, sp: Path, tmp_path: Path, patches: dict[str, str]) -> None:
    """Every target symbol has a known shape; apply (not through the shared inode), re-apply,
    verify, revert to the RECORD bytes."""
    originals = {}
    for patch_id, rel in patches.items():
        target = sp / rel
        originals[rel] = target.read_bytes()
        assert hashlib.sha256(originals[rel]).hexdigest() == record_sha256(sp, "vllm", rel)
        patch = load_catalog()[patch_id]
        for symbol, known in patch.symbol_shapes.items():
            assert symbol_digest(originals[rel].decode(), symbol) in known, symbol
        os.link(target, tmp_path / f"{target.stem}.twin")

    code, out = group_step(python, "verify", patches)
    assert (code, verdicts(out)) == (1, {"missing"}), out
    code, out = group_step(python, "apply", patches)
    assert (code, verdicts(out)) == (0, {"applied"}), out
    for rel, original in originals.items():
        patched = (sp / rel).read_bytes()
        assert patched.startswith(original) and patched != original
        compile(patched, rel, "exec")
        twin = tmp_path / f"{Path(rel).stem}.twin"
        assert twin.read_bytes() == original, "the write went through the shared inode"
    code, out = group_step(python, "apply", patches)
    assert (code, verdicts(out)) == (0, {"already-applied"}), out
    code, out = group_step(python, "verify", patches)
    assert (code, verdicts(out)) == (0, {"applied"}), out
    code, out = group_step(python, "revert", patches)
    assert (code, verdicts(out)) == (0, {"reverted"}), out
    for rel in patches.values():
        digest = hashlib.sha256((sp / rel).read_bytes()).hexdigest()
        assert digest == record_sha256(sp, "vllm", rel), rel


def absent_refused(python: Path, sp: Path, patches: dict[str, str]) -> None:
    """The module is gone, from the release the patch names as removing it (removed-in):
    not-applicable for apply and verify, nothing created; revert has nothing to do."""
    for rel in patches.values():
        assert not (sp / rel).exists(), rel
    for op in ("apply", "verify"):
        code, out = group_step(python, op, patches)
        assert (code, verdicts(out)) == (0, {"not-applicable"}), out
        assert all("is gone (removed in 0.24.0)" in str(o["reason"]) for o in out.values()), out
    code, out = group_step(python, "revert", patches)
    assert (code, verdicts(out)) == (0, {"not-applied"}), out
    for rel in patches.values():
        assert not (sp / rel).exists(), rel


def fixed_untouched(python: Path, sp: Path, patches: dict[str, str]) -> None:
    """not-needed by a fixed shape the patch knows, for apply, verify and revert; nothing
    written."""
    files = {rel: (sp / rel).read_bytes() for rel in patches.values()}
    for op in ("apply", "verify", "revert"):
        code, out = group_step(python, op, patches)
        assert code == 0, out
        assert verdicts(out) <= {"not-needed", "not-applied"}, out
        for outcome in out.values():
            if outcome["verdict"] == "not-needed":
                assert "is a fixed shape the patch knows" in str(outcome["reason"]), outcome
    assert {rel: (sp / rel).read_bytes() for rel in files} == files


def unknown_untouched(python: Path, sp: Path, patches: dict[str, str]) -> None:
    """unknown-shape for apply and verify (a shape never checked), nothing written."""
    files = {rel: (sp / rel).read_bytes() for rel in patches.values()}
    for op in ("apply", "verify"):
        code, out = group_step(python, op, patches)
        assert (code, verdicts(out)) == (1, {"unknown-shape"}), out
    assert {rel: (sp / rel).read_bytes() for rel in files} == files


def mamba_cache_modes(sp: Path) -> str:
    """The line of vllm/config/cache.py that lists the Mamba cache modes."""
    [line] = [line for line in (sp / "vllm/config/cache.py").read_text().splitlines()
              if line.startswith("MambaCacheMode = ")]
    return line


def chunk_elsewhere(python: Path, sp: Path, patches: dict[str, str]) -> None:
    """From 0.32.0 "all" mode is gone (not-needed by a fixed shape the patch knows); before
    0.28.0 the target has shapes the patch was never checked against (unknown-shape)."""
    if '"all"' in mamba_cache_modes(sp):
        unknown_untouched(python, sp, patches)
    else:
        fixed_untouched(python, sp, patches)


HYBRID_GROUPS = (  # (patches, the releases they patch, what the other releases get)
    (SPEC_PATCHES, SPEC_PATCHED, fixed_untouched),
    (BAMBA_PATCHES, BAMBA_PATCHED, absent_refused),
    (SPLIT_PATCHES, SPLIT_PATCHED, fixed_untouched),
    (CHUNK_PATCHES, CHUNK_PATCHED, chunk_elsewhere),
)


SPEC_GROUPS = [patches for patches, _, _ in HYBRID_GROUPS]


PROMOTION = "kv-cache-page-promotion"  # its checks: tests/test_kv_cache_page_promotion.py


@pytest.mark.parametrize("release", round_trip_releases(
    [PATCH, PROMOTION, *(p for group in SPEC_GROUPS for p in group)], RELEASES), indirect=True)
def test_release_round_trip(release: tuple[Path, Path], tmp_path: Path) -> None:
    """One release's real files, each patch where its shape starts or ends: the page
    unification applies, re-applies, verifies and reverts to the RECORD bytes where the bug is
    (0.16.0-0.28.0) and is not-needed by a known fixed shape after; the *-spec-conv-state
    patches (0.16.0-0.31.0; Bamba's 0.16.0-0.23.0) and mamba-split-external-kv (0.16.0-0.22.1)
    likewise, together, and are not-needed elsewhere (Bamba: not-applicable, its module is
    gone from 0.24.0); kv-cache-page-promotion applies, verifies and reverts byte-exactly on
    0.29.0+ and is refused (unknown-shape) before."""
    python, sp = release
    [dist_info] = sp.glob("vllm-*.dist-info")
    released = dist_info.name.removeprefix("vllm-").removesuffix(".dist-info")
    assert released in PATCHED + NOT_NEEDED, released
    assert PATCHED + NOT_NEEDED == list(RELEASES) == SPEC_PATCHED + SPEC_FIXED
    assert ('"all"' in mamba_cache_modes(sp)) == (Version(released) < Version("0.32.0"))
    done = []
    if at_boundary(PATCH, released):
        if released in PATCHED:
            buggy_round_trip(python, sp, tmp_path)
        else:
            fixed_not_needed(python, sp)
        done.append(PATCH)
    for patches, affected, elsewhere in HYBRID_GROUPS:
        here = {p: rel for p, rel in patches.items() if at_boundary(p, released)}
        if not here:
            continue
        if released in affected:
            patched_round_trip(python, sp, tmp_path, here)
        else:
            elsewhere(python, sp, here)
        done += list(here)
    if at_boundary(PROMOTION, released):
        if released in HOME:
            release_round_trip(python, sp, released)
        else:
            refused_before_029(python, sp)
        done.append(PROMOTION)
    assert done, "a release with no boundary of these patches is not round-tripped"
