"""The third trust review (issue 30): a patch switches off only a patch it overlaps, two
projects never stack blocks of one symbol, doctor reads a model folder as foreign data, and the
smaller findings. Real subprocesses and venvs with the demo distribution; as root, uid 65534
is the other user where a case is about another user."""

from __future__ import annotations

import json
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest
from support.commands import cli
from support.demo import DEMO_BLOCK, DEMO_PROCESS, DEMO_SOURCE, vllm_like, write_demo_catalog
from support.venvs import UV, create_venv, run, site_packages

from hatch_vllm_patch.catalog import load_patch_folders, shared_symbol
from hatch_vllm_patch.engine import symbol_digest
from hatch_vllm_patch.errors import CatalogError
from hatch_vllm_patch.selection import without_replaced
from hatch_vllm_patch.trust import chosen

RECORD = ".hatch-vllm-patch.json"


OTHER_BLOCK = textwrap.dedent('''\
    def other():
        return "patched"
    ''')


def own_patch(folder: Path, patch_id: str, symbol: str, block: str, *,
              replaces: tuple[str, ...] = ()) -> Path:
    """A project's own patch ``patch_id`` of ``demo_pkg.core.<symbol>`` in ``folder``."""
    where = folder / patch_id
    where.mkdir(parents=True)
    listed = f"replaces = {json.dumps(list(replaces))}\n" if replaces else ""
    digest = symbol_digest(DEMO_SOURCE, symbol)
    (where / "patch.toml").write_text(textwrap.dedent(f"""\
        id = "{patch_id}"
        summary = "{patch_id} of demo_pkg.core.{symbol}"
        {listed}
        [target]
        distribution = "demo-pkg"
        module = "demo_pkg.core"
        symbol = "{symbol}"

        [applies]
        shapes = ["{digest}"]
        """))
    (where / "block.py").write_text(block)
    return where


