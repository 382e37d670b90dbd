# Appended to vllm/v1/core/kv_cache_utils.py by hatch-vllm-patch (kv-cache-page-unification).
#
# Rebinds unify_kv_cache_spec_page_size to a wrapper around vLLM's own function. Wherever the
# original returns layers with one page size, its result is returned as it is (the same dict,
# the same spec objects, the same order). Only where the original gives up on a hybrid set
# (NotImplementedError, the bare AssertionError of a Mamba layer sent to the block-scaling
# branch, or pages left unequal when asserts are off), or raises NotImplementedError for an
# attention-only set without MLA layers (pages that do not divide each other, e.g. a DFlash
# drafter's beside its target's), does the wrapper unify the pages itself. A set with an MLA
# layer and no Mamba layer keeps vLLM's own error: 0.27/0.28 catch it in get_kv_cache_groups for
# their full-allocation fallback (MLA next to a sliding-window drafter). So:
#   * target page = the smallest multiple of lcm(every non-Mamba page) that is >= every page
#     (for an attention-only set: that lcm);
#   * a MambaSpec page (a constant state size, independent of block_size) is padded to it;
#   * every other layer gets block_size * (target // page), an integer multiple, and is never
#     padded: FlashAttention ignores a padded attention page and its blocks would then overlap
#     the pages of other layers in the shared KV tensor (wrong outputs, no error).
# When even that is impossible it raises NotImplementedError naming the layers, so callers that
# catch it (vLLM's own fallbacks) keep working.
import typing as _hvp_typing

if _hvp_typing.TYPE_CHECKING:
    from collections.abc import Callable

    from vllm.v1.kv_cache_interface import KVCacheSpec

_hvp_kv_page_patch_id = "kv-cache-page-unification"


def _hvp_pages_are_uniform(kv_cache_spec: "dict[str, KVCacheSpec]") -> bool:
    """True when every spec has the same page size (a set with a spec whose page cannot be
    computed, e.g. one padded below its real size, does not count as uniform)."""
    try:
        return len({spec.page_size_bytes for spec in kv_cache_spec.values()}) <= 1
    except AssertionError:
        return False


def _hvp_has_mamba_layer(kv_cache_spec: "dict[str, KVCacheSpec]") -> bool:
    from vllm.v1.kv_cache_interface import MambaSpec

    return any(isinstance(spec, MambaSpec) for spec in kv_cache_spec.values())


def _hvp_promotable_attention_only(kv_cache_spec: "dict[str, KVCacheSpec]") -> bool:
    """True for a set without Mamba and MLA layers: vLLM's NotImplementedError for it (pages
    that do not divide each other) is answered by promoting block sizes to their lcm. A set
    with an MLA layer keeps vLLM's error (0.27+'s full-allocation fallback needs it)."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    return not _hvp_has_mamba_layer(kv_cache_spec) and not any(
        isinstance(spec, MLAAttentionSpec) for spec in kv_cache_spec.values())


def _hvp_unify_pages_padding_only_mamba(
    kv_cache_spec: "dict[str, KVCacheSpec]",
) -> "dict[str, KVCacheSpec]":
    """Give every layer the same page size: pad MambaSpec pages, scale every other block size.

    Keeps the input's key order and every spec that already has the target page. Raises
    NotImplementedError naming each layer it cannot bring to the target page.
    """
    from dataclasses import replace
    from math import lcm

    from vllm.logger import init_logger
    from vllm.v1.kv_cache_interface import MambaSpec

    pages = {name: spec.page_size_bytes for name, spec in kv_cache_spec.items()}
    scaled = {name: page for name, page in pages.items()
              if not isinstance(kv_cache_spec[name], MambaSpec)}
    bad = [f"{name} ({type(kv_cache_spec[name]).__name__}, page {page} B)"
           for name, page in scaled.items() if page <= 0]
    if bad:
        raise NotImplementedError(
            "Hybrid KV cache: cannot unify page sizes, these layers have no positive page size: "
            + "; ".join(bad)
        )
    max_page = max(pages.values())
    unit = lcm(*scaled.values())  # lcm() of nothing is 1: Mamba-only sets pad to the max page
    target = -(-max_page // unit) * unit

    unified: dict[str, KVCacheSpec] = {}
    problems: list[str] = []
    padded = rescaled = 0
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
                    rescaled += 1
            new_page = new_spec.page_size_bytes
        except (AssertionError, TypeError, ValueError) as exc:
            problems.append(f"{name} ({type(spec).__name__}, page {page} B, block_size "
                            f"{spec.block_size}): {type(exc).__name__}: {exc}")
            continue
        if new_page != target:
            problems.append(
                f"{name} ({type(spec).__name__}, page {page} B, block_size {spec.block_size}):"
                f" its page does not scale with block_size ({new_page} B at block_size"
                f" {new_spec.block_size})"
            )
            continue
        unified[name] = new_spec
    if problems:
        raise NotImplementedError(
            f"Hybrid KV cache: cannot unify page sizes to {target} B (only MambaSpec pages may"
            " be padded; every other layer needs an integer multiple of its block size): "
            + "; ".join(problems)
        )
    init_logger(__name__).info(
        "Hybrid KV cache: padding max page size %d -> %d (+%.2f%%): %d Mamba layer(s) padded,"
        " %d layer(s) given a larger block size [hatch-vllm-patch %s]",
        max_page, target, 100.0 * (target - max_page) / max_page, padded, rescaled,
        _hvp_kv_page_patch_id,
    )
    return unified


def _hvp_wrap_unify_kv_cache_spec_page_size(
    original: "Callable[[dict[str, KVCacheSpec]], dict[str, KVCacheSpec]]",
) -> "Callable[[dict[str, KVCacheSpec]], dict[str, KVCacheSpec]]":
    """The wrapper that replaces ``unify_kv_cache_spec_page_size``; ``__wrapped__`` is
    ``original``."""
    import functools

    @functools.wraps(original)
    def unify_kv_cache_spec_page_size(
        kv_cache_spec: "dict[str, KVCacheSpec]",
    ) -> "dict[str, KVCacheSpec]":
        try:
            result = original(kv_cache_spec)
        except (NotImplementedError, AssertionError) as exc:
            if not _hvp_has_mamba_layer(kv_cache_spec) and not (
                isinstance(exc, NotImplementedError)
                and _hvp_promotable_attention_only(kv_cache_spec)
            ):
                raise  # vLLM's own error (0.27+ catch it for an MLA fallback)
            try:
                return _hvp_unify_pages_padding_only_mamba(kv_cache_spec)
            except NotImplementedError as ours:
                raise ours from exc
        if _hvp_pages_are_uniform(result) or not _hvp_has_mamba_layer(kv_cache_spec):
            return result
        return _hvp_unify_pages_padding_only_mamba(kv_cache_spec)

    unify_kv_cache_spec_page_size._hvp_patch_id = _hvp_kv_page_patch_id  # type: ignore[attr-defined]
    return unify_kv_cache_spec_page_size


# Wrap once. Running this block again (e.g. exec'd twice) finds the wrapper and does nothing;
# importlib.reload re-runs the whole module, so it finds vLLM's fresh function and wraps that.
_hvp_current = globals().get("unify_kv_cache_spec_page_size")
if callable(_hvp_current) and (
    getattr(_hvp_current, "_hvp_patch_id", None) != _hvp_kv_page_patch_id
):
    _hvp_original_unify_kv_cache_spec_page_size = _hvp_current
    unify_kv_cache_spec_page_size = _hvp_wrap_unify_kv_cache_spec_page_size(_hvp_current)
del _hvp_current
