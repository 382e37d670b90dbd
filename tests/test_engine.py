"""The pure engine: markers, shapes, and the plans for apply / verify / revert (no I/O)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from support.demo import DEMO_BLOCK, DEMO_SOURCE, write_demo_catalog

from hatch_vllm_patch.catalog import Patch, load_catalog
from hatch_vllm_patch.engine import (
    FileFacts,
    MarkerError,
    Verdict,
    inspect,
    parse_file,
    plan_apply,
    plan_revert,
    plan_verify,
    render_block,
    symbol_digest,
)

ORIGINAL = DEMO_SOURCE.encode()
RECORD = hashlib.sha256(ORIGINAL).hexdigest()


@pytest.fixture
def patch(tmp_path: Path) -> Patch:
    return load_catalog(write_demo_catalog(tmp_path / "c", fixed_in="2.0.0"))["demo-fix"]


def facts(content: bytes | None, version: str | None = "1.0.0", record: str | None = RECORD,
          ledger: str | None = None) -> FileFacts:
    return FileFacts("demo_pkg/core.py", content, version, record, ledger)


def applied(patch: Patch) -> bytes:
    plan = plan_apply(patch, facts(ORIGINAL))
    assert plan.verdict is Verdict.APPLIED and plan.new_content is not None
    return plan.new_content


def test_apply_appends_one_marked_block_and_keeps_the_original_bytes(patch: Patch) -> None:
    """Apply leaves the original text as an exact prefix and appends the block between markers."""
    new = applied(patch)
    assert new.startswith(ORIGINAL)
    tail = new[len(ORIGINAL):].decode()
    digest = hashlib.sha256(DEMO_BLOCK.encode()).hexdigest()
    assert tail == f"\n# >>> hatch-vllm-patch: demo-fix sha256={digest}\n{DEMO_BLOCK}" \
                   "# <<< hatch-vllm-patch: demo-fix\n"


def test_patched_module_behaves_as_the_block_says(patch: Patch) -> None:
    """The appended block really rebinds the symbol when the module runs."""
    namespace: dict[str, object] = {}
    exec(compile(applied(patch), "core.py", "exec"), namespace)
    compute = namespace["compute"]
    assert callable(compute)
    assert compute([]) == 0 and compute([3, 7]) == 7


def test_apply_twice_changes_nothing(patch: Patch) -> None:
    """A second apply reports already-applied and plans no write."""
    plan = plan_apply(patch, facts(applied(patch)))
    assert plan.verdict is Verdict.ALREADY_APPLIED and plan.new_content is None


def test_revert_restores_the_record_bytes(patch: Patch) -> None:
    """Revert plans exactly the original bytes, matching the RECORD hash."""
    plan = plan_revert(patch, facts(applied(patch)))
    assert plan.verdict is Verdict.REVERTED and plan.new_content == ORIGINAL


def test_revert_of_an_unpatched_file_is_a_no_op(patch: Patch) -> None:
    """Revert on a clean file reports not-applied and writes nothing."""
    plan = plan_revert(patch, facts(ORIGINAL))
    assert plan.verdict is Verdict.NOT_APPLIED and plan.new_content is None


def test_verify_distinguishes_missing_and_applied(patch: Patch) -> None:
    """Verify says missing before apply and applied after it."""
    assert plan_verify(patch, facts(ORIGINAL)).verdict is Verdict.MISSING
    assert plan_verify(patch, facts(applied(patch))).verdict is Verdict.APPLIED


def test_unknown_shape_is_refused(patch: Patch) -> None:
    """An edited target function is an unknown shape: no write planned."""
    edited = DEMO_SOURCE.replace("return max(values)", "return min(values)").encode()
    plan = plan_apply(patch, facts(edited, record=hashlib.sha256(edited).hexdigest()))
    assert plan.verdict is Verdict.UNKNOWN_SHAPE and plan.new_content is None
    assert "does not know" in plan.reason


def test_missing_symbol_is_an_unknown_shape(patch: Patch) -> None:
    """A module without the target symbol is refused, naming the symbol."""
    source = b"def other():\n    return 1\n"
    plan = plan_apply(patch, facts(source, record=hashlib.sha256(source).hexdigest()))
    assert plan.verdict is Verdict.UNKNOWN_SHAPE and "compute is not defined" in plan.reason


def test_file_modified_by_someone_else_is_refused(patch: Patch) -> None:
    """A file whose bytes differ from RECORD (a hand patch) is never overwritten."""
    hand = ORIGINAL + b"\n# hand-made fix\n"
    for plan in (plan_apply(patch, facts(hand)), plan_revert(patch, facts(hand))):
        assert plan.verdict is Verdict.MODIFIED and plan.new_content is None


def test_edited_patch_region_is_refused(patch: Patch) -> None:
    """Hand edits inside our block are detected by its digest and refused."""
    tampered = applied(patch).replace(b"return 0", b"return 1")
    assert plan_apply(patch, facts(tampered)).verdict is Verdict.MODIFIED
    assert plan_revert(patch, facts(tampered)).verdict is Verdict.MODIFIED


def test_damaged_markers_are_refused(patch: Patch) -> None:
    """A begin marker without its end marker is reported as modified."""
    damaged = applied(patch).rsplit(b"# <<<", 1)[0]
    with pytest.raises(MarkerError):
        parse_file(damaged)
    assert plan_apply(patch, facts(damaged)).verdict is Verdict.MODIFIED


def test_fixed_upstream_version_is_not_needed(patch: Patch) -> None:
    """An installed version at or past fixed-in gets not-needed, whatever the file holds."""
    plan = plan_apply(patch, facts(b"def compute(v):\n    return 0\n", version="2.0.0",
                                   record=None))
    assert plan.verdict is Verdict.NOT_NEEDED and plan.new_content is None


def test_not_installed(patch: Patch) -> None:
    """No distribution: not-installed, nothing planned."""
    assert plan_apply(patch, facts(None, version=None)).verdict is Verdict.NOT_INSTALLED


def test_stale_block_is_updated(patch: Patch, tmp_path: Path) -> None:
    """A block written by another version of the patch is replaced, not duplicated."""
    old = load_catalog(write_demo_catalog(tmp_path / "old", block="_hvp_old = 1\n"))["demo-fix"]
    stale = plan_apply(old, facts(ORIGINAL)).new_content
    assert stale is not None
    assert plan_verify(patch, facts(stale)).verdict is Verdict.STALE
    plan = plan_apply(patch, facts(stale))
    assert plan.verdict is Verdict.APPLIED and plan.new_content == applied(patch)


def test_other_patches_blocks_are_kept(patch: Patch) -> None:
    """Applying and reverting one patch leaves another patch's block in the same file alone."""
    other = render_block("other-fix", b"_hvp_other = 1\n")
    with_other = ORIGINAL + other
    new = plan_apply(patch, facts(with_other)).new_content
    assert new is not None and parse_file(new).original == ORIGINAL
    assert [b.patch_id for b in parse_file(new).blocks] == ["other-fix", "demo-fix"]
    reverted = plan_revert(patch, facts(new)).new_content
    assert reverted == with_other


