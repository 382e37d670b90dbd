# Appended by hatch-vllm-patch (kv-cache-page-promotion) to the module that defines vLLM's
# unify_kv_cache_spec_page_size: vllm/v1/core/kv_cache_utils.py (0.29.0 - 0.32.0) or
# vllm/v1/core/kv_cache_planning.py (0.33.0).
#
# Rebinds unify_kv_cache_spec_page_size to a wrapper around vLLM's own function, which runs
# first: its errors propagate unchanged (get_kv_cache_groups catches its NotImplementedError for
# the full-allocation fallback), and wherever its result already has the smallest common page
# this patch allows, that result is returned as it is (the same dict, spec objects, key order).
# Otherwise (vLLM padded an attention page, or padded state pages beyond that page) the
# wrapper returns its own layout:
#   * P = the smallest multiple of lcm(every attention page) that is >= every state page
#     (MambaSpec pages as they come, including padding the platform already set); without
#     state layers P = lcm(every attention page);
#   * every attention layer (a draft's included) gets block_size * (P // page): whole
#     block-size multiples, never a padded attention page (an attention backend that ignores
#     page_size_padded would let its blocks overlap other layers' pages);
#   * every MambaSpec page is padded to P.
# A set with a layer whose page does not scale exactly with block_size (MLA with a row
# alignment, an attention page already padded by the platform, a spec type of a plugin) gets
# vLLM's own result. Inside get_kv_cache_groups (also wrapped here, only to make its VllmConfig
# visible), the wrapper's layout is returned only where a request of max_model_len holds
# strictly fewer bytes in it (every layer's max_memory_usage_bytes); otherwise vLLM's result.
import typing as _hvp_typing

if _hvp_typing.TYPE_CHECKING:
    from collections.abc import Callable

    from vllm.v1.kv_cache_interface import KVCacheSpec

_hvp_kv_promotion_patch_id = "kv-cache-page-promotion"


