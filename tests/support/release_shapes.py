"""Which catalog patch has which shape in which vLLM release, read from the release wheels.

A release's wheel (the wheel cache of venvs.cached_wheel) is read as a zip, never installed: the
target files of every catalog patch of ``vllm``, their RECORD digests, and the engine's own
judgement of them (``engine.plan_verify`` on the facts an installed copy would give, one verdict
per patch as ``engine.plan_together``/``engine.decide_patch`` say it). A patch's *shape* in a
release is that verdict with the digest of every symbol the patch knows (a digest patch.toml
does not list counts as "unknown"). The full install / apply / verify / revert round trip needs
only the releases where some patch's shape starts or ends (:data:`BOUNDARIES`); every other
release keeps the wheel check (tests/test_release_shapes.py), and the exhaustive tier
(``HATCH_VLLM_PATCH_EXHAUSTIVE=1``) round-trips every release again.

What each patch promises on a release's files as released (:data:`EXPECTED`, ``expected``: the
verdict `vllm-patch verify` gives there) is read by the tests that pick the releases a patch
claims.

Why the round trips still install with ``--no-cache`` (venvs.release_venv): no test writes a
release's file through its inode (checked 2026-12-03: they unlink first, or write after the
tool's atomic apply or after ``vllm-patch edit``, which gives the file an inode of its own), so
hardlinked installs would be safe; but they need the extracted files kept (uv's cache or a
copy of our own: 0.5 - 1 GB per release, 23 releases in the complete tier), which the 30 GB
cache budget of the suite cannot hold. Installing only the boundary releases saves the larger
part of the time instead.
"""

from __future__ import annotations

import ast
import base64
import functools
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass

from packaging.version import Version

from hatch_vllm_patch.catalog import Catalog, Patch, load_catalog
from hatch_vllm_patch.engine import (
    FileFacts,
    Plan,
    Verdict,
    decide_patch,
    plan_together,
    plan_verify,
    symbol_digest,
)
from hatch_vllm_patch.operations import _FINE  # the tool's own "fine for verify" table
from support.venvs import EXHAUSTIVE, cached_wheel

# Every release of vLLM on PyPI the suite checks, oldest first.
RELEASES = ("0.16.0", "0.17.0", "0.17.1", "0.18.0", "0.18.1", "0.19.0", "0.19.1", "0.20.0",
            "0.20.1", "0.20.2", "0.21.0", "0.22.0", "0.22.1", "0.23.0", "0.24.0", "0.25.0",
            "0.25.1", "0.26.0", "0.27.0", "0.27.1", "0.28.0", "0.29.0", "0.30.0", "0.31.0",
            "0.32.0", "0.33.0", "0.34.0")

# Where each catalog patch of vllm starts or ends a shape (first and last release of every run
# of equal shapes, see :func:`shape_of`), as :func:`boundaries` computes it from the catalog and
# the wheels (tests/test_release_shapes.py proves the two equal). Kept here so that collecting
# the tests needs no wheel.
BOUNDARIES: dict[str, tuple[str, ...]] = {
    "bamba-spec-conv-state": ("0.16.0", "0.23.0", "0.24.0", "0.34.0"),
    "falcon-h1-spec-conv-state": ("0.16.0", "0.30.0", "0.31.0", "0.32.0", "0.34.0"),
    "granitemoehybrid-spec-conv-state": ("0.16.0", "0.30.0", "0.31.0", "0.32.0", "0.34.0"),
    "gdn-spec-cpu-step": ("0.16.0", "0.26.0", "0.27.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0",
                          "0.34.0"),
    "gdn-spec-zero-accepted": ("0.16.0", "0.26.0", "0.27.0", "0.30.0", "0.31.0", "0.32.0",
                               "0.33.0", "0.34.0"),
    "hybrid-prefix-drafter-window": ("0.16.0", "0.26.0", "0.27.0", "0.30.0", "0.31.0", "0.32.0",
                                     "0.33.0", "0.34.0"),
    "hybrid-prefix-mamba-block": ("0.16.0", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0",
                                  "0.33.0", "0.34.0"),
    "kv-cache-exact-groups": ("0.16.0", "0.26.0", "0.27.0", "0.30.0", "0.31.0", "0.32.0",
                              "0.33.0", "0.34.0"),
    "kv-cache-page-promotion": ("0.16.0", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0",
                                "0.33.0", "0.34.0"),
    "kv-cache-page-unification": ("0.16.0", "0.23.0", "0.24.0", "0.25.1", "0.26.0", "0.28.0",
                                  "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0"),
    "kv-cache-uneven-groups": ("0.16.0", "0.26.0", "0.27.0", "0.30.0", "0.31.0", "0.32.0",
                               "0.33.0", "0.34.0"),
    "mamba-all-mode-chunk-align": ("0.16.0", "0.27.1", "0.28.0", "0.30.0", "0.31.0", "0.32.0",
                                   "0.33.0", "0.34.0"),
    "mamba-split-external-kv": ("0.16.0", "0.17.0", "0.17.1", "0.18.0", "0.18.1", "0.19.0",
                                "0.19.1", "0.20.0", "0.20.2", "0.21.0", "0.22.1", "0.23.0",
                                "0.24.0", "0.25.1", "0.26.0", "0.27.0", "0.28.0", "0.29.0",
                                "0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0"),
    "zamba2-spec-conv-state": ("0.16.0", "0.30.0", "0.31.0", "0.32.0", "0.34.0"),
}


