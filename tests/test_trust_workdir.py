"""The caller's working directory, ``PYTHONPATH`` and ``PYTHONSTARTUP`` never reach a helper
process (``environment.run_target_python``: ``python -I`` in a private folder, no ``PYTHON*``
variable).

As root, in a folder uid 65534 owns and filled with shadows of standard modules (``json``,
``sysconfig``, ``re``, ``logging``, ``pip``, ``site``, ...; each records its name in a marker
folder when imported), every command that starts the target's interpreter is run; no shadow may
be imported. The CLI itself runs as ``python -I -m hatch_vllm_patch`` here, as the console
script would (neither puts the working directory on its own ``sys.path``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from support import REPO
from support.demo import write_demo_catalog
from support.venvs import create_venv, run

NOBODY = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0,
                                reason="planting a folder of another user (chown) needs root")

SHADOWED = ("json", "sysconfig", "re", "base64", "typing", "logging", "site", "sitecustomize",
            "usercustomize", "runpy", "importlib_metadata")
DEMO_PROBE = textwrap.dedent("""\
    import json
    import demo_pkg.core as module
    print(json.dumps({"ok": module.compute([]) == 0, "detail": "compute([]) is 0"}))
    """)
MODEL = REPO / "example_project" / "models" / "qwen3.6-finetune"


def plant_shadows(folder: Path, markers: Path) -> None:
    """``folder`` (owned by uid 65534) with a module per name of SHADOWED, a ``pip`` package
    and a startup file, each writing ``markers/<name>`` when run."""
    folder.mkdir()
    code = "open({!r} + '/' + {!r}, 'w').close()\n"
    for name in SHADOWED:
        (folder / f"{name}.py").write_text(code.format(str(markers), name))
    (folder / "pip").mkdir()
    (folder / "pip" / "__init__.py").write_text(code.format(str(markers), "pip"))
    (folder / "pip" / "__main__.py").write_text(code.format(str(markers), "pip.__main__"))
    (folder / "startup.py").write_text(code.format(str(markers), "startup"))
    for path in (folder, *folder.rglob("*")):
        os.chown(path, NOBODY, NOBODY)


@pytest.fixture
def planted(tmp_path: Path) -> tuple[Path, Path]:
    """(the other user's folder, the folder its shadows mark when imported)."""
    markers = tmp_path / "markers"
    markers.mkdir()
    folder = tmp_path / "theirs"
    plant_shadows(folder, markers)
    return folder, markers


@pytest.fixture
def project(tmp_path: Path, demo_wheels: dict[str, Path]) -> Path:
    """Root's project: demo-pkg 1.0.0 in its .venv, demo-fix (with a probe.py) selected."""
    root = tmp_path / "project"
    root.mkdir()
    create_venv(root / ".venv", str(demo_wheels["1.0.0"]))
    write_demo_catalog(root / "vllm-patches")
    (root / "vllm-patches" / "demo-fix" / "probe.py").write_text(DEMO_PROBE)
    (root / "pyproject.toml").write_text(
        '[project]\nname = "served"\nversion = "0"\n\n[tool.vllm-patch]\npatches = ["demo-fix"]\n')
    return root


def vp(*args: str, cwd: Path, env: dict[str, str] | None = None
       ) -> subprocess.CompletedProcess[str]:
    """The CLI, isolated itself (``-I``, as the console script is with respect to ``''``)."""
    proc = run([sys.executable, "-I", "-m", "hatch_vllm_patch", *args], cwd=cwd, env=env,
               check=False)
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc


def commands(project: Path, catalog: Path
             ) -> list[tuple[list[str], dict[str, str], int | None]]:
    """(arguments, extra environment, expected exit code) of every command that starts a
    helper: the environment probe, _purelib, the binding probe, probe.py, check's import."""
    python = str(project / ".venv" / "bin" / "python")
    named = {"HATCH_VLLM_PATCH_CATALOG": str(catalog)}
    return [
        (["status", "--python", python], {}, 0),
        (["apply", "--python", python], {}, None),  # no selection: the carried path (_purelib)
        (["apply", "--project", str(project)], {}, 0),
        (["verify", "--project", str(project)], {}, 0),
        (["verify", "--python", python, "--patch", "demo-fix"], named, 0),
        (["verify", "--deep", "--project", str(project)], {}, 0),  # its probe.py
        (["verify", "--deep", "--python", python, "--patch", "demo-fix"], named, 0),  # binding
        (["check", str(project / "vllm-patches"), "--python", python], {}, 0),
        (["update", "demo-fix", "--project", str(project)], {}, None),
    ]


@needs_root
def test_shadows_in_the_working_directory_never_load(planted: tuple[Path, Path], project: Path,
                                                     tmp_path: Path) -> None:
    """In a folder of the other user with shadows of json, sysconfig, re, pip, site, ...:
    status, apply, verify (--project, --python, --deep with and without probe.py), check and
    update run their helpers without importing one; the shadows are live for a plain
    ``python -c`` there."""
    folder, markers = planted
    python = project / ".venv" / "bin" / "python"
    live = subprocess.run([str(python), "-c", "import json"], cwd=folder, check=False,
                          capture_output=True)
    assert live.returncode == 0 and (markers / "json").exists(), "the shadows do not load"
    (markers / "json").unlink()
    catalog = write_demo_catalog(tmp_path / "catalog")
    for args, env, code in commands(project, catalog):
        proc = vp(*args, cwd=folder, env=env)
        if code is not None:
            assert proc.returncode == code, (args, proc.stdout, proc.stderr)
        assert not list(markers.iterdir()), (args, sorted(p.name for p in markers.iterdir()))
    deep = vp("verify", "--deep", "--project", str(project), cwd=folder)
    assert "compute([]) is 0" in deep.stdout, deep.stdout
    binding = vp("verify", "--deep", "--python", str(python), "--patch", "demo-fix", cwd=folder,
                 env={"HATCH_VLLM_PATCH_CATALOG": str(catalog)})
    assert "(no probe.py: the binding check)" in binding.stdout, binding.stdout
    checked = vp("check", str(project / "vllm-patches"), "--python", str(python), cwd=folder)
    assert "probe.py imports in" in checked.stdout, checked.stdout
    assert not list(markers.iterdir())


@needs_root
def test_python_variables_never_reach_a_helper(planted: tuple[Path, Path], project: Path,
                                               tmp_path: Path) -> None:
    """PYTHONPATH and PYTHONSTARTUP naming the other user's folder reach no helper of any
    command: nothing of theirs is imported."""
    folder, markers = planted
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    hostile = {"PYTHONPATH": str(folder), "PYTHONSTARTUP": str(folder / "startup.py")}
    python = project / ".venv" / "bin" / "python"
    live = subprocess.run([str(python), "-c", "import sysconfig"], cwd=elsewhere, check=False,
                          capture_output=True, env={**os.environ, **hostile})
    assert live.returncode == 0
    found = {p.name for p in markers.iterdir()}
    assert {"sysconfig", "sitecustomize"} <= found, f"PYTHONPATH loads no shadow: {found}"
    for mark in markers.iterdir():
        mark.unlink()
    catalog = write_demo_catalog(tmp_path / "catalog")
    for args, env, code in commands(project, catalog):
        proc = vp(*args, cwd=elsewhere, env={**env, **hostile})
        if code is not None:
            assert proc.returncode == code, (args, proc.stdout, proc.stderr)
        assert not list(markers.iterdir()), (args, sorted(p.name for p in markers.iterdir()))


@needs_root
def test_pip_and_doctor_helpers_are_isolated(planted: tuple[Path, Path], project: Path,
                                             tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The wheel download's ``python -m pip`` and doctor's probe, started in the other user's
    folder with PYTHONPATH naming it, import neither their pip nor their json; doctor's probe
    still gets the paths its caller adds on purpose (a benchmark's stand-in packages)."""
    from hatch_vllm_patch import doctor, wheels
    from hatch_vllm_patch.errors import TargetEnvironmentError

    folder, markers = planted
    python = project / ".venv" / "bin" / "python"
    monkeypatch.chdir(folder)
    monkeypatch.setenv("PYTHONPATH", str(folder))
    monkeypatch.setenv(wheels.WHEEL_CACHE_ENV, str(tmp_path / "wheels"))
    monkeypatch.setattr(wheels.shutil, "which", lambda name: None)  # no uv: pip or nothing
    with pytest.raises(TargetEnvironmentError, match="could not be downloaded"):
        wheels.release_wheel("demo-pkg", "1.0.0", python)
    assert not list(markers.iterdir()), sorted(p.name for p in markers.iterdir())

    stand_ins = tmp_path / "stand-ins"
    for name in ("torch", "vllm"):
        (stand_ins / name).mkdir(parents=True)
        (stand_ins / name / "__init__.py").write_text('__version__ = "0.0-stand-in"\n')
    answer = doctor.run_child(python, {"cases": [], "variants": []}, timeout=120,
                              extra_paths=[stand_ins])
    assert answer == {"vllm": "0.0-stand-in", "torch": "0.0-stand-in", "cases": []}
    with pytest.raises(TargetEnvironmentError, match="No module named 'torch'"):
        doctor.run_child(python, {"cases": [], "variants": []}, timeout=120)
    assert not list(markers.iterdir()), sorted(p.name for p in markers.iterdir())
    proc = vp("doctor", "--model", str(MODEL), "--python", str(python), "--json", cwd=folder)
    assert proc.returncode == 1 and "vllm is not installed" in json.loads(proc.stdout)[
        "errors"][0]
    assert not list(markers.iterdir())