def test_ledger_hash_guards_files_without_record(patch: Patch) -> None:
    """Without RECORD (editable installs) the ledger's original hash guards a patched file."""
    new = applied(patch)
    changed = new.replace(b"fails on an empty list", b"changed by hand")
    assert inspect(patch, facts(changed, record=None, ledger=RECORD)).verdict is Verdict.MODIFIED
    # A file without our blocks was replaced since (e.g. git pull): the old ledger hash is moot.
    assert inspect(patch, facts(b"def compute(v):\n    return 1\n", record=None,
                                ledger=RECORD)).verdict is Verdict.UNKNOWN_SHAPE


def test_symbol_digest_covers_decorators_and_methods() -> None:
    """Digests are taken over the exact lines of a function or method, decorators included."""
    source = "class A:\n    @classmethod\n    def f(cls):\n        return 1\n"
    expected = hashlib.sha256(b"    @classmethod\n    def f(cls):\n        return 1\n").hexdigest()
    assert symbol_digest(source, "A.f") == expected
    assert symbol_digest(source, "A.g") is None and symbol_digest(source, "B.f") is None
    assert symbol_digest("def f(:\n", "f") is None


def test_original_without_trailing_newline_round_trips(patch: Patch) -> None:
    """A module not ending in a newline is restored byte for byte too."""
    original = ORIGINAL.rstrip(b"\n")
    record = hashlib.sha256(original).hexdigest()
    new = plan_apply(patch, facts(original, record=record)).new_content
    assert new is not None
    assert plan_revert(patch, facts(new, record=record)).new_content == original


def test_block_over_a_shape_the_catalog_no_longer_knows(patch: Patch, tmp_path: Path) -> None:
    """A current block over code the patch no longer knows fails verify; revert still removes it."""
    new = applied(patch)
    narrowed = tmp_path / "narrowed"
    write_demo_catalog(narrowed)
    toml = narrowed / "demo-fix" / "patch.toml"
    toml.write_text(toml.read_text().replace('shapes = ["', 'shapes = ["' + "0" * 64 + '"] # "'))
    forgotten = load_catalog(narrowed)["demo-fix"]
    assert plan_verify(forgotten, facts(new)).verdict is Verdict.UNKNOWN_SHAPE
    assert plan_apply(forgotten, facts(new)).verdict is Verdict.UNKNOWN_SHAPE
    plan = plan_revert(forgotten, facts(new))
    assert plan.verdict is Verdict.REVERTED and plan.new_content == ORIGINAL