def round_trip_releases(patches: Iterable[str], releases: Iterable[str]) -> list[str]:
    """Of ``releases``, those where one of ``patches`` starts or ends a shape (every one of
    them in the exhaustive tier), in their order."""
    wanted = set().union(*(BOUNDARIES[p] for p in patches))
    return [r for r in releases if EXHAUSTIVE or r in wanted]


def at_boundary(patch: str, release: str) -> bool:
    """Whether ``release`` gets ``patch``'s round trip in this tier."""
    return EXHAUSTIVE or release in BOUNDARIES[patch]


@dataclass(frozen=True)
class WheelShape:
    """One patch in one release wheel: the engine's verdict (verify), its reason, and the
    patch's shape there."""

    verdict: Verdict
    reason: str
    shape: tuple[str, ...]


def vllm_patches(catalog: Catalog | None = None) -> list[Patch]:
    """The catalog's patches of the ``vllm`` distribution (whose files vLLM's wheels hold)."""
    return [p for p in (catalog or load_catalog()).values() if p.target.distribution == "vllm"]


def record_digests(wheel: zipfile.ZipFile) -> dict[str, str]:
    """path -> sha256 (hex) from the wheel's RECORD (the tests' own reading of it)."""
    [record] = [n for n in wheel.namelist() if n.endswith(".dist-info/RECORD")]
    digests = {}
    for line in wheel.read(record).decode().splitlines():
        path, digest, _ = line.rsplit(",", 2)
        if digest.startswith("sha256="):
            raw = digest.removeprefix("sha256=")
            digests[path] = base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4)).hex()
    return digests


def module_file(module: str) -> str:
    return module.replace(".", "/") + ".py"


def read_member(wheel: zipfile.ZipFile, module: str) -> bytes | None:
    try:
        return wheel.read(module_file(module))
    except KeyError:
        return None


def wheel_shape(patch: Patch, wheel: zipfile.ZipFile, version: str, catalog: Catalog,
                record: dict[str, str]) -> WheelShape:
    """What ``vllm-patch verify`` would say of ``patch`` on the wheel's files installed
    unchanged (the engine's planning on the facts an install would give), and its shape;
    ``record`` is the wheel's :func:`record_digests`."""
    parts: list[tuple[str, Plan, bool]] = []
    shape: list[str] = []
    fixed = {s.rsplit(":", 1)[-1] for s in patch.fixed_shapes}
    for member in patch.parts:
        module = member.target.module
        content = read_member(wheel, module)
        facts = FileFacts(
            path=module_file(module), content=content, installed_version=version,
            record_sha256=record.get(module_file(module)), known_ids=frozenset(catalog),
            elsewhere={m: read_member(wheel, m) for m in member.fixed_modules},
            distribution="vllm")
        plan = plan_verify(member, facts)
        parts.append((module, plan, plan.verdict in _FINE["verify"]))
        text = content.decode() if content is not None else None
        for symbol in member.target.symbols:
            digest = symbol_digest(text, symbol) if text is not None else None
            known = member.symbol_shapes.get(symbol, frozenset()) | (
                fixed if symbol == patch.target.symbol else frozenset())
            shape.append(f"{module}:{symbol}=" + (
                "no file" if text is None else "absent" if digest is None
                else digest if digest in known else "unknown"))
    if patch.members:
        parts = [(m, p, ok) for (m, _, ok), p in zip(parts, plan_together(parts), strict=True)]
    decided, _ = decide_patch(parts)
    if decided.verdict is Verdict.UNKNOWN_SHAPE:  # a release the patch refuses: one shape
        return WheelShape(decided.verdict, decided.reason, ())
    return WheelShape(decided.verdict, decided.reason, tuple(shape))


