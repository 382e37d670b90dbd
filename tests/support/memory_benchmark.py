"""benchmarks/memory.py loaded as a module (it is a script, not a package)."""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

from support import REPO

BENCHMARK = REPO / "benchmarks" / "memory.py"


def load_benchmark() -> ModuleType:
    spec = importlib.util.spec_from_file_location("hvp_memory_benchmark", BENCHMARK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module
