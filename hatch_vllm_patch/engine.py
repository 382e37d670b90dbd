"""The pure core: read a target file's text, decide what a patch means for it, plan the new text.

Nothing here touches the file system. A patch never edits the original text of a module: it
appends one marked block that rebinds the target symbol. So the original bytes are always the
prefix before the first begin marker, revert is a cut, and "is this still the file the wheel
installed?" is one hash of that prefix against the wheel's RECORD.
"""

from __future__ import annotations

import ast
import enum
import hashlib
import re
from dataclasses import dataclass

from packaging.version import InvalidVersion, Version

from .catalog import Patch

BEGIN = b"\n# >>> hatch-vllm-patch: "
END = b"# <<< hatch-vllm-patch: "
_BEGIN_LINE = re.compile(rb"^# >>> hatch-vllm-patch: ([a-z0-9-]+) sha256=([0-9a-f]{64})\n")


class Verdict(str, enum.Enum):
    """What happened to (or what is true of) one patch in one environment."""

    APPLIED = "applied"
    ALREADY_APPLIED = "already-applied"
    REVERTED = "reverted"
    NOT_APPLIED = "not-applied"
    NOT_NEEDED = "not-needed"
    NOT_INSTALLED = "not-installed"
    NOT_APPLICABLE = "not-applicable"
    MISSING = "missing"
    STALE = "stale"
    UNKNOWN_SHAPE = "unknown-shape"
    MODIFIED = "modified"
    ERROR = "error"

    def __str__(self) -> str:
        return self.value


class MarkerError(ValueError):
    """The patch markers in a file are damaged: someone edited our region."""


@dataclass(frozen=True)
class AppliedBlock:
    """One of our blocks found in a file."""

    patch_id: str
    declared_sha256: str
    body: bytes

    @property
    def intact(self) -> bool:
        return hashlib.sha256(self.body).hexdigest() == self.declared_sha256


@dataclass(frozen=True)
class ParsedFile:
    """A target file split into the original bytes and our blocks after it."""

    original: bytes
    blocks: tuple[AppliedBlock, ...]

    def block(self, patch_id: str) -> AppliedBlock | None:
        return next((b for b in self.blocks if b.patch_id == patch_id), None)

    def render(self) -> bytes:
        return self.original + b"".join(render_block(b.patch_id, b.body) for b in self.blocks)


@dataclass(frozen=True)
class FileFacts:
    """What the environment says about one target file (gathered by ``environment``)."""

    path: str
    content: bytes | None  # None: the file does not exist
    installed_version: str | None  # version of the distribution that owns it; None: not installed
    record_sha256: str | None  # the wheel's RECORD hash (hex), when the file is in a RECORD
    ledger_original_sha256: str | None = None  # what we recorded as original when we patched it


@dataclass(frozen=True)
class Plan:
    """The outcome of planning one patch operation on one file; ``new_content`` is what to write."""

    verdict: Verdict
    reason: str
    new_content: bytes | None = None


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def render_block(patch_id: str, body: bytes) -> bytes:
    return (
        BEGIN
        + f"{patch_id} sha256={sha256_hex(body)}\n".encode()
        + body
        + END
        + patch_id.encode()
        + b"\n"
    )


def parse_file(content: bytes) -> ParsedFile:
    """Split ``content`` into the original bytes and our blocks; MarkerError if damaged."""
    start = content.find(BEGIN)
    if start < 0:
        if END in content:
            raise MarkerError("an end marker without its begin marker")
        return ParsedFile(content, ())
    original, rest = content[:start], content[start + 1 :]
    blocks: list[AppliedBlock] = []
    while rest:
        match = _BEGIN_LINE.match(rest)
        if not match:
            raise MarkerError("a begin marker line is damaged")
        patch_id, digest = match.group(1).decode(), match.group(2).decode()
        end_line = END + patch_id.encode() + b"\n"
        end = rest.find(end_line, match.end())
        if end < 0:
            raise MarkerError(f"the block of {patch_id} has no end marker")
        body = rest[match.end() : end]
        if BEGIN[1:] in body or END in body:
            raise MarkerError(f"the block of {patch_id} contains another marker")
        blocks.append(AppliedBlock(patch_id, digest, body))
        rest = rest[end + len(end_line) :]
        if rest and not rest.startswith(BEGIN):
            raise MarkerError(f"text was added after the block of {patch_id}")
        rest = rest[1:]
    if len({b.patch_id for b in blocks}) != len(blocks):
        raise MarkerError("a patch block appears twice")
    return ParsedFile(original, tuple(blocks))


