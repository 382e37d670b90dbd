"""Carry your own fix: `edit` / `create` / `new` / `check` on a real wheel in a real venv (fast)
and on real vLLM code (slow: a method using super(), a property, a function; a spawn child runs
the edited code; another release says unknown-shape; a module-level edit is refused)."""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from support import REPO
from support.commands import pristine_environment
from support.venvs import UV, create_venv, record_sha256, release_venv, run, site_packages

from hatch_vllm_patch.authoring import (
    InexpressibleEdit,
    captured_references,
    render_rebinding_block,
    symbol_changes,
)

MODULE_SOURCE = textwrap.dedent('''\
    """A module with the shapes a fix touches."""

    import functools

    REGISTRY = {}


    def register(fn):
        REGISTRY[fn.__name__] = fn
        return fn


    def compute(values):
        """Return the largest value."""
        if not values:
            raise NotImplementedError("empty")
        return max(values)


    @register
    def handler(x):
        return x


    DISPATCH = {"compute": compute}


    class Base:
        def greet(self):
            return "base"

        @property
        def name(self):
            return "base"


    class Child(Base):
        __secret = 1
        kind = "child"

        def greet(self):
            return "child of " + super().greet()

        def secret(self):
            return self.__secret

        @staticmethod
        def double(x):
            return x * 2

        @classmethod
        def make(cls):
            return cls()

        @property
        def name(self):
            return "child of " + super().name

        @functools.cache
        def cached(self):
            return "cached " + super().greet()

        async def co(self):
            return "co"
    ''')

EXTRA_SOURCE = textwrap.dedent('''\
    """A second module, for patches over several modules."""

    import logging

    logger = logging.getLogger(__name__)


    def limit():
        return 10


    def describe(values):
        logger.debug("describing")
        return f"{len(values)} of {limit()}"
    ''')

EDITS = {
    "compute": ('        raise NotImplementedError("empty")', "        return 0"),
    "Child.greet": ('return "child of " + super().greet()',
                    'return "patched child of " + super().greet()'),
    "Child.secret": ("return self.__secret", "return self.__secret + 41"),
    "Child.double": ("return x * 2", "return x * 3"),
    "Child.make": ("return cls()", "return [cls()]"),
    "Child.name": ('return "child of " + super().name', 'return "patched " + super().name'),
    "Child.cached": ('return "cached " + super().greet()', 'return "cached! " + super().greet()'),
    "Child.co": ('return "co"', 'return "co patched"'),
}


def edited_source(*symbols: str) -> str:
    text = MODULE_SOURCE
    for symbol in symbols:
        old, new = EDITS[symbol]
        assert text.count(old) == 1, symbol
        text = text.replace(old, new)
    return text


def run_block(source: str, block: str) -> dict[str, Any]:
    """Run the module, then the block in its namespace (as the appended block runs); the
    module's classes stay the same objects."""
    namespace: dict[str, Any] = {"__name__": "demo"}
    exec(compile(source, "demo.py", "exec"), namespace)
    classes = {k: v for k, v in namespace.items() if isinstance(v, type)}
    exec(compile(block, "block.py", "exec"), namespace)
    assert all(namespace[k] is v for k, v in classes.items()), "a class was rebound"
    return namespace


# --- the rebinding block, judged by what the edited source would do -----------------------------

def test_block_behaves_like_the_edited_source_in_the_class() -> None:
    """super() (plain, property, functools.cache), name mangling, staticmethod, classmethod and
    async def: the patched module behaves exactly as the edited module does."""
    edited = edited_source(*EDITS)
    changes = symbol_changes(MODULE_SOURCE, edited, "demo")
    assert sorted(c.symbol for c in changes) == sorted(EDITS)
    patched = run_block(MODULE_SOURCE,
                        render_rebinding_block("demo-fix", "demo", "demo 1.0", changes))
    expected: dict[str, Any] = {"__name__": "demo"}
    exec(compile(edited, "demo.py", "exec"), expected)
    for ns in (patched, expected):
        child = ns["Child"]()
        ns["facts"] = (ns["compute"]([]), child.greet(), child.secret(), ns["Child"].double(2),
                       type(ns["Child"].make()).__name__, child.name, child.cached(),
                       asyncio.run(child.co()), ns["Child"].greet.__qualname__)
    assert patched["facts"] == expected["facts"] == (
        0, "patched child of base", 42, 6, "list", "patched base", "cached! base", "co patched",
        "Child.greet")


def test_block_run_twice_is_the_same() -> None:
    """Re-running a created block (apply mode in a process that imported the module) redefines
    the same code: the behaviour is unchanged, nothing is wrapped twice."""
    edited = edited_source("Child.greet", "compute")
    block = render_rebinding_block("demo-fix", "demo", "demo 1.0",
                         symbol_changes(MODULE_SOURCE, edited, "demo"))
    namespace = run_block(MODULE_SOURCE, block)
    exec(compile(block, "block.py", "exec"), namespace)
    assert namespace["Child"]().greet() == "patched child of base"
    assert namespace["compute"]([]) == 0


def test_added_method_and_function_are_rebound() -> None:
    """A method and a function the edit adds are defined; multi-line strings keep their text."""
    edited = MODULE_SOURCE.replace(
        '    async def co(self):\n        return "co"\n',
        '    async def co(self):\n        return "co"\n\n    def helper(self):\n'
        '        """Added:\n  a line at column 2."""\n        return self.double(21)\n',
    ) + "\n\ndef extra():\n    return 'extra'\n"
    changes = symbol_changes(MODULE_SOURCE, edited, "demo")
    assert [(c.symbol, c.added) for c in changes] == [("extra", True), ("Child.helper", True)]
    namespace = run_block(MODULE_SOURCE, render_rebinding_block("demo-fix", "demo", "v", changes))
    assert namespace["Child"]().helper() == 42 and namespace["extra"]() == "extra"
    assert namespace["Child"].helper.__doc__ == "Added:\n  a line at column 2."


@pytest.mark.parametrize("edit, problem", [
    (("REGISTRY = {}", "REGISTRY = {'x': 1}"), "module level: statement at line 5 changed"),
    (("import functools\n", "import functools\nimport os as REGISTRY\n"),
     "statement at line 4 added (import os as REGISTRY): REGISTRY is already defined"),
    (('    kind = "child"', '    kind = "child"\n    extra = 1'),
     "class Child: statement at line 40 added"),
    (("REGISTRY = {}\n", "REGISTRY = {}\nREGISTRY['x'] = 1\n"),
     "module level: statement at line 6 added"),
    (('    kind = "child"', '    kind = "other"'), "class Child: statement at line 39 changed"),
    (("def handler(x):", "def handle(x):"), "handler was removed or renamed"),
    (("    def secret(self):\n        return self.__secret\n\n", ""),
     "Child.secret was removed or renamed"),
    (("class Child(Base):", "class Child(Base, object):"), "class Child: its bases"),
    (("class Base:", "class Bass:"), "class Base was removed or renamed"),
])
def test_changes_a_rebinding_cannot_carry_are_refused(edit: tuple[str, str],
                                                      problem: str) -> None:
    """Module-level statements, class attributes, removed or renamed symbols, class headers:
    refused, each named, alongside any expressible change."""
    edited = edited_source("compute").replace(*edit)
    with pytest.raises(InexpressibleEdit) as info:
        symbol_changes(MODULE_SOURCE, edited, "demo")
    assert any(problem in p for p in info.value.problems), info.value.problems
    assert "nothing was written" in str(info.value)


def test_added_imports_names_and_classes_are_carried_in_order() -> None:
    """An import, a new constant and a new class the edit adds go into the block before the
    functions that use them, in the edited file's order; they are not rebound symbols."""
    edited = edited_source().replace("import functools\n", "import functools\nimport os\n")
    edited = edited.replace("REGISTRY = {}\n", "REGISTRY = {}\nLIMIT = 3\n\n\nclass Box:\n"
                            "    size = LIMIT\n")
    edited = edited.replace('        raise NotImplementedError("empty")',
                            '        return Box.size + len(os.sep)')
    changes = symbol_changes(MODULE_SOURCE, edited, "demo")
    assert [(c.symbol, c.binds) for c in changes] == [
        ("os", ("os",)), ("LIMIT", ("LIMIT",)), ("Box", ("Box",)), ("compute", ())]
    namespace = run_block(MODULE_SOURCE, render_rebinding_block("demo-fix", "demo", "v", changes))
    assert namespace["compute"]([]) == 4 and namespace["LIMIT"] == 3


