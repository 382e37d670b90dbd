# Appended by hatch-vllm-patch (hybrid-prefix-drafter-window) to the module that defines vLLM's
# _get_kv_cache_groups_uniform_page_size: vllm/v1/core/kv_cache_utils.py (0.29.0 - 0.32.0) or
# vllm/v1/core/kv_cache_planning.py (0.33.0 - 0.34.0).
#
# get_kv_cache_groups unifies the pages of every layer and then groups them with this function.
# The unification scales a sliding-window layer's block (a drafter's) by max_page // its page:
# next to an MLA target of 1536-token blocks, 3456 tokens. The scheduler's block is the lcm of
# the groups' blocks (13824), so a prefix hit must end on a multiple of 13824, where a Mamba
# group in "align" mode never kept a state: an identical resend gets a hit of 0.
# The wrapper runs before vLLM's grouping, on the unified specs. Only where a Mamba layer caches
# states for prefix caching (mamba_cache_mode other than "none") and a sliding-window layer's
# block does not divide L = lcm(every other layer's block), it gives that layer the largest
# block b that divides L, is a multiple of the power-of-two part of vLLM's block (so of the
# kernel block the layer started from) and whose page fits the common page, which it then pads
# to (as vLLM itself pads a non-MLA attention page that does not divide the common page, and as
# 0.33+ lay out a sliding-window layer whose backend takes any multiple of a base size).
# Everywhere else vLLM's specs go to vLLM's grouping untouched (the same dict).
import typing as _hvp_typing

if _hvp_typing.TYPE_CHECKING:
    from collections.abc import Callable

    from vllm.v1.kv_cache_interface import KVCacheSpec

_hvp_window_patch_id = "hybrid-prefix-drafter-window"


def _hvp_window_blocks(
    kv_cache_spec: "dict[str, KVCacheSpec]",
) -> "tuple[dict[str, KVCacheSpec], list[str]] | None":
    """(specs with re-blocked sliding-window layers, one note per layer), or None where vLLM's
    specs stay: no state cached for prefix caching, no sliding-window layer that inflates the
    scheduler's block, pages not unified, or no block that fits."""
    from dataclasses import replace
    from math import lcm

    from vllm.v1.kv_cache_interface import MambaSpec, SlidingWindowSpec

    if not any(isinstance(s, MambaSpec) and getattr(s, "mamba_cache_mode", "none") != "none"
               for s in kv_cache_spec.values()):
        return None
    try:
        pages = {spec.page_size_bytes for spec in kv_cache_spec.values()}
    except (AssertionError, NotImplementedError):
        return None
    others = [s.block_size for s in kv_cache_spec.values() if not isinstance(s, SlidingWindowSpec)]
    if len(pages) != 1 or not others or min(others) <= 0:
        return None
    page, common = pages.pop(), lcm(*others)
    result: dict[str, KVCacheSpec] = {}
    notes: list[str] = []
    for name, spec in kv_cache_spec.items():
        result[name] = spec
        if not isinstance(spec, SlidingWindowSpec) or common % spec.block_size == 0:
            continue
        try:
            real = spec.real_page_size_bytes
            if real % spec.block_size:
                return None
            per_token = real // spec.block_size
            unit = spec.block_size & -spec.block_size  # the kernel block divides it
            if per_token <= 0 or common % unit:
                return None
            fitting = [unit * m for m in range(1, common // unit + 1)
                       if (common // unit) % m == 0 and unit * m * per_token <= page]
            if not fitting:
                return None
            block = max(fitting)
            new_spec = replace(spec, block_size=block,
                               page_size_padded=None if block * per_token == page else page)
            if new_spec.page_size_bytes != page:
                return None
        except (AssertionError, NotImplementedError, TypeError, ValueError):
            return None
        result[name] = new_spec
        notes.append(f"{name}: {spec.block_size} -> {block} tokens")
    return (result, notes) if notes else None


def _hvp_window_wrap_grouping(
    original: "Callable[..., _hvp_typing.Any]",
) -> "Callable[..., _hvp_typing.Any]":
    """The wrapper that replaces ``_get_kv_cache_groups_uniform_page_size``; ``__wrapped__`` is
    ``original``."""
    import functools

    @functools.wraps(original)
    def _get_kv_cache_groups_uniform_page_size(kv_cache_spec):  # type: ignore[no-untyped-def]
        ours = _hvp_window_blocks(kv_cache_spec)
        if ours is None:
            return original(kv_cache_spec)
        specs, notes = ours
        from math import lcm

        from vllm.logger import init_logger

        blocks = lcm(*(s.block_size for s in specs.values()))
        init_logger(__name__).info(
            "Hybrid prefix caching: sliding-window block(s) %s (a page padded instead of a "
            "block scaled), so the scheduler's block is %d tokens instead of %d "
            "[hatch-vllm-patch %s]",
            "; ".join(notes), blocks, lcm(*(s.block_size for s in kv_cache_spec.values())),
            _hvp_window_patch_id,
        )
        return original(specs)

    _get_kv_cache_groups_uniform_page_size._hvp_patch_id = _hvp_window_patch_id  # type: ignore[attr-defined]
    return _get_kv_cache_groups_uniform_page_size


# Wrap once. Running this block again (e.g. exec'd twice) finds the wrapper and does nothing;
# importlib.reload re-runs the whole module, so it finds vLLM's fresh function and wraps that.
_hvp_window_current = globals().get("_get_kv_cache_groups_uniform_page_size")
if callable(_hvp_window_current) and (
    getattr(_hvp_window_current, "_hvp_patch_id", None) != _hvp_window_patch_id
):
    _get_kv_cache_groups_uniform_page_size = _hvp_window_wrap_grouping(_hvp_window_current)
del _hvp_window_current