FunctionNode = ast.FunctionDef | ast.AsyncFunctionDef


def locate_function(source: str, symbol: str) -> tuple[FunctionNode | None, str]:
    """The ``def`` of ``name`` or ``Class.name`` at module level (the last binding wins), or
    None with the reason it is not there. Shared with the structural classifiers of patches."""
    try:
        tree = ast.parse(source)
    except SyntaxError as exc:
        return None, f"the module does not parse: {exc.msg} (line {exc.lineno})"
    scope: list[ast.stmt] = tree.body
    *classes, name = symbol.split(".")
    for class_name in classes:
        found = [n for n in scope if isinstance(n, ast.ClassDef) and n.name == class_name]
        if not found:
            return None, f"no module-level class {class_name}"
        scope = found[-1].body
    defs = [n for n in scope if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            and n.name == name]
    if not defs:
        owner = f"{classes[-1]} defines no method" if classes else "no module-level function"
        return None, f"{owner} {name}"
    return defs[-1], ""


def find_symbol(source: str, symbol: str) -> FunctionNode | None:
    """The ``def`` of ``symbol``, or None (see :func:`locate_function` for the reason)."""
    return locate_function(source, symbol)[0]


def plain_parameters(node: FunctionNode) -> tuple[str, ...] | None:
    """The parameter names of a function taking only positional parameters without defaults;
    None for anything else (``*args``, keyword-only, ``**kwargs``, defaults)."""
    args = node.args
    if args.vararg or args.kwonlyargs or args.kwarg or args.defaults:
        return None
    return tuple(a.arg for a in (*args.posonlyargs, *args.args))


def symbol_digest(source: str, symbol: str) -> str | None:
    """sha256 of the exact source lines of ``symbol`` (first decorator to last line), or None."""
    node = find_symbol(source, symbol)
    if node is None:
        return None
    first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
    last = node.end_lineno or node.lineno
    lines = source.splitlines(keepends=True)[first - 1 : last]
    return sha256_hex("".join(lines).encode("utf-8"))


def classify_shape(patch: Patch, original: bytes) -> tuple[str, str]:
    """("known" | "not-applicable" | "unknown", reason) for the original text of the target."""
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
    node, missing = locate_function(source, patch.target.symbol)
    digest = symbol_digest(source, patch.target.symbol)
    if node is None or digest is None:
        return "unknown", f"{patch.target.symbol} is not defined in this file ({missing})"
    if digest in patch.shapes:
        return "known", f"{patch.target.symbol} has a known shape (sha256 {digest[:12]})"
    return "unknown", (
        f"{patch.target.symbol} has a shape this patch does not know (sha256 {digest[:12]})"
    )


def _fixed_upstream(patch: Patch, version: str | None) -> bool:
    if patch.fixed_in is None or version is None:
        return False
    try:
        return Version(version) >= patch.fixed_in
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


@dataclass(frozen=True)
class Inspection:
    """Everything the three operations need to know about one patch on one file."""

    verdict: Verdict  # the state: ALREADY_APPLIED, MISSING, STALE, or a terminal verdict
    reason: str
    parsed: ParsedFile | None = None


