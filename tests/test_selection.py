"""Which patches are selected, and the one rule every path shares: two selected patches that
replace one symbol are refused before anything is written (``selection.overlaps``), in
``apply``, ``check``, the build hook, the guard and doctor; a patch that declares it
``replaces`` another wins over it. Fast: the demo distribution and its catalog."""

from __future__ import annotations

import json
import shutil
import sys
import textwrap
from pathlib import Path

import pytest
from support.commands import cli
from support.demo import DEMO_BLOCK, vllm_like, write_demo_catalog
from support.hook_project import hatchling_build, make_project
from support.project_patches import SPEC_CONV, spec_conv_num_spec
from support.venvs import create_venv, site_packages

from hatch_vllm_patch.catalog import Patch, load_patch_folders
from hatch_vllm_patch.errors import UsageError
from hatch_vllm_patch.selection import (
    Overlap,
    architecture_modules,
    overlap_errors,
    overlaps,
    refuse_overlaps,
    select,
    without_replaced,
)
from hatch_vllm_patch.trust import chosen

SYMBOL = "demo_pkg.core.compute"
RECORD = ".hatch-vllm-patch.json"


def second_patch(root: Path, patch_id: str = "demo-alt", *, replaces: str | None = None
                 ) -> Path:
    """A copy of demo-fix under ``patch_id`` in ``root``, with its own block: a second patch
    of ``compute``."""
    source = write_demo_catalog(root.parent / f".{patch_id}-source") / "demo-fix"
    folder = root / patch_id
    shutil.copytree(source, folder)
    manifest = (folder / "patch.toml").read_text().replace('"demo-fix"', f'"{patch_id}"')
    if replaces:
        manifest = f'replaces = ["{replaces}"]\n' + manifest
    (folder / "patch.toml").write_text(manifest)
    (folder / "block.py").write_text(DEMO_BLOCK + f"# {patch_id}\n")
    return root


def two_patch_catalog(root: Path) -> Path:
    """demo-fix and demo-alt, both for ``demo_pkg.core.compute``."""
    return second_patch(write_demo_catalog(root))


def project_selecting_both(root: Path) -> Path:
    """A project whose own patch folder holds demo-alt, selecting it beside demo-fix (the
    catalog's), as `create --from-diff` and a doctor recommendation would leave it."""
    second_patch(root / "vllm-patches")
    (root / "pyproject.toml").write_text(textwrap.dedent("""\
        [project]
        name = "svc"
        version = "1.0"

        [tool.vllm-patch]
        guard = "apply"
        patches = ["demo-fix", "demo-alt"]
        """))
    return root


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Patch]:
    root = two_patch_catalog(tmp_path_factory.mktemp("catalog"))
    return dict(load_patch_folders(chosen(root)))


# --- the pure rule ------------------------------------------------------------------------------


def test_two_patches_of_one_symbol_overlap(loaded: dict[str, Patch]) -> None:
    """Two patches replacing one function are one overlap, naming both and the symbol."""
    found = overlaps([loaded["demo-fix"], loaded["demo-alt"]])
    assert found == (Overlap("demo_pkg.core", "compute", "demo-fix", "demo-alt"),)
    assert found[0].where == SYMBOL
    assert overlaps([loaded["demo-fix"]]) == ()


def test_a_class_and_its_method_overlap_other_modules_do_not(loaded: dict[str, Patch]) -> None:
    """A patch of a class and one of a method of it overlap; the same name in another module,
    or another method of the class, does not."""
    base = loaded["demo-fix"]

    def of(pid: str, module: str, *symbols: str) -> Patch:
        return base._replace(id=pid, target=base.target._replace(module=module, symbols=symbols))

    model = of("a", "m.x", "Model")
    method = of("b", "m.x", "Model.shape")
    other_method = of("c", "m.x", "Model.other", "ModelTwo.shape")
    elsewhere = of("d", "m.y", "Model.shape")
    assert overlaps([model, method]) == (Overlap("m.x", "Model", "a", "b"),)
    assert overlaps([method, other_method, elsewhere]) == ()


