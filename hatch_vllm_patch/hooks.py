"""Hatchling plugin registration (entry point group ``hatch``): the build hook ``vllm-patch``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hatchling.plugin import hookimpl

if TYPE_CHECKING:
    from hatchling.builders.config import BuilderConfig
    from hatchling.builders.hooks.plugin.interface import BuildHookInterface


@hookimpl
def hatch_register_build_hook() -> type[BuildHookInterface[BuilderConfig]]:
    # Imported here: hatchling loads every registered plugin on each build of any project in the
    # environment, and most of those builds never use this hook.
    from .build_hook import VllmPatchBuildHook

    return VllmPatchBuildHook