def test_unresolved_names_are_named_with_their_line() -> None:
    """A name a block's function reads that neither the module, the block nor the builtins
    define is found (with its line); module globals, block names and builtins are not."""
    from hatch_vllm_patch.authoring.symbols import unresolved_names

    block = textwrap.dedent("""\
        import os as _hvp_os


        def compute(values):
            if not values:
                loggr.info("empty")
            return max(REGISTRY or values, key=len) if _hvp_os.sep else functools.reduce(values)
        """)
    assert unresolved_names(block, MODULE_SOURCE) == [(6, "loggr")]
    assert unresolved_names(block.replace("loggr", "Child"), MODULE_SOURCE) == []


def test_captured_references_are_warned_with_their_line() -> None:
    """A dispatch table and a registering decorator captured what the block rebinds."""
    edited = edited_source("compute").replace("    return x\n", "    return -x\n", 1)
    warnings = captured_references(MODULE_SOURCE, symbol_changes(MODULE_SOURCE, edited, "demo"))
    assert [w.split(" (")[0] for w in warnings] == ["line 25 captures compute at import time"]
    assert all("keeps the original" in w for w in warnings)


def test_capture_by_a_module_level_name() -> None:
    """A module-level table that holds a changed function is named with its line (the
    function's own decorators need no warning: the block applies them again)."""
    source = MODULE_SOURCE.replace("DISPATCH = {\"compute\": compute}\n",
                                   "DISPATCH = {\"h\": handler}\n")
    edited = source.replace("def handler(x):\n    return x\n", "def handler(x):\n    return -x\n")
    warnings = captured_references(source, symbol_changes(source, edited, "demo"))
    assert [w.split(" (")[0] for w in warnings] == ["line 25 captures handler at import time"]


# --- the commands on a real wheel in a real venv -------------------------------------------------

@pytest.fixture(scope="module")
def demo_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    project = tmp_path_factory.mktemp("demo-src")
    (project / "demo_pkg").mkdir()
    (project / "demo_pkg" / "__init__.py").write_text("")
    (project / "demo_pkg" / "core.py").write_text(MODULE_SOURCE)
    (project / "demo_pkg" / "extra.py").write_text(EXTRA_SOURCE)
    (project / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["hatchling"]\nbuild-backend = "hatchling.build"\n'
        '[project]\nname = "demo-pkg"\nversion = "1.0.0"\n')
    out = tmp_path_factory.mktemp("demo-wheel")
    run([UV, "build", "--wheel", "--quiet", "--out-dir", str(out), str(project)])
    return next(out.glob("*.whl"))


def build_demo_wheel(tmp_path_factory: pytest.TempPathFactory, version: str,
                     extra: str) -> Path:
    """A wheel of demo-pkg ``version``: core as in 1.0.0, ``extra`` as given."""
    project = tmp_path_factory.mktemp(f"demo-src-{version}")
    (project / "demo_pkg").mkdir()
    (project / "demo_pkg" / "__init__.py").write_text("")
    (project / "demo_pkg" / "core.py").write_text(MODULE_SOURCE)
    (project / "demo_pkg" / "extra.py").write_text(extra)
    (project / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["hatchling"]\nbuild-backend = "hatchling.build"\n'
        f'[project]\nname = "demo-pkg"\nversion = "{version}"\n')
    out = tmp_path_factory.mktemp(f"demo-wheel-{version}")
    run([UV, "build", "--wheel", "--quiet", "--out-dir", str(out), str(project)])
    return next(out.glob("*.whl"))


# The next releases of the second module: 1.1.0 changes limit() and the log line of describe();
# 1.2.0 changes describe()'s result line; 1.3.0 has the fix of `carry-fix` itself.
PATCHED_LINE = ('    return f"{len(values)} of {limit()}"',
                '    return f"{len(values)} out of {limit()}"')
EXTRA_RELEASES = {
    "1.1.0": EXTRA_SOURCE.replace("return 10", "return 10 + 0").replace(
        'logger.debug("describing")', 'logger.debug("describing %d", len(values))'),
    "1.2.0": EXTRA_SOURCE.replace(PATCHED_LINE[0], '    return f"{len(values)}/{limit()}"'),
    "1.3.0": EXTRA_SOURCE.replace(*PATCHED_LINE),
}


@pytest.fixture(scope="module")
def demo_releases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {v: build_demo_wheel(tmp_path_factory, v, text) for v, text in EXTRA_RELEASES.items()}


@pytest.fixture(scope="module")
def demo_wheel_changed(demo_releases: dict[str, Path]) -> Path:
    """demo-pkg 1.1.0: core as in 1.0.0, ``extra.limit`` changed."""
    return demo_releases["1.1.0"]


