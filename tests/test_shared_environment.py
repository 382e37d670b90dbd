"""Several projects on one environment: every block has one verdict whatever the selection, no
advice removes another project's blocks, `revert` removes every block, and a patch `create`
made is the project's selection (dropping it removes it). A small real wheel in a real venv;
one test on vLLM 0.20.2's real files (slow)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from support.venvs import UV, create_venv, record_sha256, run, site_packages

from hatch_vllm_patch.engine import symbol_digest

SOURCE = textwrap.dedent('''\
    """A module four fixes touch: two of the catalog, one of each project."""


    def compute(values):
        if not values:
            raise NotImplementedError("empty")
        return max(values)


    def other():
        return "untouched"


    def third():
        return 3


    def fourth():
        return 4
    ''')


@pytest.fixture(scope="module")
def shared_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("shared-src")
    (src / "demo_pkg").mkdir()
    (src / "demo_pkg" / "__init__.py").write_text("")
    (src / "demo_pkg" / "core.py").write_text(SOURCE)
    (src / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["hatchling"]\nbuild-backend = "hatchling.build"\n'
        '[project]\nname = "demo-pkg"\nversion = "1.0.0"\n')
    out = tmp_path_factory.mktemp("shared-wheel")
    run([UV, "build", "--wheel", "--quiet", "--out-dir", str(out), str(src)])
    return next(out.glob("*.whl"))


def patch_folder(root: Path, pid: str, symbol: str, body: str) -> Path:
    folder = root / pid
    folder.mkdir(parents=True)
    (folder / "patch.toml").write_text(textwrap.dedent(f"""\
        id = "{pid}"
        summary = "Patch {symbol}"
        description = "Test patch."
        links = ["https://example.invalid/{pid}"]
        removal = "Never."

        [target]
        distribution = "demo-pkg"
        module = "demo_pkg.core"
        symbol = "{symbol}"

        [applies]
        shapes = ["{symbol_digest(SOURCE, symbol)}"]
        """))
    (folder / "block.py").write_text(body)
    return folder


class Shared:
    """Two projects, A and B, each with a catalog patch and an own patch, on one venv."""

    def __init__(self, root: Path, wheel: Path) -> None:
        self.python = create_venv(root / "venv", str(wheel))
        self.sp = site_packages(root / "venv")
        self.file = self.sp / "demo_pkg" / "core.py"
        self.catalog = root / "catalog"
        patch_folder(self.catalog, "demo-fix", "compute",
                     "def compute(values):\n    return max(values or [0])\n")
        patch_folder(self.catalog, "demo-other", "other", "def other():\n    return 'patched'\n")
        self.a, self.b = root / "a", root / "b"
        patch_folder(self.a / "vllm-patches", "a-own", "third", "def third():\n    return 33\n")
        patch_folder(self.b / "vllm-patches", "b-own", "fourth", "def fourth():\n    return 44\n")
        self.select(self.a, "demo-fix", "a-own")
        self.select(self.b, "demo-other", "b-own")

    @staticmethod
    def select(project: Path, *ids: str) -> None:
        listed = ", ".join(f'"{i}"' for i in ids)
        (project / "pyproject.toml").write_text(
            f'[project]\nname = "{project.name}"\n\n[tool.vllm-patch]\npatches = [{listed}]\n')

    def cli(self, where: Path, *args: str) -> dict[str, object]:
        proc = subprocess.run(
            [sys.executable, "-m", "hatch_vllm_patch", *args, "--python", str(self.python),
             "--json"], cwd=where, capture_output=True, text=True, timeout=300, check=False,
            env={**_env(), "HATCH_VLLM_PATCH_CATALOG": str(self.catalog)})
        data = json.loads(proc.stdout)
        assert data["exit_code"] == proc.returncode
        return data

    def blocks(self) -> set[str]:
        from hatch_vllm_patch.markers import parse_file

        return {b.patch_id for b in parse_file(self.file.read_bytes()).blocks}

    def pristine(self) -> bool:
        digest = hashlib.sha256(self.file.read_bytes()).hexdigest()
        return digest == record_sha256(self.sp, "demo-pkg", "demo_pkg/core.py")

    def recorded(self) -> dict[str, list[str]]:
        """Each recorded patch's selectors; empty when there is no record (a whole revert
        removes it)."""
        path = self.sp / ".hatch-vllm-patch.json"
        if not path.exists():
            return {}
        data = json.loads(path.read_text())
        return {p["id"]: p["selected_by"] for p in (data["selection"] or {}).get("patches", [])}


def _env() -> dict[str, str]:
    from support.venvs import scrubbed_environ

    return scrubbed_environ()


def verdicts(data: dict[str, object]) -> dict[str, str]:
    patches = data["patches"]
    assert isinstance(patches, list)
    return {str(p["id"]): str(p["verdict"]) for p in patches}


def advice(data: dict[str, object]) -> dict[str, str]:
    patches = data["patches"]
    assert isinstance(patches, list)
    return {str(p["id"]): str(p["next_step"]) for p in patches if p.get("next_step")}


def no_advice_against(data: dict[str, object], others: set[str]) -> None:
    """No next step is a revert of everything, nor a revert of a patch of ``others``."""
    for pid, step in advice(data).items():
        assert "revert --python" not in step or "--patch" in step, (pid, step)
        if pid in others:
            assert "revert" not in step, (pid, step)


@pytest.fixture
def shared(tmp_path: Path, shared_wheel: Path) -> Shared:
    return Shared(tmp_path, shared_wheel)


def test_one_verdict_per_block_across_projects_and_selections(shared: Shared) -> None:
    """A and B apply their catalog and own patches to one file; from either project, with the
    project's selection or any --patch, every block the run does not select is `not-selected`
    (never `unknown-patch`), exit 0; B's apply is not blocked by A's own patch; --strict fails
    and names the project that selects the block, never a revert of it."""
    a, b = shared.a, shared.b
    assert verdicts(shared.cli(a, "apply")) == {"demo-fix": "applied", "a-own": "applied"}
    applied = shared.cli(b, "apply")
    assert applied["exit_code"] == 0, applied
    assert verdicts(applied) == {"demo-other": "applied", "b-own": "applied",
                                 "demo-fix": "not-selected", "a-own": "not-selected"}
    assert shared.blocks() == {"demo-fix", "a-own", "demo-other", "b-own"}
    mine = {a: {"demo-fix", "a-own"}, b: {"demo-other", "b-own"}}
    for where, others in ((a, mine[b]), (b, mine[a])):
        for args in (("verify",), ("status",), ("verify", "--patch", "demo-other"),
                     ("verify", "--patch", "demo-fix"), ("status", "--patch", "demo-fix"),
                     ("apply",), ("apply", "--patch", "demo-fix")):
            data = shared.cli(where, *args)
            found = verdicts(data)
            assert data["exit_code"] == 0, (where, args, data)
            assert set(found) == mine[a] | mine[b], (where, args, found)
            for pid in set(found) - ({args[-1]} if "--patch" in args else mine[where]):
                assert found[pid] == "not-selected", (where, args, found)
            no_advice_against(data, others)
        strict = shared.cli(where, "verify", "--strict")
        assert strict["exit_code"] == 1
        steps = advice(strict)
        assert set(steps) == others, steps
        owner = (b if where == a else a) / "pyproject.toml"
        assert all(f"selected by {owner}" in s for s in steps.values()), steps
        no_advice_against(strict, others)


def test_a_command_line_own_patch_is_not_unknown_to_another_projects_patch_run(
        shared: Shared) -> None:
    """The issue's case: A's own patch applied with `apply --patch` (recorded for the command
    line); from B, `verify --patch demo-other` describes its block as `not-selected` like plain
    `verify` does (it was `unknown-patch`, exit 1, with the advice to revert everything)."""
    shared.select(shared.a, "demo-fix")  # a-own not in the table: applied by hand
    assert shared.cli(shared.a, "apply", "--patch", "a-own")["exit_code"] == 0
    assert shared.cli(shared.a, "apply")["exit_code"] == 0
    assert shared.recorded()["a-own"] == ["command line"]
    for args, code in ((("verify",), 1),  # B's own patches are missing
                       (("verify", "--patch", "demo-fix"), 0),
                       (("status", "--patch", "demo-other"), 0)):
        data = shared.cli(shared.b, *args)
        assert verdicts(data)["a-own"] == "not-selected", (args, data)
        assert data["exit_code"] == code, (args, data)
        no_advice_against(data, {"a-own"})
    assert shared.cli(shared.b, "apply")["exit_code"] == 0
    back = shared.cli(shared.b, "revert", "--patch", "demo-other")
    assert back["exit_code"] == 0 and verdicts(back)["a-own"] == "not-selected", back
    assert shared.blocks() == {"a-own", "demo-fix", "b-own"}


def test_revert_removes_every_block_and_names_whose(shared: Shared) -> None:
    """`revert --patch ID` removes one block (also another project's own, known only from the
    record); `revert` without --patch removes every block in the environment, naming the
    project each belonged to, and clears the record; each project's apply puts its own back."""
    a, b = shared.a, shared.b
    shared.cli(a, "apply")
    shared.cli(b, "apply")
    one = shared.cli(b, "revert", "--patch", "a-own")
    assert one["exit_code"] == 0 and verdicts(one)["a-own"] == "reverted", one
    assert shared.blocks() == {"demo-fix", "demo-other", "b-own"}
    assert "a-own" not in shared.recorded()
    shared.cli(a, "apply")
    everything = shared.cli(b, "revert")
    assert everything["exit_code"] == 0, everything
    assert verdicts(everything) == {pid: "reverted" for pid in
                                    ("demo-fix", "a-own", "demo-other", "b-own")}
    patches = everything["patches"]
    assert isinstance(patches, list)
    whose = {p["id"]: " ".join([p["reason"], *p["selected_because"]]) for p in patches}
    for pid in ("demo-fix", "a-own"):
        assert str(a / "pyproject.toml") in whose[pid], whose
    assert shared.pristine() and not (shared.recorded())
    assert not (shared.sp / ".hatch-vllm-patch.json").exists()  # nothing of ours is left
    assert verdicts(shared.cli(a, "apply")) == {"demo-fix": "applied", "a-own": "applied"}
    assert verdicts(shared.cli(b, "apply"))["b-own"] == "applied"
    assert shared.blocks() == {"demo-fix", "a-own", "demo-other", "b-own"}


