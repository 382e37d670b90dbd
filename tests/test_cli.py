"""The command line on bad input and in odd situations: one clear line, the right exit code,
never a traceback — checked by hand-picked cases and by hypothesis over the inputs a user
controls (the [tool.vllm-patch] table, pyproject.toml's bytes, a model's config.json)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from support.commands import cli, main_in_process
from support.demo import DEMO_BLOCK, write_demo_catalog, write_demo_project
from support.venvs import UV, create_venv, run, site_packages

FUZZ = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow])


@contextlib.contextmanager
def catalog_env(root: Path) -> Iterator[None]:
    saved = os.environ.get("HATCH_VLLM_PATCH_CATALOG")
    os.environ["HATCH_VLLM_PATCH_CATALOG"] = str(root)
    try:
        yield
    finally:
        if saved is None:
            del os.environ["HATCH_VLLM_PATCH_CATALOG"]
        else:
            os.environ["HATCH_VLLM_PATCH_CATALOG"] = saved


@pytest.fixture(scope="module")
def fuzz_catalog(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_demo_catalog(tmp_path_factory.mktemp("fuzz-catalog"))


# --- TOML from hypothesis values ---------------------------------------------------------------

def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return "{" + ", ".join(f"{json.dumps(k)} = {toml_value(v)}" for k, v in value.items()) + "}"


KEYS = st.sampled_from(["python", "models", "architectures", "guard", "patches", "patch-dir",
                        "DemoForCausalLM", "Qwen3_5MoeForConditionalGeneration", "x", ""])
SCALARS = st.one_of(st.booleans(), st.integers(-10**6, 10**6),
                    st.floats(allow_nan=False, allow_infinity=False),
                    st.text(max_size=12), st.sampled_from(["demo-fix", "./m", ".venv", "apply"]))
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(KEYS, inner, max_size=3)), max_leaves=10)


def project_dir(pyproject: bytes, model_config: bytes | None = None
                ) -> tempfile.TemporaryDirectory[str]:
    folder = tempfile.TemporaryDirectory()
    root = Path(folder.name)
    (root / "pyproject.toml").write_bytes(pyproject)
    if model_config is not None:
        (root / "m").mkdir()
        (root / "m" / "config.json").write_bytes(model_config)
    return folder


def check_outcome(code: int, out: str, err: str) -> None:
    assert "Traceback" not in out + err
    assert code in (0, 1, 2), (code, out, err)
    if "invalid configuration" in err or "no patches selected" in err:
        assert code == 2, (code, err)
    if code == 2:
        assert err.startswith("vllm-patch: error: "), err


@FUZZ
@given(table=st.dictionaries(KEYS, VALUES, max_size=5))
@example(table={"guard": 3, "models": [1], "architectures": {"A": []}})
@example(table={"models": "./m", "python": "", "architectures": {"DemoForCausalLM": {}}})
def test_any_tool_vllm_patch_table(fuzz_catalog: Path, table: dict[str, Any]) -> None:
    """Any [tool.vllm-patch] table: a verdict, or exit 2 with the problems; never a traceback."""
    text = "[tool]\n" + f'"vllm-patch" = {toml_value(table)}\n'
    with project_dir(text.encode(), b'{"architectures": ["DemoForCausalLM"]}') as folder, \
            catalog_env(fuzz_catalog):
        check_outcome(*main_in_process("verify", "--project", folder, "--python",
                                       sys.executable))


@FUZZ
@given(data=st.one_of(st.binary(max_size=200), st.builds(
    lambda head, tail: head + tail,
    st.sampled_from([b"[tool.vllm-patch]\n", b"tool = ", b"[tool]\nvllm-patch = ", b"\xff\xfe"]),
    st.binary(max_size=60))))
@example(data=b'tool = "yes"\n')
@example(data=b'[tool]\nvllm-patch = 1\n')
@example(data=b'[tool.vllm-patch]\npython = "\xff"\n')
def test_any_pyproject_bytes(fuzz_catalog: Path, data: bytes) -> None:
    """Arbitrary pyproject.toml bytes (not UTF-8, not TOML, `tool = "yes"`): no traceback."""
    with project_dir(data) as folder, catalog_env(fuzz_catalog):
        check_outcome(*main_in_process("apply", "--project", folder, "--python",
                                       sys.executable))


@FUZZ
@given(config=st.one_of(st.binary(max_size=80), VALUES.map(lambda v: json.dumps(v).encode()),
                        st.dictionaries(st.sampled_from(["architectures", "model_type",
                                                         "text_config", "layer_types"]),
                                        VALUES, max_size=4).map(lambda v: json.dumps(v).encode())))
@example(config=b"[]")
@example(config=b'{"architectures": "x", "text_config": []}')
@example(config=b"\xff")
def test_any_model_config(fuzz_catalog: Path, config: bytes) -> None:
    """Any config.json in a model directory of [tool.vllm-patch] models: no traceback; an
    unusable one is a configuration error (exit 2)."""
    pyproject = b'[tool.vllm-patch]\nmodels = ["./m"]\n'
    with project_dir(pyproject, config) as folder, catalog_env(fuzz_catalog):
        code, out, err = main_in_process("verify", "--project", folder, "--python",
                                         sys.executable)
        check_outcome(code, out, err)
        try:
            usable = isinstance(json.loads(config), dict)
        except ValueError:
            usable = False
        if not usable:
            assert code == 2 and "config.json" in err


@FUZZ
@given(answer=st.one_of(VALUES, st.fixed_dictionaries(
    {"executable": VALUES, "prefix": SCALARS, "python_version": SCALARS, "purelib": SCALARS,
     "distributions": VALUES, "modules": VALUES})))
def test_any_probe_answer(answer: Any) -> None:
    """Whatever a target interpreter answers to the environment probe, the result is a
    description of the environment or one TargetEnvironmentError naming the interpreter."""
    from hatch_vllm_patch.environment import InterpreterChoice, _environment
    from hatch_vllm_patch.errors import TargetEnvironmentError

    choice = InterpreterChoice(Path("/fake/python"), "given with --python")
    try:
        _environment(choice, answer, {"demo_pkg.core"})
    except TargetEnvironmentError as exc:
        assert "/fake/python" in str(exc)


# --- hand-picked cases -------------------------------------------------------------------------

def fake_interpreter(folder: Path, body: str) -> Path:
    script = folder / "python"
    script.write_text("#!/bin/sh\n" + body + "\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


@pytest.mark.parametrize("name, body", [
    ("echo", None),
    ("no JSON", "echo hello"),
    ("a list", "echo '[1, 2]'"),
    ("wrong types", """echo '{"executable": 1, "prefix": "/", "python_version": "3",
      "purelib": "/x", "distributions": {}, "modules": {}}'"""),
    ("no module answer", """echo '{"executable": "/x", "prefix": "/", "python_version": "3",
      "purelib": "/x", "distributions": {}, "modules": {}}'"""),
    ("fails", "echo boom >&2; exit 3"),
])
def test_python_that_does_not_answer_the_probe(tmp_path: Path, demo_catalog: Path, name: str,
                                               body: str | None) -> None:
    """--python /bin/echo or any interpreter whose answer is not the probe's: a usage error
    (exit 2, like every unusable --python), one line."""
    python = "/bin/echo" if body is None else str(fake_interpreter(tmp_path, body))
    proc = cli("verify", "--python", python, "--patch", "demo-fix", catalog=demo_catalog)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
    assert python in proc.stderr