def _hvp_promoted_pages(
    kv_cache_spec: "dict[str, KVCacheSpec]",
) -> "tuple[dict[str, KVCacheSpec], int, int, int] | None":
    """(specs, P, attention layers promoted, state pages padded), or None for a set this patch
    leaves to vLLM (no attention layer, or a layer that does not reach P exactly)."""
    from dataclasses import replace
    from math import lcm

    from vllm.v1.kv_cache_interface import MambaSpec

    try:
        pages = {name: spec.page_size_bytes for name, spec in kv_cache_spec.items()}
    except (AssertionError, NotImplementedError):
        return None
    attention = [p for n, p in pages.items() if not isinstance(kv_cache_spec[n], MambaSpec)]
    states = [p for n, p in pages.items() if isinstance(kv_cache_spec[n], MambaSpec)]
    if not attention or min(attention) <= 0:
        return None
    unit = lcm(*attention)
    target = max(1, -(-max(states, default=0) // unit)) * unit
    unified: dict[str, KVCacheSpec] = {}
    promoted = padded = 0
    for name, spec in kv_cache_spec.items():
        page = pages[name]
        new_spec = spec
        try:
            if page != target:
                if isinstance(spec, MambaSpec):
                    new_spec = replace(spec, page_size_padded=target)
                    padded += 1
                else:
                    new_spec = replace(spec, block_size=spec.block_size * (target // page))
                    promoted += 1
            if new_spec.page_size_bytes != target:
                return None
        except (AssertionError, NotImplementedError, TypeError, ValueError):
            return None
        unified[name] = new_spec
    return unified, target, promoted, padded


def _hvp_wrap_unify_for_promotion(
    original: "Callable[[dict[str, KVCacheSpec]], dict[str, KVCacheSpec]]",
) -> "Callable[[dict[str, KVCacheSpec]], dict[str, KVCacheSpec]]":
    """The wrapper that replaces ``unify_kv_cache_spec_page_size``; ``__wrapped__`` is
    ``original``."""
    import functools

    @functools.wraps(original)
    def unify_kv_cache_spec_page_size(
        kv_cache_spec: "dict[str, KVCacheSpec]",
    ) -> "dict[str, KVCacheSpec]":
        result = original(kv_cache_spec)
        if result is kv_cache_spec:
            return result  # one page size already: nothing was unified
        ours = _hvp_promoted_pages(kv_cache_spec)
        if ours is None:
            return result
        unified, target, promoted, padded = ours
        try:
            upstream_page = max(spec.page_size_bytes for spec in result.values())
        except (AssertionError, ValueError):
            return result
        if upstream_page == target:
            return result  # vLLM's layout already has the smallest page: it is returned as is
        config = _hvp_promotion_planning_config.get()
        if config is not None:  # inside get_kv_cache_groups: compare what a request holds
            try:
                ours_bytes = sum(s.max_memory_usage_bytes(config) for s in unified.values())
                vllms_bytes = sum(s.max_memory_usage_bytes(config) for s in result.values())
            except Exception:  # a spec that cannot say: compare pages only, as without a config
                ours_bytes = vllms_bytes = 0
            if ours_bytes and ours_bytes >= vllms_bytes:
                return result  # a smaller page, but no fewer bytes per request of max_model_len
        from vllm.logger import init_logger

        init_logger(__name__).info(
            "Hybrid KV cache: common page %d B instead of vLLM's %d B: %d attention layer(s)"
            " given whole block-size multiples, %d state page(s) padded, no attention page"
            " padded [hatch-vllm-patch %s]",
            target, upstream_page, promoted, padded, _hvp_kv_promotion_patch_id,
        )
        return unified

    unify_kv_cache_spec_page_size._hvp_patch_id = _hvp_kv_promotion_patch_id  # type: ignore[attr-defined]
    return unify_kv_cache_spec_page_size


def _hvp_wrap_groups_for_promotion(original: "Callable[..., _hvp_typing.Any]",
                                   ) -> "Callable[..., _hvp_typing.Any]":
    """The wrapper that replaces ``get_kv_cache_groups``: it calls vLLM's function unchanged,
    with the VllmConfig it was given visible to the unification wrapper above (which compares
    the bytes one request of max_model_len holds in vLLM's layout and in its own)."""
    import functools

    @functools.wraps(original)
    def get_kv_cache_groups(vllm_config, kv_cache_spec):  # type: ignore[no-untyped-def]
        token = _hvp_promotion_planning_config.set(vllm_config)
        try:
            return original(vllm_config, kv_cache_spec)
        finally:
            _hvp_promotion_planning_config.reset(token)

    get_kv_cache_groups._hvp_patch_id = _hvp_kv_promotion_patch_id  # type: ignore[attr-defined]
    return get_kv_cache_groups


# The VllmConfig of the get_kv_cache_groups call in progress (None outside one: vLLM's tests
# that call the unification directly get the page rule alone).
if "_hvp_promotion_planning_config" not in globals():
    import contextvars as _hvp_contextvars

    _hvp_promotion_planning_config = _hvp_contextvars.ContextVar(
        "_hvp_promotion_planning_config", default=None)

# Wrap once. Running this block again (e.g. exec'd twice) finds the wrapper and does nothing;
# importlib.reload re-runs the whole module, so it finds vLLM's fresh function and wraps that.
_hvp_current = globals().get("unify_kv_cache_spec_page_size")
if callable(_hvp_current) and (
    getattr(_hvp_current, "_hvp_patch_id", None) != _hvp_kv_promotion_patch_id
):
    _hvp_original_unify_for_promotion = _hvp_current
    unify_kv_cache_spec_page_size = _hvp_wrap_unify_for_promotion(_hvp_current)
_hvp_current = globals().get("get_kv_cache_groups")
if callable(_hvp_current) and (
    getattr(_hvp_current, "_hvp_patch_id", None) != _hvp_kv_promotion_patch_id
):
    get_kv_cache_groups = _hvp_wrap_groups_for_promotion(_hvp_current)
del _hvp_current