def test_convergence_of_one_project_leaves_the_others_blocks(shared: Shared) -> None:
    """A drops its own patch and its catalog patch from pyproject.toml: A's apply removes
    exactly A's blocks; B's stay and B's verify still passes; then B drops its own: B's apply
    removes it, and only the catalog patch B selects is left."""
    a, b = shared.a, shared.b
    shared.cli(a, "apply")
    shared.cli(b, "apply")
    shared.select(a)
    dropped = shared.cli(a, "apply")
    assert verdicts(dropped) == {"demo-fix": "removed", "a-own": "removed",
                                 "demo-other": "not-selected", "b-own": "not-selected"}
    assert shared.blocks() == {"demo-other", "b-own"}
    assert shared.cli(b, "verify", "--strict")["exit_code"] == 0
    shared.select(b, "demo-other")
    assert verdicts(shared.cli(b, "apply")) == {"demo-other": "already-applied",
                                                "b-own": "removed"}
    assert shared.blocks() == {"demo-other"}


MODULE_EDIT = ('        raise NotImplementedError("empty")\n', "        return 0\n")


def test_a_created_patch_is_the_projects_and_dropping_it_removes_it(shared: Shared) -> None:
    """The README's own-fix flow on a shared environment: `create` in A adds the patch to A's
    [tool.vllm-patch] patches and records it as selected by A's pyproject.toml (not the
    command line), and puts back B's blocks that `edit` took out; B sees it as not-selected;
    when A drops it, A's next apply removes it and leaves B's blocks."""
    a = shared.a
    shared.select(a, "a-own")
    shared.cli(shared.b, "apply")
    opened = shared.cli(a, "edit", "demo_pkg.core")
    assert opened["exit_code"] == 0, opened
    assert shared.blocks() == set()
    shared.file.write_text(shared.file.read_text().replace(*MODULE_EDIT))
    made = shared.cli(a, "create", "a-compute", "--summary", "Zero for nothing")
    assert made["exit_code"] == 0, made
    listed = (a / "pyproject.toml").read_text()
    assert 'patches = ["a-own", "a-compute"]' in listed, listed
    assert shared.recorded()["a-compute"] == [str(a / "pyproject.toml")]
    assert shared.recorded()["b-own"] == [str(shared.b / "pyproject.toml")]
    assert shared.blocks() == {"a-compute", "demo-other", "b-own"}
    assert verdicts(shared.cli(a, "apply"))["a-own"] == "applied"
    assert shared.cli(a, "verify")["exit_code"] == 0
    assert shared.cli(shared.b, "verify")["exit_code"] == 0
    assert verdicts(shared.cli(shared.b, "verify"))["a-compute"] == "not-selected"
    shared.select(a, "a-own")
    assert verdicts(shared.cli(a, "apply"))["a-compute"] == "removed"
    assert shared.blocks() == {"a-own", "demo-other", "b-own"}
    assert "a-compute" not in shared.recorded()