def vp(*args: str, cwd: Path, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "HATCH_VLLM_PATCH_CATALOG"}
    return subprocess.run([sys.executable, "-m", "hatch_vllm_patch", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600, check=False,
                          input=stdin)


@pytest.fixture
def session(tmp_path: Path, demo_wheel: Path) -> tuple[Path, Path, Path]:
    """(python, project, installed module file): a venv with the demo wheel (hardlinked from
    uv's cache) and a project with an empty [tool.vllm-patch]."""
    python = create_venv(tmp_path / "venv", str(demo_wheel))
    project = tmp_path / "serve"
    project.mkdir()
    (project / "pyproject.toml").write_text('[project]\nname = "serve"\nversion = "0"\n\n'
                                            "[tool.vllm-patch]\n")
    return python, project, site_packages(tmp_path / "venv") / "demo_pkg" / "core.py"


def test_edit_create_cycle(session: tuple[Path, Path, Path]) -> None:
    """edit prints the file (now its own inode), create writes the folder, restores the
    pristine bytes and applies; verify passes; revert gives RECORD's bytes back."""
    python, project, target = session
    sp = target.parent.parent
    assert target.stat().st_nlink >= 2, "not hardlinked from uv's cache: the test proves nothing"
    cached_inode = target.stat().st_ino
    opened = vp("edit", "demo_pkg.core", "--python", str(python), cwd=project)
    assert opened.returncode == 0, opened.stderr
    assert Path(opened.stdout.strip()) == target
    assert target.stat().st_ino != cached_inode and target.stat().st_nlink == 1
    target.write_text(edited_source("compute", "Child.greet"))  # in place, like an editor

    made = vp("create", "demo-fix", "--python", str(python), "--summary", "Zero for nothing",
              cwd=project, stdin="")
    assert made.returncode == 0, made.stdout + made.stderr
    assert "created" in made.stdout and "redefines compute, Child.greet" in made.stdout
    assert "warning: demo_pkg.core: line 25 captures compute" in made.stdout
    folder = project / "vllm-patches" / "demo-fix"
    assert sorted(p.name for p in folder.iterdir()) == ["base", "block.py", "patch.toml"]
    content = target.read_bytes()
    assert content.startswith(MODULE_SOURCE.encode())
    assert hashlib.sha256(MODULE_SOURCE.encode()).hexdigest() == record_sha256(
        sp, "demo-pkg", "demo_pkg/core.py")
    assert b"# >>> hatch-vllm-patch: demo-fix sha256=" in content

    (project / "pyproject.toml").write_text(
        '[project]\nname = "serve"\nversion = "0"\n\n[tool.vllm-patch]\npatches = ["demo-fix"]\n')
    verified = vp("verify", "--python", str(python), cwd=project)
    assert verified.returncode == 0, verified.stdout
    assert "[tool.vllm-patch] patches (for every model served)" in verified.stdout
    behaviour = run([str(python), "-c", "import demo_pkg.core as m; "
                     "print(m.compute([]), m.Child().greet())"])
    assert behaviour.stdout.split() == ["0", "patched", "child", "of", "base"]
    status = vp("status", "-v", "--python", str(python), cwd=project)
    assert "summary: Zero for nothing" in status.stdout

    reverted = vp("revert", "--python", str(python), cwd=project)
    assert reverted.returncode == 0, reverted.stdout
    assert target.read_text() == MODULE_SOURCE
    # nothing of ours is left: no record, no lock, no edits folder
    assert not {".hatch-vllm-patch.json", ".hatch-vllm-patch.lock",
                ".hatch-vllm-patch-edits"} & {p.name for p in sp.iterdir()}


def test_create_in_a_project_without_the_table(session: tuple[Path, Path, Path]) -> None:
    """Without [tool.vllm-patch], create writes vllm-patches/ID, adds the table with
    patches = [ID] to pyproject.toml (the rest of the file as it was) and applies it as the
    project's: verify from the project passes."""
    python, project, target = session
    (project / "pyproject.toml").write_text('[project]\nname = "serve"  # ours\nversion = "0"\n')
    vp("edit", "demo_pkg.core", "--python", str(python), cwd=project)
    target.write_text(edited_source("compute"))
    made = vp("create", "demo-fix", "--python", str(python), cwd=project, stdin="")
    assert made.returncode == 0, made.stdout + made.stderr
    assert f"selected it in {project / 'pyproject.toml'}" in made.stdout, made.stdout
    assert "next: fill in the TODOs" in made.stdout and "commit the folder and pyproject.toml" \
        in made.stdout
    assert (project / "pyproject.toml").read_text() == (
        '[project]\nname = "serve"  # ours\nversion = "0"\n\n[tool.vllm-patch]\n'
        'patches = ["demo-fix"]\n')
    assert (project / "vllm-patches" / "demo-fix" / "block.py").is_file()
    assert "# >>> hatch-vllm-patch: demo-fix" in target.read_text()
    assert vp("verify", "--python", str(python), cwd=project).returncode == 0


def test_create_refuses_a_module_level_edit_and_writes_nothing(
        session: tuple[Path, Path, Path]) -> None:
    """An edit of a module-level statement is refused, naming it; no folder, the edit stays."""
    python, project, target = session
    vp("edit", "demo_pkg.core", "--python", str(python), cwd=project)
    edited = edited_source("compute").replace("REGISTRY = {}", "REGISTRY = {'a': 1}")
    target.write_text(edited)
    made = vp("create", "demo-fix", "--python", str(python), cwd=project, stdin="")
    assert made.returncode == 2 and "Traceback" not in made.stderr
    assert "module level: statement at line 5 changed (REGISTRY = {'a': 1})" in made.stderr
    assert not (project / "vllm-patches" / "demo-fix").exists()
    assert target.read_text() == edited
    discarded = vp("edit", "demo_pkg.core", "--discard", "--python", str(python), cwd=project)
    assert discarded.returncode == 0 and target.read_text() == MODULE_SOURCE


def test_edit_takes_our_blocks_out_and_create_puts_them_back(
        session: tuple[Path, Path, Path], tmp_path: Path) -> None:
    """A file already patched: edit removes our block first; create re-applies it beside the new
    patch; a file that differs from RECORD cannot be opened for editing."""
    python, project, target = session
    vp("edit", "demo_pkg.core", "--python", str(python), cwd=project)
    target.write_text(edited_source("compute"))
    assert vp("create", "fix-one", "--python", str(python), cwd=project,
              stdin="").returncode == 0
    opened = vp("edit", "demo_pkg.core", "--python", str(python), cwd=project)
    assert "took out fix-one" in opened.stderr
    assert target.read_text() == MODULE_SOURCE
    target.write_text(edited_source("Child.double"))
    made = vp("create", "fix-two", "--python", str(python), cwd=project, stdin="")
    assert made.returncode == 0, made.stdout + made.stderr
    blocks = [line.split()[3] for line in target.read_text().splitlines()
              if line.startswith("# >>> hatch-vllm-patch:")]
    assert blocks == ["fix-one", "fix-two"]
    os.unlink(target)
    target.write_text(MODULE_SOURCE + "# a hand edit\n")
    refused = vp("edit", "demo_pkg.core", "--python", str(python), cwd=project)
    assert refused.returncode == 2 and "must start from the pristine file" in refused.stderr


def test_create_usage_errors(session: tuple[Path, Path, Path]) -> None:
    """No edit open, a built-in id, a bad id: one clear line each, exit 2, nothing written."""
    python, project, _ = session
    for args, message in ((["create", "demo-fix"], "no module is open for editing"),
                          (["create", "kv-cache-page-unification"], "is already a patch"),
                          (["create", "Demo_Fix"], "a patch id is kebab-case")):
        proc = vp(*args, "--python", str(python), cwd=project, stdin="")
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert not (project / "vllm-patches").exists()


def test_two_modules_make_one_patch_applied_and_reverted_together(
        session: tuple[Path, Path, Path], demo_wheel_changed: Path, tmp_path: Path) -> None:
    """Two modules open for editing become one patch ([[targets]]); apply writes both, verify
    passes, an open edit is `editing` (exit 1, never a reinstall); revert restores both; when
    one module has a shape the patch does not know, apply writes to neither."""
    python, project, core = session
    extra = core.parent / "extra.py"
    for module in ("demo_pkg.core", "demo_pkg.extra"):
        assert vp("edit", module, "--python", str(python), cwd=project).returncode == 0
    core.write_text(edited_source("compute"))
    extra.write_text(EXTRA_SOURCE.replace("return 10", "return 20"))
    made = vp("create", "two-fix", "--python", str(python), cwd=project, stdin="")
    assert made.returncode == 0, made.stdout + made.stderr
    folder = project / "vllm-patches" / "two-fix"
    assert sorted(p.name for p in folder.iterdir()) == [
        "base", "demo_pkg.core.py", "demo_pkg.extra.py", "patch.toml"]
    assert (folder / "patch.toml").read_text().count("[[targets]]") == 2
    assert "# >>> hatch-vllm-patch: two-fix" in core.read_text()
    assert "# >>> hatch-vllm-patch: two-fix" in extra.read_text()
    (project / "pyproject.toml").write_text(
        '[project]\nname = "serve"\nversion = "0"\n\n[tool.vllm-patch]\npatches = ["two-fix"]\n')
    verified = vp("verify", "--python", str(python), cwd=project)
    assert verified.returncode == 0, verified.stdout
    assert verified.stdout.count("two-fix") == 1, verified.stdout  # one patch, one verdict
    assert "target demo_pkg.core: applied: " in verified.stdout
    assert "target demo_pkg.extra: applied: " in verified.stdout
    deep = vp("verify", "--deep", "--python", str(python), cwd=project)
    assert deep.returncode == 0, deep.stdout
    assert "deep probe passed: imported demo_pkg.core, demo_pkg.extra; 2 symbol(s) are the " \
        "block's" in deep.stdout, deep.stdout
    behaviour = run([str(python), "-c", "import demo_pkg.core as c, demo_pkg.extra as e; "
                     "print(c.compute([]), e.describe([1]))"])
    assert behaviour.stdout.split() == ["0", "1", "of", "20"]

    assert vp("edit", "demo_pkg.extra", "--python", str(python), cwd=project).returncode == 0
    editing = vp("verify", "--python", str(python), cwd=project)
    assert editing.returncode == 1 and "editing" in editing.stdout, editing.stdout
    assert "--reinstall" not in editing.stdout and "edit demo_pkg.extra --discard" in \
        editing.stdout
    assert vp("edit", "demo_pkg.extra", "--discard", "--python", str(python),
              cwd=project).returncode == 0

    reverted = vp("revert", "--python", str(python), cwd=project)
    assert reverted.returncode == 0, reverted.stdout
    assert core.read_text() == MODULE_SOURCE and extra.read_text() == EXTRA_SOURCE

    os.unlink(extra)  # a hand edit of the second module
    extra.write_text(EXTRA_SOURCE.replace("return 10", "return 11"))
    refused = vp("apply", "--python", str(python), cwd=project)
    assert refused.returncode == 1, refused.stdout
    assert "modified  two-fix: modified in demo_pkg.extra (" in refused.stdout and \
        "nothing written to any of its modules" in refused.stdout
    assert refused.stdout.count("two-fix:") == 1, refused.stdout  # one patch, one verdict
    assert core.read_text() == MODULE_SOURCE

    newer = create_venv(tmp_path / "newer", str(demo_wheel_changed))  # extra.limit changed
    newer_core = site_packages(tmp_path / "newer") / "demo_pkg" / "core.py"
    unknown = vp("apply", "--python", str(newer), cwd=project)
    assert unknown.returncode == 1, unknown.stdout
    assert unknown.stdout.count("unknown-shape  two-fix") == 1, unknown.stdout
    assert "target demo_pkg.extra: unknown-shape: " in unknown.stdout, unknown.stdout
    assert newer_core.read_text() == MODULE_SOURCE
    assert "hatch-vllm-patch" not in (newer_core.parent / "extra.py").read_text()


def test_create_refuses_a_typo_and_check_names_its_line(
        session: tuple[Path, Path, Path], tmp_path: Path) -> None:
    """A misspelt global (`loggr`) in an edited function is refused by create, naming the
    line, nothing written; a block carrying one fails `check` with its line."""
    python, project, core = session
    extra = core.parent / "extra.py"
    vp("edit", "demo_pkg.extra", "--python", str(python), cwd=project)
    typo = EXTRA_SOURCE.replace('logger.debug("describing")', 'loggr.debug("describing")')
    extra.write_text(typo)
    refused = vp("create", "typo-fix", "--python", str(python), cwd=project, stdin="")
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert "line 13 reads 'loggr'" in refused.stderr, refused.stderr
    assert not (project / "vllm-patches" / "typo-fix").exists()
    assert extra.read_text() == typo
    extra.write_text(EXTRA_SOURCE.replace("return 10", "return 12"))
    made = vp("create", "good-fix", "--python", str(python), cwd=project, stdin="")
    assert made.returncode == 0, made.stdout + made.stderr
    block = project / "vllm-patches" / "good-fix" / "block.py"
    block.write_text("def limit():\n    return loggr.level\n")  # a hand-written block
    checked = vp("check", "--python", str(python), cwd=project)
    assert checked.returncode == 1, checked.stdout
    assert f"{block}:2: reads 'loggr'" in checked.stdout, checked.stdout


def _git_diff(files: dict[str, tuple[str, str]]) -> str:
    """A `git diff` of ``files`` (path -> (old, new)), paths relative to the repository."""
    import difflib

    out = []
    for path, (old, new) in files.items():
        out.append(f"diff --git a/{path} b/{path}\nindex 0000000..1111111 100644\n")
        out += difflib.unified_diff(old.splitlines(keepends=True), new.splitlines(keepends=True),
                                    fromfile=f"a/{path}", tofile=f"b/{path}")
    return "".join(out)


def test_create_from_a_diff(session: tuple[Path, Path, Path], tmp_path: Path) -> None:
    """A diff over two installed modules, a test and a doc: one patch (tests and docs listed as
    skipped), applied; a hunk whose context differs, a module-level change and a typo are each
    refused with nothing written."""
    python, project, core = session
    extra = core.parent / "extra.py"
    diff = _git_diff({
        "demo_pkg/core.py": (MODULE_SOURCE, edited_source("compute")),
        "demo_pkg/extra.py": (EXTRA_SOURCE, EXTRA_SOURCE.replace("return 10", "return 30")),
        "tests/test_core.py": ("", "def test():\n    pass\n"),
        "docs/index.md": ("a\n", "b\n"),
    })
    stale = diff.replace(' """Return the largest value."""', ' """Return the top value."""')
    for bad, message in (
            (stale, "hunk 1 (@@ -13,7 +13,7 @@) does not match the installed file"),
            (_git_diff({"demo_pkg/core.py": (MODULE_SOURCE, MODULE_SOURCE.replace(
                "REGISTRY = {}", "REGISTRY = {1: 2}"))}), "statement at line 5 changed"),
            (_git_diff({"demo_pkg/extra.py": (EXTRA_SOURCE, EXTRA_SOURCE.replace(
                "logger.debug", "loggr.debug"))}), "line 13 reads 'loggr'")):
        refused = vp("create", "backport", "--from-diff", "-", "--python", str(python),
                     cwd=project, stdin=bad)
        assert refused.returncode == 2 and message in refused.stderr, refused.stderr
        assert "Traceback" not in refused.stderr
        assert not (project / "vllm-patches").exists()
        assert core.read_text() == MODULE_SOURCE and extra.read_text() == EXTRA_SOURCE
    (tmp_path / "fix.diff").write_text(diff)
    made = vp("create", "backport", "--from-diff", str(tmp_path / "fix.diff"), "--python",
              str(python), cwd=project, stdin="")
    assert made.returncode == 0, made.stdout + made.stderr
    assert "skipped, not installed in" in made.stdout
    assert "tests/test_core.py, docs/index.md" in made.stdout, made.stdout
    assert "redefines compute, limit" in made.stdout
    behaviour = run([str(python), "-c", "import demo_pkg.core as c, demo_pkg.extra as e; "
                     "print(c.compute([]), e.limit())"])
    assert behaviour.stdout.split() == ["0", "30"]
    assert vp("revert", "--python", str(python), "--patch", "backport", cwd=project).returncode \
        == 0
    assert core.read_text() == MODULE_SOURCE and extra.read_text() == EXTRA_SOURCE


def changed_lines(old: str, new: str) -> list[str]:
    """The lines removed from ``old`` and added in ``new``, with their diff sign."""
    import difflib

    return [line for line in difflib.ndiff(old.splitlines(), new.splitlines())
            if line[:1] in "+-"]


def test_update_onto_later_releases(session: tuple[Path, Path, Path],
                                    demo_releases: dict[str, Path], tmp_path: Path) -> None:
    """A patch made on 1.0.0, on releases where its function changed: apply's next step names
    `vllm-patch update`; a change elsewhere in it merges cleanly (known on both, runs on both,
    probe.py kept, patch.toml edited in place: only its version and shapes change); a change
    of the patched line gives conflict markers and nothing applied, and --continue finishes; a
    release with the fix itself is not-needed, and --set-fixed-in adds just that line."""
    python, project, core = session
    extra = core.parent / "extra.py"
    vp("edit", "demo_pkg.extra", "--python", str(python), cwd=project)
    extra.write_text(EXTRA_SOURCE.replace(*PATCHED_LINE))
    assert vp("create", "carry-fix", "--python", str(python), "--summary", "Say out of",
              cwd=project, stdin="").returncode == 0
    folder = project / "vllm-patches" / "carry-fix"
    (folder / "probe.py").write_text("print('{\"ok\": true, \"detail\": \"kept\"}')\n")
    (project / "pyproject.toml").write_text('[project]\nname = "serve"\nversion = "0"\n\n'
                                            '[tool.vllm-patch]\npatches = ["carry-fix"]\n')
    manifest = folder / "patch.toml"
    lines = manifest.read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("removal = "))
    lines[at:at + 1] = ['removal = """', "When demo-pkg says 'out of'", "itself.", '"""']
    hand = "# Our fix; written by hand from here on.\n" + "\n".join(lines) + "\n"
    manifest.write_text(hand)

    def release(version: str) -> tuple[Path, Path]:
        python = create_venv(tmp_path / version, str(demo_releases[version]))
        return python, site_packages(tmp_path / version) / "demo_pkg" / "extra.py"

    def describe(python: Path) -> str:
        return run([str(python), "-c", "import demo_pkg.extra as e; print(e.describe([1]))"]
                   ).stdout.strip()

    fixed, _ = release("1.3.0")
    done = vp("update", "carry-fix", "--python", str(fixed), cwd=project)
    assert done.returncode == 0 and "not-needed  carry-fix" in done.stdout, done.stdout
    assert "--set-fixed-in" in done.stdout
    assert vp("update", "carry-fix", "--set-fixed-in", "--python", str(fixed),
              cwd=project).returncode == 0
    assert changed_lines(hand, manifest.read_text()) == ['+ fixed-in = "1.3.0"']
    hand = manifest.read_text()
    assert "not-needed" in vp("verify", "--python", str(fixed), cwd=project).stdout

    newer, _ = release("1.1.0")
    refused = vp("apply", "--python", str(newer), cwd=project)
    assert refused.returncode == 1 and "unknown-shape  carry-fix" in refused.stdout
    assert f"next: carry it to demo-pkg 1.1.0: run `vllm-patch update carry-fix --python " \
        f"{newer}` in {project}; it merges the patch's change" in refused.stdout, refused.stdout
    updated = vp("update", "carry-fix", "--python", str(newer), cwd=project)
    assert updated.returncode == 0, updated.stdout + updated.stderr
    edits = changed_lines(hand, manifest.read_text())
    assert edits and all(line.split()[1] in {"version", "shapes"} for line in edits), edits
    assert "merged: describe" in updated.stdout and "+    return f\"{len(values)} out of" in \
        updated.stdout
    assert describe(newer) == "1 out of 10"
    assert 'logger.debug("describing %d", len(values))' in (folder / "block.py").read_text()
    assert (folder / "probe.py").is_file() and "Say out of" in (folder / "patch.toml").read_text()
    assert vp("verify", "--python", str(newer), cwd=project).returncode == 0
    assert vp("apply", "--python", str(python), cwd=project).returncode == 0  # the old release
    assert vp("verify", "--python", str(python), cwd=project).returncode == 0
    assert describe(python) == "1 out of 10"

    conflicting, conflicting_file = release("1.2.0")
    before = conflicting_file.read_text()
    refused = vp("update", "carry-fix", "--python", str(conflicting), cwd=project)
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert "CONFLICT: describe" in refused.stdout and "nothing was applied" in refused.stdout
    text = conflicting_file.read_text()
    assert "<<<<<<< patch carry-fix\n" in text and ">>>>>>> installed demo-pkg 1.2.0\n" in text
    assert "hatch-vllm-patch:" not in text
    assert vp("verify", "--python", str(conflicting), cwd=project).stdout.count("editing") >= 1
    early = vp("update", "carry-fix", "--continue", "--python", str(conflicting), cwd=project)
    assert early.returncode == 2 and "still holds conflict markers" in early.stderr
    start, end = text.index("<<<<<<<"), text.index(">>>>>>> installed demo-pkg 1.2.0\n")
    resolved = text[:start] + '    return f"{len(values)} out of {limit()}!"\n' + \
        text[end + len(">>>>>>> installed demo-pkg 1.2.0\n"):]
    conflicting_file.write_text(resolved)
    finished = vp("create", "carry-fix", "--update", "--python", str(conflicting), cwd=project)
    assert finished.returncode == 0, finished.stdout + finished.stderr
    assert describe(conflicting) == "1 out of 10!"
    assert conflicting_file.read_text().startswith(before)


