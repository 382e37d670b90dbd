"""The tests' shared machinery, one room per kind (docs/explanation/architecture.md, "The tests'
rooms"): environments (``venvs``), the releases' shapes (``release_shapes``), the runner of
vLLM's own tests (``upstream``), the prefix patches' blocks (``prefix_patches``), the memory
patches' releases (``page_promotion``, ``uneven_groups``), what a block binds
(``block_names``), the demo distribution (``demo``), the hook's project (``hook_project``), a
project's own patches (``project_patches``), model folders (``models``), the memory benchmark
(``memory_benchmark``), the docs' console examples (``console_examples``), running the tool
(``commands``), the machine (``machine``), the served harness's driver (``served``), the
host-CPU answers of the scenario scripts (``scenario_cpu``), and the scripts run by path in a
vLLM interpreter (``served_harness/``, ``kernel_harness/``, ``kv_scenarios/``,
``prefix_scenarios/``, ``hybrid_scenarios/``). Test modules import from here, never from each
other; ``conftest.py`` keeps the fixtures and the pytest hooks.
"""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
