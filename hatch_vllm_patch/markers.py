"""Our markers in a target file: the original bytes, then our blocks, each between two lines.

Import-light on purpose (``hashlib`` and ``re`` only): the guard that runs in every vLLM process
reads files with it, and so do the engine and the authoring commands.
"""

from __future__ import annotations

import hashlib
import re
from typing import NamedTuple

from .names import is_patch_id, shown

BEGIN = b"\n# >>> hatch-vllm-patch: "
END = b"# <<< hatch-vllm-patch: "
_BEGIN_LINE = re.compile(rb"^# >>> hatch-vllm-patch: ([a-z0-9-]+) sha256=([0-9a-f]{64})\n")


class MarkerError(ValueError):
    """The patch markers in a file are damaged: someone edited our region."""


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class AppliedBlock(NamedTuple):
    """One of our blocks found in a file."""

    patch_id: str
    declared_sha256: str
    body: bytes

    @property
    def intact(self) -> bool:
        return sha256_hex(self.body) == self.declared_sha256


class ParsedFile(NamedTuple):
    """A target file split into the original bytes and our blocks after it."""

    original: bytes
    blocks: tuple[AppliedBlock, ...]

    def block(self, patch_id: str) -> AppliedBlock | None:
        return next((b for b in self.blocks if b.patch_id == patch_id), None)

    def without(self, *patch_ids: str) -> ParsedFile:
        return ParsedFile(self.original, tuple(b for b in self.blocks
                                               if b.patch_id not in patch_ids))

    def render(self) -> bytes:
        return self.original + b"".join(render_block(b.patch_id, b.body) for b in self.blocks)


def render_block(patch_id: str, body: bytes) -> bytes:
    if not is_patch_id(patch_id):  # a marker line is never made from a bad id
        raise MarkerError(f"{shown(patch_id)} is not a patch id: no marker is written for it")
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