def test_update_without_a_kept_base(session: tuple[Path, Path, Path],
                                    demo_releases: dict[str, Path], tmp_path: Path) -> None:
    """A patch without base/ (made before create kept it) and without a downloadable release
    is refused with the way out; --base FILE (a pristine copy) merges it; a base that is not
    the code the patch was made on is refused."""
    python, project, core = session
    extra = core.parent / "extra.py"
    vp("edit", "demo_pkg.extra", "--python", str(python), cwd=project)
    extra.write_text(EXTRA_SOURCE.replace(*PATCHED_LINE))
    assert vp("create", "old-fix", "--python", str(python), cwd=project,
              stdin="").returncode == 0
    folder = project / "vllm-patches" / "old-fix"
    shutil.rmtree(folder / "base")
    manifest = folder / "patch.toml"
    manifest.write_text("\n".join(line for line in manifest.read_text().splitlines()
                                  if not line.startswith("version = ")) + "\n")
    newer = create_venv(tmp_path / "newer", str(demo_releases["1.1.0"]))
    refused = vp("update", "old-fix", "--python", str(newer), cwd=project)
    assert refused.returncode == 2 and "--base FILE" in refused.stderr, refused.stderr
    wrong = tmp_path / "wrong.py"
    wrong.write_text(EXTRA_RELEASES["1.2.0"])
    refused = vp("update", "old-fix", "--base", str(wrong), "--python", str(newer), cwd=project)
    assert refused.returncode == 2 and "is not code the patch knows" in refused.stderr
    pristine = tmp_path / "extra-1.0.0.py"
    pristine.write_text(EXTRA_SOURCE)
    updated = vp("update", "old-fix", "--base", str(pristine), "--python", str(newer),
                 cwd=project)
    assert updated.returncode == 0, updated.stdout + updated.stderr
    assert "merged: describe" in updated.stdout and (folder / "base").is_dir()


