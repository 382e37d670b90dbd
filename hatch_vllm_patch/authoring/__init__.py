"""Carry your own fix: ``edit`` a module in place, ``create`` a patch folder from the edit,
scaffold a wrapper with ``new``, and ``check`` patch folders.

A patch made here is a folder like the catalog's (``patch.toml`` + ``block.py``), so it is
applied, verified, reverted and guarded by the same engine. What makes it safe:

* ``edit`` gives the file its own inode (uv's cache and other environments never see the edit),
  checks its pristine bytes against the wheel's RECORD, keeps them, and takes our blocks out;
* ``create`` finds, with ``ast``, every module-level function and every method of a module-level
  class that differs from the pristine text (or was added), and writes a block that defines
  exactly those and rebinds them; anything a rebinding cannot express (a changed module-level
  statement, a class attribute, a removed or renamed symbol) is refused, each change named;
* the patch knows the pristine digest of every symbol it replaces, so on another release it
  says ``unknown-shape`` instead of fuzz-applying.

The package reads as the pipeline: :mod:`.symbols` (the pure symbol diff), :mod:`.render`
(block and manifest), :mod:`.check` (patch folders), and :mod:`.commands` and
:mod:`.create_patch` (the commands and their effects) last.
"""

from __future__ import annotations

from .check import FolderCheck, check, interactive_ask
from .commands import EditResult, edit, new, write_patch_folder
from .create_patch import CreateResult, create, create_from_diff
from .render import PLACEHOLDER, render_manifest, render_rebinding_block, render_wrapper_block
from .symbols import InexpressibleEdit, SymbolChange, captured_references, symbol_changes
from .update import UpdateResult, update

__all__ = [
    "PLACEHOLDER",
    "CreateResult",
    "EditResult",
    "FolderCheck",
    "InexpressibleEdit",
    "SymbolChange",
    "UpdateResult",
    "captured_references",
    "check",
    "create",
    "create_from_diff",
    "edit",
    "interactive_ask",
    "new",
    "render_manifest",
    "render_rebinding_block",
    "render_wrapper_block",
    "symbol_changes",
    "update",
    "write_patch_folder",
]
