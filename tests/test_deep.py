"""verify --deep's probes, all of one environment in one child of the target (``deep.py`` and
``_deep_runner.py``): each patch keeps the verdict its probe would give alone, a probe that
ends its child fails only its own patch, and the probes after it still run.

Real subprocesses of a real venv (demo-pkg); the probes are small scripts that do what a probe
can do wrong: fail, skip, raise, change the process's state, crash, exit, hang. The binding
check (a patch without probe.py) looks for the block only in the targets verify judged applied:
on demo-pkg, and on real vLLM 0.33.0 / 0.34.0 (slow: the shared full environment with CPU
torch), where kv_cache_utils exists but another target carries the drafter window's symbol.
"""

from __future__ import annotations

import hashlib
import json
import re
import textwrap
from pathlib import Path
from typing import Any

import pytest
from support.commands import cli
from support.demo import DEMO_SOURCE, compute_digest, write_demo_catalog
from support.venvs import record_sha256, site_packages

from hatch_vllm_patch.catalog import load_catalog
from hatch_vllm_patch.deep import run_probes
from hatch_vllm_patch.environment import InterpreterChoice, ModuleQuery, inspect_environment

PASS = 'import json, os\nprint(json.dumps({"ok": True, "detail": f"pid {os.getpid()}"}))\n'
PROBES = {
    "a-pass": PASS,
    # what a probe may leave behind for the next one in the same process
    "b-state": textwrap.dedent("""\
        import json, logging, os, sys
        logging.disable(logging.CRITICAL)
        logging.getLogger().setLevel(logging.CRITICAL)
        logging.getLogger().addHandler(logging.StreamHandler(sys.stdout))
        os.environ["HVP_PROBE_LEFT"] = "1"
        sys.path.insert(0, "/nonexistent")
        sys.argv.append("--left")
        os.chdir("/")
        print(json.dumps({"ok": True, "detail": f"pid {os.getpid()}"}))
        """),
    "c-clean": textwrap.dedent("""\
        import json, logging, os, sys
        left = [what for what, there in [
            ("logging.disable", logging.root.manager.disable != 0),
            ("root logger", logging.getLogger().level != logging.WARNING
             or logging.getLogger().handlers),
            ("environ", "HVP_PROBE_LEFT" in os.environ),
            ("sys.path", "/nonexistent" in sys.path),
            ("argv", sys.argv[1:] != []), ("cwd", os.getcwd() == "/")] if there]
        print(json.dumps({"ok": not left, "detail": f"pid {os.getpid()} left: {left}"}))
        """),
    "d-fail": ('import json, sys\nprint(json.dumps({"ok": False, "detail": "wrapped twice"}))\n'
               "sys.exit(1)\n"),
    "e-skip": 'import json\nprint(json.dumps({"skipped": "needs the Neuron SDK"}))\n',
    "f-raise": "raise ValueError('boom')\n",
    "g-crash": ("import os, signal, sys\nprint('not json')\nsys.stdout.flush()\n"
                "os.kill(os.getpid(), signal.SIGSEGV)\n"),
    "h-after": PASS,
    # a verdict printed before the process ends is kept, as a lone `python probe.py` gives it
    "i-exit": ('import json, os\nprint(json.dumps({"ok": True, "detail": "printed, then '
               'os._exit"}))\nos._exit(0)\n'),
    "j-last": PASS,
    "k-hang": "import time\ntime.sleep(120)\n",
    "l-final": PASS,
}


def catalog_of(root: Path, probes: dict[str, str]) -> Path:
    """Copies of demo-fix under other ids, each with its own probe.py (never applied)."""
    write_demo_catalog(root / "template")
    for pid, probe in probes.items():
        folder = root / "catalog" / pid
        folder.mkdir(parents=True)
        toml = (root / "template" / "demo-fix" / "patch.toml").read_text()
        (folder / "patch.toml").write_text(toml.replace('id = "demo-fix"', f'id = "{pid}"'))
        (folder / "block.py").write_text((root / "template" / "demo-fix" / "block.py")
                                         .read_text())
        (folder / "probe.py").write_text(probe)
    return root / "catalog"