@pytest.mark.parametrize("value, message", [
    ("", "--python: an empty path"),
    ("{dir}", "is not a Python environment"),
])
def test_python_option_usage_errors(tmp_path: Path, demo_catalog: Path, value: str,
                                    message: str) -> None:
    """--python "" and a directory that is no environment are usage errors (exit 2)."""
    proc = cli("verify", "--python", value.format(dir=tmp_path), "--patch", "demo-fix",
               catalog=demo_catalog)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert "Permission denied" not in proc.stderr and "Traceback" not in proc.stderr


def test_configuration_that_selects_nothing_exits_0(tmp_path: Path, demo_venv: Path,
                                                    demo_catalog: Path) -> None:
    """A [tool.vllm-patch] for a model that needs no patch: said so, exit 0; no table and no
    selection on the command line is still exit 2."""
    project = tmp_path / "fleet"
    project.mkdir()
    (project / "pyproject.toml").write_text(
        "[tool.vllm-patch.architectures.LlamaForCausalLM]\n")
    proc = cli("verify", "--python", str(demo_venv), cwd=project, catalog=demo_catalog)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "selects no patch for what it serves" in proc.stdout
    assert "no patch in the catalog is meant for LlamaForCausalLM" in proc.stdout
    (project / "pyproject.toml").write_text("[project]\nname = 'fleet'\n")
    proc = cli("verify", "--python", str(demo_venv), cwd=project, catalog=demo_catalog)
    assert proc.returncode == 2 and "no patches selected" in proc.stderr


