"""The guard that vLLM loads in every process (``vllm.general_plugins``): modes, healing, the
in-memory re-run of blocks, and silence where there is nothing to guard.

Fast tests use the demo distribution in a venv that also has hatch-vllm-patch installed from its
wheel, as a downstream project has it, and call the guard as vLLM does (the entry point, in a new
process). The slow test runs vLLM 0.20.2's own plugin loading in ``spawn`` children.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.commands import pristine_environment
from support.demo import DEMO_BLOCK, vllm_like, write_demo_catalog
from support.venvs import UV, create_venv, reinstall_from_cache, run, site_packages

RECORD = ".hatch-vllm-patch.json"
PATCH = "kv-cache-page-unification"

@pytest.fixture
def guarded(tmp_path: Path, demo_wheels: dict[str, Path], project_wheel: Path) -> Path:
    """A venv with demo-pkg 1.0.0 and hatch-vllm-patch (its guard entry point included)."""
    return create_venv(tmp_path / "venv", str(demo_wheels["1.0.0"]), str(project_wheel))


def cli_in(python: Path, *args: str, catalog: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    return run([str(python), "-m", "hatch_vllm_patch", *args], cwd=cwd,
               env={"HATCH_VLLM_PATCH_CATALOG": str(catalog)}, check=False)


def reinstall_demo(python: Path, wheel: Path) -> None:
    run([UV, "pip", "install", "--quiet", "--reinstall", "--no-deps", "--python", str(python),
         str(wheel)])


def test_entry_point_is_shipped(guarded: Path) -> None:
    """Installing hatch-vllm-patch registers the guard in vllm.general_plugins."""
    proc = run([str(guarded), "-c", "import importlib.metadata as m; print([(e.name, e.value) "
                "for e in m.entry_points(group='vllm.general_plugins')])"])
    assert proc.stdout.strip() == "[('hatch_vllm_patch', 'hatch_vllm_patch.guard:check')]"


def test_in_place_logs_one_info_line(guarded: Path, tmp_path: Path) -> None:
    """After apply, the guard logs one INFO line naming the patches and its time."""
    catalog = write_demo_catalog(tmp_path / "catalog")
    assert cli_in(guarded, "apply", "--patch", "demo-fix", catalog=catalog,
                  cwd=tmp_path).returncode == 0
    proc = vllm_like(guarded, tmp_path, catalog=catalog)
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if "hatch-vllm-patch" in line]
    assert len(lines) == 1 and lines[0].startswith("INFO vllm.hatch_vllm_patch: "), lines
    assert "patches in place (demo-fix) [guard error, " in lines[0] and " ms]" in lines[0]
    assert "patched: True" in proc.stdout


def test_modes_after_a_reinstall_behind_our_back(guarded: Path, tmp_path: Path,
                                                 demo_wheels: dict[str, Path]) -> None:
    """After a reinstall without apply: error stops with the fix, warn logs and goes on, off is
    silent, apply heals the file and the module a process had already imported."""
    catalog = write_demo_catalog(tmp_path / "catalog")
    cli_in(guarded, "apply", "--patch", "demo-fix", catalog=catalog, cwd=tmp_path)
    reinstall_demo(guarded, demo_wheels["1.0.0"])
    target = site_packages(guarded.parent.parent) / "demo_pkg" / "core.py"
    unpatched = target.read_bytes()

    stopped = vllm_like(guarded, tmp_path, catalog=catalog)
    assert stopped.returncode == 1 and "Traceback" not in stopped.stderr
    assert "patched:" not in stopped.stdout
    message = stopped.stderr
    for part in ("demo-fix: missing in", str(target), "fix: run: vllm-patch apply", "guard error"):
        assert part in message, message

    warned = vllm_like(guarded, tmp_path, mode="warn", catalog=catalog)
    assert warned.returncode == 0 and "patched: False" in warned.stdout
    assert "WARNING vllm.hatch_vllm_patch:" in warned.stdout and "demo-fix: missing" in \
        warned.stdout
    assert target.read_bytes() == unpatched

    silent = vllm_like(guarded, tmp_path, mode="off", catalog=catalog)
    assert "hatch-vllm-patch" not in silent.stdout + silent.stderr

    healed = vllm_like(guarded, tmp_path, "pre", mode="apply", catalog=catalog)
    assert healed.returncode == 0, healed.stdout + healed.stderr
    assert "healed (demo-fix)" in healed.stdout
    assert "demo-fix re-run in the already imported demo_pkg.core" in healed.stdout
    assert "patched: True" in healed.stdout, "the imported module kept the original"
    assert target.read_bytes() != unpatched
    again = vllm_like(guarded, tmp_path, catalog=catalog)
    assert "patches in place (demo-fix)" in again.stdout and "patched: True" in again.stdout


def test_each_message_once_also_before_logging_is_set_up(
        guarded: Path, tmp_path: Path, demo_wheels: dict[str, Path]) -> None:
    """Where the process has set up no logging when plugins load (vLLM 0.34), the "in place"
    line still reaches stderr at INFO, once (not with VLLM_CONFIGURE_LOGGING=0); a stop says
    its message once, with logging set up or not."""
    catalog = write_demo_catalog(tmp_path / "catalog")
    cli_in(guarded, "apply", "--patch", "demo-fix", catalog=catalog, cwd=tmp_path)
    bare = vllm_like(guarded, tmp_path, "unconfigured", catalog=catalog)
    assert bare.returncode == 0 and "patched: True" in bare.stdout, bare.stdout + bare.stderr
    lines = [line for line in bare.stderr.splitlines() if "hatch-vllm-patch" in line]
    assert len(lines) == 1 and lines[0].startswith("INFO "), bare.stderr
    assert "[guard] hatch-vllm-patch: patches in place (demo-fix) [guard error" in lines[0]
    off = vllm_like(guarded, tmp_path, "unconfigured", catalog=catalog,
                    env={"VLLM_CONFIGURE_LOGGING": "0"})
    assert off.returncode == 0 and "hatch-vllm-patch" not in off.stdout + off.stderr
    reinstall_demo(guarded, demo_wheels["1.0.0"])
    for args in (("unconfigured",), ()):
        stopped = vllm_like(guarded, tmp_path, *args, catalog=catalog)
        both = stopped.stdout + stopped.stderr
        assert stopped.returncode == 1 and "patched:" not in stopped.stdout, both
        assert both.count("this vLLM is not patched as selected") == 1, (args, both)
        assert both.count("demo-fix: missing in") == 1, (args, both)


def test_silent_without_record_or_configuration(guarded: Path, tmp_path: Path) -> None:
    """A vLLM that merely has hatch-vllm-patch installed: no record, no pyproject.toml above the
    working directory: the guard says nothing and changes nothing."""
    work = tmp_path / "work"
    work.mkdir()
    proc = vllm_like(guarded, work)
    assert proc.returncode == 0, proc.stderr
    assert "hatch-vllm-patch" not in proc.stdout + proc.stderr
    assert not (site_packages(guarded.parent.parent) / RECORD).exists()


PLANTED = '[tool.vllm-patch]\nguard = "{mode}"\n\n[tool.vllm-patch.architectures.DemoForCausalLM]\n'


def test_working_directory_configuration_is_never_read(guarded: Path, tmp_path: Path) -> None:
    """No record: a [tool.vllm-patch] in the working directory or above it (guard apply, error)
    is not read: silent, nothing written; the project named by $HATCH_VLLM_PATCH_PROJECT is, and
    a relative value is refused. (Before: the nearest pyproject.toml decided.)"""
    catalog = write_demo_catalog(tmp_path / "catalog")
    sp = site_packages(guarded.parent.parent)
    target = sp / "demo_pkg" / "core.py"
    unpatched = target.read_bytes()
    project = tmp_path / "project"
    (project / "deep" / "inside").mkdir(parents=True)
    for mode in ("apply", "error"):
        (project / "pyproject.toml").write_text(PLANTED.format(mode=mode))
        (project / "deep" / "pyproject.toml").write_text(PLANTED.format(mode=mode))
        for cwd in (project, project / "deep" / "inside"):
            proc = vllm_like(guarded, cwd, catalog=catalog)
            assert proc.returncode == 0, proc.stdout + proc.stderr
            assert "hatch-vllm-patch" not in proc.stdout + proc.stderr
            assert "patched: False" in proc.stdout
    assert target.read_bytes() == unpatched and not (sp / RECORD).exists()

    relative = vllm_like(guarded, tmp_path, catalog=catalog,
                         env={"HATCH_VLLM_PATCH_PROJECT": "project"})
    assert relative.returncode == 1 and "relative path" in relative.stderr
    assert "Traceback" not in relative.stderr and target.read_bytes() == unpatched

    (project / "deep" / "pyproject.toml").unlink()
    (project / "pyproject.toml").write_text(PLANTED.format(mode="apply"))
    named = vllm_like(guarded, tmp_path / "project" / "deep" / "inside", catalog=catalog,
                      env={"HATCH_VLLM_PATCH_PROJECT": str(project)})
    assert named.returncode == 0, named.stdout + named.stderr
    assert "healed (demo-fix)" in named.stdout and "patched: True" in named.stdout
    record = json.loads((sp / RECORD).read_text())
    assert record["selection"]["guard"] == "apply"
    assert [p["id"] for p in record["selection"]["patches"]] == ["demo-fix"]


def test_heals_only_to_the_recorded_block(guarded: Path, tmp_path: Path,
                                          demo_wheels: dict[str, Path]) -> None:
    """A patch folder whose block changed since apply is not healed from: apply mode stops
    with its own message and the command; the file stays as the reinstall left it."""
    catalog = write_demo_catalog(tmp_path / "catalog")
    cli_in(guarded, "apply", "--patch", "demo-fix", catalog=catalog, cwd=tmp_path)
    reinstall_demo(guarded, demo_wheels["1.0.0"])
    target = site_packages(guarded.parent.parent) / "demo_pkg" / "core.py"
    unpatched = target.read_bytes()
    block = catalog / "demo-fix" / "block.py"
    block.write_text(DEMO_BLOCK + "print('a block nobody applied')\n")
    proc = vllm_like(guarded, tmp_path, mode="apply", catalog=catalog)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "its patch folder changed since it was selected" in proc.stderr
    assert "heals only to the selected block" in proc.stderr
    assert "vllm-patch apply" in proc.stderr
    assert "a block nobody applied" not in proc.stdout + proc.stderr
    assert target.read_bytes() == unpatched
    block.write_text(DEMO_BLOCK)
    healed = vllm_like(guarded, tmp_path, mode="apply", catalog=catalog)
    assert healed.returncode == 0 and "healed (demo-fix)" in healed.stdout


def test_error_mode_fails_closed(guarded: Path, tmp_path: Path,
                                 demo_wheels: dict[str, Path]) -> None:
    """When the guard cannot establish that the patches are in place (the recorded patch folder
    is gone, the lock is held past its timeout), error and apply stop with the reason, warn
    logs it and goes on."""
    import fcntl

    project = tmp_path / "project"
    write_demo_catalog(project / "vllm-patches")
    (project / "pyproject.toml").write_text(PLANTED.format(mode="error"))
    assert run([str(guarded), "-m", "hatch_vllm_patch", "apply"], cwd=project,
               check=False).returncode == 0
    reinstall_demo(guarded, demo_wheels["1.0.0"])
    sp = site_packages(guarded.parent.parent)

    from hatch_vllm_patch.files import lock_file_of

    fd = os.open(lock_file_of(sp, sp), os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        waited = vllm_like(guarded, tmp_path, env={"HATCH_VLLM_PATCH_LOCK_TIMEOUT": "1"})
    finally:
        os.close(fd)
    assert waited.returncode == 1, waited.stdout + waited.stderr
    assert "cannot establish that this vLLM is patched" in waited.stderr
    assert "lock" in waited.stderr and "Traceback" not in waited.stderr

    moved = tmp_path / "moved"
    (project / "vllm-patches").rename(moved)
    for mode in (None, "apply"):
        stopped = vllm_like(guarded, tmp_path, mode=mode)
        assert stopped.returncode == 1, stopped.stdout + stopped.stderr
        assert f"the recorded patch folder {project / 'vllm-patches'} is gone" in stopped.stderr
        assert "patched:" not in stopped.stdout
    warned = vllm_like(guarded, tmp_path, mode="warn")
    assert warned.returncode == 0 and "patched: False" in warned.stdout
    assert "WARNING vllm.hatch_vllm_patch: hatch-vllm-patch: cannot establish" in warned.stdout


CLASSIFIER = """\
import pathlib
pathlib.Path({marker!r}).write_text("classify.py ran")