@pytest.mark.slow
def test_two_projects_on_vllm_0_20_2(tmp_path: Path) -> None:
    """The issue's trial on vLLM 0.20.2's real files (--no-deps): A serves Qwen3-Next and
    Zamba2 (the KV and Zamba2 patches) and applied its own wrapper of kv_cache_utils with
    `--patch` (recorded for the command line); B selects the scheduler patch. From B, `verify`,
    `verify --patch kv-cache-page-unification` and `status` call A's blocks not-selected (exit
    0, no advice that removes them); B's `revert` removes all four blocks, and
    kv_cache_utils.py, zamba2.py and scheduler.py are RECORD's bytes again."""
    from support.venvs import release_venv

    python = release_venv(tmp_path / "venv", "vllm", "0.20.2")
    sp = site_packages(tmp_path / "venv")
    files = ("vllm/v1/core/kv_cache_utils.py", "vllm/model_executor/models/zamba2.py",
             "vllm/v1/core/sched/scheduler.py")

    def pristine(relative: str) -> bool:
        digest = hashlib.sha256((sp / relative).read_bytes()).hexdigest()
        return digest == record_sha256(sp, "vllm", relative)

    def cli(where: Path, *args: str) -> dict[str, object]:
        proc = subprocess.run([sys.executable, "-m", "hatch_vllm_patch", *args, "--python",
                               str(python), "--json"], cwd=where, capture_output=True,
                              text=True, timeout=600, check=False, env=_env())
        return dict(json.loads(proc.stdout))

    a, b = tmp_path / "a", tmp_path / "b"
    for project, table in ((a, "[tool.vllm-patch.architectures.Qwen3NextForCausalLM]\n"
                                "[tool.vllm-patch.architectures.Zamba2ForCausalLM]\n"),
                           (b, 'patches = ["mamba-split-external-kv"]\n')):
        project.mkdir()
        (project / "pyproject.toml").write_text(f'[project]\nname = "{project.name}"\n\n'
                                                f"[tool.vllm-patch]\n{table}")
    made = cli(a, "new", "a-wrap", "--target",
               "vllm.v1.core.kv_cache_utils:get_kv_cache_groups")
    assert made["exit_code"] == 0, made
    assert cli(a, "apply", "--patch", "a-wrap")["exit_code"] == 0
    first = cli(a, "apply")
    assert first["exit_code"] == 0, first
    assert verdicts(first)["kv-cache-page-unification"] == "applied", first
    assert verdicts(cli(b, "apply"))["mamba-split-external-kv"] == "applied"
    a_blocks = {"a-wrap", "kv-cache-page-unification", "zamba2-spec-conv-state"}
    for args in (("verify",), ("verify", "--patch", "kv-cache-page-unification"), ("status",)):
        data = cli(b, *args)
        found = verdicts(data)
        assert data["exit_code"] == 0, (args, data)
        for pid in a_blocks - {args[-1]}:
            assert found[pid] == "not-selected", (args, found)
        no_advice_against(data, a_blocks)
    everything = cli(b, "revert")
    assert everything["exit_code"] == 0, everything
    found = verdicts(everything)
    assert all(found[pid] == "reverted" for pid in [*a_blocks, "mamba-split-external-kv"]), found
    assert all(pristine(f) for f in files)
