"""A project's own patch folders built from the catalog's blocks and known shapes."""

from __future__ import annotations

from pathlib import Path

from support import REPO

SPEC_CONV = {  # the three catalog patches a backport of upstream's fix covers in one patch
    "falcon-h1-spec-conv-state": "falcon_h1",
    "granitemoehybrid-spec-conv-state": "granitemoehybrid",
    "zamba2-spec-conv-state": "zamba2",
}


def spec_conv_num_spec(root: Path) -> Path:
    """A project patch over falcon_h1, granitemoehybrid and zamba2 (what `create --from-diff`
    of upstream's num_spec fix makes: one [[targets]] per module, no architectures), built from
    the catalog's blocks and known shapes."""
    from hatch_vllm_patch.catalog import load_catalog

    catalog = load_catalog(REPO / "patches")
    folder = root / "spec-conv-num-spec"
    folder.mkdir(parents=True)
    lines = ['id = "spec-conv-num-spec"', 'summary = "Mamba-2 conv state with the draft rows"',
             "architectures = []"]
    for pid, module in SPEC_CONV.items():
        patch = catalog[pid]
        (folder / f"{module}.py").write_text(patch.block)
        shapes = ", ".join(f'"{d}"' for d in sorted(patch.shapes))
        lines += ["", "[[targets]]", 'distribution = "vllm"',
                  f'module = "{patch.target.module}"', f'symbol = "{patch.target.symbol}"',
                  f'block = "{module}.py"', f"shapes = [{shapes}]"]
    (folder / "patch.toml").write_text("\n".join(lines) + "\n")
    return root