def classify(source):
    return ("known", "the demo shape") if "raise NotImplementedError" in source else \\
        ("unknown", "not the demo shape")
"""


def test_guard_never_runs_classify(guarded: Path, tmp_path: Path,
                                   demo_wheels: dict[str, Path]) -> None:
    """The guard never imports a patch's classify.py: it heals a reinstalled file with the shape
    check the record remembers, and calls a shape the record does not know unknown."""
    marker = tmp_path / "classifier-ran"
    project = tmp_path / "project"
    folder = write_demo_catalog(project / "vllm-patches") / "demo-fix"
    manifest = folder / "patch.toml"
    text = manifest.read_text()
    manifest.write_text(text[:text.index("shapes = ")] + 'classifier = "classify.py"\n')
    (folder / "classify.py").write_text(CLASSIFIER.format(marker=str(marker)))
    (project / "pyproject.toml").write_text(PLANTED.format(mode="apply"))
    applied = run([str(guarded), "-m", "hatch_vllm_patch", "apply"], cwd=project, check=False)
    assert applied.returncode == 0, applied.stdout + applied.stderr
    assert marker.exists(), "the CLI runs the project's classifier (the user asked for it)"
    marker.unlink()

    reinstall_demo(guarded, demo_wheels["1.0.0"])
    healed = vllm_like(guarded, tmp_path)
    assert healed.returncode == 0 and "healed (demo-fix)" in healed.stdout, healed.stderr
    reinstall_demo(guarded, demo_wheels["2.0.0"])
    unknown = vllm_like(guarded, tmp_path)
    assert unknown.returncode == 1, unknown.stdout + unknown.stderr
    assert "which the guard never runs" in unknown.stderr
    assert not marker.exists(), "the guard imported classify.py"


def test_revert_of_everything_clears_the_selection(guarded: Path, tmp_path: Path) -> None:
    """revert (all) leaves no selection: the guard has nothing to check."""
    catalog = write_demo_catalog(tmp_path / "catalog")
    cli_in(guarded, "apply", "--patch", "demo-fix", catalog=catalog, cwd=tmp_path)
    cli_in(guarded, "revert", catalog=catalog, cwd=tmp_path)
    path = site_packages(guarded.parent.parent) / RECORD
    assert not path.exists()  # nothing of ours is left: the record went with the blocks
    proc = vllm_like(guarded, tmp_path, catalog=catalog)
    assert "hatch-vllm-patch" not in proc.stdout + proc.stderr


@contextlib.contextmanager
def read_only(path: Path) -> Iterator[None]:
    """``path`` as a read-only bind mount (root only): even root cannot write there."""
    if os.geteuid() != 0:
        pytest.skip("a read-only bind mount needs root")
    done = subprocess.run(["mount", "--bind", str(path), str(path)], capture_output=True,
                          check=False)
    if done.returncode != 0:
        pytest.skip("bind mounts are not available here")
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(path)], check=True)
        yield
    finally:
        subprocess.run(["umount", str(path)], check=False)


def test_read_only_environment_in_apply_mode(guarded: Path, tmp_path: Path,
                                             demo_wheels: dict[str, Path]) -> None:
    """apply mode cannot heal a read-only environment: the message, exit 1, no traceback."""
    catalog = write_demo_catalog(tmp_path / "catalog")
    cli_in(guarded, "apply", "--patch", "demo-fix", catalog=catalog, cwd=tmp_path)
    reinstall_demo(guarded, demo_wheels["1.0.0"])
    package = site_packages(guarded.parent.parent) / "demo_pkg"
    with read_only(package):
        proc = vllm_like(guarded, tmp_path, mode="apply", catalog=catalog)
    assert proc.returncode == 1 and "Traceback" not in proc.stdout + proc.stderr
    assert "could not heal" in proc.stderr and "Read-only file system" in proc.stderr


NEURON_STAND_INS = {
    "neuron-runner-kv-spec": ("NeuronxDistributedModelRunner", "get_kv_cache_spec", textwrap.dedent(
        """\
        class NeuronxDistributedModelRunner:
            def get_kv_cache_spec(self):
                return {"layers.0.self_attn": 1}
        """)),
    "neuron-platform-prefix-caching": ("NeuronPlatform", "check_and_update_config",
                                       textwrap.dedent(
        """\
        class NeuronPlatform:
            @classmethod
            def check_and_update_config(cls, vllm_config):
                return None
        """)),
}


def wrappers(function: object, patch_id: str) -> int:
    count = 0
    function = getattr(function, "__func__", function)
    while getattr(function, "_hvp_patch_id", None) == patch_id:
        count, function = count + 1, getattr(function, "__wrapped__", None)
    return count


@pytest.mark.parametrize("patch_id", sorted(NEURON_STAND_INS))
def test_neuron_blocks_run_twice_wrap_once(patch_id: str) -> None:
    """apply mode re-runs a block in a module a process already imported: the catalog's blocks
    find their own wrapper and leave it (the KV block is checked on real vLLM, in scenarios.py
    and in the spawn test below)."""
    cls_name, method, source = NEURON_STAND_INS[patch_id]
    block = (Path(__file__).resolve().parents[1] / "patches" / patch_id / "block.py").read_text()
    namespace: dict[str, object] = {"__name__": "stand_in"}
    exec(source, namespace)
    exec(block, namespace)
    first = vars(namespace[cls_name])[method]
    exec(block, namespace)
    again = vars(namespace[cls_name])[method]
    assert again is first and wrappers(again, patch_id) == 1


def test_demo_block_run_twice_wraps_the_original_once() -> None:
    """The demo block, run twice, still wraps the module's original function, once."""
    namespace: dict[str, object] = {}
    exec("def compute(values):\n    return max(values)\n", namespace)
    original = namespace["compute"]
    exec(DEMO_BLOCK, namespace)
    exec(DEMO_BLOCK, namespace)
    assert namespace["_hvp_demo_original"] is original


