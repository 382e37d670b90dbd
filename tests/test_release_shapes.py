"""Every vLLM release 0.16.0 … 0.34.0, read from its wheel without installing it: each catalog
patch's target files are there (or patch.toml says why not), RECORD's digests are the files',
and the engine's verdict on the untouched files (its own shape and digest code,
release_shapes.wheel_shape) is the one patch.toml promises for that release. The install /
apply / verify / revert round trips run on the releases where a shape starts or ends
(release_shapes.BOUNDARIES, proven here to be what the wheels say)."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest
from packaging.version import Version
from support.release_shapes import (
    BOUNDARIES,
    EXPECTED,
    RELEASES,
    boundaries,
    expected,
    module_file,
    read_member,
    record_digests,
    registry_by_ast,
    release_shapes,
    vllm_patches,
)
from support.venvs import cached_wheel

from hatch_vllm_patch.catalog import ELSEWHERE
from hatch_vllm_patch.engine import Verdict
from hatch_vllm_patch.selection import registered_architectures

pytestmark = pytest.mark.slow  # the wheels: ~9 GB downloaded once into the wheel cache

# Not-needed by fixed-in alone, with no fixed shape of its own symbols: the fix is in another
# function of the module. gdn-spec-cpu-step: 0.33.0's `_spec_forward` writes the conv layout
# itself (read), a function the patch does not wrap (gdn-spec-zero-accepted wraps it); its two
# symbols are unchanged there, so no digest of theirs can tell the fix.
VERSION_ONLY = {"gdn-spec-cpu-step"}


def test_expectations_follow_patch_toml() -> None:
    """The table names every vllm patch of the catalog; its not-needed starts at fixed-in and
    its not-applicable at removed-in."""
    patches = {p.id: p for p in vllm_patches()}
    assert set(EXPECTED) == set(patches) == set(BOUNDARIES)
    for pid, patch in patches.items():
        starts = {v: first for first, v in EXPECTED[pid]}
        assert starts.get("not-needed") == patch.fixed_in, pid
        assert starts.get("not-applicable") == patch.removed_in, pid


@pytest.mark.parametrize("release", RELEASES)
def test_wheel_files_shapes_and_record(release: str, tmp_path: Path) -> None:
    """The release's wheel: every patch's target files exist where it is not refused, gone
    only where patch.toml says so (removed-in, or "elsewhere": another target holds the
    symbol), RECORD's digest is each file's; the engine's verdict is the one patch.toml
    promises, a known shape where it patches, a known fixed shape where it is not needed (for
    VERSION_ONLY: fixed-in alone); and the tool's quick registry reader agrees with ast."""
    shapes = release_shapes(release)
    with zipfile.ZipFile(cached_wheel("vllm", release)) as wheel:
        record = record_digests(wheel)
        for patch in vllm_patches():
            found = shapes[patch.id]
            want = expected(patch.id, release)
            assert str(found.verdict) == want, (patch.id, found)
            for member in patch.parts:
                rel = module_file(member.target.module)
                content = read_member(wheel, member.target.module)
                if content is None:
                    gone = (patch.removed_in is not None
                            and Version(release) >= Version(patch.removed_in))
                    elsewhere = all(ELSEWHERE in k for k in member.symbol_shapes.values())
                    assert gone or elsewhere or want == "unknown-shape", (patch.id, rel)
                    continue
                assert hashlib.sha256(content).hexdigest() == record[rel], rel
            if found.verdict is Verdict.MISSING:
                assert found.shape and not [s for s in found.shape if s.endswith("=unknown")]
            if found.verdict is Verdict.NOT_NEEDED and patch.id in VERSION_ONLY:
                assert not patch.fixed_shapes and found.reason.endswith(
                    f">= {patch.fixed_in}: fixed upstream"), (patch.id, found)
            elif found.verdict is Verdict.NOT_NEEDED:
                assert "is a fixed shape the patch knows" in found.reason, (patch.id, found)
        registry = tmp_path / "registry.py"
        registry.write_bytes(wheel.read("vllm/model_executor/models/registry.py"))
    assert registered_architectures(registry) == registry_by_ast(registry.read_text())


def test_boundaries_are_the_wheels() -> None:
    """release_shapes.BOUNDARIES is what the catalog and the wheels give: for each patch, the
    first and last release of each of its shapes; so they hold a release of every shape."""
    shapes = {r: release_shapes(r) for r in RELEASES}  # computed by the tests above
    assert boundaries(shapes) == BOUNDARIES
    for pid in BOUNDARIES:
        every = {(shapes[r][pid].verdict, shapes[r][pid].shape) for r in RELEASES}
        kept = {(shapes[r][pid].verdict, shapes[r][pid].shape) for r in BOUNDARIES[pid]}
        assert kept == every and len(every) > 1, pid


def test_other_round_trips_on_boundaries_of_every_shape() -> None:
    """The memory patches' round trips (their own modules) run on boundary releases only, and
    on a release of every shape where they apply."""
    from support.page_promotion import HOME
    from support.uneven_groups import MODULE_OF

    shapes = {r: release_shapes(r) for r in RELEASES}
    for pid, tried in (("kv-cache-page-promotion", HOME), ("kv-cache-uneven-groups", MODULE_OF),
                       ("kv-cache-exact-groups", MODULE_OF)):
        assert set(tried) <= set(BOUNDARIES[pid]), pid
        applies = {shapes[r][pid].shape for r in RELEASES
                   if shapes[r][pid].verdict is Verdict.MISSING}
        assert {shapes[r][pid].shape for r in tried} == applies, pid