def own_project(root: Path, *patches: str) -> Path:
    """A project selecting ``patches`` from its own ``vllm-patches`` folder (guard error)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "pyproject.toml").write_text(textwrap.dedent(f"""\
        [project]
        name = "{root.name}"
        version = "1.0"

        [tool.vllm-patch]
        patches = {json.dumps(list(patches))}
        """))
    return root


# --- 1. `replaces` names only a patch it overlaps -----------------------------------------------

def test_replaces_of_an_unrelated_patch_is_refused_at_load(tmp_path: Path) -> None:
    """A folder whose b-fix (of `other`) replaces a-fix (of `compute`): the catalog is refused,
    naming both and both symbols; without_replaced never drops a patch sharing no symbol."""
    root = tmp_path / "patches"
    own_patch(root, "a-fix", "compute", DEMO_BLOCK)
    own_patch(root, "b-fix", "other", OTHER_BLOCK, replaces=("a-fix",))
    with pytest.raises(CatalogError) as refused:
        load_patch_folders(chosen(root))
    message = str(refused.value)
    for part in ("b-fix", "'a-fix'", "demo_pkg.core.compute", "demo_pkg.core.other",
                 "shares no symbol"):
        assert part in message, message
    (root / "b-fix" / "patch.toml").write_text(
        (root / "b-fix" / "patch.toml").read_text().replace('replaces = ["a-fix"]\n', ""))
    catalog = load_patch_folders(chosen(root))
    a, b = catalog["a-fix"], catalog["b-fix"]
    assert shared_symbol(a, b) is None
    kept, replaced = without_replaced([a, b._replace(replaces=("a-fix",))])
    assert [p.id for p in kept] == ["a-fix", "b-fix"] and replaced == {}


def test_another_projects_replaces_never_switches_a_fix_off(
        tmp_path: Path, demo_wheels: dict[str, Path], project_wheel: Path) -> None:
    """Project A applies a-fix (compute), project B applies b-fix (other) declaring it
    replaces a-fix; after a reinstall, an `error` vLLM process stops naming both instead of
    saying the patches are in place, and an `apply` one does not claim it healed."""
    python = create_venv(tmp_path / "venv", str(demo_wheels["1.0.0"]), str(project_wheel))
    catalog = write_demo_catalog(tmp_path / "catalog")
    first = own_project(tmp_path / "a", "a-fix")
    own_patch(first / "vllm-patches", "a-fix", "compute", DEMO_BLOCK)
    second = own_project(tmp_path / "b", "b-fix")
    own_patch(second / "vllm-patches", "b-fix", "other", OTHER_BLOCK, replaces=("a-fix",))
    env = {"HATCH_VLLM_PATCH_CATALOG": str(catalog)}
    for project in (first, second):
        proc = run([str(python), "-m", "hatch_vllm_patch", "apply"], cwd=project, env=env,
                   check=False)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    run([UV, "pip", "install", "--quiet", "--reinstall", "--no-deps", "--python", str(python),
         str(demo_wheels["1.0.0"])])
    stopped = vllm_like(python, tmp_path, mode="error", catalog=catalog)
    assert stopped.returncode == 1, stopped.stdout + stopped.stderr
    assert "patches in place" not in stopped.stdout and "Traceback" not in stopped.stderr
    assert "b-fix" in stopped.stderr and "'a-fix'" in stopped.stderr, stopped.stderr
    healing = vllm_like(python, tmp_path, mode="apply", catalog=catalog)
    assert healing.returncode == 1 and "healed (b-fix)" not in healing.stdout


# --- 2. two projects never stack blocks of one symbol -------------------------------------------

def _apply(python: Path, project: Path, catalog: Path, *args: str
           ) -> subprocess.CompletedProcess[str]:
    return cli(*args, "--python", str(python), cwd=project, catalog=catalog)


def test_another_projects_patch_of_the_same_symbol_is_blocked(
        tmp_path: Path, demo_venv: Path) -> None:
    """Project A applies its a-fix of compute; project B's b-fix of compute is blocked before
    writing, naming A's patch and project; blocks stacked by an earlier release (a record with
    no symbols) make both projects' verify fail."""
    catalog = write_demo_catalog(tmp_path / "catalog")
    first = own_project(tmp_path / "a", "a-fix")
    own_patch(first / "vllm-patches", "a-fix", "compute", DEMO_BLOCK)
    second = own_project(tmp_path / "b", "b-fix")
    own_patch(second / "vllm-patches", "b-fix", "compute", DEMO_BLOCK + "# b\n")
    assert _apply(demo_venv, first, catalog, "apply").returncode == 0
    core = site_packages(demo_venv.parent.parent) / "demo_pkg" / "core.py"
    record = site_packages(demo_venv.parent.parent) / RECORD
    after_a = core.read_bytes()
    blocked = _apply(demo_venv, second, catalog, "apply", "--json")
    assert blocked.returncode == 1, blocked.stdout + blocked.stderr
    (outcome,) = [o for o in json.loads(blocked.stdout)["patches"] if o["id"] == "b-fix"]
    assert outcome["verdict"] == "blocked", outcome
    for part in ("a-fix", "demo_pkg.core.compute", str(first / "pyproject.toml")):
        assert part in outcome["reason"], outcome["reason"]
    assert core.read_bytes() == after_a
    # a record of an earlier release (no symbols): the second apply stacks its block
    data = json.loads(record.read_text())
    for entry in data["selection"]["patches"]:
        entry.pop("symbols", None)
    record.write_text(json.dumps(data))
    assert _apply(demo_venv, second, catalog, "apply").returncode == 0
    assert b"hatch-vllm-patch: a-fix" in core.read_bytes()
    assert b"hatch-vllm-patch: b-fix" in core.read_bytes()
    data = json.loads(record.read_text())  # as this release records them
    for entry in data["selection"]["patches"]:
        entry["symbols"] = ["compute"]
    record.write_text(json.dumps(data))
    for project, rival in ((first, "b-fix"), (second, "a-fix")):
        verify = _apply(demo_venv, project, catalog, "verify")
        assert verify.returncode == 1, verify.stdout + verify.stderr
        assert "blocked" in verify.stdout and rival in verify.stdout, verify.stdout


# --- 3. doctor reads a model folder as foreign data ---------------------------------------------

def _model(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(
        {"architectures": ["DemoForCausalLM"], "auto_map": {"AutoConfig": "x.Y"}}))
    (folder / "tokenizer_config.json").write_text("{}")
    return folder


@pytest.mark.parametrize("plant", ["dev-zero", "fifo", "not-utf8", "directory", "outside",
                                   "huge"])