def test_not_needed_says_whether_the_fixed_code_is_known(tmp_path: Path) -> None:
    """Past fixed-in, a function with a fixed shape the patch lists is named as such; any other
    shape is still not-needed, but the reason says it was never checked."""
    fixed_source = DEMO_SOURCE.replace('raise NotImplementedError("empty")', "return 0")
    fixed = fixed_source.encode()
    lines = fixed_source.splitlines(keepends=True)
    start = next(i for i, line in enumerate(lines) if line.startswith("def compute"))
    end = next(i for i, line in enumerate(lines) if line.startswith("def other"))
    digest = hashlib.sha256("".join(lines[start:end]).rstrip("\n").encode() + b"\n").hexdigest()
    root = write_demo_catalog(tmp_path / "c", fixed_in="2.0.0")
    toml = root / "demo-fix" / "patch.toml"
    toml.write_text(toml.read_text().replace(
        "[applies]\n", f'[applies]\nfixed-shapes = ["{digest}"]\n'))
    patch = load_catalog(root)["demo-fix"]
    known = plan_verify(patch, facts(fixed, version="2.0.0", record=None))
    assert known.verdict is Verdict.NOT_NEEDED and "fixed shape the patch knows" in known.reason
    other = fixed.replace(b"return 0", b"return -1")
    unknown = plan_verify(patch, facts(other, version="2.1.0", record=None))
    assert unknown.verdict is Verdict.NOT_NEEDED and "never checked" in unknown.reason


def test_a_patch_over_several_modules_has_one_verdict() -> None:
    """plan_together: when one module's plan is refused, no module writes and each fine one
    reports the refusal, naming the module; when all are fine, the plans stand."""
    from hatch_vllm_patch.engine import Plan, plan_together

    write = Plan(Verdict.APPLIED, "known shape", b"new")
    refused = Plan(Verdict.UNKNOWN_SHAPE, "g has a shape this patch does not know")
    shared = plan_together([("pkg.a", write, True), ("pkg.b", refused, False)])
    assert [p.verdict for p in shared] == [Verdict.UNKNOWN_SHAPE, Verdict.UNKNOWN_SHAPE]
    assert all(p.new_content is None for p in shared)
    assert shared[0].reason.startswith("unknown-shape in pkg.b, another target of this patch")
    assert "nothing written to any of its modules" in shared[0].reason
    assert plan_together([("pkg.a", write, True), ("pkg.b", write, True)]) == [write, write]


def test_a_patch_over_several_targets_is_decided_once() -> None:
    """decide_patch: a refused patch takes the most severe target's verdict (unknown-shape over
    missing), naming its module; a fine patch the verdict that says most (applied over
    already-applied), never an "elsewhere" target's, which is named as a detail."""
    from hatch_vllm_patch.engine import Plan, decide_patch, refusing_part

    write = Plan(Verdict.APPLIED, "known shape", b"new")
    missing = Plan(Verdict.MISSING, "not patched")
    unknown = Plan(Verdict.UNKNOWN_SHAPE, "g has a shape this patch does not know")
    away = Plan(Verdict.NOT_APPLICABLE, "not here: f is not in this module")
    parts = [("pkg.a", missing, False), ("pkg.b", away, True), ("pkg.c", unknown, False)]
    assert refusing_part(parts) == 2
    decided, speakers = decide_patch(parts)
    assert (decided.verdict, speakers) == (Verdict.UNKNOWN_SHAPE, (2,))
    assert decided.reason == ("unknown-shape in pkg.c (g has a shape this patch does not "
                              "know)")
    decided, _ = decide_patch([("pkg.a", write, True), ("pkg.c", unknown, False)],
                              would_write=True)
    assert decided.reason.endswith("; nothing written to any of its modules")
    done = Plan(Verdict.ALREADY_APPLIED, "block in place")
    decided, speakers = decide_patch([("pkg.a", write, True), ("pkg.b", away, True),
                                      ("pkg.c", done, True)])
    assert (decided.verdict, speakers) == (Verdict.APPLIED, (0,))
    assert decided.new_content is None
    assert decided.reason == ("applied in pkg.a (known shape); already-applied in pkg.c; "
                              "pkg.b: not in this release (another target carries the symbol)")
    decided, speakers = decide_patch([("pkg.a", away, True), ("pkg.b", away, True)])
    assert decided.verdict is Verdict.NOT_APPLICABLE and speakers == (0, 1)
    alone, _ = decide_patch([("pkg.a", unknown, False)])
    assert alone == unknown  # one target: its own verdict and reason, unchanged


