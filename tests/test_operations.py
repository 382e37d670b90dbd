"""apply / verify / revert / status / diff end to end: a real wheel, a real venv, the CLI."""

from __future__ import annotations

import hashlib
import json
import os
import textwrap
from pathlib import Path

import pytest
from conftest import DEMO_SOURCE, cli, write_demo_catalog, write_demo_project
from venvs import UV, create_venv, record_sha256, run, site_packages, venv_python


def core_file(python: Path) -> Path:
    return site_packages(python.parent.parent) / "demo_pkg" / "core.py"


def core_record(python: Path) -> str:
    """The sha256 RECORD gives for demo_pkg/core.py, as hex."""
    return record_sha256(site_packages(python.parent.parent), "demo-pkg", "demo_pkg/core.py")


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


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
                     "'demo-fx' (known patches: demo-fix)",
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
    ("other-pkg", "demo_pkg.core", "is not a file of other-pkg: other-pkg is not installed"),
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


def test_edit_refuses_a_module_of_no_distribution(demo_venv: Path, tmp_path: Path) -> None:
    """`vllm-patch edit` of a standard-library module is refused (exit 2) and writes nothing."""
    proc = cli("edit", "json.decoder", "--python", str(demo_venv), cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "refused" in proc.stderr and "belongs to no installed distribution" in proc.stderr
    site = site_packages(demo_venv.parent.parent)
    assert not (site / ".hatch-vllm-patch.json").exists()
    assert not (site / ".hatch-vllm-patch-edits").exists()
