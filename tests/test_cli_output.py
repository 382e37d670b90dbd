"""What the command line prints: one JSON schema for every outcome, `status --short`, the
project found from a subdirectory, and the messages users meet first — all through real
subprocesses on the demo distribution."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import sys
import textwrap
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from support import REPO
from support.commands import cli
from support.demo import write_demo_catalog
from support.venvs import repetitions, site_packages

from hatch_vllm_patch.engine import Verdict

SCHEMA_FILE = REPO / "hatch_vllm_patch" / "schema" / "output.schema.json"


@pytest.fixture(scope="module")
def validator() -> jsonschema.protocols.Validator:
    schema = json.loads(SCHEMA_FILE.read_text())
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def json_run(validator: Any, *args: str, **kwargs: Any) -> dict[str, Any]:
    """``vllm-patch ARGS --json``: stdout is one object of the schema, whatever the outcome, and
    its exit_code is the process's."""
    proc = cli(*args, "--json", **kwargs)
    assert "Traceback" not in proc.stderr, proc.stderr
    doc = json.loads(proc.stdout)
    errors = sorted(validator.iter_errors(doc), key=str)
    assert not errors, (args, [e.message for e in errors], doc)
    assert doc["exit_code"] == proc.returncode and doc["ok"] == (proc.returncode == 0), doc
    return doc


def test_schema_names_every_verdict(validator: Any) -> None:
    """The schema's verdicts are exactly the engine's: a new verdict must be added to it."""
    enum = validator.schema["$defs"]["patch"]["properties"]["verdict"]["enum"]
    assert sorted(enum) == sorted(v.value for v in Verdict)
    targets = validator.schema["$defs"]["target"]["properties"]["verdict"]["enum"]
    assert sorted(targets) == sorted(v.value for v in Verdict)


def test_every_command_and_outcome_matches_the_schema(tmp_path: Path, demo_venv: Path,
                                                      demo_catalog: Path, validator: Any) -> None:
    """apply / verify / revert / status / diff, on success, drift, failure, configuration and
    usage errors: each prints one object of the schema (exit_code, ok, errors, notes)."""
    python = str(demo_venv)
    sel = ("--python", python, "--patch", "demo-fix")
    seen: dict[str, set[int]] = {}

    def run(*args: str, cwd: Path | None = None) -> dict[str, Any]:
        doc = json_run(validator, *args, catalog=demo_catalog, cwd=cwd or tmp_path)
        seen.setdefault(str(doc["operation"]), set()).add(doc["exit_code"])
        return doc

    doc = run("verify", *sel)
    assert (doc["exit_code"], doc["patches"][0]["verdict"]) == (1, "missing")
    doc = run("diff", *sel)
    [patch] = doc["patches"]
    assert (doc["exit_code"], patch["verdict"]) == (0, "would-apply"), doc
    assert patch["diff"].startswith("--- a/demo_pkg/core.py")
    [target] = patch["targets"]  # one target: the patch's own verdict, its module beneath it
    assert (target["module"], target["verdict"]) == ("demo_pkg.core", "would-apply"), patch
    assert target["diff"] == patch["diff"]
    assert run("status", "--python", python)["exit_code"] == 0
    doc = run("apply", *sel)
    assert doc["patches"][0]["verdict"] == "applied" and doc["errors"] == []
    assert run("apply", *sel)["patches"][0]["verdict"] == "already-applied"
    assert run("diff", *sel)["patches"][0]["verdict"] == "already-applied"
    assert run("verify", *sel)["exit_code"] == 0
    assert run("revert", *sel)["patches"][0]["verdict"] == "reverted"
    assert run("revert", *sel)["patches"][0]["verdict"] == "not-applied"

    # exit 2: usage errors (argparse's too), configuration errors, an unusable interpreter.
    doc = run("verify", "--bogus", *sel)
    assert doc["operation"] == "verify" and "unrecognized arguments: --bogus" in doc["errors"][0]
    doc = run("frobnicate")
    assert doc["operation"] is None and "invalid choice" in doc["errors"][0]
    doc = run("apply", "--python", python, "--patch", "demo-fx")
    assert "did you mean demo-fix?" in doc["errors"][0]
    assert run("status", "--python", "/bin/echo")["exit_code"] == 2
    assert run("revert", "--python", str(tmp_path / "nope"))["exit_code"] == 2
    doc = run("verify", "--python", python)  # no configuration, no selection
    assert "no patches selected" in doc["errors"][0] and doc["notes"] == []
    project = tmp_path / "project"
    project.mkdir()
    (project / "pyproject.toml").write_text(
        '[tool.vllm-patch]\npatches = ["demo-fx", 3]\nguard = "loud"\n')
    doc = run("diff", "--python", python, cwd=project)
    assert doc["config"] == str(project / "pyproject.toml") and len(doc["errors"]) == 3
    assert doc["errors"][0].startswith("tool.vllm-patch.guard: expected one of"), doc

    # exit 1: the environment's record is unreadable, so apply writes nothing.
    record = site_packages(demo_venv.parent.parent) / ".hatch-vllm-patch.json"
    record.write_text("{not json")
    doc = run("apply", *sel)
    assert doc["exit_code"] == 1 and doc["environment"] is None and "record" in doc["errors"][0]
    record.unlink()
    assert seen == {"verify": {0, 1, 2}, "diff": {0, 2}, "status": {0, 2}, "apply": {0, 1, 2},
                    "revert": {0, 2}, "None": {2}}