def test_model_that_needs_no_patch_exits_0(tmp_path: Path, demo_venv: Path,
                                           demo_catalog: Path) -> None:
    """--model of a model no patch is for: exit 0 with a note."""
    model = tmp_path / "llama"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    proc = cli("apply", "--python", str(demo_venv), "--model", str(model), cwd=tmp_path,
               catalog=demo_catalog)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "the command line selects no patch" in proc.stdout


def test_modified_editable_file_suggests_restoring_the_checkout(tmp_path: Path,
                                                                demo_catalog: Path) -> None:
    """A hand edit of a patched file in an editable checkout is `modified` (the ledger guards
    it), and the next step is to restore the file in the checkout, not a reinstall."""
    checkout = write_demo_project(tmp_path / "checkout")
    python = create_venv(tmp_path / "venv")
    run([UV, "pip", "install", "--quiet", "--python", str(python), "-e", str(checkout)])
    assert cli("apply", "--python", str(python), "--patch", "demo-fix",
               catalog=demo_catalog).returncode == 0
    target = checkout / "demo_pkg" / "core.py"
    target.write_text(target.read_text().replace("return max(values)", "return min(values)"))
    proc = cli("verify", "--python", str(python), "--patch", "demo-fix", "--json",
               catalog=demo_catalog)
    [outcome] = json.loads(proc.stdout)["patches"]
    assert (proc.returncode, outcome["verdict"]) == (1, "modified")
    assert "in its checkout" in outcome["next_step"] and "--reinstall" not in outcome["next_step"]
    revert = cli("revert", "--python", str(python), "--patch", "demo-fix", catalog=demo_catalog)
    assert revert.returncode == 1 and "min(values)" in target.read_text()


PROBE = textwrap.dedent("""\
    import json, sys
    print(json.dumps({PAYLOAD}))
    sys.exit({CODE})
    """)


@pytest.mark.parametrize("payload, code, exit_code, expected", [
    ('{"ok": True, "detail": "fine"}', 0, 0, "deep probe passed: fine"),
    ('{"skipped": "needs the Neuron SDK"}', 0, 0,
     "deep probe could not run on this machine: needs the Neuron SDK"),
    ('{"ok": False, "detail": "wrapped twice"}', 1, 1, "deep probe failed: wrapped twice"),
])
def test_deep_probe_outcomes(tmp_path: Path, demo_venv: Path, payload: str, code: int,
                             exit_code: int, expected: str) -> None:
    """verify --deep: a passing probe, one that cannot run here (not a failure), a failing one
    (the `error` verdict, exit 1)."""
    catalog = write_demo_catalog(tmp_path / "catalog")
    (catalog / "demo-fix" / "probe.py").write_text(
        PROBE.replace("{PAYLOAD}", payload).replace("{CODE}", str(code)))
    assert cli("apply", "--python", str(demo_venv), "--patch", "demo-fix",
               catalog=catalog).returncode == 0
    proc = cli("verify", "--deep", "--python", str(demo_venv), "--patch", "demo-fix", "--json",
               catalog=catalog)
    [outcome] = json.loads(proc.stdout)["patches"]
    assert proc.returncode == exit_code and expected in outcome["reason"], outcome
    assert outcome["verdict"] == ("error" if exit_code else "applied")


