"""kv-cache-uneven-groups' releases: the modules that keep the grouping it wraps and the releases
whose files its round trips test (``MODULE_OF``), which tests/test_release_shapes.py checks
against the releases' shapes."""

from __future__ import annotations

UTILS, PLANNING = "vllm.v1.core.kv_cache_utils", "vllm.v1.core.kv_cache_planning"
# Where a release keeps the function. Released files tested: one per known shape and module
# (0.27.0 is also the earliest claimed; 0.28.0 - 0.30.0 share its digest, 0.32.0 0.31.0's), and
# the newest release (0.34.0: 0.33.0's function in 0.33.0's module).
MODULE_OF = {"0.27.0": UTILS, "0.31.0": UTILS, "0.33.0": PLANNING, "0.34.0": PLANNING}