# --- real vLLM: its own plugin loading, in spawn children -------------------------------------

SPAWN = textwrap.dedent("""\
    import multiprocessing, sys

    def child(pre):
        if pre:  # as vLLM's engine core: the module is imported before the plugins are loaded
            import vllm.v1.core.kv_cache_utils
        from vllm.plugins import load_general_plugins
        load_general_plugins()
        import vllm.v1.core.kv_cache_utils as k
        function = k.unify_kv_cache_spec_page_size
        print("CHILD patched:", getattr(function, "_hvp_patch_id", None), flush=True)

    if __name__ == "__main__":
        process = multiprocessing.get_context("spawn").Process(
            target=child, args=(sys.argv[1:] == ["pre"],))
        process.start()
        process.join()
        sys.exit(process.exitcode)
    """)


@pytest.mark.slow
def test_vllm_spawn_children_are_guarded(vllm_with_tool: Path, tmp_path: Path) -> None:
    """vLLM 0.20.2's load_general_plugins in spawn children: the INFO line after apply; after a
    reinstall error stops, warn goes on unpatched, apply heals the already imported module and
    the next child gets the patched file; silence without a record or a project."""
    python = vllm_with_tool
    with pristine_environment(python):
        _spawn_scenarios(python, tmp_path)


def _spawn_scenarios(python: Path, tmp_path: Path) -> None:
    program = tmp_path / "spawn.py"
    program.write_text(SPAWN)
    work = tmp_path / "work"
    work.mkdir()
    target = site_packages(python.parent.parent) / "vllm" / "v1" / "core" / "kv_cache_utils.py"

    def spawn(*args: str, mode: str | None = None) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items()
               if k not in {"HATCH_VLLM_PATCH_GUARD", "VIRTUAL_ENV", "HATCH_VLLM_PATCH_CATALOG"}}
        env["HF_HUB_OFFLINE"] = "1"
        if mode:
            env["HATCH_VLLM_PATCH_GUARD"] = mode
        proc = subprocess.run([str(python), str(program), *args], cwd=work, env=env,
                              capture_output=True, text=True, timeout=900, check=False)
        assert "Traceback" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
        return proc

    def reinstall() -> None:
        reinstall_from_cache(python, "vllm==0.20.2")

    run([str(python), "-m", "hatch_vllm_patch", "apply", "--patch", PATCH], cwd=work)
    ok = spawn()
    assert ok.returncode == 0 and f"CHILD patched: {PATCH}" in ok.stdout
    assert f"hatch-vllm-patch: patches in place ({PATCH}) [guard error" in ok.stdout

    reinstall()
    stopped = spawn()
    assert stopped.returncode == 1 and "CHILD patched" not in stopped.stdout
    assert f"{PATCH}: missing in {target}" in stopped.stderr
    assert "fix: run: vllm-patch apply" in stopped.stderr

    warned = spawn(mode="warn")
    assert warned.returncode == 0 and "CHILD patched: None" in warned.stdout
    assert f"{PATCH}: missing" in warned.stdout

    healed = spawn("pre", mode="apply")
    assert healed.returncode == 0, healed.stdout
    assert f"{PATCH} re-run in the already imported vllm.v1.core.kv_cache_utils" in healed.stdout
    assert f"CHILD patched: {PATCH}" in healed.stdout
    second = spawn()
    assert f"CHILD patched: {PATCH}" in second.stdout and "patches in place" in second.stdout

    reinstall()
    with read_only(target.parent):
        blocked = spawn(mode="apply")
    assert blocked.returncode == 1 and "could not heal" in blocked.stderr

    run([str(python), "-m", "hatch_vllm_patch", "revert"], cwd=work)
    assert not (site_packages(python.parent.parent) / RECORD).exists()  # revert removed it
    silent = spawn()
    assert silent.returncode == 0 and "CHILD patched: None" in silent.stdout
    assert "hatch-vllm-patch" not in silent.stdout + silent.stderr