def test_added_names_must_be_absent_from_the_module(tmp_path: Path) -> None:
    """A patch that adds a module-level name (target.adds) is unknown-shape where the module
    already binds it, known where it does not."""
    root = write_demo_catalog(tmp_path / "catalog")
    manifest = root / "demo-fix" / "patch.toml"
    manifest.write_text(manifest.read_text().replace(
        'symbol = "compute"', 'symbol = "compute"\nadds = ["LIMIT"]'))
    from hatch_vllm_patch.engine import classify_shape

    patch = load_catalog(root)["demo-fix"]
    assert classify_shape(patch, DEMO_SOURCE.encode())[0] == "known"
    status, reason = classify_shape(patch, (DEMO_SOURCE + "LIMIT = 1\n").encode())
    assert status == "unknown" and "LIMIT already defined in this module" in reason


def test_a_symbol_known_elsewhere_is_not_applicable_here(patch: Patch) -> None:
    """A target whose shapes list 'elsewhere' (a function moved to another target's module) is
    not-applicable where its module or symbol is missing, still unknown-shape on an unknown
    digest; plan_together refuses a patch whose every target says 'not here'."""
    from hatch_vllm_patch.catalog import ELSEWHERE
    from hatch_vllm_patch.engine import Plan, plan_together

    moved = patch._replace(symbol_shapes={patch.target.symbol: frozenset({ELSEWHERE})})
    gone = plan_apply(moved, facts(None))
    assert gone.verdict is Verdict.NOT_APPLICABLE and gone.new_content is None
    assert gone.reason.startswith("not here: ")
    without = plan_apply(moved, facts(b"def other():\n    return 1\n", record=None))
    assert without.verdict is Verdict.NOT_APPLICABLE and "another target carries" in without.reason
    present = plan_apply(moved, facts(DEMO_SOURCE.encode(), record=None))
    assert present.verdict is Verdict.UNKNOWN_SHAPE
    assert plan_apply(patch, facts(None)).verdict is Verdict.UNKNOWN_SHAPE  # no 'elsewhere'
    write = Plan(Verdict.APPLIED, "known shape", b"new")
    assert plan_together([("pkg.a", write, True), ("pkg.b", gone, True)]) == [write, gone]
    nowhere = plan_together([("pkg.a", gone, True), ("pkg.b", without, True)])
    assert {p.verdict for p in nowhere} == {Verdict.UNKNOWN_SHAPE}
    assert "no target of this patch holds it" in nowhere[0].reason


def test_a_target_vllm_removed_is_not_applicable_from_that_release(tmp_path: Path) -> None:
    """applies.removed-in: where the module is gone from that release on, not-applicable with
    the release in the reason; before it (or with the file there) the usual verdicts; a
    removed-in that is no release is a catalog error naming the key."""
    from hatch_vllm_patch.errors import CatalogError

    root = write_demo_catalog(tmp_path / "c")
    manifest = root / "demo-fix" / "patch.toml"
    manifest.write_text(manifest.read_text().replace("[applies]\n",
                                                     '[applies]\nremoved-in = "2.0.0"\n'))
    patch = load_catalog(root)["demo-fix"]
    assert patch.removed_in == "2.0.0"
    gone = plan_apply(patch, facts(None, version="2.1.0"))
    assert gone.verdict is Verdict.NOT_APPLICABLE and gone.new_content is None
    assert gone.reason.startswith("demo-pkg 2.1.0 >= 2.0.0: demo_pkg.core is gone (removed in "
                                  "2.0.0), nothing to patch"), gone.reason
    assert plan_verify(patch, facts(None, version="2.0.0")).verdict is Verdict.NOT_APPLICABLE
    assert plan_apply(patch, facts(None, version="1.9.0")).verdict is Verdict.UNKNOWN_SHAPE
    assert plan_apply(patch, facts(ORIGINAL, version="2.0.0")).verdict is Verdict.APPLIED
    broken = write_demo_catalog(tmp_path / "broken") / "demo-fix" / "patch.toml"
    broken.write_text(broken.read_text().replace("[applies]\n",
                                                 '[applies]\nremoved-in = "after 2.0"\n'))
    with pytest.raises(CatalogError, match=r"applies\.removed-in 'after 2\.0' is not a release"):
        load_catalog(broken.parents[1])


def test_bamba_is_not_applicable_from_vllm_0_24() -> None:
    """bamba-spec-conv-state declares the release that removed Bamba (bamba.py is absent from
    the 0.24.0 wheel on: test_vllm_releases' absent releases), so 0.33 says not-applicable."""
    patch = load_catalog()["bamba-spec-conv-state"]
    assert patch.removed_in == "0.24.0"
    plan = plan_verify(patch, FileFacts("vllm/model_executor/models/bamba.py", None, "0.33.0",
                                        None))
    assert plan.verdict is Verdict.NOT_APPLICABLE and "removed in 0.24.0" in plan.reason