def test_any_target_of_a_patch_over_several_modules_counts(loaded: dict[str, Patch]) -> None:
    """A patch over several modules overlaps a patch of one module at its second target."""
    base = loaded["demo-fix"]
    first = base._replace(target=base.target._replace(module="m.one", symbols=("A.f",)))
    second = base._replace(target=base.target._replace(module="m.two", symbols=("B.f",)))
    several = base._replace(id="spec-conv", members=(first._replace(id="spec-conv"),
                                                      second._replace(id="spec-conv")))
    single = second._replace(id="catalog-two")
    assert overlaps([single, several]) == (Overlap("m.two", "B.f", "catalog-two", "spec-conv"),)


def test_patches_of_disjoint_releases_do_not_overlap(loaded: dict[str, Patch]) -> None:
    """Two patches of one function whose known shapes are disjoint (one for older releases,
    its successor for newer ones) never write in one release: no overlap. One shared shape, or
    a patch judged by its classifier (no digests), is an overlap again."""
    base, alt = loaded["demo-fix"], loaded["demo-alt"]
    old, new, third = "a" * 64, "b" * 64, "c" * 64

    def known(patch: Patch, *digests: str) -> Patch:
        return patch._replace(symbol_shapes={patch.target.symbol: frozenset(digests)})

    assert overlaps([known(base, old), known(alt, new, "elsewhere")]) == ()
    assert len(overlaps([known(base, old, third), known(alt, new, third)])) == 1
    assert len(overlaps([known(base), known(alt, new)])) == 1


def test_opt_in_patches_are_not_architecture_defaults(loaded: dict[str, Patch]) -> None:
    """An opt-in patch names the architectures it concerns, yet the catalog does not select it
    for them: a project selects it by id."""
    from hatch_vllm_patch.catalog import Catalog

    base = loaded["demo-fix"]._replace(architectures=("DemoForCausalLM",))
    catalog = Catalog((base, loaded["demo-alt"]._replace(architectures=("DemoForCausalLM",),
                                                          opt_in=True)), Path("/c"))
    assert [p.id for p in catalog.for_architecture("DemoForCausalLM")] == ["demo-fix"]


def test_opt_in_must_be_a_boolean(tmp_path: Path) -> None:
    """`opt-in = "yes"` is a catalog error naming the key."""
    root = write_demo_catalog(tmp_path / "cat")
    manifest = root / "demo-fix" / "patch.toml"
    manifest.write_text('opt-in = "yes"\n' + manifest.read_text())
    with pytest.raises(Exception, match="opt-in must be true or false"):
        load_patch_folders(chosen(root))


def test_replaces_drops_the_replaced(loaded: dict[str, Patch]) -> None:
    """A patch declaring `replaces` wins over the one it names when both are given."""
    newer = loaded["demo-alt"]._replace(replaces=("demo-fix",))
    kept, replaced = without_replaced([loaded["demo-fix"], newer])
    assert [p.id for p in kept] == ["demo-alt"] and replaced == {"demo-fix": "demo-alt"}
    assert overlaps(kept) == ()
    kept, replaced = without_replaced([loaded["demo-fix"]])
    assert [p.id for p in kept] == ["demo-fix"] and replaced == {}


def test_the_message_names_both_the_symbol_and_how_to_choose(
        loaded: dict[str, Patch]) -> None:
    """One line: both patches with why each is selected, the symbol, the two choices (the
    architecture's table when a catalog default selects one)."""
    found = overlaps([loaded["demo-fix"], loaded["demo-alt"]])
    why = {"demo-fix": ("DemoForCausalLM (catalog default, via DemoForCausalLM in m/config.json)",),
           "demo-alt": ("[tool.vllm-patch] patches (for every model served)",)}
    (line,) = overlap_errors(found, why)
    assert "'demo-fix' (DemoForCausalLM (catalog default" in line
    assert "'demo-alt' ([tool.vllm-patch] patches" in line
    assert f"both replace {SYMBOL}" in line
    assert ('[tool.vllm-patch.architectures.DemoForCausalLM] patches = ["demo-fix"] or '
            'patches = ["demo-alt"]') in line
    (line,) = overlap_errors(found, command_line=True)
    assert "--patch demo-fix or --patch demo-alt" in line