def test_native_copy_refuses_what_is_no_regular_json_file(tmp_path: Path, plant: str) -> None:
    """A model folder's `generation_config.json -> /dev/zero`, a FIFO, a non-UTF-8 file, a
    folder named `y.json`, a link out of the folder, a file over the bound: each a one-line
    UsageError naming the file, at once (no hang), and nothing left in the scratch folder."""
    import os

    from hatch_vllm_patch.doctor import MAX_NATIVE_FILE, native_copy
    from hatch_vllm_patch.errors import UsageError

    model = _model(tmp_path / "model")
    secret = tmp_path / "secret.json"
    secret.write_text("{}")
    bad = model / "generation_config.json"
    if plant == "dev-zero":
        bad.symlink_to("/dev/zero")
    elif plant == "fifo":
        os.mkfifo(bad)
    elif plant == "not-utf8":
        bad.write_bytes(b'{"a": "\xff\xfe"}')
    elif plant == "directory":
        bad.mkdir()
    elif plant == "outside":
        bad.symlink_to(secret)
    else:
        bad.write_bytes(b" " * (MAX_NATIVE_FILE + 1))
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    with pytest.raises(UsageError) as refused:
        native_copy(model, scratch)
    message = str(refused.value)
    assert str(bad) in message and "\n" not in message, message
    copy = scratch / "model"
    assert not (copy / "generation_config.json").exists()
    assert not any(p.is_symlink() for p in copy.iterdir())


def test_native_copy_copies_regular_files_without_auto_map(tmp_path: Path) -> None:
    """A plain model folder: its JSON files copied, config.json without auto_map."""
    from hatch_vllm_patch.doctor import native_copy

    model = _model(tmp_path / "model")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    copy = native_copy(model, scratch)
    assert sorted(p.name for p in copy.iterdir()) == ["config.json", "tokenizer_config.json"]
    assert "auto_map" not in json.loads((copy / "config.json").read_text())


def test_a_fifo_config_json_is_refused_not_waited_for(tmp_path: Path, demo_catalog: Path
                                                      ) -> None:
    """`status --model` of a folder whose config.json is a FIFO exits 2 at once, naming it."""
    import os
    import sys

    model = tmp_path / "model"
    model.mkdir()
    os.mkfifo(model / "config.json")
    proc = cli("status", "--model", str(model), "--python", sys.executable, cwd=tmp_path,
               catalog=demo_catalog)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "config.json" in proc.stderr and "not a regular file" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_doctors_child_never_runs_the_guard(tmp_path: Path) -> None:
    """doctor's probe child gets HATCH_VLLM_PATCH_GUARD=off, whatever this process has (an
    `apply` guard there could write during a doctor run)."""
    import os
    import stat

    from hatch_vllm_patch.doctor import run_child

    fake = tmp_path / "python"
    fake.write_text('#!/bin/sh\nfor last; do :; done\n'
                    'printf \'{"guard": "%s"}\' "$HATCH_VLLM_PATCH_GUARD" > "$last"\n')
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HATCH_VLLM_PATCH_GUARD", "apply")
        answer = run_child(fake, {}, timeout=30,
                           extra_env={"HATCH_VLLM_PATCH_GUARD": "apply"})
    assert answer == {"guard": "off"}
    assert os.environ.get("HATCH_VLLM_PATCH_GUARD") != "off"


def test_deeply_nested_overrides_are_one_message(tmp_path: Path) -> None:
    """`doctor --hf-overrides` with 50,000 nested `[` is a usage error, not a RecursionError."""
    from hatch_vllm_patch.doctor import parse_json_object
    from hatch_vllm_patch.errors import UsageError

    with pytest.raises(UsageError, match="nested deeper than"):
        parse_json_object("--hf-overrides", "[" * 50_000)


# --- 5. create checks everything before its first write -----------------------------------------

def _edited(body: str) -> str:
    return DEMO_SOURCE.replace('raise NotImplementedError("empty")', body)