# --- edit sessions and the guard, on real vLLM files (#19) ------------------------------------

# What vLLM does in each process, without importing vLLM (its files only, --no-deps): load our
# entry point of vllm.general_plugins (vLLM's own need torch) and call it; then what the server
# would run.
PLUGINS = textwrap.dedent("""\
    import importlib.metadata, importlib.util, logging, sys
    logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                        format="%(levelname)s %(name)s: %(message)s")
    for ep in importlib.metadata.entry_points(group="vllm.general_plugins"):
        if ep.value.startswith("hatch_vllm_patch"):
            ep.load()()
    spec = importlib.util.find_spec("vllm")
    path = spec.submodule_search_locations[0] + "/v1/core/kv_cache_utils.py"
    text = open(path).read()
    print("SERVES", "edited" if "HVP-EDITED" in text else
          "patched" if "# >>> hatch-vllm-patch: kv-cache" in text else "unpatched")
    """)


@pytest.mark.slow
def test_edit_sessions_end_when_their_file_is_replaced(tmp_path: Path,
                                                       project_wheel: Path) -> None:
    """On vLLM 0.20.2's files: a live edit lets the server run on the edited file, reported as
    not checked (open for editing), never in place; a reinstall mid-edit ends the session:
    status and verify name it, the guard stops an error process and heals in apply mode (which
    ends it and drops its pristine copy), edit opens afresh; a restore by hand and a reinstall
    of another version end it too; revert says which sessions stay open."""
    from support.venvs import cached_wheel, release_venv

    python = release_venv(tmp_path / "venv", "vllm", "0.20.2")
    run([UV, "pip", "install", "--quiet", "--python", str(python), str(project_wheel)])
    sp = site_packages(tmp_path / "venv")
    target = sp / "vllm" / "v1" / "core" / "kv_cache_utils.py"
    module = "vllm.v1.core.kv_cache_utils"
    project = tmp_path / "serve"
    project.mkdir()
    (project / "pyproject.toml").write_text(f'[tool.vllm-patch]\npatches = ["{PATCH}"]\n')
    program = tmp_path / "plugins.py"
    program.write_text(PLUGINS)

    def tool(*args: str) -> subprocess.CompletedProcess[str]:
        return run([str(python), "-m", "hatch_vllm_patch", *args], cwd=project, check=False)

    def serve(mode: str | None = None) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if k not in {"HATCH_VLLM_PATCH_GUARD",
                                                                 "VIRTUAL_ENV"}}
        if mode:
            env["HATCH_VLLM_PATCH_GUARD"] = mode
        proc = subprocess.run([str(python), str(program)], cwd="/", env=env,
                              capture_output=True, text=True, timeout=300, check=False)
        assert "Traceback" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
        return proc

    def install(version: str) -> None:
        run([UV, "pip", "install", "--quiet", "--reinstall", "--no-deps", "--no-cache",
             "--python", str(python), str(cached_wheel("vllm", version))])

    def edit_in_place() -> None:
        assert tool("edit", module).returncode == 0
        text = target.read_text()
        target.write_text(text.replace('"""Utilities', '"""HVP-EDITED Utilities', 1)
                          if '"""Utilities' in text else text + "\n# HVP-EDITED\n")

    def sessions() -> dict[str, object]:
        return json.loads((sp / RECORD).read_text())["edits"]

    assert tool("apply").returncode == 0
    edit_in_place()
    copies = list((sp / ".hatch-vllm-patch-edits").iterdir())
    assert len(copies) == 1
    live = serve()
    assert live.returncode == 0 and "SERVES edited" in live.stdout, live.stdout + live.stderr
    assert "patches in place (none checked)" in live.stdout
    assert f"not checked (open for editing, vllm-patch edit): {PATCH} ({target})" in live.stdout
    healing = serve("apply")
    assert healing.returncode == 0 and "SERVES edited" in healing.stdout  # not healed over
    assert "is over" not in tool("status").stdout

    install("0.20.2")  # the installer replaces the file mid-edit: the sequence
    status = tool("status")
    assert f"the edit session of {module} ({target}) is over: it is the pristine vllm 0.20.2 " \
        "file again" in status.stdout, status.stdout
    verify = tool("verify")
    assert verify.returncode == 1 and "is over" in verify.stdout
    assert f"missing      {PATCH}" in verify.stdout or "missing" in verify.stdout
    stopped = serve()
    assert stopped.returncode == 1 and "SERVES" not in stopped.stdout
    assert f"{PATCH}: missing in {target}" in stopped.stderr
    assert "patches in place" not in stopped.stdout + stopped.stderr
    healed = serve("apply")
    assert healed.returncode == 0 and "SERVES patched" in healed.stdout, healed.stdout
    assert f"healed ({PATCH})" in healed.stdout
    assert sessions() == {} and not list((sp / ".hatch-vllm-patch-edits").iterdir())
    assert "patches in place (kv-cache-page-unification)" in serve().stdout

    edit_in_place()  # a stale session makes edit open the module afresh
    install("0.20.2")
    again = tool("edit", module)
    assert again.returncode == 0 and "opened afresh" in again.stdout + again.stderr
    assert list(sessions()) == [str(target)]
    assert tool("edit", module, "--discard").returncode == 0
    assert tool("apply").returncode == 0

    patched = target.read_bytes()  # restored by hand, in place, from a copy with our block
    edit_in_place()
    target.write_bytes(patched)
    by_hand = serve()
    assert by_hand.returncode == 0 and "SERVES patched" in by_hand.stdout
    assert "patches in place (kv-cache-page-unification) [guard error, full check" in \
        by_hand.stdout, by_hand.stdout
    ended = tool("apply")
    assert ended.returncode == 0 and f"ended the edit session of {module}" in ended.stdout
    assert sessions() == {}

    edit_in_place()  # a reinstall of another version mid-edit
    install("0.20.1")
    other = tool("status")
    assert "vllm 0.20.1 is installed now; the edit was of 0.20.2" in other.stdout, other.stdout
    stopped = serve()
    assert stopped.returncode == 1 and f"{PATCH}: missing" in stopped.stderr
    install("0.20.2")
    assert tool("apply").returncode == 0 and sessions() == {}

    edit_in_place()  # revert of everything during an edit: the live session stays, named
    reverted = tool("revert")
    assert f"still open for editing, your changes kept: {module} ({target})" in reverted.stdout
    assert list(sessions()) == [str(target)] and "HVP-EDITED" in target.read_text()
    install("0.20.2")
    reverted = tool("revert")
    assert f"ended the edit session of {module}" in reverted.stdout, reverted.stdout
    # nothing of ours left: the record, its lock and the edits folder are gone with it
    assert not (sp / RECORD).exists() and not (sp / ".hatch-vllm-patch-edits").exists()