def test_json_is_off_without_the_option(tmp_path: Path, demo_catalog: Path) -> None:
    """Without --json a usage error is argparse's usage and one error line on stderr."""
    proc = cli("verify", "--bogus", catalog=demo_catalog, cwd=tmp_path)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("usage: vllm-patch ")
    assert proc.stderr.splitlines()[-1] == "vllm-patch: error: unrecognized arguments: --bogus"
    proc = cli("verify", "--patch", catalog=demo_catalog, cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.startswith("usage: vllm-patch verify")
    assert proc.stderr.splitlines()[-1] == ("vllm-patch verify: error: argument --patch: "
                                            "expected one argument")


def test_status_short_is_one_line_per_patch(tmp_path: Path, demo_venv: Path) -> None:
    """status --short: id, verdict and file, one line per patch; status: one line per patch
    with its reason, and the option that adds the accounts; status -v: the accounts. status
    exits 0 and its summary says how many patches are not in place (never "OK" beside one;
    JSON ``in_place``), where verify fails."""
    catalog = write_demo_catalog(tmp_path / "catalog")
    second = catalog / "demo-two"
    second.mkdir()
    for name in ("patch.toml", "block.py"):
        text = (catalog / "demo-fix" / name).read_text()
        (second / name).write_text(text.replace('id = "demo-fix"', 'id = "demo-two"')
                                   .replace("_hvp_demo_original", "_hvp_demo_two"))
    assert cli("apply", "--python", str(demo_venv), "--patch", "demo-fix",
               catalog=catalog).returncode == 0
    proc = cli("status", "--short", "--python", str(demo_venv), catalog=catalog)
    assert proc.returncode == 0, proc.stderr
    core = site_packages(demo_venv.parent.parent) / "demo_pkg" / "core.py"
    assert proc.stdout.splitlines() == [f"demo-fix  applied  {core}",
                                        f"demo-two  missing  {core}"]
    shown = cli("status", "--python", str(demo_venv), catalog=catalog)
    default = shown.stdout.splitlines()
    assert default[-4].split()[:2] == ["applied", "demo-fix:"], default
    # status reports (exit 0) and never says OK beside a patch verify would fail: it marks it
    assert default[-4].endswith(" in place") and default[-3].startswith("! missing   demo-two: ")
    assert default[-2:] == ["each patch's file, selectors and account: vllm-patch status -v",
                            "vllm-patch status: 1 applied, 1 missing \u2014 1 not in place"
                            ], default
    assert shown.returncode == 0 and len(default) == 6 and "file:" not in str(default), default
    doc = json.loads(cli("status", "--json", "--python", str(demo_venv), catalog=catalog).stdout)
    assert (doc["exit_code"], doc["ok"]) == (0, True), doc
    assert {p["id"]: (p["ok"], p["in_place"]) for p in doc["patches"]} == {
        "demo-fix": (True, True), "demo-two": (True, False)}, doc
    verify = cli("verify", "--python", str(demo_venv), "--patch", "demo-two", catalog=catalog)
    assert verify.returncode == 1 and verify.stdout.splitlines()[-1] == (
        "vllm-patch verify: 1 missing, 1 not-selected \u2014 FAILED"), verify.stdout
    done = cli("status", "--python", str(demo_venv), "--patch", "demo-fix",
               catalog=catalog).stdout.splitlines()
    assert done[-1] == "vllm-patch status: 1 applied \u2014 all in place", done
    long = cli("status", "-v", "--python", str(demo_venv), catalog=catalog).stdout
    assert "summary: Make demo_pkg.core.compute" in long and len(long.splitlines()) > 10
    usage = cli("status", "-v", "--short", "--python", str(demo_venv), catalog=catalog)
    assert usage.returncode == 2 and "not allowed with" in usage.stderr, usage.stderr


def test_project_is_found_upward_and_named(tmp_path: Path, demo_venv: Path,
                                           demo_catalog: Path) -> None:
    """From a subdirectory the nearest pyproject.toml is the project (its .venv, its table),
    and the output names it; the search stops at a repository root."""
    project = tmp_path / "serve"
    deep = project / "src" / "pkg"
    deep.mkdir(parents=True)
    (project / "pyproject.toml").write_text(
        f'[tool.vllm-patch]\npython = "{demo_venv}"\npatches = ["demo-fix"]\n')
    proc = cli("apply", cwd=deep, catalog=demo_catalog)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"config: {project / 'pyproject.toml'}\n" in proc.stdout
    assert "applied" in proc.stdout
    # A pyproject.toml without the table is still the project, and said to be.
    (project / "pyproject.toml").write_text("[project]\nname = 'serve'\n")
    proc = cli("status", "--python", str(demo_venv), cwd=deep, catalog=demo_catalog)
    assert (f"config: {project / 'pyproject.toml'} (no [tool.vllm-patch] table)"
            in proc.stdout), proc.stdout
    # A repository root between here and the pyproject.toml ends the search.
    (project / "src" / ".git").mkdir()
    proc = cli("status", "--python", str(demo_venv), cwd=deep, catalog=demo_catalog)
    assert "config:" not in proc.stdout, proc.stdout


def test_revert_needs_no_valid_configuration(tmp_path: Path, demo_venv: Path,
                                             demo_catalog: Path) -> None:
    """A broken pyproject.toml blocks apply (exit 2) but not revert, which says why it went
    on without it and removes every block of ours."""
    project = tmp_path / "serve"
    project.mkdir()
    (project / "pyproject.toml").write_text('[tool.vllm-patch]\npatches = ["demo-fix"]\n')
    assert cli("apply", "--python", str(demo_venv), cwd=project,
               catalog=demo_catalog).returncode == 0
    (project / "pyproject.toml").write_text("[tool.vllm-patch\npatches = [")
    assert cli("apply", "--python", str(demo_venv), cwd=project,
               catalog=demo_catalog).returncode == 2
    proc = cli("revert", "--python", str(demo_venv), cwd=project, catalog=demo_catalog)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "reverted" in proc.stdout and "not a usable configuration" in proc.stdout
    core = site_packages(demo_venv.parent.parent) / "demo_pkg" / "core.py"
    assert "hatch-vllm-patch" not in core.read_text()


def test_verify_with_nothing_selected_names_the_blocks_left(tmp_path: Path, demo_venv: Path,
                                                             demo_catalog: Path) -> None:
    """Nothing selected but blocks of ours left (the table removed, as in an uninstall; a
    table selecting nothing; an `apply --patch` of the past): verify fails (exit 1, drift) and
    names each block and `vllm-patch revert`; a block another project selects is not this
    one's drift; with no block left, nothing selected is the usage error it was (exit 2)."""
    python = str(demo_venv)
    project = tmp_path / "serve"
    project.mkdir()
    pyproject = project / "pyproject.toml"
    pyproject.write_text('[tool.vllm-patch]\npatches = ["demo-fix"]\n')

    def vp(*args: str, where: Path = project) -> Any:
        return cli(*args, "--python", python, cwd=where, catalog=demo_catalog)

    assert vp("apply").returncode == 0
    pyproject.write_text("[project]\nname = 'serve'\n")  # the table removed
    proc = vp("verify")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "! not-selected  demo-fix: present but not selected" in proc.stdout, proc.stdout
    assert f"next: vllm-patch revert --python {python} --patch demo-fix" in proc.stdout
    assert "note: nothing is selected, but blocks of hatch-vllm-patch remain" in proc.stdout
    assert "`vllm-patch revert` removes them" in proc.stdout, proc.stdout
    # From elsewhere the block is that project's: named with it, not this place's drift.
    proc = vp("verify", where=tmp_path)
    assert proc.returncode == 0 and f"applied for {pyproject}" in proc.stdout, proc.stdout
    pyproject.write_text("[tool.vllm-patch]\npatches = []\n")  # a table selecting nothing
    proc = vp("verify")
    assert proc.returncode == 1 and "`vllm-patch revert` removes them" in proc.stdout, proc.stdout
    # Another project's block (selected there) is not this project's leftover.
    other = tmp_path / "other"
    other.mkdir()
    (other / "pyproject.toml").write_text('[tool.vllm-patch]\npatches = ["demo-fix"]\n')
    assert vp("apply", where=other).returncode == 0
    proc = vp("verify")
    assert proc.returncode == 0 and "  not-selected  demo-fix" in proc.stdout, proc.stdout
    assert "remain" not in proc.stdout, proc.stdout
    proc = vp("revert")
    assert proc.returncode == 0 and "reverted" in proc.stdout, proc.stdout
    pyproject.write_text("[project]\nname = 'serve'\n")
    proc = vp("verify")
    assert proc.returncode == 2 and "no patches selected" in proc.stderr, proc.stderr


def test_configuration_error_headline_is_the_first_real_error(tmp_path: Path, demo_venv: Path,
                                                              demo_catalog: Path) -> None:
    """A misspelt architecture that leaves nothing selected: the headline is that name with
    its close match, not "add [tool.vllm-patch]"; an unknown id gets a "did you mean"."""
    registry = site_packages(demo_venv.parent.parent) / "vllm" / "model_executor" / "models"
    registry.mkdir(parents=True)
    (registry / "registry.py").write_text(
        '_TEXT_GENERATION_MODELS = {\n    "DemoForCausalLM": ("demo", "Demo"),\n}\n')
    # an installed vllm that lists the file (targets are confined to their distribution)
    info = registry.parents[2] / "vllm-0.20.2.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.20.2\n")
    digest = base64.urlsafe_b64encode(hashlib.sha256(
        (registry / "registry.py").read_bytes()).digest()).rstrip(b"=").decode()
    (info / "RECORD").write_text(f"vllm/model_executor/models/registry.py,sha256={digest},1\n"
                                 "vllm-0.20.2.dist-info/RECORD,,\n")
    project = tmp_path / "serve"
    project.mkdir()
    (project / "pyproject.toml").write_text("[tool.vllm-patch.architectures.DemoForCausalLm]\n")
    proc = cli("verify", "--python", str(demo_venv), cwd=project, catalog=demo_catalog)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    headline = proc.stderr.splitlines()[0]
    assert headline == (f"vllm-patch: error: invalid configuration in {project}/pyproject.toml: "
                        "tool.vllm-patch.architectures: architecture 'DemoForCausalLm' is not "
                        "registered by the installed vLLM; did you mean DemoForCausalLM?")
    proc = cli("verify", "--python", str(demo_venv), "--architecture", "DemoForCausalLm",
               catalog=demo_catalog, cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[0].endswith("did you mean DemoForCausalLM?")
    (project / "pyproject.toml").write_text('[tool.vllm-patch]\npatches = ["demo-fx"]\n')
    proc = cli("verify", "--python", str(demo_venv), cwd=project, catalog=demo_catalog)
    assert proc.returncode == 2 and "unknown patch 'demo-fx' (did you mean demo-fix?" in (
        proc.stderr.splitlines()[0]), proc.stderr


def test_apply_patch_says_how_to_select_it(tmp_path: Path, demo_venv: Path,
                                           demo_catalog: Path) -> None:
    """apply --patch of a patch the project does not select ends with how to select it; none
    when the project selects it already."""
    project = tmp_path / "serve"
    project.mkdir()
    (project / "pyproject.toml").write_text("[project]\nname = 'serve'\n")
    proc = cli("apply", "--python", str(demo_venv), "--patch", "demo-fix", cwd=project,
               catalog=demo_catalog)
    assert proc.returncode == 0
    assert (f'add it to [tool.vllm-patch] in {project}/pyproject.toml: patches = ["demo-fix"]'
            in proc.stdout), proc.stdout
    (project / "pyproject.toml").write_text('[tool.vllm-patch]\npatches = ["demo-fix"]\n')
    proc = cli("apply", "--python", str(demo_venv), "--patch", "demo-fix", cwd=project,
               catalog=demo_catalog)
    assert proc.returncode == 0 and "add it to" not in proc.stdout, proc.stdout


@pytest.mark.parametrize("value, excluded", [
    (None, False), ("hatch_vllm_patch", False), ("other,hatch_vllm_patch", False),
    ("other", True), ("", True),
])
def test_vllm_plugins_that_exclude_the_guard_are_named(tmp_path: Path, demo_venv: Path,
                                                       demo_catalog: Path, value: str | None,
                                                       excluded: bool) -> None:
    """verify and status say when VLLM_PLUGINS (an allow-list; empty: none) leaves the guard
    out; unset or naming it, nothing is said."""
    env = {} if value is None else {"VLLM_PLUGINS": value}
    for command in ("verify", "status"):
        proc = cli(command, "--python", str(demo_venv), "--patch", "demo-fix", env=env,
                   catalog=demo_catalog, cwd=tmp_path)
        assert ("skip the guard" in proc.stdout) == excluded, proc.stdout
    if excluded:
        assert f"VLLM_PLUGINS={value!r}" in proc.stdout


def test_new_says_how_to_select_the_patch(tmp_path: Path, demo_venv: Path,
                                          demo_catalog: Path) -> None:
    """new ID ends by saying how to select the new patch in [tool.vllm-patch]."""
    project = tmp_path / "serve"
    project.mkdir()
    (project / "pyproject.toml").write_text("[project]\nname = 'serve'\n")
    proc = cli("new", "my-fix", "--target", "demo_pkg.core:compute", "--python",
               str(demo_venv), cwd=project, catalog=demo_catalog)
    assert proc.returncode == 0, proc.stderr
    assert (f'select it in [tool.vllm-patch] of {project}/pyproject.toml: patches = ["my-fix"]'
            in proc.stderr), proc.stderr


def test_removal_text_is_never_wrapped_inside_a_word(tmp_path: Path, demo_venv: Path,
                                                     demo_catalog: Path) -> None:
    """A long --removal with hyphenated words comes back from status in one piece."""
    project = tmp_path / "serve"
    project.mkdir()
    (project / "pyproject.toml").write_text("[tool.vllm-patch]\n")
    python = str(demo_venv)
    edit = cli("edit", "demo_pkg.core", "--python", python, cwd=project, catalog=demo_catalog)
    assert edit.returncode == 0, edit.stderr
    module = Path(edit.stdout.strip())
    module.write_text(module.read_text().replace('return "untouched"', 'return "touched"'))
    # textwrap's default would break this line after "hatch-" at 96 columns.
    removal = ("When demo-pkg ships the fix upstream and every deployment that runs this patch "
               "with the hatch-vllm-patch plugin has moved on, delete this folder")
    proc = cli("create", "touch", "--summary", "touch other()", "--why", "a test",
               "--removal", removal, "--python", python, cwd=project, catalog=demo_catalog)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    manifest = (project / "vllm-patches" / "touch" / "patch.toml").read_text()
    assert "vllm-\n" not in manifest and "hatch-\n" not in manifest, manifest
    status = cli("status", "-v", "--python", python, "--patch", "touch", cwd=project,
                 catalog=demo_catalog)
    assert f"remove when: {removal}" in status.stdout, status.stdout


def test_model_option_takes_a_hub_id_from_the_local_cache(tmp_path: Path, demo_venv: Path,
                                                          demo_catalog: Path) -> None:
    """--model Org/Name is read from the Hugging Face cache (refs/main -> its snapshot),
    offline; not cached, the error says where it looked; a directory of that name wins."""
    hub = tmp_path / "hf" / "hub"
    repo = hub / "models--Acme--Demo-7B"
    snapshot = repo / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    (snapshot / "config.json").write_text(json.dumps({"architectures": ["DemoForCausalLM"]}))
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    proc = cli("verify", "--python", str(demo_venv), "--model", "Acme/Demo-7B", "--json",
               env=env, catalog=demo_catalog, cwd=tmp_path)
    [patch] = json.loads(proc.stdout)["patches"]
    assert patch["id"] == "demo-fix" and str(snapshot) in patch["selected_because"][0], patch
    # HF_HUB_CACHE wins over HF_HOME; a model not there is named with the place looked in.
    proc = cli("verify", "--python", str(demo_venv), "--model", "Acme/Demo-7B",
               env={**env, "HF_HUB_CACHE": str(tmp_path / "empty")}, catalog=demo_catalog,
               cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "not in the local Hugging Face cache" in proc.stderr
    assert f"{tmp_path / 'empty'}/models--Acme--Demo-7B/snapshots/*/config.json" in proc.stderr
    # The same id in [tool.vllm-patch] models.
    project = tmp_path / "serve"
    project.mkdir()
    (project / "pyproject.toml").write_text('[tool.vllm-patch]\nmodels = ["Acme/Demo-7B"]\n')
    proc = cli("verify", "--python", str(demo_venv), "--json", env=env, catalog=demo_catalog,
               cwd=project)
    assert [p["id"] for p in json.loads(proc.stdout)["patches"]] == ["demo-fix"], proc.stdout
    # A local folder Acme/Demo-7B is a path, as it is for vLLM.
    local = tmp_path / "Acme" / "Demo-7B"
    local.mkdir(parents=True)
    (local / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    proc = cli("verify", "--python", str(demo_venv), "--model", "Acme/Demo-7B", env=env,
               catalog=demo_catalog, cwd=tmp_path)
    assert proc.returncode == 0 and "selects no patch" in proc.stdout, proc.stdout


@pytest.mark.parametrize("probe", [
    "import demo_pkg.core\nimport torch_that_is_not_installed\n",
    textwrap.dedent("""\
        import json
        try:
            import torch_that_is_not_installed
        except Exception as exc:
            print(json.dumps({"ok": False, "detail": f"{type(exc).__name__}: {exc}"}))
        """),
], ids=["uncaught", "reported"])
def test_deep_probe_that_cannot_import_its_dependencies_passes(tmp_path: Path, demo_venv: Path,
                                                               probe: str) -> None:
    """A deep probe stopped by a missing module of the target (torch in a --no-deps vLLM),
    raised or reported as its verdict, says what is missing and passes the patch, without
    advising revert."""
    catalog = write_demo_catalog(tmp_path / "catalog")
    (catalog / "demo-fix" / "probe.py").write_text(probe)
    assert cli("apply", "--python", str(demo_venv), "--patch", "demo-fix",
               catalog=catalog).returncode == 0
    proc = cli("verify", "--deep", "--python", str(demo_venv), "--patch", "demo-fix",
               catalog=catalog)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "torch_that_is_not_installed" in proc.stdout and "revert" not in proc.stdout
    assert "deep probe could not run in this environment" in proc.stdout


def test_misspelt_module_and_symbol_get_close_matches(tmp_path: Path, demo_venv: Path,
                                                      demo_catalog: Path) -> None:
    """edit / new name the installed modules and functions closest to a misspelt one."""
    project = tmp_path / "serve"
    project.mkdir()
    (project / "pyproject.toml").write_text("[tool.vllm-patch]\n")
    proc = cli("edit", "demo_pkg.cor", "--python", str(demo_venv), cwd=project,
               catalog=demo_catalog)
    assert proc.returncode == 2 and "(did you mean demo_pkg.core?)" in proc.stderr, proc.stderr
    proc = cli("new", "my-fix", "--target", "demo_pkg.core:comput", "--python",
               str(demo_venv), cwd=project, catalog=demo_catalog)
    assert proc.returncode == 2 and "(did you mean compute?)" in proc.stderr, proc.stderr


# --- Ctrl-C -------------------------------------------------------------------------------------

# Each run is one `vllm-patch apply` (0.15 s on 2 idle cores, 0.4 s on busy ones): 30-60 s.
CTRL_C_RUNS = repetitions(150, 600)


@pytest.fixture(scope="module")
def nodeps_vllm(tmp_path_factory: pytest.TempPathFactory, project_wheel: Path) -> Path:
    """vLLM 0.16.0's real files (``--no-deps``: no torch) with hatch-vllm-patch installed from
    its wheel; returns the interpreter. Tests leave it unpatched."""
    from support.venvs import UV, release_venv, run

    python = release_venv(tmp_path_factory.mktemp("nodeps") / "venv", "vllm", "0.16.0")
    run([UV, "pip", "install", "--quiet", "--python", str(python), str(project_wheel)])
    return python


@pytest.mark.slow
def test_deep_probe_in_a_no_deps_vllm_passes_naming_torch(nodeps_vllm: Path,
                                                          tmp_path: Path) -> None:
    """verify --deep on vLLM files without torch: the patch passes, the probe's reason names
    torch as missing, and revert is not advised."""
    script = str(nodeps_vllm.parent / "vllm-patch")
    patch = ("--patch", "kv-cache-page-unification")
    try:
        cli_run = [script, "apply", *patch]
        from support.venvs import run

        run(cli_run, cwd=tmp_path)
        proc = run([script, "verify", "--deep", *patch], cwd=tmp_path, check=False)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "No module named 'torch'" in proc.stdout and "revert" not in proc.stdout
    finally:
        run([script, "revert"], cwd=tmp_path)


def _launcher_interrupted(err: str) -> bool:
    """Is ``err`` CPython's own traceback of a Ctrl-C before our code could catch it: while the
    interpreter started (``site``) or the console script imported our entry point (importlib
    and our modules' top level), never inside a function of ours?"""
    lines = err.strip().splitlines()
    if lines[:1] == ["Fatal Python error: init_import_site: Failed to import the site module"]:
        # during `site`, CPython's start-up ends with this fatal error and exit 1
        lines = lines[2:] if lines[1:2] == ["Python runtime state: initialized"] else lines[1:]
    if len(lines) < 3 or lines[0] != "Traceback (most recent call last):" \
            or lines[-1] != "KeyboardInterrupt":
        return False
    frames = re.findall(r'^\s*File "([^"]+)", line \d+, in (\S+)$', err, re.MULTILINE)
    return bool(frames) and all("hatch_vllm_patch" not in path or name == "<module>"
                                for path, name in frames)


def as_from_a_shell() -> None:
    """A child's SIGINT as a shell gives it: unblocked, default action (a pytest worker may
    pass on a blocked or ignored one)."""
    import signal

    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.signal(signal.SIGINT, signal.SIG_DFL)


SEAM = """
import os, signal, sys
import hatch_vllm_patch._cli as cli
from hatch_vllm_patch.__main__ import entry

def interrupt(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGINT)
    return real(*args, **kwargs)

real = getattr(cli, sys.argv[1])
setattr(cli, sys.argv[1], interrupt)
sys.argv[1:] = ["apply", "--patch", "kv-cache-page-unification"]
sys.exit(entry())
"""


@pytest.mark.parametrize("seam", ["main", "_robust_streams"])
def test_ctrl_c_at_the_seams_of_the_entry_point(tmp_path: Path, seam: str) -> None:
    """A real SIGINT delivered exactly as ``entry`` calls ``main``, and as ``main`` sets up its
    streams (before anything is read): one line and exit 130, never a traceback. The random
    draws below hit this window once in 150 runs of a CI job; here it is hit every time."""
    import subprocess

    proc = subprocess.run([sys.executable, "-c", SEAM, seam], capture_output=True, text=True,
                          cwd=tmp_path, preexec_fn=as_from_a_shell, timeout=120)
    assert (proc.returncode, proc.stdout, proc.stderr) == (
        130, "", "vllm-patch: interrupted; nothing was written\n")


FINALIZER_SEAM = """
import os, signal, sys, time
import hatch_vllm_patch._cli as cli
from hatch_vllm_patch.__main__ import entry

class Dropped:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(2000):  # Python runs the SIGINT handler here, inside __del__
            time.sleep(0.001)

real = cli._main

def main_with_garbage(*args, **kwargs):
    Dropped()  # collected at once: its __del__ runs now
    return real(*args, **kwargs)

cli._main = main_with_garbage
sys.argv[1:] = ["apply", "--patch", "kv-cache-page-unification"]
sys.exit(entry())
"""


def test_ctrl_c_inside_a_finalizer_stops_the_command(tmp_path: Path) -> None:
    """A real SIGINT handled inside an object's ``__del__`` (Python would print "Exception
    ignored in" with a traceback and carry on, exit 0) stops the command like any Ctrl-C: one
    line and exit 130."""
    import subprocess

    proc = subprocess.run([sys.executable, "-c", FINALIZER_SEAM], capture_output=True,
                          text=True, cwd=tmp_path, preexec_fn=as_from_a_shell, timeout=120)
    assert (proc.returncode, proc.stdout, proc.stderr) == (
        130, "", "vllm-patch: interrupted; nothing was written\n")


@pytest.mark.slow
def test_ctrl_c_at_random_moments_of_apply(tmp_path: Path, nodeps_vllm: Path) -> None:
    """Real SIGINTs at random moments of `vllm-patch apply` (the console script) on vLLM
    0.16.0's real files: exit 130 with one line and no traceback, the file original or fully
    patched, "nothing was written" only when nothing was, else the files named."""
    import os
    import random
    import signal
    import statistics
    import subprocess
    import time

    from support.venvs import run

    python = nodeps_vllm
    script = str(python.parent / "vllm-patch")
    sp = site_packages(python.parent.parent)
    target = sp / "vllm" / "v1" / "core" / "kv_cache_utils.py"
    record = sp / ".hatch-vllm-patch.json"
    original = target.read_bytes()
    command = [script, "apply", "--patch", "kv-cache-page-unification"]

    def restore() -> None:
        scratch = target.with_name(".restore.tmp")
        scratch.write_bytes(original)
        os.replace(scratch, target)
        record.unlink(missing_ok=True)

    durations = []
    for _ in range(3):
        start = time.monotonic()
        run(command, cwd=tmp_path)
        durations.append(time.monotonic() - start)
        patched = target.read_bytes()
        restore()
    assert patched != original
    # Before the package's first line runs, CPython is starting and looking for it: a SIGINT
    # there is CPython's own (README, "The command line"); the draws start after it.
    startup = []
    for _ in range(5):
        start = time.monotonic()
        run([str(python), "-c", "import hatch_vllm_patch.__main__"])
        startup.append(time.monotonic() - start)
    first, last = max(startup) * 1.5, statistics.median(durations) * 1.2
    rng = random.Random(16)
    seen: dict[str, int] = {"finished": 0, "nothing written": 0, "after writing": 0,
                            "before Python ran": 0}
    # A child inherits its parent's SIGINT mask and an ignored SIGINT; a pytest worker that ran
    # other tests first may pass on either, and then no SIGINT ever lands (seen once in a full
    # run on two workers: 150 runs, all finished). Each child gets SIGINT as a shell gives it.
    print(f"this process: SIGINT handler {signal.getsignal(signal.SIGINT)}, blocked "
          f"{signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, [])}")

    for i in range(CTRL_C_RUNS):
        delay = rng.uniform(first, last)
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, cwd=tmp_path, preexec_fn=as_from_a_shell)
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
        content = target.read_bytes()
        where = f"run {i}, SIGINT after {delay * 1000:.1f} ms: exit {proc.returncode}\n{err}"
        assert "Traceback" not in err + out or _launcher_interrupted(err), where
        assert content in (original, patched), where
        if proc.returncode == 0:  # the work was done before the signal (or was being printed)
            assert content == patched and out.rstrip().endswith("OK"), where
            seen["finished"] += 1
        elif proc.returncode == -signal.SIGINT or (proc.returncode == 1
                                                   and _launcher_interrupted(err)):
            # Killed by the signal itself: it came before CPython set up its handler, during
            # `site` (CPython's fatal start-up error, exit 1), or while
            # the console script was still importing our entry point, CPython's own traceback
            # of that one line (a loaded machine starts the process that late, past the draws'
            # lower bound). Nothing of ours ran: nothing written.
            assert out == "" and content == original and not record.exists(), where
            assert err == "" or _launcher_interrupted(err), where
            seen["before Python ran"] += 1
        else:
            assert proc.returncode == 130 and out == "" and err.count("\n") == 1, where
            if err == "vllm-patch: interrupted; nothing was written\n":
                assert content == original and not record.exists(), where
                seen["nothing written"] += 1
            else:
                assert err.startswith("vllm-patch: interrupted after writing "), where
                named = err.split(" after writing ", 1)[1]
                assert (str(target) in named) == (content == patched), where
                assert (str(record) in named) == record.exists(), where
                seen["after writing"] += 1
        restore()
    run([script, "revert"], cwd=tmp_path)
    print(f"{CTRL_C_RUNS} SIGINTs between {first * 1000:.0f} and {last * 1000:.0f} ms: {seen}")
    assert seen["nothing written"] and seen["after writing"], seen


def test_authoring_commands_json_matches_the_schema(tmp_path: Path, demo_venv: Path,
                                                    demo_catalog: Path, validator: Any) -> None:
    """edit / create / new / check --json: the same schema, with what each made in `result`;
    their failures too."""
    project = tmp_path / "serve"
    project.mkdir()
    (project / "pyproject.toml").write_text("[tool.vllm-patch]\n")
    python = str(demo_venv)

    def run(*args: str) -> dict[str, Any]:
        return json_run(validator, *args, "--python", python, catalog=demo_catalog, cwd=project)

    doc = run("new", "my-wrap", "--target", "demo_pkg.core:compute")
    folder = project / "vllm-patches" / "my-wrap"
    assert doc["exit_code"] == 0 and doc["result"] == {"folder": str(folder)}
    assert 'patches = ["my-wrap"]' in doc["notes"][0]
    doc = run("check")
    assert [f["folder"] for f in doc["result"]["folders"]] == [str(folder)]
    doc = run("edit", "demo_pkg.core")
    assert doc["result"]["state"] == "open" and doc["exit_code"] == 0
    module = Path(doc["result"]["file"])
    module.write_text(module.read_text().replace('return "untouched"', 'return "touched"'))
    doc = run("create", "touch", "--summary", "touch other()", "--why", "a test")
    assert doc["exit_code"] == 0 and doc["result"]["changes"] == [
        {"symbol": "other", "added": False}], doc
    assert {p["id"]: p["verdict"] for p in doc["patches"]}["touch"] == "applied"
    assert run("edit", "demo_pkg.cor")["exit_code"] == 2
    assert run("new", "Bad_Id", "--target", "demo_pkg.core:compute")["exit_code"] == 2


def test_a_ctrl_c_wrapped_by_a_loading_module_is_a_ctrl_c() -> None:
    """A KeyboardInterrupt that a module being imported wrapped (``__set_name__`` raising a
    RuntimeError from it, as ipaddress does) counts as Ctrl-C; any other error does not."""
    from hatch_vllm_patch.__main__ import interrupted

    try:
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt as inner:
            raise RuntimeError("Error calling __set_name__") from inner
    except RuntimeError as wrapped:
        assert interrupted(wrapped)
    assert interrupted(KeyboardInterrupt())
    assert not interrupted(RuntimeError("a real error"))


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give the folder to another user")
def test_a_project_found_above_must_pass_the_ownership_rule(tmp_path: Path, demo_venv: Path,
                                                            demo_catalog: Path) -> None:
    """A pyproject.toml another user owns in a parent folder never configures the command (as
    git refuses a repository owned by someone else): exit 2 naming it, nothing written; in the
    folder itself, or named with --project, it is the user's choice."""
    project = tmp_path / "theirs"
    deep = project / "sub"
    deep.mkdir(parents=True)
    (project / "pyproject.toml").write_text(
        f'[tool.vllm-patch]\npython = "{demo_venv}"\npatches = ["demo-fix"]\n')
    for path in (project, deep, project / "pyproject.toml"):
        os.chown(path, 65534, 65534)
    core = site_packages(demo_venv.parent.parent) / "demo_pkg" / "core.py"
    before = core.read_bytes()
    proc = cli("apply", cwd=deep, catalog=demo_catalog)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    assert str(project) in proc.stderr and "uid 65534" in proc.stderr, proc.stderr
    assert "--project" in proc.stderr and core.read_bytes() == before
    named = cli("apply", "--project", str(project), cwd=deep, catalog=demo_catalog)
    assert named.returncode == 0 and "applied" in named.stdout, named.stdout + named.stderr
