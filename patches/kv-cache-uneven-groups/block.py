# Appended to vLLM's KV planning module by hatch-vllm-patch (kv-cache-uneven-groups).
#
# Rebinds _get_kv_cache_groups_uniform_page_size to a wrapper around vLLM's own function. vLLM
# splits each layer type (a "bucket" of layers with one KV spec) into groups of one size g, the
# smallest or (within 1.5x) the largest bucket; a bucket that g does not divide is padded. Every
# KV block then holds g layer pages, so a padded slot costs memory in every block its group uses.
# The wrapper always calls vLLM first and returns that very list unless a group size between
# g/2 and g gives strictly fewer padded slots while no layer type whose KV grows with the
# context (full attention, MLA, ...) gets more slots and the slots it frees pay for every slot
# it adds to a bounded type (sliding window, chunked local, Mamba state). Then it builds the
# groups the way vLLM does (the same buckets, layers[i::n] per group, vLLM's own
# create_kv_cache_group_specs) with that size. A request's KV bytes never grow that way, and the
# groups never more than double.
import typing as _hvp_typing

if _hvp_typing.TYPE_CHECKING:
    from collections.abc import Callable

    from vllm.v1.kv_cache_interface import KVCacheGroupSpec, KVCacheSpec

_hvp_uneven_groups_patch_id = "kv-cache-uneven-groups"


def _hvp_layer_buckets(
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


def _hvp_split(buckets: "list[tuple[list[str], list[KVCacheSpec]]]", size: int
               ) -> list[list[str]]:
    """Each bucket in ceil(n / size) groups, layer i of a bucket in group i mod that count (the
    split that keeps pipeline stages balanced)."""
    groups: list[list[str]] = []
    for names, _ in buckets:
        count = -(-len(names) // size)
        groups += [names[i::count] for i in range(count)]
    return groups


def _hvp_slots(counts: list[int], size: int) -> list[int]:
    """Page slots each bucket takes per block-row when split by ``size``: its group count times
    the widest group of all buckets (a block holds that many pages of every group)."""
    groups = [-(-n // size) for n in counts]
    width = max(-(-n // g) for n, g in zip(counts, groups, strict=True))
    return [g * width for g in groups]


def _hvp_is_bounded(spec: "KVCacheSpec") -> bool:
    """True for specs whose KV per request vLLM bounds whatever the context length (a window,
    a chunk, a recurrent state); unknown types count as unbounded, so they are never padded
    more than vLLM pads them."""
    from vllm.v1 import kv_cache_interface

    bounded = tuple(getattr(kv_cache_interface, name) for name in (
        "SlidingWindowSpec", "ChunkedLocalAttentionSpec", "MambaSpec")
        if isinstance(getattr(kv_cache_interface, name, None), type))
    return isinstance(spec, bounded)


def _hvp_group_size(counts: list[int], bounded: list[bool], size: int) -> int:
    """The group size for buckets of ``counts`` given vLLM's ``size``: among the sizes in
    [ceil(size / 2), size] whose unbounded buckets take no more slots than at ``size`` and whose
    freed unbounded slots cover every slot added to a bounded bucket, the one with the fewest
    unbounded slots, then the fewest slots in all, then the fewest groups; ``size`` itself on a
    tie."""
    base = _hvp_slots(counts, size)
    base_unbounded = sum(s for s, b in zip(base, bounded, strict=True) if not b)
    best, best_key = size, (base_unbounded, sum(base), sum(-(-n // size) for n in counts))
    for candidate in range(size - 1, (size + 1) // 2 - 1, -1):
        slots = _hvp_slots(counts, candidate)
        unbounded = sum(s for s, b in zip(slots, bounded, strict=True) if not b)
        grown = sum(max(s - s0, 0) for s, s0, b in zip(slots, base, bounded, strict=True) if b)
        if unbounded > base_unbounded or (unbounded - base_unbounded) + grown > 0:
            continue
        key = (unbounded, sum(slots), sum(-(-n // candidate) for n in counts))
        if key < best_key:
            best, best_key = candidate, key
    # A candidate beats ``size`` only with fewer unbounded slots, or as many and fewer slots in
    # all (it cannot have fewer groups): a request's KV bytes shrink at every length.
    return best


def _hvp_wrap_uniform_page_grouping(
    original: "Callable[[dict[str, KVCacheSpec]], list[KVCacheGroupSpec]]",
) -> "Callable[[dict[str, KVCacheSpec]], list[KVCacheGroupSpec]]":
    """The wrapper that replaces ``_get_kv_cache_groups_uniform_page_size``; ``__wrapped__`` is
    ``original``."""
    import functools

    @functools.wraps(original)
    def _get_kv_cache_groups_uniform_page_size(
        kv_cache_spec: "dict[str, KVCacheSpec]",
    ) -> "list[KVCacheGroupSpec]":
        groups = original(kv_cache_spec)
        if len(groups) < 2:
            return groups
        size = max(len(group.layer_names) for group in groups)
        buckets = _hvp_layer_buckets(kv_cache_spec)
        if _hvp_split(buckets, size) != [list(g.layer_names) for g in groups]:
            return groups  # not the grouping this patch knows how to redo: vLLM's stands
        counts = [len(names) for names, _ in buckets]
        bounded = [_hvp_is_bounded(specs[0]) for _, specs in buckets]
        better = _hvp_group_size(counts, bounded, size)
        if better == size:
            return groups
        # vLLM's own builder of group specs, a function of the module this block is appended to
        regrouped = create_kv_cache_group_specs(  # noqa: F821
            kv_cache_spec, _hvp_split(buckets, better))
        before, after = _hvp_slots(counts, size), _hvp_slots(counts, better)
        grows = [not b for b in bounded]
        from vllm.logger import init_logger

        init_logger(__name__).info(
            "Hybrid KV cache grouping: %d padding layer(s) instead of %d (%d saved; %d instead"
            " of %d in layers whose KV grows with the context) with group size %d instead of"
            " %d, %d groups instead of %d [hatch-vllm-patch %s]",
            sum(after) - sum(counts), sum(before) - sum(counts), sum(before) - sum(after),
            sum(s - n for s, n, g in zip(after, counts, grows, strict=True) if g),
            sum(s - n for s, n, g in zip(before, counts, grows, strict=True) if g),
            max(len(g.layer_names) for g in regrouped), size, len(regrouped), len(groups),
            _hvp_uneven_groups_patch_id,
        )
        return regrouped

    _get_kv_cache_groups_uniform_page_size._hvp_patch_id = (  # type: ignore[attr-defined]
        _hvp_uneven_groups_patch_id)
    return _get_kv_cache_groups_uniform_page_size


# Wrap once. Running this block again (e.g. exec'd twice) finds the wrapper and does nothing;
# importlib.reload re-runs the whole module, so it finds vLLM's fresh function and wraps that.
_hvp_current = globals().get("_get_kv_cache_groups_uniform_page_size")
if callable(_hvp_current) and (
    getattr(_hvp_current, "_hvp_patch_id", None) != _hvp_uneven_groups_patch_id
):
    _hvp_original_get_kv_cache_groups_uniform_page_size = _hvp_current
    _get_kv_cache_groups_uniform_page_size = _hvp_wrap_uniform_page_grouping(_hvp_current)
del _hvp_current