def test_create_overlapping_a_taken_out_patch_writes_nothing(tmp_path: Path,
                                                             demo_venv: Path) -> None:
    """With the project's own c-fix applied, `edit` the module again, change the same
    function and `create d-fix`: exit 2 naming c-fix and the symbol; no d-fix folder,
    pyproject.toml and the open edit as they were."""
    project = tmp_path / "svc"
    project.mkdir()
    (project / "pyproject.toml").write_text(
        '[project]\nname = "svc"\nversion = "0"\n\n[tool.vllm-patch]\n')
    core = site_packages(demo_venv.parent.parent) / "demo_pkg" / "core.py"
    python = ("--python", str(demo_venv))
    assert cli("edit", "demo_pkg.core", *python, cwd=project).returncode == 0
    core.write_text(_edited("return 0"))
    made = cli("create", "c-fix", *python, "--summary", "c", cwd=project)
    assert made.returncode == 0, made.stdout + made.stderr
    opened = cli("edit", "demo_pkg.core", *python, cwd=project)
    assert opened.returncode == 0 and "c-fix" in opened.stderr, opened.stderr
    core.write_text(_edited("return -1"))
    edited, pyproject = core.read_bytes(), (project / "pyproject.toml").read_bytes()
    refused = cli("create", "d-fix", *python, "--summary", "d", cwd=project)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "c-fix" in refused.stderr and "demo_pkg.core.compute" in refused.stderr
    assert "nothing was written" in refused.stderr and "Traceback" not in refused.stderr
    assert not (project / "vllm-patches" / "d-fix").exists()
    assert core.read_bytes() == edited
    assert (project / "pyproject.toml").read_bytes() == pyproject


# --- 6. a distribution stands in for another only for that one's own package --------------------

