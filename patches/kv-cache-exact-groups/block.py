# Appended to vLLM's KV planning module by hatch-vllm-patch (kv-cache-exact-groups).
#
# Rebinds _get_kv_cache_groups_uniform_page_size to a wrapper around vLLM's own function. vLLM
# splits each layer type (a "bucket" of layers with one KV spec) into groups of one size g; a
# bucket that g does not divide is padded, and every KV block then holds g layer pages, padded
# slots included. The wrapper always calls vLLM first and returns that very list wherever it pads
# nothing. Where it pads, it builds the groups the way vLLM does (the same buckets, layers[i::n]
# per group, vLLM's own create_kv_cache_group_specs) with the greatest common divisor of the
# bucket sizes as the group size: no padding slot at all, so every bucket takes exactly its own
# layers' pages, the least a request can hold. The price is groups: coprime counts (a draft's
# layer beside 10 + 30) make one-layer groups, and vLLM does per-group work every step.
import typing as _hvp_typing

if _hvp_typing.TYPE_CHECKING:
    from collections.abc import Callable

    from vllm.v1.kv_cache_interface import KVCacheGroupSpec, KVCacheSpec

_hvp_exact_groups_patch_id = "kv-cache-exact-groups"


def _hvp_exact_buckets(
    kv_cache_spec: "dict[str, KVCacheSpec]",
) -> "list[tuple[list[str], list[KVCacheSpec]]]":
    """Layers of one spec together (first appearance order), then joined with an earlier
    bucket whose specs ``merge`` accepts them, as vLLM buckets them before grouping."""
    by_spec: dict[KVCacheSpec, list[str]] = {}
    for name, spec in kv_cache_spec.items():
        by_spec.setdefault(spec, []).append(name)
    buckets: list[tuple[list[str], list[KVCacheSpec]]] = []
    for spec, names in by_spec.items():
        for bucket_names, bucket_specs in buckets:
            try:
                type(bucket_specs[0]).merge([*bucket_specs, spec])
            except (AssertionError, ValueError):
                continue
            bucket_names.extend(names)
            bucket_specs.append(spec)
            break
        else:
            buckets.append((list(names), [spec]))
    return buckets


def _hvp_exact_split(buckets: "list[tuple[list[str], list[KVCacheSpec]]]", size: int
                     ) -> list[list[str]]:
    """Each bucket in ceil(n / size) groups, layer i of a bucket in group i mod that count (the
    split that keeps pipeline stages balanced)."""
    groups: list[list[str]] = []
    for names, _ in buckets:
        count = -(-len(names) // size)
        groups += [names[i::count] for i in range(count)]
    return groups


def _hvp_wrap_exact_grouping(
    original: "Callable[[dict[str, KVCacheSpec]], list[KVCacheGroupSpec]]",
) -> "Callable[[dict[str, KVCacheSpec]], list[KVCacheGroupSpec]]":
    """The wrapper that replaces ``_get_kv_cache_groups_uniform_page_size``; ``__wrapped__`` is
    ``original``."""
    import functools
    import math

    @functools.wraps(original)
    def _get_kv_cache_groups_uniform_page_size(
        kv_cache_spec: "dict[str, KVCacheSpec]",
    ) -> "list[KVCacheGroupSpec]":
        groups = original(kv_cache_spec)
        if len(groups) < 2:
            return groups
        size = max(len(group.layer_names) for group in groups)
        padding = len(groups) * size - sum(len(group.layer_names) for group in groups)
        if padding == 0:
            return groups
        buckets = _hvp_exact_buckets(kv_cache_spec)
        if _hvp_exact_split(buckets, size) != [list(g.layer_names) for g in groups]:
            return groups  # not the grouping this patch knows how to redo: vLLM's stands
        exact = math.gcd(*(len(names) for names, _ in buckets))
        # vLLM's own builder of group specs, a function of the module this block is appended to
        regrouped = create_kv_cache_group_specs(  # noqa: F821
            kv_cache_spec, _hvp_exact_split(buckets, exact))
        from vllm.logger import init_logger

        init_logger(__name__).info(
            "Hybrid KV cache grouping: no padding layer instead of %d, with group size %d"
            " instead of %d: %d groups instead of %d (vLLM does per-group work every step)"
            " [hatch-vllm-patch %s]",
            padding, exact, size, len(regrouped), len(groups), _hvp_exact_groups_patch_id,
        )
        return regrouped

    _get_kv_cache_groups_uniform_page_size._hvp_patch_id = (  # type: ignore[attr-defined]
        _hvp_exact_groups_patch_id)
    return _get_kv_cache_groups_uniform_page_size


# Wrap once. Running this block again (e.g. exec'd twice) finds the wrapper and does nothing;
# importlib.reload re-runs the whole module, so it finds vLLM's fresh function and wraps that.
_hvp_current = globals().get("_get_kv_cache_groups_uniform_page_size")
if callable(_hvp_current) and (
    getattr(_hvp_current, "_hvp_patch_id", None) != _hvp_exact_groups_patch_id
):
    _hvp_original_get_kv_cache_groups_uniform_page_size = _hvp_current
    _get_kv_cache_groups_uniform_page_size = _hvp_wrap_exact_grouping(_hvp_current)
del _hvp_current