@pytest.mark.parametrize("tail, exit_code, expected", [
    ("", 0, "deep probe passed: imported demo_pkg.core; 1 symbol(s) are the block's"),
    ("compute = _hvp_demo_original\n", 1,
     "deep probe failed: demo_pkg.core.compute is not the block's after import"),
])
def test_deep_without_a_probe_checks_the_binding(tmp_path: Path, demo_venv: Path, tail: str,
                                                 exit_code: int, expected: str) -> None:
    """verify --deep of a patch with no probe.py imports the patched module in the target and
    confirms the symbol is the block's; a block that leaves the original bound fails."""
    from support.demo import DEMO_BLOCK

    catalog = write_demo_catalog(tmp_path / "catalog", block=DEMO_BLOCK + tail)
    assert cli("apply", "--python", str(demo_venv), "--patch", "demo-fix",
               catalog=catalog).returncode == 0
    proc = cli("verify", "--deep", "--python", str(demo_venv), "--patch", "demo-fix", "--json",
               catalog=catalog)
    [outcome] = json.loads(proc.stdout)["patches"]
    assert proc.returncode == exit_code and expected in outcome["reason"], outcome


@pytest.mark.parametrize("patch_id", ["neuron-runner-kv-spec", "neuron-platform-prefix-caching"])
def test_neuron_probes_say_when_the_neuron_sdk_is_absent(tmp_path: Path, patch_id: str) -> None:
    """The Neuron probes report `skipped` (exit 0) when the plugin imports the Neuron SDK and it
    is not installed, as on every machine without Trainium."""
    package = tmp_path / "vllm_neuron"
    (package / "worker").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "worker" / "__init__.py").write_text("")
    for rel in ("platform.py", "worker/neuronx_distributed_model_runner.py"):
        (package / rel).write_text("import neuronx_distributed_inference  # the Neuron SDK\n")
    probe = Path(__file__).resolve().parents[1] / "patches" / patch_id / "probe.py"
    proc = run([sys.executable, str(probe)], env={"PYTHONPATH": str(tmp_path)}, check=False)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "neuronx_distributed_inference" in data["skipped"]


def test_status_prints_each_patchs_account(demo_venv: Path, demo_catalog: Path) -> None:
    """status -v shows each patch's file, summary, why, links and removal condition."""
    proc = cli("status", "-v", "--python", str(demo_venv), catalog=demo_catalog)
    assert proc.returncode == 0
    for expected in ("file: ", "selected for: all catalog patches",
                     "summary: Make demo_pkg.core.compute return 0 for an empty list",
                     "why:", "Test patch.", "link: https://example.invalid/demo/1",
                     "remove when: When demo-pkg fixes compute()."):
        assert expected in proc.stdout, proc.stdout
    data = json.loads(cli("status", "--python", str(demo_venv), "--json",
                          catalog=demo_catalog).stdout)
    [outcome] = data["patches"]
    assert outcome["links"] == ["https://example.invalid/demo/1"]
    assert outcome["removal"] == "When demo-pkg fixes compute()."


def test_project_option_from_another_directory(tmp_path: Path, demo_wheels: dict[str, Path],
                                               demo_catalog: Path) -> None:
    """--project DIR reads DIR's pyproject.toml and patches DIR/.venv from anywhere."""
    project = tmp_path / "serve"
    project.mkdir()
    (project / "pyproject.toml").write_text("[tool.vllm-patch.architectures.DemoForCausalLM]\n")
    create_venv(project / ".venv", str(demo_wheels["1.0.0"]))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    proc = cli("apply", "--project", str(project), cwd=elsewhere, catalog=demo_catalog)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"config: {project / 'pyproject.toml'}" in proc.stdout
    assert "the project's .venv" in proc.stdout
    target = site_packages(project / ".venv") / "demo_pkg" / "core.py"
    assert "hatch-vllm-patch: demo-fix" in target.read_text()