def test_a_module_of_another_distribution_is_not_the_declared_ones(
        tmp_path: Path, demo_wheels: dict[str, Path], project_wheel: Path) -> None:
    """A patch declaring `distribution = "hatch-vllm-patch"` (installed) or an uninstalled
    `other-dist` for `demo_pkg.core` (demo-pkg's): refused as outside its distribution, the
    file untouched; the catalog's demo-fix still applies."""
    python = create_venv(tmp_path / "venv", str(demo_wheels["1.0.0"]), str(project_wheel))
    core = site_packages(tmp_path / "venv") / "demo_pkg" / "core.py"
    before = core.read_bytes()
    for declared in ("hatch-vllm-patch", "other-dist"):
        catalog = write_demo_catalog(tmp_path / declared)
        manifest = catalog / "demo-fix" / "patch.toml"
        manifest.write_text(manifest.read_text().replace('distribution = "demo-pkg"',
                                                         f'distribution = "{declared}"'))
        proc = cli("apply", "--python", str(python), "--patch", "demo-fix", "--json",
                   catalog=catalog, cwd=tmp_path)
        assert proc.returncode == 1, proc.stdout + proc.stderr
        (outcome,) = json.loads(proc.stdout)["patches"]
        assert outcome["verdict"] == "outside-distribution", outcome
        assert f"not a file of {declared}" in outcome["reason"], outcome
        assert core.read_bytes() == before
    proc = cli("apply", "--python", str(python), "--patch", "demo-fix",
               catalog=write_demo_catalog(tmp_path / "right"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# --- 4, 12. edits of hand-written files keep what the tool does not own ------------------------

def test_set_fixed_in_keeps_optional_and_install_from_and_links_stay_links(
        tmp_path: Path, demo_wheels: dict[str, Path]) -> None:
    """`create` with a symlinked pyproject.toml adds the patch to the file the link leads to
    (the link stays); `update --set-fixed-in` keeps the author's `optional` and `install-from`
    (and edits a symlinked patch.toml through the link); a link to no regular file is refused
    with a message, never replaced."""
    import os

    python = create_venv(tmp_path / "v1", str(demo_wheels["1.0.0"]))
    fixed = create_venv(tmp_path / "v2", str(demo_wheels["2.0.0"]))
    core = site_packages(tmp_path / "v1") / "demo_pkg" / "core.py"
    project = tmp_path / "proj"
    project.mkdir()
    shared = tmp_path / "shared-pyproject.toml"
    shared.write_text('[project]\nname = "p"\nversion = "0"\n\n[tool.vllm-patch]\n')
    (project / "pyproject.toml").symlink_to(shared)
    assert cli("edit", "demo_pkg.core", "--python", str(python), cwd=project).returncode == 0
    core.write_text(_edited("return 0"))
    made = cli("create", "zero-fix", "--summary", "Zero", "--python", str(python), cwd=project)
    assert made.returncode == 0, made.stdout + made.stderr
    assert (project / "pyproject.toml").is_symlink()
    assert 'patches = ["zero-fix"]' in shared.read_text()
    folder = project / "vllm-patches" / "zero-fix"
    manifest = folder / "patch.toml"
    authored = manifest.read_text().replace(
        'version = "1.0.0"', 'optional = true\ninstall-from = "https://example.invalid/demo"\n'
        'version = "1.0.0"')
    kept = tmp_path / "kept-patch.toml"
    kept.write_text(authored)
    manifest.unlink()
    manifest.symlink_to(kept)
    updated = cli("update", "zero-fix", "--set-fixed-in", "--python", str(fixed), cwd=project)
    assert updated.returncode == 0, updated.stdout + updated.stderr
    assert manifest.is_symlink() and 'fixed-in = "2.0.0"' in kept.read_text()
    text = kept.read_text()
    assert "optional = true" in text and 'install-from = "https://example.invalid/demo"' in text
    # a link to a directory: refused in one message, the link left as it was
    (project / "pyproject.toml").unlink()
    (project / "pyproject.toml").symlink_to(tmp_path)
    from hatch_vllm_patch.authoring.toml_edit import select_in_pyproject
    from hatch_vllm_patch.errors import UsageError

    with pytest.raises(UsageError, match="not a regular file"):
        select_in_pyproject(project / "pyproject.toml", "other-fix")
    assert os.readlink(project / "pyproject.toml") == str(tmp_path)


def test_update_keeps_the_authors_keys_of_every_target() -> None:
    """`optional`, `install-from` of [[targets]] entries (matched by module) and an
    `[applies] classifier` survive edit_manifest; computed keys the rendering drops go."""
    from hatch_vllm_patch import _toml
    from hatch_vllm_patch.authoring.render import ManifestTarget, render_manifest
    from hatch_vllm_patch.authoring.toml_edit import edit_manifest

    def drafted(version: str) -> str:
        return render_manifest("p", targets=[
            ManifestTarget("vllm", "vllm.a", version, {"f": ["a" * 64]}, (), "vllm.a.py"),
            ManifestTarget("vllm-neuron", "vllm_neuron.b", version, {"h": ["c" * 64]},
                           ("X",), "vllm_neuron.b.py")],
            summary="s", why="w", removal="r", fixed_in=None, made_by="update")

    hand = drafted("1.0").replace(
        'module = "vllm_neuron.b"',
        'module = "vllm_neuron.b"\noptional = true\ninstall-from = "https://x.invalid"')
    edited = _toml.loads(edit_manifest(hand, drafted("2.0")))
    first, second = edited["targets"]
    assert "optional" not in first and first["version"] == "2.0"
    assert second["optional"] is True and second["install-from"] == "https://x.invalid"
    assert second["version"] == "2.0"


# --- 7. the guard and the probe never search the working directory -----------------------------

def test_a_package_planted_in_the_working_directory_does_not_stop_vllm(
        tmp_path: Path, demo_wheels: dict[str, Path], project_wheel: Path) -> None:
    """An optional patch of a distribution not installed is recorded not-installed; a folder of
    that package planted in a vLLM process's working directory (uid 65534's, when run as root)
    is not taken for the installed package: the guard says the patches are in place."""
    import os

    python = create_venv(tmp_path / "venv", str(demo_wheels["1.0.0"]), str(project_wheel))
    catalog = write_demo_catalog(tmp_path / "catalog")
    absent = catalog / "absent-fix"
    absent.mkdir()
    (absent / "patch.toml").write_text(textwrap.dedent(f"""\
        id = "absent-fix"
        summary = "a fix of a plugin that is not installed here"

        [target]
        distribution = "absent-pkg"
        module = "absent_pkg.worker.runner"
        symbol = "run"
        optional = true

        [applies]
        shapes = ["{'a' * 64}"]
        """))
    (absent / "block.py").write_text("def run():\n    return 1\n")
    proc = cli("apply", "--python", str(python), "--patch", "demo-fix", "--patch", "absent-fix",
               catalog=catalog, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    workdir = tmp_path / "shared"
    workdir.mkdir(mode=0o1777)
    workdir.chmod(0o1777)
    planted = workdir / "absent_pkg" / "worker"
    planted.mkdir(parents=True)
    (planted.parent / "__init__.py").write_text("")
    (planted / "__init__.py").write_text("")
    (planted / "runner.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w')\n"
                                       "def run():\n    return 0\n")
    if os.geteuid() == 0:
        for folder, _, files in os.walk(workdir / "absent_pkg"):
            shutil.chown(folder, 65534, 65534)
            for name in files:
                shutil.chown(os.path.join(folder, name), 65534, 65534)
    script = vllm_like(python, workdir, mode="error", catalog=catalog)  # its folder on sys.path
    environ = {k: v for k, v in os.environ.items() if k != "HATCH_VLLM_PATCH_GUARD"}
    inline = subprocess.run(  # '' on sys.path (python -c, python -m)
        [str(python), "-c", DEMO_PROCESS], cwd=workdir, capture_output=True, text=True,
        env={**environ, "HATCH_VLLM_PATCH_GUARD": "error",
             "HATCH_VLLM_PATCH_CATALOG": str(catalog)}, timeout=300, check=False)
    for ran in (script, inline):
        assert ran.returncode == 0, ran.stdout + ran.stderr
        assert "patches in place (absent-fix, demo-fix)" in ran.stdout, ran.stdout
        assert not (tmp_path / "ran").exists()


# --- 9. one target, only "elsewhere": unknown-shape ---------------------------------------------

def test_a_single_target_only_elsewhere_is_unknown_shape(tmp_path: Path,
                                                          demo_venv: Path) -> None:
    """A [[targets]] patch with one target whose module is missing and whose only shape is
    "elsewhere" is unknown-shape (exit 1), not not-applicable."""
    catalog = tmp_path / "catalog"
    folder = catalog / "moved-fix"
    folder.mkdir(parents=True)
    (folder / "patch.toml").write_text(textwrap.dedent("""\
        id = "moved-fix"
        summary = "a fix of a function that moved"

        [[targets]]
        distribution = "demo-pkg"
        module = "demo_pkg.gone"
        symbol = "compute"
        shapes = ["elsewhere"]
        """))
    (folder / "demo_pkg.gone.py").write_text("def compute(values):\n    return 0\n")
    proc = cli("verify", "--python", str(demo_venv), "--patch", "moved-fix", "--json",
               catalog=catalog, cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    (outcome,) = json.loads(proc.stdout)["patches"]
    assert outcome["verdict"] == "unknown-shape", outcome


# --- 14. the record is read only when it is a regular file -----------------------------------

def test_a_fifo_as_the_record_hangs_nothing(tmp_path: Path, demo_wheels: dict[str, Path],
                                            project_wheel: Path) -> None:
    """A FIFO under the record's name: a vLLM process (guard warn) and `verify` answer at once,
    naming the record; nothing hangs."""
    import os

    python = create_venv(tmp_path / "venv", str(demo_wheels["1.0.0"]), str(project_wheel))
    record = site_packages(tmp_path / "venv") / RECORD
    os.mkfifo(record)
    ran = vllm_like(python, tmp_path, mode="warn")
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "not a regular file" in ran.stdout + ran.stderr, ran.stdout + ran.stderr
    proc = run([str(python), "-m", "hatch_vllm_patch", "verify", "--patch", "demo-fix"],
               cwd=tmp_path, env={"HATCH_VLLM_PATCH_CATALOG": str(
                   write_demo_catalog(tmp_path / "catalog"))}, check=False, timeout=120)
    assert "not a regular file" in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr


# --- 10. a relative --python is made absolute where it is read ----------------------------------

def test_a_relative_python_is_the_one_in_the_working_directory(tmp_path: Path,
                                                                demo_venv: Path) -> None:
    """`--python venv/bin/python` from the folder that holds the venv applies there."""
    relative = str(demo_venv.relative_to(tmp_path))
    proc = cli("apply", "--python", relative, "--patch", "demo-fix",
               catalog=write_demo_catalog(tmp_path / "catalog"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert str(demo_venv) in proc.stdout, proc.stdout
    assert b"hatch-vllm-patch: demo-fix" in (
        site_packages(demo_venv.parent.parent) / "demo_pkg" / "core.py").read_bytes()


# --- 11. tracebacks become messages --------------------------------------------------------------

def test_an_empty_hunk_then_no_newline_is_a_diff_error() -> None:
    """`@@ -0,0 +0,0 @@` followed by `\\ No newline at end of file`: a DiffError naming the
    line, not an IndexError."""
    from hatch_vllm_patch.authoring.unidiff import DiffError, parse_diff

    diff = ("--- a/demo_pkg/core.py\n+++ b/demo_pkg/core.py\n@@ -0,0 +0,0 @@\n"
            "\\ No newline at end of file\n")
    with pytest.raises(DiffError, match="holds no line"):
        parse_diff(diff, "x.diff")


@pytest.mark.parametrize("bad", ["not-utf8", "directory", "fifo"])
def test_a_block_that_is_no_utf8_file_is_a_catalog_error(tmp_path: Path, demo_venv: Path,
                                                         bad: str) -> None:
    """A project's block.py that is not UTF-8, a directory or a FIFO: `apply` exits 2 with a
    message naming it, no traceback, no hang."""
    import os

    project = own_project(tmp_path / "svc", "a-fix")
    folder = own_patch(project / "vllm-patches", "a-fix", "compute", DEMO_BLOCK)
    block = folder / "block.py"
    block.unlink()
    if bad == "not-utf8":
        block.write_bytes(b"x = '\xff'\n")
    elif bad == "directory":
        block.mkdir()
    else:
        os.mkfifo(block)
    proc = cli("apply", "--python", str(demo_venv), cwd=project,
               catalog=write_demo_catalog(tmp_path / "catalog"))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert str(block) in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


# --- 13. check never runs another user's code ----------------------------------------------------

@pytest.mark.skipif(__import__("os").geteuid() != 0, reason="another user's files need root")
def test_check_of_another_users_folder_runs_none_of_its_code(shared: Path,
                                                             demo_venv: Path) -> None:
    """`check /shared/contrib/x-fix` as root, the folder planted by uid 65534 in a 1777
    folder: its classify.py and probe.py are parsed, never run (a warning says why); the same
    folder of root's own is run as before."""

    from support.machine import plant

    marker = shared / "ran"
    marker.write_text("")
    staged = shared / "staged" / "x-fix"
    write_demo_catalog(shared / "staged")
    shutil.move(shared / "staged" / "demo-fix", staged)
    manifest = staged / "patch.toml"
    text = manifest.read_text().replace('id = "demo-fix"', 'id = "x-fix"')
    manifest.write_text(text[:text.index("shapes = ")] + 'classifier = "classify.py"\n')
    code = (f"open({str(marker)!r}, 'a').write('x')\n"
            "def classify(source):\n    return ('known', 'fine')\n")
    (staged / "classify.py").write_text(code)
    (staged / "probe.py").write_text(code)
    planted = shared / "shared" / "x-fix"
    plant(staged, planted)
    proc = cli("check", str(planted), "--python", str(demo_venv), cwd=shared)
    assert marker.read_text() == "", "the other user's code ran"
    assert "ran neither" in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    assert "uid 65534" in proc.stdout + proc.stderr
    proc = cli("check", str(staged), "--python", str(demo_venv), cwd=shared)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert marker.read_text() != "", "the user's own classifier was not run"


# --- 8. the record keeps every project's file digests current -----------------------------------

def test_two_projects_patching_one_file_keep_the_fast_path(
        tmp_path: Path, demo_wheels: dict[str, Path], project_wheel: Path) -> None:
    """Project A patches compute, project B other, in one file: after both applies every
    recorded digest is the file's, and a vLLM process takes the fast path (no full check);
    after a reinstall and B's apply alone, A's entry keeps its old digest (its block is gone),
    so the guard checks and stops."""
    import hashlib

    python = create_venv(tmp_path / "venv", str(demo_wheels["1.0.0"]), str(project_wheel))
    catalog = write_demo_catalog(tmp_path / "catalog")
    first = own_project(tmp_path / "a", "a-fix")
    own_patch(first / "vllm-patches", "a-fix", "compute", DEMO_BLOCK)
    second = own_project(tmp_path / "b", "b-fix")
    own_patch(second / "vllm-patches", "b-fix", "other", OTHER_BLOCK)
    for project in (first, second):
        assert _apply(python, project, catalog, "apply").returncode == 0
    sp = site_packages(tmp_path / "venv")
    digest = hashlib.sha256((sp / "demo_pkg" / "core.py").read_bytes()).hexdigest()
    entries = json.loads((sp / RECORD).read_text())["selection"]["patches"]
    assert {e["id"]: e["file_sha256"] for e in entries} == {"a-fix": digest, "b-fix": digest}
    fast = vllm_like(python, tmp_path, mode="error", catalog=catalog)
    assert fast.returncode == 0, fast.stdout + fast.stderr
    assert "patches in place" in fast.stdout and "full check" not in fast.stdout, fast.stdout
    run([UV, "pip", "install", "--quiet", "--reinstall", "--no-deps", "--python", str(python),
         str(demo_wheels["1.0.0"])])
    assert _apply(python, second, catalog, "apply").returncode == 0
    stopped = vllm_like(python, tmp_path, mode="error", catalog=catalog)
    assert stopped.returncode == 1 and "a-fix" in stopped.stderr, stopped.stdout + stopped.stderr