def pid_of(detail: str) -> int:
    return int(re.match(r"pid (\d+)", detail).group(1))  # type: ignore[union-attr]


def test_probes_share_a_child_and_keep_their_own_verdicts(tmp_path: Path,
                                                           demo_venv: Path) -> None:
    """Twelve probes in one verify --deep: the passing ones before a crash ran in one process,
    each failing, skipped, raising, crashing or hanging probe gets its own verdict, named as it
    would alone, state one probe changes is put back for the next, and the probes after a
    crash, an os._exit and a timeout each run in a new child."""
    catalog = load_catalog(catalog_of(tmp_path, PROBES))
    env = inspect_environment(InterpreterChoice(demo_venv, "given with --python"),
                              [ModuleQuery("demo-pkg", "demo_pkg.core", "core.py")],
                              in_process=False)
    verdicts = run_probes([catalog[pid] for pid in PROBES], env, timeout=5.0)
    assert list(verdicts) == list(PROBES)
    assert all(verdicts[p].passed is True for p in ("a-pass", "b-state", "c-clean", "h-after",
                                                    "i-exit", "j-last", "l-final")), verdicts
    first = {pid_of(verdicts[p].detail) for p in ("a-pass", "b-state", "c-clean")}
    assert len(first) == 1, verdicts  # one child up to the crash
    assert verdicts["c-clean"].detail.endswith("left: []")
    assert verdicts["d-fail"] == (False, "wrapped twice")
    assert verdicts["e-skip"] == (None, "on this machine: needs the Neuron SDK")
    assert verdicts["f-raise"] == (False, "probe exited 1 without a verdict: ValueError: boom")
    assert verdicts["g-crash"].passed is False
    assert verdicts["g-crash"].detail.startswith("probe exited -11 without a verdict: ")
    assert verdicts["i-exit"].detail == "printed, then os._exit"
    assert verdicts["k-hang"] == (False, f"probe did not run: {demo_venv} did not answer "
                                         "within 5 s (k-hang's probe.py)")
    pids = [pid_of(verdicts[p].detail) for p in ("a-pass", "h-after", "j-last", "l-final")]
    assert len(set(pids)) == 4, pids  # a new child after the crash, the exit, the timeout


def test_the_binding_check_and_a_probe_in_one_child(tmp_path: Path, demo_venv: Path) -> None:
    """An applied patch without probe.py (the binding check: the patched module imports and
    compute is the block's) and a probe that fails: the first passes, the second alone fails,
    with its own detail; the probe ran after the binding check in the same process (it finds
    demo_pkg.core imported)."""
    catalog = write_demo_catalog(tmp_path / "catalog")
    assert cli("apply", "--python", str(demo_venv), "--patch", "demo-fix",
               catalog=catalog).returncode == 0
    probes = catalog_of(tmp_path / "more", {"demo-probe": textwrap.dedent("""\
        import json, sys
        seen = "demo_pkg.core" in sys.modules
        print(json.dumps({"ok": False, "detail": f"demo_pkg.core imported before: {seen}"}))
        sys.exit(1)
        """)})
    env = inspect_environment(InterpreterChoice(demo_venv, "given with --python"),
                              [ModuleQuery("demo-pkg", "demo_pkg.core", "core.py")],
                              in_process=False)
    verdicts = run_probes([load_catalog(catalog)["demo-fix"],
                           load_catalog(probes)["demo-probe"]], env)
    assert verdicts["demo-fix"] == (True, "imported demo_pkg.core; 1 symbol(s) are the block's "
                                          "(no probe.py: the binding check)")
    assert verdicts["demo-probe"] == (False, "demo_pkg.core imported before: True")