def test_project_patch_with_a_built_in_id_is_a_configuration_error(tmp_path: Path) -> None:
    """A project folder vllm-patches/<built-in id>: exit 2, naming both folders."""
    project = tmp_path / "serve"
    clash = project / "vllm-patches" / "kv-cache-page-unification"
    clash.mkdir(parents=True)
    for name in ("patch.toml", "block.py"):
        (clash / name).write_text((REPO / "patches" / "kv-cache-page-unification" / name)
                                  .read_text())
    (project / "pyproject.toml").write_text("[tool.vllm-patch]\n")
    proc = vp("verify", "--python", sys.executable, cwd=project)
    assert proc.returncode == 2
    assert str(clash) in proc.stderr and str(REPO / "patches" / "kv-cache-page-unification") \
        in proc.stderr and "tool.vllm-patch.patch-dir" in proc.stderr


@pytest.mark.parametrize("target, check_code", [
    ("demo_pkg.core:compute", "m.compute([3, 1])"),
    ("demo_pkg.core:Child.greet", "m.Child().greet()"),
    ("demo_pkg.core:Child.double", "m.Child.double(4)"),
    ("demo_pkg.core:Child.make", "type(m.Child.make()).__name__"),
    ("demo_pkg.core:Child.co", "__import__('asyncio').run(m.Child().co())"),
])
def test_new_scaffolds_a_wrapper_that_calls_the_original(
        session: tuple[Path, Path, Path], target: str, check_code: str) -> None:
    """new writes a wrapper (function, method, staticmethod, classmethod, async) whose block
    calls the original, kept as __wrapped__; applied, the behaviour is the original's."""
    python, project, _ = session
    proc = vp("new", "my-wrap", "--target", target, "--python", str(python), cwd=project)
    assert proc.returncode == 0, proc.stderr
    folder = Path(proc.stdout.strip())
    assert (folder / "block.py").is_file()
    check = vp("check", "--python", str(python), cwd=project)
    assert check.returncode == 0, check.stdout
    assert "known" in check.stdout
    before = run([str(python), "-c", f"import demo_pkg.core as m; print({check_code})"]).stdout
    applied = vp("apply", "--patch", "my-wrap", "--python", str(python), cwd=project)
    assert applied.returncode == 0, applied.stdout + applied.stderr
    symbol = target.split(":")[1].split(".")[-1]
    owner = "m.Child" if "." in target.split(":")[1] else "m"
    after = run([str(python), "-c", f"import demo_pkg.core as m; print({check_code}); "
                 f"f = vars({owner}).get('{symbol}') if '{owner}' != 'm' else m.{symbol}; "
                 "f = getattr(f, '__func__', f); print(f._hvp_patch_id, hasattr(f, "
                 "'__wrapped__'))"]).stdout.splitlines()
    assert after == [before.strip(), "my-wrap True"]