# One vLLM import for the sequence: vLLM's own load_general_plugins() in error mode
# (it must stop), then, flags reset as in a new process, in apply mode (it must heal the
# already imported module).
ERROR_THEN_APPLY = textwrap.dedent("""\
    import logging, os, sys
    logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                        format="%(levelname)s %(name)s: %(message)s")
    import vllm.plugins
    import vllm.v1.core.kv_cache_utils as k
    import hatch_vllm_patch.guard as guard
    for mode in ("error", "apply"):
        os.environ["HATCH_VLLM_PATCH_GUARD"] = mode
        vllm.plugins.plugins_loaded = False
        guard._checked = False
        try:
            vllm.plugins.load_general_plugins()
            print(mode.upper(), "went on", flush=True)
        except SystemExit as exc:
            print(mode.upper(), "stopped:", str(exc).splitlines()[0], flush=True)
        print(mode.upper(), "patched:",
              getattr(k.unify_kv_cache_spec_page_size, "_hvp_patch_id", None), flush=True)
    """)


@pytest.mark.slow
def test_reinstall_during_an_edit_stops_error_and_heals_apply_in_vllm(
        vllm_with_tool: Path, tmp_path: Path) -> None:
    """The sequence of #19 on vLLM 0.20.2 with its own plugin loading: apply, edit, reinstall;
    then an error process stops (no "in place" line) and an apply process heals the module it
    had imported; the stale edit session is gone."""
    python = vllm_with_tool
    with pristine_environment(python):
        work = tmp_path / "work"
        work.mkdir()
        sp = site_packages(python.parent.parent)
        program = tmp_path / "sequence.py"
        program.write_text(ERROR_THEN_APPLY)
        run([str(python), "-m", "hatch_vllm_patch", "apply", "--patch", PATCH], cwd=work)
        run([str(python), "-m", "hatch_vllm_patch", "edit", "vllm.v1.core.kv_cache_utils"],
            cwd=work)
        reinstall_from_cache(python, "vllm==0.20.2")
        env = {k: v for k, v in os.environ.items() if k not in {"VIRTUAL_ENV"}}
        env["HF_HUB_OFFLINE"] = "1"
        proc = subprocess.run([str(python), str(program)], cwd=work, env=env,
                              capture_output=True, text=True, timeout=900, check=False)
        out = proc.stdout
        assert proc.returncode == 0 and "Traceback" not in out + proc.stderr, out + proc.stderr
        assert "ERROR stopped: hatch-vllm-patch: this vLLM is not patched as selected" in out
        assert "ERROR patched: None" in out and "patches in place" not in out
        assert "APPLY went on" in out and f"APPLY patched: {PATCH}" in out, out
        assert json.loads((sp / RECORD).read_text())["edits"] == {}