def test_a_child_that_runs_no_probe_fails_each_patch_once(tmp_path: Path) -> None:
    """An interpreter that exits before running any probe (here a script that only complains):
    every patch fails with its exit status and last line, and no second child is started."""
    from hatch_vllm_patch.environment import TargetEnvironment

    calls = tmp_path / "calls"
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\necho started >> {calls}\necho 'cannot start' >&2\nexit 3\n")
    fake.chmod(0o755)
    env = TargetEnvironment(fake, "given with --python", str(fake), str(tmp_path), "3.11.7",
                            tmp_path)
    catalog = load_catalog(catalog_of(tmp_path / "c", {"a-pass": PASS, "h-after": PASS}))
    verdicts = run_probes([catalog["a-pass"], catalog["h-after"]], env)
    expected = (False, "probe did not run: the deep probes' child exited 3 before any probe: "
                       "cannot start")
    assert verdicts == {"a-pass": expected, "h-after": expected}
    assert calls.read_text() == "started\n"



def test_the_binding_check_skips_a_target_another_target_carries(tmp_path: Path,
                                                                 demo_venv: Path) -> None:
    """A patch over two modules of which one exists but no longer defines the symbol (its
    shape "elsewhere": not-applicable, another target carries it), as vLLM 0.33's
    kv_cache_utils for hybrid-prefix-drafter-window: verify --deep passes, the binding check
    looking for the block only in the target that holds it; revert restores both files."""
    catalog = tmp_path / "catalog"
    write_demo_catalog(catalog)
    folder = catalog / "demo-fix"
    digest = compute_digest(DEMO_SOURCE)
    (folder / "patch.toml").write_text(textwrap.dedent(f"""\
        id = "demo-fix"
        summary = "Make demo_pkg.core.compute return 0 for an empty list"
        description = "Test patch: compute moved from the package to demo_pkg.core."
        links = ["https://example.invalid/demo/1"]
        removal = "When demo-pkg fixes compute()."
        architectures = []

        [[targets]]
        distribution = "demo-pkg"
        module = "demo_pkg"
        symbol = "compute"
        block = "block.py"
        shapes = ["elsewhere"]

        [[targets]]
        distribution = "demo-pkg"
        module = "demo_pkg.core"
        symbol = "compute"
        block = "block.py"
        shapes = ["{digest}"]
        """))
    python = str(demo_venv)
    sp = site_packages(demo_venv.parent.parent)
    assert (sp / "demo_pkg" / "__init__.py").is_file()  # there, without compute
    applied = cli("apply", "--python", python, "--patch", "demo-fix", "--json", catalog=catalog)
    [entry] = json.loads(applied.stdout)["patches"]
    assert applied.returncode == 0 and entry["verdict"] == "applied", applied.stdout
    assert {t["module"]: t["verdict"] for t in entry["targets"]} == {
        "demo_pkg": "not-applicable", "demo_pkg.core": "applied"}, entry
    deep = cli("verify", "--deep", "--python", python, "--patch", "demo-fix", "--json",
               catalog=catalog)
    [entry] = json.loads(deep.stdout)["patches"]
    assert (deep.returncode, entry["verdict"]) == (0, "applied"), deep.stdout
    assert ("deep probe passed: imported demo_pkg.core; 1 symbol(s) are the block's (no "
            "probe.py: the binding check); demo_pkg: no block in this release, not checked"
            in entry["reason"]), entry
    reverted = cli("revert", "--python", python, "--patch", "demo-fix", catalog=catalog)
    assert reverted.returncode == 0, reverted.stdout
    for rel in ("demo_pkg/__init__.py", "demo_pkg/core.py"):
        assert hashlib.sha256((sp / rel).read_bytes()).hexdigest() == record_sha256(
            sp, "demo-pkg", rel), rel

# --- on real vLLM: a patch whose other target is "elsewhere" in this release ------------------

# Every catalog patch that applies on 0.33.0 and 0.34.0 beside hybrid-prefix-drafter-window
# (kv-cache-uneven-groups and kv-cache-exact-groups wrap the same function: not selectable with
# it). Two of them have no probe.py (the binding check), the drafter window over two targets of
# which kv_cache_utils, still there, is "elsewhere" (no longer defines the symbol).
NEIGHBOURS = ("hybrid-prefix-drafter-window", "kv-cache-page-promotion",
              "hybrid-prefix-mamba-block")
UTILS = "vllm.v1.core.kv_cache_utils"
PLANNING = "vllm.v1.core.kv_cache_planning"


def _vllm_hashes(sp: Path) -> dict[str, str]:
    return {p.relative_to(sp).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted((sp / "vllm").rglob("*.py"))}