def test_stale_block_through_the_cli(tmp_path: Path, demo_venv: Path) -> None:
    """A block written by another version of the patch: verify says stale (exit 1), apply
    replaces it (exit 0), verify passes."""
    old = write_demo_catalog(tmp_path / "old", block=DEMO_BLOCK.replace("return 0", "return 00"))
    new = write_demo_catalog(tmp_path / "new")
    assert cli("apply", "--python", str(demo_venv), "--patch", "demo-fix",
               catalog=old).returncode == 0
    stale = cli("verify", "--python", str(demo_venv), "--patch", "demo-fix", catalog=new)
    assert stale.returncode == 1 and "stale" in stale.stdout and "another version" in stale.stdout
    assert "next: run: vllm-patch apply" in stale.stdout
    updated = cli("apply", "--python", str(demo_venv), "--patch", "demo-fix", catalog=new)
    assert updated.returncode == 0 and "updated a stale block" in updated.stdout
    assert cli("verify", "--python", str(demo_venv), "--patch", "demo-fix",
               catalog=new).returncode == 0


def test_selection_is_the_union_with_one_reason_line_per_patch(tmp_path: Path,
                                                               demo_venv: Path) -> None:
    """Two patches, selected through a model, an architecture table and the top-level list:
    both are selected (the union), each with its own reasons, none repeated."""
    catalog = write_demo_catalog(tmp_path / "catalog")
    second = catalog / "demo-two"
    shutil.copytree(catalog / "demo-fix", second)
    toml = second / "patch.toml"
    toml.write_text(toml.read_text().replace('id = "demo-fix"', 'id = "demo-two"')
                    .replace('["DemoForCausalLM"]', '["OtherForCausalLM"]'))
    project = tmp_path / "serve"
    (project / "model").mkdir(parents=True)
    (project / "model" / "config.json").write_text(
        json.dumps({"architectures": ["DemoForCausalLM"]}))
    (project / "pyproject.toml").write_text(textwrap.dedent("""\
        [tool.vllm-patch]
        models = ["./model"]
        patches = ["demo-two"]
        [tool.vllm-patch.architectures.DemoForCausalLM]
        [tool.vllm-patch.architectures.OtherForCausalLM]
        """))
    proc = cli("status", "--python", str(demo_venv), "--json", cwd=project, catalog=catalog)
    why = {p["id"]: p["selected_because"] for p in json.loads(proc.stdout)["patches"]}
    assert set(why) == {"demo-fix", "demo-two"}
    assert why["demo-fix"] == [f"DemoForCausalLM (catalog default, via DemoForCausalLM in "
                               f"{project / 'model'}/config.json)"]
    assert why["demo-two"] == ["[tool.vllm-patch] patches (for every model served)",
                               "OtherForCausalLM (catalog default)"]


def test_version_names_the_builtin_catalog(tmp_path: Path) -> None:
    """`--version` prints the package's version, and the built-in catalog's: the same version,
    its patch count and the start of its content digest."""
    from support import REPO

    from hatch_vllm_patch import __version__
    from hatch_vllm_patch.catalog import catalog_digest, load_catalog

    catalog = load_catalog(REPO / "patches")
    proc = cli("--version", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout == (f"vllm-patch {__version__} (catalog {__version__}: {len(catalog)} "
                           f"patches, sha256 {catalog_digest(catalog)[:12]})\n")


def test_version_names_an_overriding_catalog(tmp_path: Path) -> None:
    """A catalog of $HATCH_VLLM_PATCH_CATALOG is named as such (it has no version); an
    unreadable one is named too, and exits 1."""
    from hatch_vllm_patch import __version__
    from hatch_vllm_patch.catalog import catalog_digest, load_catalog

    catalog = write_demo_catalog(tmp_path / "catalog")
    proc = cli("--version", cwd=tmp_path, catalog=catalog)
    digest = catalog_digest(load_catalog(catalog))[:12]
    assert proc.stdout == (f"vllm-patch {__version__} (catalog from $HATCH_VLLM_PATCH_CATALOG: "
                           f"1 patch, sha256 {digest})\n"), proc.stdout + proc.stderr
    assert proc.returncode == 0
    (catalog / "demo-fix" / "patch.toml").write_text("id = \n")
    broken = cli("--version", cwd=tmp_path, catalog=catalog)
    assert broken.returncode == 1
    assert broken.stdout.startswith(f"vllm-patch {__version__} (catalog unreadable: "), \
        broken.stdout