def test_select_refuses_both_and_keeps_the_replacing_one(tmp_path: Path) -> None:
    """`select` keeps both (the caller decides); refuse_overlaps raises the command line's
    UsageError; with `replaces`, selecting both selects the replacing one, with a note."""
    catalog = load_patch_folders(chosen(two_patch_catalog(tmp_path / "a")))
    selection = select(catalog, None, patches=["demo-fix", "demo-alt"])
    assert [p.id for p in selection.patches] == ["demo-alt", "demo-fix"]
    with pytest.raises(UsageError, match=r"both replace demo_pkg\.core\.compute"):
        refuse_overlaps(selection, None, command_line=True)
    replacing = load_patch_folders(chosen(second_patch(write_demo_catalog(tmp_path / "b"),
                                                       replaces="demo-fix")))
    selection = select(replacing, None, patches=["demo-fix", "demo-alt"])
    assert [p.id for p in selection.patches] == ["demo-alt"]
    assert any("demo-alt replaces demo-fix" in n for n in selection.notes)
    refuse_overlaps(selection, None)


def test_replaces_must_name_another_patch(tmp_path: Path) -> None:
    """`replaces` naming the patch itself is a catalog error with its TOML path."""
    from hatch_vllm_patch.errors import CatalogError

    root = second_patch(write_demo_catalog(tmp_path / "c"), replaces="demo-alt")
    with pytest.raises(CatalogError, match=r"replaces\[0\] 'demo-alt' must be another"):
        load_patch_folders(chosen(root))


def test_architecture_modules_reads_multi_line_entries(tmp_path: Path) -> None:
    """The registry's entries, also those spread over several lines, give each
    architecture's module."""
    registry = tmp_path / "registry.py"
    registry.write_text('_TEXT_GENERATION_MODELS = {\n'
                        '    "FalconH1ForCausalLM": ("falcon_h1", "FalconH1ForCausalLM"),\n'
                        '    "Long": (\n        "long_mod",\n        "Long",\n    ),\n}\n')
    assert architecture_modules(registry) == {
        "FalconH1ForCausalLM": "vllm.model_executor.models.falcon_h1",
        "Long": "vllm.model_executor.models.long_mod"}
    assert architecture_modules(None) == {}


# --- every path refuses it, writing nothing ---------------------------------------------------


def _unchanged(python: Path) -> tuple[bytes, bool]:
    sp = site_packages(python.parent.parent)
    return (sp / "demo_pkg" / "core.py").read_bytes(), (sp / RECORD).exists()