def test_check_reports_errors_with_their_paths(tmp_path: Path) -> None:
    """check: a broken manifest, a block that does not compile or binds a foreign name."""
    folder = tmp_path / "patches"
    bad = folder / "bad-one"
    bad.mkdir(parents=True)
    (bad / "patch.toml").write_text('id = "bad-one"\nsummary = "x"\n[target]\n'
                                    'distribution = "demo-pkg"\nmodule = "demo_pkg.core"\n'
                                    'symbol = "compute"\n[applies]\nshapes = ["nope"]\n')
    (bad / "block.py").write_text("def compute(:\n")
    binds = folder / "binds-name"
    binds.mkdir()
    (binds / "patch.toml").write_text(
        'id = "binds-name"\nsummary = "x"\n[target]\ndistribution = "demo-pkg"\n'
        'module = "demo_pkg.core"\nsymbol = "compute"\n[applies]\nshapes = ["' + "0" * 64
        + '"]\n')
    (binds / "block.py").write_text("import os\nMAX = 3\ndef compute(v):\n    return 0\n")
    proc = vp("check", str(folder), "--python", sys.executable, cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout
    out = proc.stdout
    assert f"{bad / 'patch.toml'}: applies.shapes[0]: 'nope' is not a sha256 hex digest" in out
    assert f"{bad / 'block.py'}: not valid Python" in out
    assert f"{binds / 'block.py'}:1: binds 'os' at module level" in out
    assert f"{binds / 'block.py'}:2: binds 'MAX' at module level" in out
    assert "vllm-patch check: 0 ok, 2 failed" in out


def test_catalog_folders_pass_check() -> None:
    """The built-in catalog passes the same check users run on their folders."""
    proc = vp("check", str(REPO / "patches"), "--python", sys.executable, cwd=REPO)
    assert proc.returncode == 0, proc.stdout
    folders = [p for p in (REPO / "patches").iterdir() if (p / "patch.toml").is_file()]
    assert len(folders) >= 7, folders
    assert f"vllm-patch check: {len(folders)} ok, 0 failed" in proc.stdout


# --- real vLLM ----------------------------------------------------------------------------------

# Real vLLM 0.20.2 code, one edit per case the rebinding must get right: (patch id, module,
# [(old, new)], what `create` must report as redefined).
REAL_PATCHES = [
    ("kv-interface-edit", "vllm.v1.kv_cache_interface", [
        # a module-level function
        ("    if kv_cache_dtype == \"nvfp4\":\n        return KVQuantMode.NVFP4\n",
         "    if kv_cache_dtype == \"nvfp4\":\n        return KVQuantMode.NVFP4\n"
         "    if kv_cache_dtype == \"fp8-edited\":\n        return KVQuantMode.FP8_PER_TENSOR\n"),
        # a property of a subclass that calls super()
        ("            return self.block_size * self.num_kv_heads * self.tq_slot_size\n"
         "        return super().real_page_size_bytes\n",
         "            return self.block_size * self.num_kv_heads * self.tq_slot_size\n"
         "        return 2 * super().real_page_size_bytes\n"),
        # a classmethod that calls super()
        ("        return replace(merged, tq_slot_size=specs[0].tq_slot_size)\n",
         "        return replace(merged, tq_slot_size=specs[0].tq_slot_size + 1)\n"),
        # a dataclass's __post_init__ with zero-argument super()
        ("    def __post_init__(self):\n        super().__post_init__()\n"
         "        _apply_alignment_padding(self)\n",
         "    def __post_init__(self):\n        super().__post_init__()\n"
         "        _apply_alignment_padding(self)\n"
         "        object.__setattr__(self, \"model_version\", self.model_version or \"edited\")\n"),
    ], "get_kv_quant_mode, MLAAttentionSpec.__post_init__, "
       "TQFullAttentionSpec.real_page_size_bytes, TQFullAttentionSpec.merge"),
    ("import-utils-edit", "vllm.utils.import_utils", [
        # private names (self.__name is self._PlaceholderModule__name) and super() in __init__
        ("        # Apply name mangling to avoid conflicting with module attributes\n"
         "        self.__name = name\n",
         "        # Apply name mangling to avoid conflicting with module attributes\n"
         "        self.__name = name\n        self.__hint = f\"pip install {name}\"\n"),
        ("        name = self.__name\n\n        try:\n            importlib.import_module(name)\n"
         "        except ImportError as exc:\n",
         "        name = self.__name\n\n        try:\n            importlib.import_module(name)\n"
         "        except ImportError as exc:\n"
         "            if name.startswith(\"hvp_\"):\n"
         "                raise ImportError(f\"{name} is missing: {self.__hint}\") from exc\n"),
        # a functools.cache function
        ("    return importlib.util.find_spec(module_name) is not None\n",
         "    if module_name == \"hvp_always\":\n        return True\n"
         "    return importlib.util.find_spec(module_name) is not None\n"),
    ], "_has_module, PlaceholderModule.__init__, PlaceholderModule.__getattr__"),
    ("async-utils-edit", "vllm.utils.async_utils", [
        # a module-level async def
        ("    async for item in iterator:\n        items.append(item)\n",
         "    async for item in iterator:\n        items.append((\"edited\", item))\n"),
    ], "collect_from_async_generator"),
    ("request-edit", "vllm.v1.request", [
        # a staticmethod of an enum
        ("        return status > RequestStatus.PREEMPTED\n",
         "        return status > RequestStatus.PREEMPTED or status == RequestStatus.WAITING\n"),
    ], "RequestStatus.is_finished"),
    ("chat-template-edit", "vllm.transformers_utils.chat_templates.registry", [
        # a function that a module-level dict captured at import time
        ("    return CHAT_TEMPLATES_DIR / \"template_basic.jinja\"\n\n\n"
         "def _get_minicpmv_chat_template_fallback",
         "    return CHAT_TEMPLATES_DIR / \"template_edited.jinja\"\n\n\n"
         "def _get_minicpmv_chat_template_fallback"),
    ], "_get_qwen_chat_template_fallback"),
]

CHILD = textwrap.dedent("""\
    import asyncio, multiprocessing, sys

    def child():
        import torch
        import vllm.v1.kv_cache_interface as k
        import vllm.utils.import_utils as iu
        import vllm.utils.async_utils as au
        import vllm.v1.request as rq
        import vllm.transformers_utils.chat_templates.registry as ct
        common = dict(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
        try:
            iu.PlaceholderModule("hvp_missing").anything
        except ImportError as exc:
            placeholder = str(exc)
        async def numbers():
            yield 1
        print("KV", k.is_quantized_kv_cache("fp8-edited"),
              k.TQFullAttentionSpec(**common).real_page_size_bytes
              // k.FullAttentionSpec(**common).real_page_size_bytes,
              k.TQFullAttentionSpec.merge([k.TQFullAttentionSpec(**common, tq_slot_size=4)])
              .tq_slot_size, k.MLAAttentionSpec(**common).model_version, flush=True)
        print("IMPORT", placeholder, "|", iu._has_module("hvp_always"),
              hasattr(iu._has_module, "cache_info"), flush=True)
        print("ASYNC", asyncio.run(au.collect_from_async_generator(numbers())), flush=True)
        print("STATIC", rq.RequestStatus.is_finished(rq.RequestStatus.WAITING), flush=True)
        print("CAPTURED", ct._get_qwen_chat_template_fallback("x").name,
              ct._MODEL_TYPE_TO_CHAT_TEMPLATE_FALLBACK["qwen"]("x").name, flush=True)

    if __name__ == "__main__":
        process = multiprocessing.get_context("spawn").Process(target=child)
        process.start()
        process.join()
        sys.exit(process.exitcode)
    """)


@pytest.mark.slow
def test_real_vllm_edit_create_verify_spawn_revert(vllm_with_tool: Path, tmp_path: Path) -> None:
    """On vLLM 0.20.2, edits in place of real functions and methods — super() in a method, a
    property, a classmethod and a dataclass __post_init__; private names; functools.cache;
    async def; a staticmethod; a function a dict captured — each made a patch by create: the
    file is RECORD's original plus our block, verify exits 0, a spawn child runs the edited
    code (the captured copy keeps the original, as create warned), revert restores RECORD's
    bytes; on vLLM 0.16.0 a patch whose code differs is unknown-shape and writes nothing; a
    change of an existing module-level assignment is refused."""
    python = vllm_with_tool
    project = tmp_path / "serve"
    project.mkdir()
    (project / "pyproject.toml").write_text('[tool.vllm-patch]\npatches = []\n')
    with pristine_environment(python):
        _real_vllm_cycle(python, project, tmp_path)


def _real_vllm_cycle(python: Path, project: Path, tmp_path: Path) -> None:

    def tool(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(python), "-m", "hatch_vllm_patch", *args], cwd=project,
                              capture_output=True, text=True, timeout=600, check=False,
                              input="", env={**os.environ, "HF_HUB_OFFLINE": "1"})

    pristine: dict[str, tuple[Path, bytes]] = {}
    for patch_id, module, edits, redefined in REAL_PATCHES:
        opened = tool("edit", module)
        assert opened.returncode == 0, opened.stderr
        target = Path(opened.stdout.strip())
        original = target.read_bytes()
        pristine[patch_id] = (target, original)
        text = original.decode()
        for old, new in edits:
            assert text.count(old) == 1, (module, old)
            text = text.replace(old, new)
        target.write_text(text)
        made = tool("create", patch_id, "--summary", f"create on real vLLM: {module}")
        assert made.returncode == 0, made.stdout + made.stderr
        assert f"redefines {redefined}\n" in made.stdout, made.stdout
        content = target.read_bytes()
        assert content.startswith(original) and content != original
    made_output = made.stdout  # the last one: the captured function
    assert "captures _get_qwen_chat_template_fallback at import time" in made_output
    ids = ", ".join(f'"{p[0]}"' for p in REAL_PATCHES)
    (project / "pyproject.toml").write_text(f"[tool.vllm-patch]\npatches = [{ids}]\n")
    verified = tool("verify")
    assert verified.returncode == 0, verified.stdout

    program = tmp_path / "child.py"
    program.write_text(CHILD)
    child = run([str(python), str(program)], env={"HF_HUB_OFFLINE": "1"}, timeout=900).stdout
    assert "KV True 2 5 edited" in child, child
    assert "IMPORT hvp_missing is missing: pip install hvp_missing | True True" in child, child
    assert "ASYNC [('edited', 1)]" in child, child
    assert "STATIC True" in child, child
    assert "CAPTURED template_edited.jinja template_basic.jinja" in child, child

    reverted = tool("revert")
    assert reverted.returncode == 0, reverted.stdout
    for target, original in pristine.values():
        assert target.read_bytes() == original

    other = release_venv(tmp_path / "old", "vllm", "0.16.0")
    old_file = site_packages(tmp_path / "old") / "vllm" / "v1" / "kv_cache_interface.py"
    before = old_file.read_bytes()
    elsewhere = tool("apply", "--python", str(other), "--patch", "kv-interface-edit")
    assert elsewhere.returncode == 1, elsewhere.stdout
    assert "unknown-shape  kv-interface-edit" in elsewhere.stdout
    assert old_file.read_bytes() == before

    target, original = pristine["kv-interface-edit"]
    tool("edit", "vllm.v1.kv_cache_interface")
    target.write_text(original.decode().replace("class KVQuantMode(IntEnum):",
                                                "class KVQuantMode(IntEnum):  # edited", 1)
                      .replace("logger = init_logger(__name__)\n",
                               "logger = init_logger('vllm.kv')\n", 1))
    refused = tool("create", "module-level")
    assert refused.returncode == 2 and "module level: statement at line" in refused.stderr
    assert "changed (logger = init_logger('vllm.kv'))" in refused.stderr, refused.stderr
    assert not (project / "vllm-patches" / "module-level").exists()
    assert tool("edit", "vllm.v1.kv_cache_interface", "--discard").returncode == 0
    assert target.read_bytes() == original