@pytest.mark.slow
@pytest.mark.parametrize("version", ["0.33.0", "0.34.0"])
def test_deep_skips_a_target_another_target_carries(version: str, tmp_path: Path) -> None:
    """vLLM 0.33.0 / 0.34.0 (full, CPU torch): hybrid-prefix-drafter-window and its neighbours
    apply; `verify --deep` (one call, one vLLM import) passes each, the binding check looking
    for the drafter window's block only in kv_cache_planning (kv_cache_utils exists but is
    not-applicable: another target carries the symbol); status and diff say every patch is in
    place; revert gives every target file back as RECORD has it."""
    from support.venvs import full_vllm_planning_env, record_sha256, site_packages

    python = full_vllm_planning_env(version)
    sp = site_packages(python.parent.parent)
    record = sp / ".hatch-vllm-patch.json"
    had_record = record.exists()
    pristine = _vllm_hashes(sp)
    selection = [arg for pid in NEIGHBOURS for arg in ("--patch", pid)]

    def vp(*args: str) -> tuple[int, dict[str, dict[str, Any]], str]:
        proc = cli(*args, "--python", str(python), *selection, "--json", cwd=tmp_path)
        assert "Traceback" not in proc.stderr, proc.stderr
        doc = json.loads(proc.stdout)
        assert doc["exit_code"] == proc.returncode, doc
        return proc.returncode, {p["id"]: p for p in doc["patches"]}, proc.stdout

    def targets(entry: dict[str, Any]) -> dict[str, str]:
        return {t["module"]: t["verdict"] for t in entry["targets"]}

    try:
        code, out, raw = vp("apply")
        assert code == 0 and {i: o["verdict"] for i, o in out.items()} == dict.fromkeys(
            NEIGHBOURS, "applied"), raw
        window = out["hybrid-prefix-drafter-window"]
        assert targets(window) == {UTILS: "not-applicable", PLANNING: "applied"}, window
        assert (sp / "vllm/v1/core/kv_cache_utils.py").exists()  # there, but not a holder

        code, out, raw = vp("verify", "--deep")
        assert code == 0 and {i: o["verdict"] for i, o in out.items()} == dict.fromkeys(
            NEIGHBOURS, "applied"), raw
        assert all("deep probe passed" in o["reason"] for o in out.values()), raw
        reason = out["hybrid-prefix-drafter-window"]["reason"]
        assert (f"imported {PLANNING}; 1 symbol(s) are the block's" in reason
                and f"{UTILS}: no block in this release, not checked" in reason), reason
        assert "imported vllm.v1.core.sched.scheduler, vllm.v1.worker" in out[
            "hybrid-prefix-mamba-block"]["reason"], raw

        code, out, raw = vp("status")
        assert code == 0 and all(o["verdict"] == "applied" and o["in_place"]
                                 for o in out.values()), raw
        status = cli("status", "--python", str(python), *selection, cwd=tmp_path).stdout
        assert status.splitlines()[-1] == "vllm-patch status: 3 applied \u2014 all in place", \
            status
        code, out, raw = vp("diff")
        assert code == 0 and {i: o["verdict"] for i, o in out.items()} == dict.fromkeys(
            NEIGHBOURS, "already-applied") and not any("diff" in o for o in out.values()), raw

        code, out, raw = vp("revert")
        assert code == 0 and {i: o["verdict"] for i, o in out.items()} == dict.fromkeys(
            NEIGHBOURS, "reverted"), raw
        files = {str(t["file"]) for o in out.values() for t in o["targets"] if t["file"]}
        assert len(files) == 5, files  # every target that exists, the elsewhere one too
        for file in files:
            rel = Path(file).relative_to(sp).as_posix()
            assert hashlib.sha256(Path(file).read_bytes()).hexdigest() == record_sha256(
                sp, "vllm", rel), rel
        assert _vllm_hashes(sp) == pristine
    finally:  # the shared environment, as this test found it
        cli("revert", "--python", str(python), *selection, cwd=tmp_path)
        if not had_record:
            record.unlink(missing_ok=True)