def test_after_convergence_the_guard_demands_what_is_selected(guarded: Path, tmp_path: Path,
                                                              demo_wheels: dict[str, Path]
                                                              ) -> None:
    """A drops its patch: apply removes it; then B applies its own patch (B's patch folder) and
    A applies again: B's entry and folder stay recorded, and after a reinstall the guard
    demands and heals B's patch only, never the removed one."""
    from support.demo import OTHER_BLOCK, pair_catalog, project

    catalog = write_demo_catalog(tmp_path / "catalog")
    own = pair_catalog(tmp_path / "both") / "demo-other"
    b = project(tmp_path / "b", 'patch-dir = "vllm-patches"\npatches = ["demo-other"]')
    (b / "vllm-patches").mkdir()
    os.rename(own, b / "vllm-patches" / "demo-other")
    a = project(tmp_path / "a", 'patches = ["demo-fix"]')

    def apply(where: Path) -> str:
        done = cli_in(guarded, "apply", catalog=catalog, cwd=where)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    apply(a)
    project(a, "patches = []")
    assert "removed: no longer selected" in apply(a)
    apply(b)
    assert "demo-other: present but not selected" in apply(a)
    selection = json.loads((site_packages(guarded.parent.parent) / RECORD).read_text())[
        "selection"]
    assert [p["id"] for p in selection["patches"]] == ["demo-other"]
    assert selection["patch_dirs"] == [str((b / "vllm-patches").resolve())]
    reinstall_demo(guarded, demo_wheels["1.0.0"])
    stopped = vllm_like(guarded, tmp_path, catalog=catalog)
    assert stopped.returncode == 1 and "demo-other: missing" in stopped.stderr, stopped.stderr
    assert "demo-fix" not in stopped.stderr
    healed = vllm_like(guarded, tmp_path, mode="apply", catalog=catalog)
    assert "healed (demo-other)" in healed.stdout, healed.stdout + healed.stderr
    core = (site_packages(guarded.parent.parent) / "demo_pkg" / "core.py").read_text()
    assert OTHER_BLOCK.splitlines()[-1].strip() in core and "_hvp_demo_original" not in core