@functools.cache
def release_shapes(version: str) -> dict[str, WheelShape]:
    """Every vllm patch's :class:`WheelShape` in ``vllm==version``'s wheel (once per process:
    the catalog of this checkout does not change during a run)."""
    catalog = load_catalog()
    with zipfile.ZipFile(cached_wheel("vllm", version)) as wheel:
        record = record_digests(wheel)
        return {p.id: wheel_shape(p, wheel, version, catalog, record)
                for p in vllm_patches(catalog)}


def boundaries(shapes: dict[str, dict[str, WheelShape]]) -> dict[str, tuple[str, ...]]:
    """patch -> the releases (of ``shapes``: release -> patch -> shape, oldest first) where its
    shape starts or ends."""
    releases = list(shapes)
    found: dict[str, tuple[str, ...]] = {}
    for patch in next(iter(shapes.values())):
        seen = [(shapes[r][patch].verdict, shapes[r][patch].shape) for r in releases]
        found[patch] = tuple(
            r for i, r in enumerate(releases)
            if i == 0 or i == len(releases) - 1 or seen[i - 1] != seen[i]
            or seen[i + 1] != seen[i])
    return found


def registry_by_ast(source: str) -> list[str]:
    """The architectures of a vLLM model registry, read with ast (the slow, exact way)."""
    names: list[str] = []
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign):
            targets, value = [node.target], node.value
        else:
            continue
        if any(isinstance(t, ast.Name) and t.id.endswith("_MODELS")
               and "PREVIOUSLY" not in t.id for t in targets) and isinstance(value, ast.Dict):
            names += [k.value for k in value.keys
                      if isinstance(k, ast.Constant) and isinstance(k.value, str)]
    return names


# What each patch is in each release, from the first release named on: the verdict `vllm-patch
# verify` gives on the files as released (patch.toml: shapes, fixed-in, fixed-shapes,
# removed-in; "unknown-shape" where the patch knows no code of that release).
EXPECTED: dict[str, tuple[tuple[str, str], ...]] = {
    "kv-cache-page-unification": (("0.16.0", "missing"), ("0.29.0", "not-needed")),
    "falcon-h1-spec-conv-state": (("0.16.0", "missing"), ("0.32.0", "not-needed")),
    "granitemoehybrid-spec-conv-state": (("0.16.0", "missing"), ("0.32.0", "not-needed")),
    "zamba2-spec-conv-state": (("0.16.0", "missing"), ("0.32.0", "not-needed")),
    "bamba-spec-conv-state": (("0.16.0", "missing"), ("0.24.0", "not-applicable")),
    "mamba-split-external-kv": (("0.16.0", "missing"), ("0.23.0", "not-needed")),
    "kv-cache-page-promotion": (("0.16.0", "unknown-shape"), ("0.29.0", "missing")),
    "kv-cache-uneven-groups": (("0.16.0", "unknown-shape"), ("0.27.0", "missing")),
    "kv-cache-exact-groups": (("0.16.0", "unknown-shape"), ("0.27.0", "missing")),
    "hybrid-prefix-drafter-window": (("0.16.0", "unknown-shape"), ("0.27.0", "missing")),
    "hybrid-prefix-mamba-block": (("0.16.0", "unknown-shape"), ("0.29.0", "missing")),
    "gdn-spec-cpu-step": (("0.16.0", "unknown-shape"), ("0.27.0", "missing"),
                          ("0.33.0", "not-needed")),
    "gdn-spec-zero-accepted": (("0.16.0", "unknown-shape"), ("0.27.0", "missing")),
    "mamba-all-mode-chunk-align": (("0.16.0", "unknown-shape"), ("0.28.0", "missing"),
                                   ("0.32.0", "not-needed")),
}


def expected(patch: str, release: str) -> str:
    return [v for first, v in EXPECTED[patch] if Version(release) >= Version(first)][-1]