def test_apply_refuses_two_patches_of_one_symbol(tmp_path: Path, demo_venv: Path) -> None:
    """`apply --patch A --patch B` (both of compute) and `apply` from a project selecting
    both exit 2 naming both and the symbol; nothing is written, no record."""
    catalog = two_patch_catalog(tmp_path / "catalog")
    before = _unchanged(demo_venv)
    proc = cli("apply", "--python", str(demo_venv), "--patch", "demo-fix", "--patch",
               "demo-alt", catalog=catalog, cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "'demo-fix'" in proc.stderr and "'demo-alt'" in proc.stderr
    assert f"both replace {SYMBOL}" in proc.stderr and "Traceback" not in proc.stderr
    project = project_selecting_both(tmp_path / "svc")
    proc = cli("apply", "--python", str(demo_venv), cwd=project,
               catalog=write_demo_catalog(tmp_path / "one"))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"both replace {SYMBOL}" in proc.stderr
    assert 'patches = ["demo-alt"] or patches = ["demo-fix"]' in proc.stderr
    assert _unchanged(demo_venv) == before and before[1] is False
    verify = cli("verify", "--python", str(demo_venv), cwd=project,
                 catalog=write_demo_catalog(tmp_path / "two"))
    assert verify.returncode == 2 and "both replace" in verify.stderr
    # revert and status reach both: the way out never depends on the configuration's sense
    status = cli("status", "--python", str(demo_venv), cwd=project,
                 catalog=write_demo_catalog(tmp_path / "three"))
    assert status.returncode == 0, status.stdout + status.stderr


def test_apply_with_replaces_applies_the_replacing_one(tmp_path: Path, demo_venv: Path) -> None:
    """A project patch declaring `replaces = ["demo-fix"]`, selected beside demo-fix: apply
    writes only its block and says so."""
    project = project_selecting_both(tmp_path / "svc")
    manifest = project / "vllm-patches" / "demo-alt" / "patch.toml"
    manifest.write_text('replaces = ["demo-fix"]\n' + manifest.read_text())
    proc = cli("apply", "--python", str(demo_venv), cwd=project,
               catalog=write_demo_catalog(tmp_path / "one"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "demo-alt replaces demo-fix" in proc.stdout + proc.stderr
    text = (site_packages(demo_venv.parent.parent) / "demo_pkg" / "core.py").read_text()
    assert "hatch-vllm-patch: demo-alt" in text and "hatch-vllm-patch: demo-fix" not in text


def test_check_reports_the_overlap(tmp_path: Path, demo_venv: Path) -> None:
    """`check` in a project selecting both exits 2 as apply does; `check FOLDER` of a patch
    of a symbol a catalog patch also replaces fails when the project selects both, and warns
    (never select both) when it does not."""
    project = project_selecting_both(tmp_path / "svc")
    catalog = write_demo_catalog(tmp_path / "one")
    proc = cli("check", "--python", str(demo_venv), cwd=project, catalog=catalog)
    assert proc.returncode == 2 and f"both replace {SYMBOL}" in proc.stderr, proc.stderr
    folder = project / "vllm-patches" / "demo-alt"
    proc = cli("check", str(folder), "--python", str(demo_venv), cwd=project, catalog=catalog)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "selects both demo-alt and demo-fix" in proc.stdout
    text = (project / "pyproject.toml").read_text().replace('"demo-fix", ', "")
    (project / "pyproject.toml").write_text(text)
    proc = cli("check", str(folder), "--python", str(demo_venv), cwd=project, catalog=catalog)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"warning: demo-fix ({catalog / 'demo-fix'}) also replaces {SYMBOL}" in proc.stdout


def test_build_hook_refuses_the_overlap(tmp_path: Path, demo_wheels: dict[str, Path]) -> None:
    """An editable build of a project selecting two patches of one symbol fails, naming
    both; its .venv is left as it was."""
    project = make_project(tmp_path / "demo", vllm_patch=(
        '[tool.vllm-patch]\npatches = ["demo-fix", "demo-alt"]\n'))
    create_venv(project / ".venv", str(demo_wheels["1.0.0"]))
    module = site_packages(project / ".venv") / "demo_pkg" / "core.py"
    before = module.read_bytes()
    catalog = two_patch_catalog(tmp_path / "catalog")
    code, output = hatchling_build(project, "editable",
                                   env={"HATCH_VLLM_PATCH_CATALOG": str(catalog)})
    assert code != 0, output
    assert "invalid configuration" in output and f"both replace {SYMBOL}" in output
    assert module.read_bytes() == before


def test_guard_refuses_to_heal_an_overlap(tmp_path: Path, demo_wheels: dict[str, Path],
                                          project_wheel: Path) -> None:
    """The guard with the project named by $HATCH_VLLM_PATCH_PROJECT selecting both (guard
    apply) stops the process naming both and the symbol, and heals nothing."""
    python = create_venv(tmp_path / "venv", str(demo_wheels["1.0.0"]), str(project_wheel))
    project = project_selecting_both(tmp_path / "svc")
    before = _unchanged(python)
    proc = vllm_like(python, tmp_path, catalog=write_demo_catalog(tmp_path / "one"),
                     env={"HATCH_VLLM_PATCH_PROJECT": str(project)})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"both replace {SYMBOL}" in proc.stderr and "Traceback" not in proc.stderr
    assert "patched: True" not in proc.stdout
    assert _unchanged(python) == before


def test_doctor_refuses_a_project_selecting_both(tmp_path: Path) -> None:
    """doctor from a project selecting both exits 2 before it imports vLLM, naming both."""
    project = project_selecting_both(tmp_path / "svc")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["DemoForCausalLM"]}))
    proc = cli("doctor", "--model", str(model), "--python", sys.executable, cwd=project,
               catalog=write_demo_catalog(tmp_path / "one"))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"both replace {SYMBOL}" in proc.stderr
    assert "imports vLLM" not in proc.stderr



