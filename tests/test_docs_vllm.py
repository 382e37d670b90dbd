"""The docs' examples that need vLLM (the slow tier of tests/test_docs.py): the route of
docs/how-to/cpu-build.md to vLLM 0.33 on a CPU-only machine, followed as a new user would.

The page's ``<!-- example-vllm-project: NAME -->`` toml block is the downstream project's whole
``pyproject.toml`` (the doc and the test cannot drift): the test writes it to a fresh folder, points
its ``find-links`` at this machine's local wheels and its ``hatch-vllm-patch`` at this checkout's
wheel, runs the real ``uv lock`` and ``uv sync`` (uv's cache is warm from the other slow tests),
and runs the page's ``<!-- example-vllm: NAME -->`` console examples there, in page order,
comparing what they print (stdout and stderr as a terminal shows them) with what the page shows.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
from support import REPO
from support.console_examples import SHOWN_REPO, SHOWN_WORKDIR, commands
from support.venvs import UV, local_wheels, run, scrubbed_environ, site_packages

pytestmark = pytest.mark.slow

PAGE = REPO / "docs" / "how-to" / "cpu-build.md"
SETUP = "cpu-0.33"
# The shown find-links folder, and the wheel it must hold (cp311: the block's requires-python).
SHOWN_WHEELS = "/opt/wheels"
CPU_TORCH = "torch-2.13.0+cpu-cp311-cp311-*.whl"
# The example project's Qwen3.6-like model, which the page copies into the project.
MODEL = REPO / "example_project" / "models" / "qwen3.6-finetune"
PROJECT = re.compile(
    r"<!-- example-vllm-project: (?P<setup>[\w.-]+) -->\n```toml\n(?P<body>.*?)```", re.S)
EXAMPLE = re.compile(
    r"<!-- example-vllm: (?P<setup>[\w.-]+) -->\n```console\n(?P<body>.*?)\n```", re.S)


def test_cpu_route_for_0_33(tmp_path: Path, project_wheel: Path) -> None:
    """The page's pyproject.toml locks and syncs vLLM 0.33.0 with the CPU torch and without
    torchvision; its doctor examples on a Qwen3.6-like model print what the page shows: the
    failed import named with its fix, then with the stand-in torchvision the diagnosis."""
    text = PAGE.read_text(encoding="utf-8")
    blocks = [m["body"] for m in PROJECT.finditer(text) if m["setup"] == SETUP]
    examples = [m["body"] for m in EXAMPLE.finditer(text) if m["setup"] == SETUP]
    assert len(blocks) == 1 and len(examples) >= 1, (blocks, examples)
    wheels = local_wheels()
    if not any(wheels.glob(CPU_TORCH)):
        pytest.skip(f"no {CPU_TORCH} in {wheels} (pip's find-links or "
                    "$HATCH_VLLM_PATCH_LOCAL_WHEELS), which the page's find-links names")

    project = tmp_path / "my-service"
    project.mkdir()
    pyproject = blocks[0]
    assert f'find-links = ["{SHOWN_WHEELS}"]' in pyproject
    pyproject = pyproject.replace(f'find-links = ["{SHOWN_WHEELS}"]',
                                  f'find-links = ["{wheels}"]')
    # hatch-vllm-patch from PyPI on the page, this checkout's wheel here
    pyproject += f'\n[tool.uv.sources]\nhatch-vllm-patch = {{ path = "{project_wheel}" }}\n'
    (project / "pyproject.toml").write_text(pyproject)
    shutil.copytree(MODEL, project / "models" / MODEL.name)
    (project / ".git").mkdir()  # the project search stops here

    # A new user's vLLM cache: vLLM keeps what it learnt inspecting a model class
    # (<VLLM_CACHE_ROOT>/modelinfos) and then skips the import, so after an inspection that
    # succeeded (another test, the stand-in below) a missing torchvision fails later and
    # differently (at `platform`, not `config`; measured).
    env = {"UV_LINK_MODE": "hardlink", "COLUMNS": "80", "NO_COLOR": "1",
           "VLLM_CACHE_ROOT": str(tmp_path / "vllm-cache")}
    run([UV, "lock"], cwd=project, env=env, timeout=600)
    run([UV, "sync"], cwd=project, env=env, timeout=1800)

    lock = (project / "uv.lock").read_text()
    for name in ("torchvision", "torchaudio", "torchcodec"):
        assert f'name = "{name}"\n' not in lock, name
    sp = site_packages(project / ".venv")
    assert [p.name for p in sp.glob("torch-*.dist-info")] == ["torch-2.13.0+cpu.dist-info"]
    assert [p.name for p in sp.glob("vllm-*.dist-info")] == ["vllm-0.33.0.dist-info"]
    for name in ("torchvision", "torchaudio", "torchcodec"):
        assert not list(sp.glob(f"{name}*")), name

    printed = []
    for body in examples:
        for cmd, shown in commands(body):
            argv = shlex.split(cmd.replace(SHOWN_REPO, str(REPO)))
            # the page's copy of the stand-in torchvision (from this checkout), or vllm-patch
            assert argv[0] == "cp" or argv[:3] == ["uv", "run", "vllm-patch"], cmd
            if argv[0] == "uv":
                argv[0] = UV
            proc = subprocess.run(argv, cwd=project, env={**scrubbed_environ(), **env},
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  timeout=900, check=False)
            got = proc.stdout.replace(str(project.resolve()), SHOWN_WORKDIR)
            got = got.replace(str(REPO), SHOWN_REPO)
            got = "\n".join(line.rstrip() for line in got.strip().splitlines())
            assert got == shown.strip(), (f"{PAGE.name}: `{cmd}` printed something else "
                                          f"(exit {proc.returncode}); update the page or the "
                                          f"code:\n{got}")
            printed.append((argv[0], proc.returncode, got))
    # What the page must keep showing: without torchvision doctor names the import and its fix
    # (exit 1); with the stand-in it diagnoses the model (exit 0).
    doctors = [(code, got) for what, code, got in printed if what == UV]
    assert [code for code, _ in doctors] == [1, 0], doctors
    assert "`import torchvision` fails" in doctors[0][1] and "Fix: " in doctors[0][1]
    assert "verdict: starts as installed" in doctors[1][1]