DUO_A = ('def compute(values):\n    if not values:\n        raise ValueError("empty")\n'
         '    return max(values)\n')
DUO_B = 'def limit():\n    return 1\n'
DUO_BLOCKS = {
    "duo_pkg.a": ('if "_hvp_duo_a" not in globals():\n    _hvp_duo_a = compute\n\n\n'
                  'def compute(values):\n    return _hvp_duo_a(values) if values else 0\n'),
    "duo_pkg.b": ('if "_hvp_duo_b" not in globals():\n    _hvp_duo_b = limit\n\n\n'
                  'def limit():\n    return _hvp_duo_b() + 1\n'),
}
DUO_PROCESS = textwrap.dedent("""\
    import importlib.metadata, logging, sys
    logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                        format="%(levelname)s %(name)s: %(message)s")
    if sys.argv[1:] == ["pre"]:
        import duo_pkg.a, duo_pkg.b
    for ep in importlib.metadata.entry_points(group="vllm.general_plugins"):
        ep.load()()
    import duo_pkg.a, duo_pkg.b
    print("patched:", duo_pkg.a.compute([]) == 0, duo_pkg.b.limit() == 2)
    """)


def _digest(source: str, symbol: str) -> str:
    import ast
    import hashlib

    from hatch_vllm_patch.engine import locate_in, node_source

    node, _ = locate_in(ast.parse(source), symbol)
    assert node is not None
    return hashlib.sha256(node_source(source, node).encode("utf-8")).hexdigest()


def test_a_patch_over_two_modules_heals_to_its_recorded_blocks(
        tmp_path: Path, project_wheel: Path) -> None:
    """A patch over two modules: the record holds each target's block; the guard heals both
    files and re-runs each block in its already imported module, and refuses to heal when
    either block changed since apply (nothing written)."""
    project = tmp_path / "duo"
    (project / "duo_pkg").mkdir(parents=True)
    (project / "duo_pkg" / "__init__.py").write_text("")
    (project / "duo_pkg" / "a.py").write_text(DUO_A)
    (project / "duo_pkg" / "b.py").write_text(DUO_B)
    (project / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["hatchling"]\nbuild-backend = "hatchling.build"\n\n'
        '[project]\nname = "duo-pkg"\nversion = "1.0.0"\n')
    run([UV, "build", "--wheel", "--quiet", "--out-dir", str(tmp_path / "dist"), str(project)])
    wheel = next((tmp_path / "dist").glob("duo_pkg-1.0.0-*.whl"))
    python = create_venv(tmp_path / "venv", str(wheel), str(project_wheel))
    catalog = tmp_path / "catalog"
    folder = catalog / "duo-fix"
    folder.mkdir(parents=True)
    (folder / "patch.toml").write_text(textwrap.dedent(f"""\
        id = "duo-fix"
        summary = "One fix over two modules"
        links = ["https://example.invalid/duo"]
        architectures = ["DemoForCausalLM"]

        [[targets]]
        distribution = "duo-pkg"
        module = "duo_pkg.a"
        symbol = "compute"
        shapes = ["{_digest(DUO_A, "compute")}"]

        [[targets]]
        distribution = "duo-pkg"
        module = "duo_pkg.b"
        symbol = "limit"
        shapes = ["{_digest(DUO_B, "limit")}"]

        # a later release's home of compute: absent here, nothing written
        [[targets]]
        distribution = "duo-pkg"
        module = "duo_pkg.later"
        symbol = "compute"
        shapes = ["{_digest(DUO_A, "compute")}", "elsewhere"]
        """))
    for module, block in DUO_BLOCKS.items():
        (folder / f"{module}.py").write_text(block)
    (folder / "duo_pkg.later.py").write_text(DUO_BLOCKS["duo_pkg.a"] + "# in duo_pkg.later\n")
    applied = cli_in(python, "apply", "--patch", "duo-fix", catalog=catalog, cwd=tmp_path)
    assert applied.returncode == 0, applied.stdout + applied.stderr
    site = site_packages(python.parent.parent)
    record = json.loads((site / RECORD).read_text())
    entries = [p for p in record["selection"]["patches"] if p["id"] == "duo-fix"]
    assert len(entries) == 3 and len({p["block_sha256"] for p in entries}) == 3, entries
    assert [p["verdict"] for p in entries if p["file"] is None] == ["not-applicable"], entries
    program_dir = tmp_path / "prog"
    program_dir.mkdir()
    (program_dir / "serve.py").write_text(DUO_PROCESS)

    def serve(*args: str, mode: str) -> subprocess.CompletedProcess[str]:
        environ = {k: v for k, v in os.environ.items() if k not in {"VIRTUAL_ENV"}}
        environ.update({"HATCH_VLLM_PATCH_GUARD": mode, "HATCH_VLLM_PATCH_CATALOG": str(catalog)})
        return subprocess.run([str(python), str(program_dir / "serve.py"), *args], cwd=tmp_path,
                              env=environ, capture_output=True, text=True, timeout=300,
                              check=False)

    in_place = serve(mode="error")
    assert in_place.returncode == 0, in_place.stdout + in_place.stderr
    assert "patches in place (duo-fix) [guard error" in in_place.stdout
    # the absent module's target is as apply left it: the fast check holds, no full check
    assert "full check" not in in_place.stdout, in_place.stdout
    assert "patched: True True" in in_place.stdout
    run([UV, "pip", "install", "--quiet", "--reinstall", "--no-deps", "--python", str(python),
         str(wheel)])
    files = [site / "duo_pkg" / "a.py", site / "duo_pkg" / "b.py"]
    assert [f.read_text() for f in files] == [DUO_A, DUO_B]
    second = folder / "duo_pkg.b.py"
    second.write_text(DUO_BLOCKS["duo_pkg.b"] + "print('a block nobody applied')\n")
    refused = serve(mode="apply")
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert "its patch folder changed since it was selected" in refused.stderr
    assert "a block nobody applied" not in refused.stdout + refused.stderr
    assert [f.read_text() for f in files] == [DUO_A, DUO_B]  # neither file written
    second.write_text(DUO_BLOCKS["duo_pkg.b"])
    healed = serve("pre", mode="apply")
    assert healed.returncode == 0, healed.stdout + healed.stderr
    assert "healed (duo-fix" in healed.stdout
    for module in ("duo_pkg.a", "duo_pkg.b"):
        assert f"duo-fix re-run in the already imported {module}" in healed.stdout, healed.stdout
    assert "patched: True True" in healed.stdout
    assert all(b"# >>> hatch-vllm-patch: duo-fix" in f.read_bytes() for f in files)