def test_a_block_of_the_same_symbol_in_place_blocks_the_other(tmp_path: Path,
                                                               demo_venv: Path) -> None:
    """demo-fix applied by one selection (the command line), then a project selecting
    demo-alt (of the same function) applies: demo-alt is blocked naming demo-fix and the
    symbol, the file keeps one block, and the next step removes only demo-fix's block."""
    catalog = two_patch_catalog(tmp_path / "catalog")
    first = cli("apply", "--python", str(demo_venv), "--patch", "demo-fix", catalog=catalog,
                cwd=tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    core = site_packages(demo_venv.parent.parent) / "demo_pkg" / "core.py"
    after_first = core.read_bytes()
    second = cli("apply", "--python", str(demo_venv), "--patch", "demo-alt", "--json",
                 catalog=catalog, cwd=tmp_path)
    assert second.returncode == 1, second.stdout + second.stderr
    (alt,) = [o for o in json.loads(second.stdout)["patches"] if o["id"] == "demo-alt"]
    assert alt["verdict"] == "blocked"
    assert f"the block of demo-fix, which also replaces {SYMBOL}" in alt["reason"]
    assert "revert --python" in alt["next_step"] and "--patch demo-fix" in alt["next_step"]
    assert core.read_bytes() == after_first


# --- on real vLLM files ---------------------------------------------------------------------------

FALCON_SYMBOL = ("vllm.model_executor.models.falcon_h1.FalconH1ForCausalLM."
                 "get_mamba_state_shape_from_config")


@pytest.mark.slow
def test_real_vllm_catalog_and_project_patch_of_one_classmethod(tmp_path: Path) -> None:
    """vLLM 0.20.2's files (--no-deps): a project selecting the catalog's
    falcon-h1-spec-conv-state and its own spec-conv-num-spec (both rebind
    FalconH1ForCausalLM.get_mamba_state_shape_from_config) is refused by check and apply
    (exit 2, both named, the symbol), nothing written; its own patch alone applies to all three
    modules; the catalog patch added then by --patch is blocked, the file left as it was."""
    from support.venvs import release_venv

    python = release_venv(tmp_path / "vllm", "vllm", "0.20.2")
    models = site_packages(python.parent.parent) / "vllm" / "model_executor" / "models"
    files = {m: models / f"{m}.py" for m in SPEC_CONV.values()}
    pristine = {m: f.read_bytes() for m, f in files.items()}
    project = tmp_path / "svc"
    spec_conv_num_spec(project / "vllm-patches")
    (project / "pyproject.toml").write_text(textwrap.dedent(f"""\
        [project]
        name = "svc"
        version = "1.0"

        [tool.vllm-patch]
        python = "{python}"
        patches = ["falcon-h1-spec-conv-state", "spec-conv-num-spec"]
        """))
    for command in ("check", "apply"):
        proc = cli(command, cwd=project)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert "'falcon-h1-spec-conv-state'" in proc.stderr
        assert "'spec-conv-num-spec'" in proc.stderr
        assert f"both replace {FALCON_SYMBOL}" in proc.stderr
    assert {m: f.read_bytes() for m, f in files.items()} == pristine
    text = (project / "pyproject.toml").read_text()
    (project / "pyproject.toml").write_text(text.replace('"falcon-h1-spec-conv-state", ', ""))
    applied = cli("apply", cwd=project)
    assert applied.returncode == 0, applied.stdout + applied.stderr
    for module, path in files.items():
        assert "# >>> hatch-vllm-patch: spec-conv-num-spec" in path.read_text(), module
    falcon = files["falcon_h1"].read_bytes()
    added = cli("apply", "--patch", "falcon-h1-spec-conv-state", "--json", cwd=project)
    assert added.returncode == 1, added.stdout + added.stderr
    (outcome,) = [o for o in json.loads(added.stdout)["patches"]
                  if o["id"] == "falcon-h1-spec-conv-state"]
    assert outcome["verdict"] == "blocked"
    assert f"the block of spec-conv-num-spec, which also replaces {FALCON_SYMBOL}" in \
        outcome["reason"]
    assert files["falcon_h1"].read_bytes() == falcon