# --- real vLLM: carry a fix across releases ------------------------------------------------------

KV_UTILS = "vllm/v1/core/kv_cache_utils.py"
MEMORY_CHECK = "_check_enough_kv_cache_memory"

# Calls vLLM's own memory check in a spawn child, both ways it raises, and prints the messages.
MEMORY_CHILD = textwrap.dedent("""\
    import multiprocessing, sys

    def child():
        import vllm
        from vllm.v1.core import kv_cache_utils as k
        for available, needed in ((0, 1 << 30), (1 << 20, 1 << 30)):
            try:
                k._check_enough_kv_cache_memory(available, lambda: needed, 4096, lambda m: 7)
            except ValueError as exc:
                print("MESSAGE", vllm.__version__, str(exc).replace("\\n", " "), flush=True)

    if __name__ == "__main__":
        process = multiprocessing.get_context("spawn").Process(target=child)
        process.start()
        process.join()
        sys.exit(process.exitcode)
    """)


def _symbol_text(source: str, symbol: str) -> str:
    from hatch_vllm_patch.engine import locate_function, node_source

    node, missing = locate_function(source, symbol)
    assert node is not None, missing
    return node_source(source, node)


def _wheel_source(version: str, path: str) -> str:
    import zipfile

    from support.venvs import cached_wheel

    return zipfile.ZipFile(cached_wheel("vllm", version)).read(path).decode()


def _take_ours(text: str) -> str:
    """A conflict resolved the way the patch had it (its side of every marked region)."""
    out, side = [], None
    for line in text.splitlines(keepends=True):
        if line.startswith("<<<<<<< "):
            side = "ours"
        elif line.startswith("||||||| ") and side:
            side = "base"
        elif line == "=======\n" and side:
            side = "theirs"
        elif line.startswith(">>>>>>> ") and side:
            side = None
        elif side in (None, "ours"):
            out.append(line)
    return "".join(out)


@pytest.mark.slow
def test_real_vllm_backport_update_and_refusals(vllm_with_tool: Path, tmp_path: Path) -> None:
    """On real vLLM: 0.22.1's memory-check fix, backported to 0.20.2 from a diff made from the
    two wheels (with a second module, and a test file skipped), gives 0.22.1's messages through
    vLLM's own code in a spawn child and reverts byte for byte; on 0.16.0, where the second
    module differs, it writes nothing to either file. The full-file diff (module-level changes),
    the same diff on 0.22.1 (context moved on) and a typo are refused, nothing written. A patch
    made on 0.20.2 is updated onto 0.22.1: a clean merge is known on both and runs on both; a
    conflicting one leaves markers and applies nothing; the example project's own patch
    (made before patches kept their base: the base comes from 0.20.2's wheel) conflicts,
    is resolved, finished with --continue and runs on 0.22.1."""
    python = vllm_with_tool
    project = tmp_path / "serve"
    project.mkdir()
    (project / "pyproject.toml").write_text("[tool.vllm-patch]\npatches = []\n")
    with pristine_environment(python):
        _real_vllm_carry(python, project, tmp_path)