def test_a_dropped_patch_over_two_modules_is_removed_from_both(tmp_path: Path,
                                                                project_wheel: Path) -> None:
    """Convergence over a patch with two targets: the project drops it, apply removes its block
    from both files (each the wheel's bytes again) and the record names neither target."""
    from support.demo import project as write_project

    source = tmp_path / "duo"
    (source / "duo_pkg").mkdir(parents=True)
    (source / "duo_pkg" / "__init__.py").write_text("")
    (source / "duo_pkg" / "a.py").write_text(DUO_A)
    (source / "duo_pkg" / "b.py").write_text(DUO_B)
    (source / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["hatchling"]\nbuild-backend = "hatchling.build"\n\n'
        '[project]\nname = "duo-pkg"\nversion = "1.0.0"\n')
    run([UV, "build", "--wheel", "--quiet", "--out-dir", str(tmp_path / "dist"), str(source)])
    wheel = next((tmp_path / "dist").glob("duo_pkg-1.0.0-*.whl"))
    python = create_venv(tmp_path / "venv", str(wheel), str(project_wheel))
    folder = tmp_path / "catalog" / "duo-fix"
    folder.mkdir(parents=True)
    (folder / "patch.toml").write_text(textwrap.dedent(f"""\
        id = "duo-fix"
        summary = "One fix over two modules"
        links = ["https://example.invalid/duo"]

        [[targets]]
        distribution = "duo-pkg"
        module = "duo_pkg.a"
        symbol = "compute"
        shapes = ["{_digest(DUO_A, "compute")}"]

        [[targets]]
        distribution = "duo-pkg"
        module = "duo_pkg.b"
        symbol = "limit"
        shapes = ["{_digest(DUO_B, "limit")}"]
        """))
    for module, block in DUO_BLOCKS.items():
        (folder / f"{module}.py").write_text(block)
    catalog = folder.parent
    app = write_project(tmp_path / "app", 'patches = ["duo-fix"]')
    applied = cli_in(python, "apply", catalog=catalog, cwd=app)
    assert applied.returncode == 0, applied.stdout + applied.stderr
    site = site_packages(python.parent.parent)
    files = [site / "duo_pkg" / "a.py", site / "duo_pkg" / "b.py"]
    assert [f.read_text() for f in files] != [DUO_A, DUO_B]
    write_project(app, "patches = []")
    removed = cli_in(python, "apply", "--json", catalog=catalog, cwd=app)
    assert removed.returncode == 0, removed.stdout + removed.stderr
    outcomes = json.loads(removed.stdout)["patches"]
    assert [(o["id"], o["verdict"]) for o in outcomes] == [("duo-fix", "removed")]
    assert [t["verdict"] for t in outcomes[0]["targets"]] == ["removed"] * 2, outcomes
    assert [f.read_text() for f in files] == [DUO_A, DUO_B]
    record = json.loads((site / RECORD).read_text())
    assert record["selection"]["patches"] == [] and record["files"] == {}


@pytest.mark.slow
def test_in_place_line_on_vllm_034(tmp_path: Path, project_wheel: Path) -> None:
    """vLLM 0.34 (full, CPU torch, with hatch-vllm-patch installed) sets up no handler for its
    loggers by the time it loads plugins; the guard's "patches in place" line reaches stderr
    once all the same, at INFO, when vLLM's own load_general_plugins() calls it."""
    from support.venvs import PLANNING_TORCH, vllm_venv

    python = vllm_venv(tmp_path / "venv", "0.34.0", str(project_wheel), torch=PLANNING_TORCH)
    run([str(python), "-m", "hatch_vllm_patch", "apply", "--python", str(python), "--patch",
         "kv-cache-page-promotion"], cwd=tmp_path)
    program = ("import logging, vllm.plugins\n"
               "print('handlers:', len(logging.getLogger('vllm').handlers))\n"
               "vllm.plugins.load_general_plugins()\n")
    proc = run([str(python), "-c", program], cwd=tmp_path, env={"HF_HUB_OFFLINE": "1"})
    assert "handlers: 0" in proc.stdout, proc.stdout  # the case: nothing handles vLLM's logs
    lines = [line for line in proc.stderr.splitlines() if "hatch-vllm-patch" in line]
    assert len(lines) == 1 and lines[0].startswith("INFO "), proc.stderr
    assert "patches in place (kv-cache-page-promotion) [guard error" in lines[0], lines
