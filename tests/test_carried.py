"""Selections carried inside downstream wheels: the build hook writes them on a regular wheel
build; installed with pip or uv (no apply step), they drive the guard and ``apply`` run with no
project. Real hatchling builds, real venvs, the guard called as vLLM calls it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
import textwrap
import zipfile
from pathlib import Path

import pytest
from support.demo import DEMO_BLOCK, vllm_like, write_demo_catalog
from support.venvs import (
    UV,
    create_venv,
    reinstall_from_cache,
    run,
    scrubbed_environ,
    site_packages,
    vllm_venv,
)

from hatch_vllm_patch.environment import run_bounded

RECORD = ".hatch-vllm-patch.json"

OTHER_BLOCK = textwrap.dedent("""\
    def other():
        return "patched other"
    """)


def downstream_project(root: Path, name: str, *, guard: str = "apply",
                       block: str = DEMO_BLOCK, patch: str = "demo-fix") -> Path:
    """A downstream service depending on demo-pkg with its own patch folder selecting ``patch``
    (demo-fix: ``compute``; demo-other: ``other``)."""
    package = name.replace("-", "_")
    (root / package).mkdir(parents=True)
    (root / package / "__init__.py").write_text("")
    folder = write_demo_catalog(root / "vllm-patches", block=block) / "demo-fix"
    if patch == "demo-other":
        manifest = (folder / "patch.toml").read_text().replace('"demo-fix"', '"demo-other"')
        manifest = manifest.replace('symbol = "compute"', 'symbol = "other"')
        start = manifest.index("shapes = ")
        manifest = manifest[:start] + 'classifier = "classify.py"\n'
        target = folder.parent / "demo-other"
        folder.rename(target)
        (target / "patch.toml").write_text(manifest)
        (target / "block.py").write_text(OTHER_BLOCK)
        (target / "classify.py").write_text(
            "def classify(source):\n    return ('known', 'other() is there')\n")
    (root / "pyproject.toml").write_text(textwrap.dedent(f"""\
        [build-system]
        requires = ["hatchling"]
        build-backend = "hatchling.build"

        [project]
        name = "{name}"
        version = "1.0"

        [tool.hatch.build.targets.wheel]
        packages = ["{package}"]

        [tool.hatch.build.hooks.vllm-patch]

        [tool.vllm-patch]
        guard = "{guard}"
        patches = ["{patch}"]
        """))
    return root


def build_wheel(project: Path) -> Path:
    """A regular wheel, built by hatchling with this checkout's hook, as a frontend builds it."""
    out = project / "dist"
    code = "import sys, hatchling.build as b; print(b.build_wheel(sys.argv[1]))"
    proc = run([sys.executable, "-c", code, str(out)], cwd=project, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return next(out.glob("*.whl"))


@pytest.fixture(scope="module")
def service_wheels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("services")
    return {
        "svc-a": build_wheel(downstream_project(root / "a", "svc-a")),
        "svc-b": build_wheel(downstream_project(root / "b", "svc-b", guard="error",
                                                patch="demo-other")),
        "svc-c": build_wheel(downstream_project(root / "c", "svc-c",
                                                block=DEMO_BLOCK + "# another block\n")),
    }


def installed(tmp_path: Path, demo_wheels: dict[str, Path], project_wheel: Path,
              *wheels: Path) -> Path:
    """pip's way: a venv made from wheels only, no apply step."""
    return create_venv(tmp_path / "venv", str(demo_wheels["1.0.0"]), str(project_wheel),
                       *map(str, wheels))


def test_regular_wheel_carries_the_selection_and_its_own_folder(
        service_wheels: dict[str, Path]) -> None:
    """The wheel's dist-info holds the resolved selection (id, reasons, block digest, guard)
    and the project's own patch folder."""
    with zipfile.ZipFile(service_wheels["svc-a"]) as wheel:
        names = wheel.namelist()
        base = "svc_a-1.0.dist-info/extra_metadata/hatch-vllm-patch"
        assert f"{base}/patches/demo-fix/block.py" in names
        assert f"{base}/patches/demo-fix/patch.toml" in names
        document = json.loads(wheel.read(f"{base}/selection.json"))
        assert wheel.read(f"{base}/patches/demo-fix/block.py").decode() == DEMO_BLOCK
    import hashlib

    assert document["guard"] == "apply" and document["distribution"] == "svc-a"
    [entry] = document["patches"]
    assert entry["id"] == "demo-fix" and entry["own"] is True
    assert entry["block_sha256"] == hashlib.sha256(DEMO_BLOCK.encode()).hexdigest()
    assert entry["why"] == ["[tool.vllm-patch] patches (for every model served)"]


def test_guard_heals_from_the_carried_selection(tmp_path: Path, demo_wheels: dict[str, Path],
                                                project_wheel: Path,
                                                service_wheels: dict[str, Path]) -> None:
    """Installed from wheels with no apply step, the first vLLM process (started from /)
    heals to the carried block in apply mode and records it (for its carrier); the next finds
    it in place."""
    python = installed(tmp_path, demo_wheels, project_wheel, service_wheels["svc-a"])
    healed = vllm_like(python, Path("/"), program_dir=tmp_path)
    assert healed.returncode == 0, healed.stdout + healed.stderr
    assert "healed (demo-fix)" in healed.stdout and "patched: True" in healed.stdout
    assert "carried by svc-a 1.0" in healed.stdout
    record = json.loads((site_packages(python.parent.parent) / RECORD).read_text())
    assert record["selection"]["guard"] == "apply"
    # the heal records the carrier, not the command line (a later apply may remove it)
    assert [p["selected_by"] for p in record["selection"]["patches"]] == [["carried by svc-a"]]
    again = vllm_like(python, Path("/"), program_dir=tmp_path)
    assert "patches in place (demo-fix)" in again.stdout and "patched: True" in again.stdout


def test_apply_without_a_project_uses_the_carried_selection(
        tmp_path: Path, demo_wheels: dict[str, Path], project_wheel: Path,
        service_wheels: dict[str, Path]) -> None:
    """`python -m hatch_vllm_patch apply` in a folder with no project applies what the
    installed wheels carry: the union of two, each reason naming its distribution."""
    python = installed(tmp_path, demo_wheels, project_wheel, service_wheels["svc-a"],
                       service_wheels["svc-b"])
    empty = tmp_path / "empty"
    empty.mkdir()
    applied = run([str(python), "-m", "hatch_vllm_patch", "apply", "--json"], cwd=empty,
                  check=False)
    assert applied.returncode == 0, applied.stdout + applied.stderr
    outcomes = {o["id"]: o for o in json.loads(applied.stdout)["patches"]}
    assert set(outcomes) == {"demo-fix", "demo-other"}
    assert outcomes["demo-fix"]["selected_because"] == [
        "[tool.vllm-patch] patches (for every model served), carried by svc-a 1.0"]
    assert outcomes["demo-other"]["selected_because"] == [
        "[tool.vllm-patch] patches (for every model served), carried by svc-b 1.0"]
    core = site_packages(python.parent.parent) / "demo_pkg" / "core.py"
    assert "# >>> hatch-vllm-patch: demo-other" in core.read_text()
    assert "# >>> hatch-vllm-patch: demo-fix" in core.read_text()


def test_a_clash_between_carried_selections_is_refused(
        tmp_path: Path, demo_wheels: dict[str, Path], project_wheel: Path,
        service_wheels: dict[str, Path]) -> None:
    """Two installed wheels carrying one id with different blocks: apply refuses (exit 2) and
    the guard stops, naming both; nothing is written."""
    python = installed(tmp_path, demo_wheels, project_wheel, service_wheels["svc-a"],
                       service_wheels["svc-c"])
    core = site_packages(python.parent.parent) / "demo_pkg" / "core.py"
    before = core.read_bytes()
    applied = run([str(python), "-m", "hatch_vllm_patch", "apply"], cwd=tmp_path, check=False)
    assert applied.returncode == 2, applied.stdout + applied.stderr
    assert "svc-a 1.0" in applied.stderr and "svc-c 1.0" in applied.stderr
    assert "clash" in applied.stderr
    stopped = vllm_like(python, Path("/"), program_dir=tmp_path)
    assert stopped.returncode == 1 and "svc-c 1.0" in stopped.stderr, stopped.stderr
    assert "Traceback" not in stopped.stderr
    assert core.read_bytes() == before


# --- many nodes: a real Ray cluster -------------------------------------------------------------

RAY = "ray==2.60.0"
KV_PATCH = "kv-cache-page-unification"

# Runs on the second node, in that node's own environment: vLLM's own plugin loading, then the
# patched function on specs that unpatched vLLM 0.20.2 rejects (KNOWLEDGE S1: a 1073152 B GDN
# state page next to a 16384 B bf16 attention page).
RAY_DRIVER = textwrap.dedent("""\
    import json, ray
    ray.init(address="127.0.0.1:6379", logging_level="ERROR")

    @ray.remote(resources={"node2": 1}, num_cpus=0)
    def serve_on_node2():
        import logging, os, sys, sysconfig
        record = os.path.join(sysconfig.get_paths()["purelib"], ".hatch-vllm-patch.json")
        before = os.path.exists(record)
        from vllm.plugins import load_general_plugins  # vLLM configures its logging here
        lines = []
        handler = logging.Handler()
        handler.emit = lambda r: lines.append(r.getMessage())
        logging.getLogger("vllm.hatch_vllm_patch").addHandler(handler)
        load_general_plugins()
        import torch
        import vllm.v1.core.kv_cache_utils as k
        from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec
        specs = {
            "attn": FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=256,
                                      dtype=torch.bfloat16),
            "gdn": MambaSpec(block_size=16, shapes=((3, 4096), (16, 128, 128)),
                             dtypes=(torch.bfloat16, torch.float32)),
        }
        unified = k.unify_kv_cache_spec_page_size(specs)
        return {"python": sys.executable, "record_before": before,
                "record_after": os.path.exists(record), "guard": lines,
                "patch": getattr(k.unify_kv_cache_spec_page_size, "_hvp_patch_id", None),
                "pages": {n: s.page_size_bytes for n, s in unified.items()}}

    print("RESULT " + json.dumps(ray.get(serve_on_node2.remote(), timeout=600)), flush=True)
    """)

RAY_CLUSTER = textwrap.dedent("""\
    set -e
    ip link set lo up
    cd "$RAY_TMP"  # Ray packs the driver's working directory for the workers otherwise
    trap '"$HEAD/ray" stop --force >/dev/null 2>&1 || true' EXIT
    common="--node-ip-address=127.0.0.1 --num-cpus=1 --object-store-memory=100000000"
    "$HEAD/ray" start --head --port=6379 $common --include-dashboard=false \\
        --disable-usage-stats --temp-dir="$RAY_TMP" >"$RAY_TMP/head.log" 2>&1
    "$NODE2/ray" start --address=127.0.0.1:6379 $common --resources='{"node2": 1}' \\
        >"$RAY_TMP/node2.log" 2>&1
    "$HEAD/python" "$RAY_TMP/driver.py"
    """)


def _stop_ray_of(*folders: Path) -> None:
    """Kill what is left of this test's cluster (the processes run from its environments or
    its Ray folder) — never another Ray on the machine, as `ray stop` would."""
    import signal

    marks = [str(f) for f in folders]
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if any(mark in command for mark in marks):
            with contextlib.suppress(OSError):
                os.kill(int(entry.name), signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("ip"),
                    reason="a network namespace of the test's own needs root, unshare and ip")
def test_ray_second_node_heals_from_the_wheel(tmp_path: Path, project_wheel: Path) -> None:
    """A two-node Ray cluster (in a network namespace of its own): a task pinned to the second
    node, whose environment was made only by installing the service's wheel (vLLM 0.20.2
    reinstalled pristine), calls vLLM's load_general_plugins(); the guard heals to the carried
    block and the patched function then unifies specs unpatched vLLM rejects."""
    service = tmp_path / "service"
    (service / "ray_svc").mkdir(parents=True)
    (service / "ray_svc" / "__init__.py").write_text("")
    (service / "pyproject.toml").write_text(textwrap.dedent(f"""\
        [build-system]
        requires = ["hatchling"]
        build-backend = "hatchling.build"

        [project]
        name = "ray-svc"
        version = "1.0"

        [tool.hatch.build.hooks.vllm-patch]

        [tool.vllm-patch]
        guard = "apply"
        patches = ["{KV_PATCH}"]
        """))
    wheel = build_wheel(service)
    # Each node's environment, built before entering the namespace (nothing there reaches
    # PyPI): the head has Ray only; node 2 is what `pip install ray-svc` gives an image.
    head = create_venv(tmp_path / "head", RAY)
    node2 = vllm_venv(tmp_path / "node2", "0.20.2", RAY, str(project_wheel), str(wheel))
    reinstall_from_cache(node2, "vllm==0.20.2")
    sp = site_packages(node2.parent.parent)
    assert not (sp / RECORD).exists()
    target = sp / "vllm" / "v1" / "core" / "kv_cache_utils.py"
    assert "hatch-vllm-patch" not in target.read_text()

    ray_tmp = Path(tempfile.mkdtemp(prefix="hvp-ray-", dir="/tmp"))  # short: unix sockets
    try:
        (ray_tmp / "driver.py").write_text(RAY_DRIVER)
        (ray_tmp / "cluster.sh").write_text(RAY_CLUSTER)
        env = {**scrubbed_environ(), "HEAD": str(head.parent), "NODE2": str(node2.parent),
               "RAY_TMP": str(ray_tmp), "HF_HUB_OFFLINE": "1", "RAY_USAGE_STATS_ENABLED": "0",
               # Under `uv run` (as this suite runs) Ray would otherwise re-create the driver's
               # uv environment on each node, from PyPI: the node must use its own environment.
               "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0"}
        env.pop("VLLM_PLUGINS", None)
        try:
            proc = run_bounded(["unshare", "-n", "bash", str(ray_tmp / "cluster.sh")],
                               timeout=1200, env=env)
        finally:
            _stop_ray_of(tmp_path, ray_tmp)
        logs = "".join(p.read_text(errors="replace") for p in ray_tmp.glob("*.log"))
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout + proc.stderr + logs
    result = json.loads(lines[-1][len("RESULT "):])
    assert result["python"] == str(node2), result
    assert result["record_before"] is False and result["record_after"] is True
    assert any(f"healed ({KV_PATCH})" in line and "carried by ray-svc 1.0" in line
               for line in result["guard"]), result["guard"]
    assert result["patch"] == KV_PATCH
    assert set(result["pages"].values()) == {1081344}, result["pages"]
    assert f"# >>> hatch-vllm-patch: {KV_PATCH}" in target.read_text()


def test_apply_of_the_carried_selections_follows_the_installed_wheels(
        tmp_path: Path, demo_wheels: dict[str, Path], project_wheel: Path,
        service_wheels: dict[str, Path]) -> None:
    """The record names each carried patch's carrier; once svc-b is uninstalled, apply with no
    project removes its patch (no longer selected) and keeps svc-a's."""
    python = installed(tmp_path, demo_wheels, project_wheel, service_wheels["svc-a"],
                       service_wheels["svc-b"])
    empty = tmp_path / "empty"
    empty.mkdir()

    def apply() -> dict[str, str]:
        done = run([str(python), "-m", "hatch_vllm_patch", "apply", "--json"], cwd=empty,
                   check=False)
        assert done.returncode == 0, done.stdout + done.stderr
        return {o["id"]: o["verdict"] for o in json.loads(done.stdout)["patches"]}

    assert apply() == {"demo-fix": "applied", "demo-other": "applied"}
    record = json.loads((site_packages(python.parent.parent) / RECORD).read_text())
    assert {p["id"]: p["selected_by"] for p in record["selection"]["patches"]} == {
        "demo-fix": ["carried by svc-a"], "demo-other": ["carried by svc-b"]}
    run([UV, "pip", "uninstall", "--quiet", "--python", str(python), "svc-b"])
    assert apply() == {"demo-fix": "already-applied", "demo-other": "removed"}
    core = (site_packages(python.parent.parent) / "demo_pkg" / "core.py").read_text()
    assert "hatch-vllm-patch: demo-other" not in core and "hatch-vllm-patch: demo-fix" in core