def _real_vllm_carry(python: Path, project: Path, tmp_path: Path) -> None:
    def tool(*args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(python), "-m", "hatch_vllm_patch", *args], cwd=project,
                              capture_output=True, text=True, timeout=900, check=False,
                              input=stdin, env={**os.environ, "HF_HUB_OFFLINE": "1"})

    def select(*ids: str) -> None:
        listed = ", ".join(f'"{i}"' for i in ids)
        (project / "pyproject.toml").write_text(f"[tool.vllm-patch]\npatches = [{listed}]\n")

    old_sp = site_packages(python.parent.parent)
    newer = release_venv(tmp_path / "v0.22.1", "vllm", "0.22.1")
    new_sp = site_packages(tmp_path / "v0.22.1")

    def messages(interpreter: Path) -> list[str]:
        """The two messages of the memory check, from a spawn child of ``interpreter`` (0.22.1
        borrows 0.20.2's dependencies — the same torch pin — through a .pth while it runs)."""
        program = tmp_path / "memory_child.py"
        program.write_text(MEMORY_CHILD)
        borrowed = new_sp / "zz_hvp_test_deps.pth"
        if interpreter == newer:
            borrowed.write_text(f"{old_sp}\n")
        try:
            out = run([str(interpreter), str(program)], env={"HF_HUB_OFFLINE": "1"},
                      timeout=900).stdout
        finally:
            borrowed.unlink(missing_ok=True)
        return [line for line in out.splitlines() if line.startswith("MESSAGE")]

    old_text, new_text = _wheel_source("0.20.2", KV_UTILS), _wheel_source("0.22.1", KV_UTILS)
    assert (old_sp / KV_UTILS).read_text() == old_text
    old_fn, new_fn = _symbol_text(old_text, MEMORY_CHECK), _symbol_text(new_text, MEMORY_CHECK)
    assert old_fn != new_fn and old_fn in old_text

    # The upstream fix as a diff of two files (plus a test file), made now from the wheels.
    request_path = "vllm/v1/request.py"
    request_text = (old_sp / request_path).read_text()
    anchor = ('    ) -> "Request":\n        return cls(\n'
              "            request_id=request.request_id,")
    assert request_text.count(anchor) == 1
    diff = _git_diff({
        KV_UTILS: (old_text, old_text.replace(old_fn, new_fn)),
        request_path: (request_text, request_text.replace(
            anchor, anchor.replace("        return cls(", "        # backported\n"
                                                          "        return cls("))),
        "tests/v1/core/test_kv_cache_utils.py": ("", "def test_message():\n    pass\n"),
    })
    files = {p: (old_sp / p).read_bytes() for p in (KV_UTILS, request_path)}
    (tmp_path / "pr.diff").write_text(diff)

    # Refused, nothing written: the whole file's diff, the same diff where its context moved
    # on, a misspelt name.
    whole = _git_diff({KV_UTILS: (old_text, new_text)})
    refused = tool("create", "whole-file", "--from-diff", "-", stdin=whole)
    assert refused.returncode == 2 and "module level: statement" in refused.stderr, \
        refused.stderr
    moved = tool("create", "moved-on", "--from-diff", str(tmp_path / "pr.diff"), "--python",
                 str(newer))
    assert moved.returncode == 2 and "does not match the installed file" in moved.stderr, \
        moved.stderr
    assert "the first line that differs" in moved.stderr
    typo = _git_diff({KV_UTILS: (old_text, old_text.replace(
        "    needed_memory = get_needed_memory()\n",
        "    needed_memory = get_needed_memry()\n", 1))})
    refused = tool("create", "typo", "--from-diff", "-", stdin=typo)
    assert refused.returncode == 2 and "reads 'get_needed_memry'" in refused.stderr, \
        refused.stderr
    assert not (project / "vllm-patches").exists()
    assert {p: (old_sp / p).read_bytes() for p in files} == files
    assert (new_sp / KV_UTILS).read_text() == new_text

    made = tool("create", "memory-backport", "--from-diff", str(tmp_path / "pr.diff"),
                "--summary", "vLLM 0.22.1's memory messages")
    assert made.returncode == 0, made.stdout + made.stderr
    assert "skipped, not installed" in made.stdout and "tests/v1/core/test_kv_cache_utils.py" \
        in made.stdout
    assert f"redefines {MEMORY_CHECK}, Request.from_engine_core_request" in made.stdout
    select("memory-backport")
    assert tool("verify").returncode == 0
    old_messages = messages(python)
    assert len(old_messages) == 2 and all(" 0.20.2 " in m for m in old_messages)
    assert "also controls CPU memory reservation on the CPU backend" in old_messages[0]
    assert "with the model's max seq len" in old_messages[1]

    oldest = release_venv(tmp_path / "v0.16.0", "vllm", "0.16.0")
    oldest_sp = site_packages(tmp_path / "v0.16.0")
    before = {p: (oldest_sp / p).read_bytes() for p in files}
    elsewhere = tool("apply", "--python", str(oldest))
    # one verdict for the patch, the refusing target named, each target's finding beneath
    assert elsewhere.returncode == 1 and elsewhere.stdout.count(
        "unknown-shape  memory-backport") == 1, elsewhere.stdout
    assert "unknown-shape in vllm.v1.request (" in elsewhere.stdout, elsewhere.stdout
    assert "target vllm.v1.request: unknown-shape" in elsewhere.stdout, elsewhere.stdout
    assert {p: (oldest_sp / p).read_bytes() for p in files} == before

    assert tool("revert").returncode == 0
    assert {p: (old_sp / p).read_bytes() for p in files} == files

    # update: a patch made on 0.20.2, merged onto 0.22.1.
    def edit_and_create(patch_id: str, old: str, new: str) -> None:
        opened = tool("edit", "vllm.v1.core.kv_cache_utils")
        assert opened.returncode == 0, opened.stderr
        text = (old_sp / KV_UTILS).read_text()
        assert text.count(old) == 1
        (old_sp / KV_UTILS).write_text(text.replace(old, new))
        made = tool("create", patch_id)
        assert made.returncode == 0, made.stdout + made.stderr

    # memory-backport rebinds the function memory-words changes: out of the selection first
    # (create refuses an overlap with the selection before it writes anything)
    select()
    edit_and_create("memory-words", '"Based on the available memory, "',
                    '"From the memory that is left, "')
    unify_lines = ("                    dtype=spec.dtype,\n"
                   "                    sliding_window=spec.sliding_window,\n"
                   "                    page_size_padded=spec.page_size_padded,\n")
    edit_and_create("unify-note", unify_lines,
                    unify_lines.replace("spec.dtype,", "spec.dtype,  # as the layer has it"))
    select("memory-words", "unify-note")
    assert tool("verify").returncode == 0
    conflicting = tool("update", "unify-note", "--python", str(newer))
    assert conflicting.returncode == 1, conflicting.stdout + conflicting.stderr
    assert "CONFLICT: unify_hybrid_kv_cache_specs" in conflicting.stdout
    marked = (new_sp / KV_UTILS).read_text()
    assert "<<<<<<< patch unify-note\n" in marked and "head_size_v=spec.head_size_v" in marked
    assert "# >>> hatch-vllm-patch:" not in marked
    assert tool("edit", "vllm.v1.core.kv_cache_utils", "--discard", "--python",
                str(newer)).returncode == 0
    assert (new_sp / KV_UTILS).read_text() == new_text
    select("memory-words")

    updated = tool("update", "memory-words", "--python", str(newer))
    assert updated.returncode == 0, updated.stdout + updated.stderr
    assert f"merged: {MEMORY_CHECK}" in updated.stdout
    manifest = (project / "vllm-patches" / "memory-words" / "patch.toml").read_text()
    assert hashlib.sha256(old_fn.encode()).hexdigest() in manifest
    assert hashlib.sha256(new_fn.encode()).hexdigest() in manifest
    assert tool("verify", "--python", str(newer)).returncode == 0
    assert tool("apply").returncode == 0  # the updated block on 0.20.2 too
    assert tool("verify").returncode == 0
    for interpreter, version in ((python, "0.20.2"), (newer, "0.22.1")):
        got = messages(interpreter)
        assert len(got) == 2 and f" {version} " in got[1], got
        assert "From the memory that is left, the estimated maximum model length is 7" in got[1]
        assert "(which also controls CPU memory on the CPU backend)" in got[1]
    assert tool("revert", "--python", str(newer)).returncode == 0
    assert (new_sp / KV_UTILS).read_text() == new_text

    # The example project's own patch, made on 0.20.2 before create kept a base.
    shutil.copytree(REPO / "example_project" / "vllm-patches" / "clearer-kv-memory-error",
                    project / "vllm-patches" / "clearer-kv-memory-error")
    select("clearer-kv-memory-error")
    assert "unknown-shape" in tool("apply", "--python", str(newer)).stdout
    step5 = tool("update", "clearer-kv-memory-error", "--python", str(newer))
    assert step5.returncode == 1 and f"CONFLICT: {MEMORY_CHECK}" in step5.stdout, \
        step5.stdout + step5.stderr
    (new_sp / KV_UTILS).write_text(_take_ours((new_sp / KV_UTILS).read_text()))
    finished = tool("update", "clearer-kv-memory-error", "--continue", "--python", str(newer))
    assert finished.returncode == 0, finished.stdout + finished.stderr
    assert tool("verify", "--python", str(newer)).returncode == 0
    [no_memory, too_little] = messages(newer)
    assert "No memory is left for the KV cache" in no_memory and " 0.22.1 " in no_memory
    assert "with the model's max seq len" in too_little
    assert (project / "vllm-patches" / "clearer-kv-memory-error" / "probe.py").is_file()
    assert tool("revert", "--python", str(newer)).returncode == 0
    assert (new_sp / KV_UTILS).read_text() == new_text