def inspect(patch: Patch, facts: FileFacts) -> Inspection:
    """The state of ``patch`` in the file described by ``facts``; pure."""
    dist = patch.target.distribution
    if facts.installed_version is None:
        return Inspection(Verdict.NOT_INSTALLED, f"{dist} is not installed in this environment")
    if facts.content is None:
        if _fixed_upstream(patch, facts.installed_version):
            return Inspection(
                Verdict.NOT_NEEDED, f"{dist} {facts.installed_version} >= {patch.fixed_in}: "
                "fixed upstream",
            )
        return Inspection(Verdict.UNKNOWN_SHAPE, f"{facts.path} does not exist")
    try:
        parsed = parse_file(facts.content)
    except MarkerError as exc:
        return Inspection(Verdict.MODIFIED, f"patch markers were edited by hand ({exc})")
    expected, source_name = _expected_original(facts, parsed)
    if expected is not None and sha256_hex(parsed.original) != expected:
        return Inspection(
            Verdict.MODIFIED,
            f"the file differs from {source_name} (sha256 {sha256_hex(parsed.original)[:12]}, "
            f"expected {expected[:12]}): modified by someone else",
            parsed,
        )
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
        # have dropped a shape, or the file may be a copy from another build.)
        status, reason = classify_shape(patch, parsed.original)
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
        return Inspection(
            Verdict.NOT_NEEDED,
            f"{dist} {facts.installed_version} >= {patch.fixed_in}: fixed upstream",
            parsed,
        )
    status, reason = classify_shape(patch, parsed.original)
    if status == "not-applicable":
        return Inspection(Verdict.NOT_APPLICABLE, reason, parsed)
    if status == "unknown":
        return Inspection(Verdict.UNKNOWN_SHAPE, f"{reason}; refusing to patch", parsed)
    return Inspection(Verdict.MISSING, reason, parsed)


def plan_apply(patch: Patch, facts: FileFacts) -> Plan:
    """Plan applying ``patch``: write only when it is missing (or stale) on a known shape."""
    state = inspect(patch, facts)
    if state.verdict is Verdict.MISSING or state.verdict is Verdict.STALE:
        assert state.parsed is not None
        if state.verdict is Verdict.STALE:
            status, reason = classify_shape(patch, state.parsed.original)
            if status != "known":
                return Plan(Verdict.UNKNOWN_SHAPE, f"{reason}; refusing to update the patch")
        body = patch.block.encode("utf-8")
        others = tuple(b for b in state.parsed.blocks if b.patch_id != patch.id)
        new = ParsedFile(state.parsed.original, (*others, AppliedBlock(patch.id, "", body)))
        note = "updated a stale block" if state.verdict is Verdict.STALE else state.reason
        return Plan(Verdict.APPLIED, note, new.render())
    return Plan(state.verdict, state.reason)


def plan_revert(patch: Patch, facts: FileFacts) -> Plan:
    """Plan removing ``patch``'s block; the original must come back byte for byte."""
    state = inspect(patch, facts)
    ours = state.parsed is not None and state.parsed.block(patch.id) is not None
    if ours and state.verdict is not Verdict.MODIFIED:
        assert state.parsed is not None
        others = tuple(b for b in state.parsed.blocks if b.patch_id != patch.id)
        new = ParsedFile(state.parsed.original, others).render()
        expected, source_name = _expected_original(facts, state.parsed)
        if not others and expected is not None and sha256_hex(new) != expected:
            return Plan(Verdict.ERROR, f"reverting would not restore {source_name}'s bytes")
        where = f"; matches {source_name}" if expected and not others else ""
        return Plan(Verdict.REVERTED, f"removed the block{where}", new)
    if state.verdict in {Verdict.MISSING, Verdict.NOT_NEEDED, Verdict.NOT_APPLICABLE,
                         Verdict.UNKNOWN_SHAPE}:
        return Plan(Verdict.NOT_APPLIED, "nothing to revert: the patch is not in the file")
    return Plan(state.verdict, state.reason)


def plan_verify(patch: Patch, facts: FileFacts) -> Plan:
    """What ``verify`` reports: APPLIED when in place and current, otherwise the problem."""
    state = inspect(patch, facts)
    if state.verdict is Verdict.ALREADY_APPLIED:
        return Plan(Verdict.APPLIED, state.reason)
    if state.verdict is Verdict.MISSING:
        return Plan(Verdict.MISSING, f"not patched ({state.reason})")
    return Plan(state.verdict, state.reason)
