"""kv-cache-page-promotion on a release's installed files: where each release keeps the function
it wraps (``HOME``), and its round trip there (``release_round_trip``; ``refused_before_029``
before its first shape), run by tests/test_vllm_releases.py on the one install per release that
every catalog patch shares."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from hatch_vllm_patch.catalog import load_catalog
from hatch_vllm_patch.engine import symbol_digest
from support.commands import cli
from support.venvs import record_sha256

PATCH = "kv-cache-page-promotion"
UTILS = "vllm/v1/core/kv_cache_utils.py"
PLANNING = "vllm/v1/core/kv_cache_planning.py"
PLATFORM = "vllm/platforms/interface.py"  # the platform step, the third target
# The module that defines unify_kv_cache_spec_page_size, per release
HOME = {"0.29.0": UTILS, "0.30.0": UTILS, "0.31.0": UTILS, "0.32.0": UTILS,
        "0.33.0": PLANNING, "0.34.0": PLANNING}


def steps(python: Path, op: str) -> tuple[int, str, dict[str, str]]:
    """One CLI operation on the patch: exit code, the patch's one verdict, and what each of
    its three targets found (by module), listed beneath it."""
    proc = cli(op, "--python", str(python), "--patch", PATCH, "--json")
    assert "Traceback" not in proc.stderr, proc.stderr
    data = json.loads(proc.stdout)
    [entry] = data["patches"]  # one patch, one entry
    targets = {str(t["module"]): str(t["verdict"]) for t in entry["targets"]}
    assert len(targets) == 3, entry
    return proc.returncode, str(entry["verdict"]), targets


def verdicts(targets: dict[str, str]) -> list[str]:
    return sorted(targets.values())


def release_round_trip(python: Path, sp: Path, version: str) -> None:
    """Real files: diff, apply, re-apply, verify, revert byte-exact; one module written.
    (Run by tests/test_vllm_releases.py on the install of each release 0.29.0+ it round-trips:
    one install per release for every catalog patch.)"""
    home = sp / HOME[version]
    other = sp / (PLANNING if HOME[version] == UTILS else UTILS)
    platform = sp / PLATFORM
    original, other_bytes = home.read_bytes(), (other.read_bytes() if other.exists() else None)
    platform_bytes = platform.read_bytes()
    assert symbol_digest(original.decode(), "unify_kv_cache_spec_page_size") in next(
        m.shapes for m in load_catalog()[PATCH].parts
        if m.target.relative_path == HOME[version].removeprefix("vllm/"))

    code, verdict, targets = steps(python, "verify")
    # one verdict for the patch; beneath it each target's own finding
    assert (code, verdict) == (1, "missing"), targets
    assert verdicts(targets) == ["missing", "missing", "not-applicable"], targets
    code, verdict, targets = steps(python, "diff")
    assert (code, verdict) == (0, "would-apply"), targets
    assert verdicts(targets) == ["not-applicable", "would-apply", "would-apply"], targets
    assert home.read_bytes() == original and platform.read_bytes() == platform_bytes
    code, verdict, targets = steps(python, "apply")
    assert (code, verdict) == (0, "applied"), targets
    assert verdicts(targets) == ["applied", "applied", "not-applicable"], targets
    for path, before, marker in ((home, original, b"# >>> hatch-vllm-patch: kv-cache-page-pro"),
                                 (platform, platform_bytes, b"_hvp_install_platform_promotion()")):
        patched = path.read_bytes()
        assert patched.startswith(before) and patched != before and marker in patched
        compile(patched, str(path), "exec")
    assert (other.read_bytes() if other.exists() else None) == other_bytes
    code, verdict, targets = steps(python, "apply")
    assert (code, verdict) == (0, "already-applied"), targets
    assert verdicts(targets) == ["already-applied", "already-applied", "not-applicable"]
    code, verdict, targets = steps(python, "verify")
    assert (code, verdict) == (0, "applied"), targets
    assert verdicts(targets) == ["applied", "applied", "not-applicable"], targets
    code, verdict, targets = steps(python, "revert")
    assert (code, verdict) == (0, "reverted"), targets
    assert verdicts(targets) == ["not-applied", "reverted", "reverted"], targets
    for relative in (HOME[version], PLATFORM):
        assert hashlib.sha256((sp / relative).read_bytes()).hexdigest() == record_sha256(
            sp, "vllm", relative)
    assert platform.read_bytes() == platform_bytes
    assert (other.read_bytes() if other.exists() else None) == other_bytes


def refused_before_029(python: Path, sp: Path) -> None:
    """Releases before 0.29.0 (0.28.0: the last of kv-cache-page-unification): unknown-shape,
    nothing written (run by tests/test_vllm_releases.py on its installs)."""
    target = sp / UTILS
    before = target.read_bytes()
    code, verdict, targets = steps(python, "apply")
    assert (code, verdict) == (1, "unknown-shape") and "unknown-shape" in verdicts(targets)
    assert target.read_bytes() == before
