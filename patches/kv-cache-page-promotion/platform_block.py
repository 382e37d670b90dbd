# Appended by hatch-vllm-patch (kv-cache-page-promotion) to vllm/platforms/interface.py
# (0.29.0 - 0.33.0), the module of Platform._align_hybrid_block_size: the platform step that
# raises the attention block size of a hybrid model until the target's attention page covers the
# state page, and pads the state page to it. It counts the target's bytes per token only. With a
# draft model whose attention has other bytes per token (an EAGLE-3 head with a bf16 KV cache on
# an fp8 target, a DFlash draft), the draft's page at that block size is larger, and the KV
# planning then pads every state page up to the draft's page.
#
# Rebinds Platform._align_hybrid_block_size to a wrapper of vLLM's own method, which runs first
# (its errors propagate). The step runs after the model, a draft's included, is loaded: the
# wrapper reads every loaded layer's KV spec at the settings vLLM chose. Where attention layers
# have different bytes per token (a draft's), mamba_cache_mode is "none" or "align" (vLLM's
# default with prefix caching; "all" keeps vLLM's layout) and every spec is full or
# sliding-window attention or a Mamba state, it computes P, the smallest page that every
# attention page divides at whole multiples of the kernel's block unit and that covers the
# state page. Where P is smaller than the page vLLM's unification would lay everything out on
# and a request of max_model_len holds strictly fewer bytes (vLLM's max_memory_usage_bytes of
# every layer, both ways), it sets the block size to gcd(P / each attention layer's bytes per
# token) (in "align" mode mamba_block_size too, vLLM's rule) and leaves the state page
# unpadded: this patch's wrapper of unify_kv_cache_spec_page_size (the other targets) then
# promotes every attention layer to page P and pads the states to P. Anywhere else (no draft, a
# draft of the target's bytes per token, MLA, fp8 skip layers, another spec type, anything it
# cannot compute) vLLM's settings stay as vLLM set them.
import typing as _hvp_typing

if _hvp_typing.TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.attention.backend import AttentionBackend
    from vllm.v1.kv_cache_interface import KVCacheSpec

_hvp_platform_promotion_id = "kv-cache-page-promotion"


def _hvp_kernel_unit(
    cls: _hvp_typing.Any,
    vllm_config: "VllmConfig",
    backend_cls: "type[AttentionBackend]",
    block_before: int,
) -> int:
    """The block unit vLLM aligns to: the larger of the backend's smallest kernel block and the
    block size before the step, and a multiple of every attention backend's smallest block."""
    from math import lcm

    from vllm.config.vllm import set_current_vllm_config

    def smallest(backend: _hvp_typing.Any) -> int:
        sizes = backend.get_supported_kernel_block_sizes()
        return min(int(getattr(s, "base", s)) for s in sizes) if sizes else 1

    with set_current_vllm_config(vllm_config):
        unit = max(smallest(backend_cls), block_before)
        if hasattr(cls, "_find_non_ssm_backends"):
            unit = lcm(unit, *(smallest(b) for b in cls._find_non_ssm_backends(vllm_config)))
        indexer = getattr(cls, "_get_indexer_block_alignment", None)
        if indexer is not None and indexer(vllm_config):
            unit = lcm(unit, int(indexer(vllm_config)))
        if getattr(vllm_config.cache_config, "mamba_cache_mode", "none") == "align":
            try:  # 0.33+: prefill checkpoints land on block boundaries
                from vllm.model_executor.layers.mamba.abstract import (
                    get_mamba_prefill_checkpoint_alignment,
                )
            except ImportError:
                pass
            else:
                unit = lcm(unit, int(get_mamba_prefill_checkpoint_alignment(vllm_config) or 1))
    return unit


def _hvp_layer_specs(vllm_config: "VllmConfig") -> "dict[str, KVCacheSpec] | None":
    """The KV spec of every loaded layer (the step runs after the model, a draft's included, is
    loaded) at the settings vLLM's step just chose; None unless every spec is one whose page
    this patch computes exactly: full or sliding-window attention whose page is block_size
    times its bytes per token, unpadded, or a Mamba state."""
    from dataclasses import replace

    from vllm.config.vllm import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    specs = {}
    for name, layer in get_layers_from_vllm_config(vllm_config, AttentionLayerBase).items():
        spec = layer.get_kv_cache_spec(vllm_config)
        if spec is None:
            continue  # a layer that reads another's cache
        if not isinstance(spec, MambaSpec):
            if type(spec) not in (FullAttentionSpec, SlidingWindowSpec):
                return None
            one = replace(spec, block_size=1).page_size_bytes
            if getattr(spec, "page_size_padded", None) is not None or (
                    spec.page_size_bytes != spec.block_size * one):
                return None
        specs[name] = spec
    return specs


def _hvp_draft_aware_block(
    cls: _hvp_typing.Any,
    vllm_config: "VllmConfig",
    backend_cls: "type[AttentionBackend]",
    block_before: int,
) -> "dict[str, int] | None":
    """The block size from which the KV planning reaches the smallest common page, with the
    pages and the bytes a request of max_model_len holds either way; None where vLLM's layout
    stays (it needs no more bytes, or a setting this patch does not compute as vLLM does)."""
    from dataclasses import replace
    from functools import reduce
    from math import gcd, lcm

    from vllm.v1.kv_cache_interface import MambaSpec

    cache = vllm_config.cache_config
    mode = getattr(cache, "mamba_cache_mode", "none")
    if mode not in ("none", "align"):
        return None  # "all" caches a state per block: the block size is its cost
    if vllm_config.model_config.use_mla or getattr(cache, "kv_cache_dtype_skip_layers", None):
        return None
    specs = _hvp_layer_specs(vllm_config)
    if not specs:
        return None
    states = {n: s for n, s in specs.items() if isinstance(s, MambaSpec)}
    attention = {n: s for n, s in specs.items() if n not in states}
    if not states or not attention:
        return None
    per_token = {n: replace(s, block_size=1).page_size_bytes for n, s in attention.items()}
    kinds = set(per_token.values())
    if len(kinds) < 2:
        return None  # one attention page: vLLM's step already made it the smallest
    # vLLM's layout: its unification brings every page to the largest at these settings
    # (an attention page that divides it by more blocks, any other page padded)
    upstream_page = max(s.page_size_bytes for s in specs.values())
    vllms = 0
    for spec in specs.values():
        page = spec.page_size_bytes
        if page != upstream_page:
            if isinstance(spec, MambaSpec) or upstream_page % page:
                spec = replace(spec, page_size_padded=upstream_page)
            else:
                spec = replace(spec, block_size=spec.block_size * (upstream_page // page))
        vllms += spec.max_memory_usage_bytes(vllm_config)
    # ours: every attention page a whole number of blocks of the kernel's unit; the state
    # padded only to the smallest page they all divide
    unit = _hvp_kernel_unit(cls, vllm_config, backend_cls, block_before)
    state = max(replace(s, page_size_padded=None).page_size_bytes for s in states.values())
    common = lcm(*(unit * b for b in kinds))
    page = max(1, -(-state // common)) * common
    if page >= upstream_page:
        return None
    # a multiple of the unit (page // b is, for every b), so >= the block before the step
    block = reduce(gcd, (page // b for b in kinds))
    ours = sum(replace(s, block_size=page // per_token[n]).max_memory_usage_bytes(vllm_config)
               for n, s in attention.items())
    state_block = block if mode == "align" else None
    for spec in states.values():
        spec = replace(spec, page_size_padded=page)
        if state_block is not None:
            spec = replace(spec, block_size=state_block)
        ours += spec.max_memory_usage_bytes(vllm_config)
    if ours >= vllms:
        return None  # a request of max_model_len would not hold fewer bytes
    return {"block_size": block, "page": page, "upstream_page": upstream_page,
            "bytes_per_request": ours, "upstream_bytes_per_request": vllms}


def _hvp_install_platform_promotion() -> None:
    import functools

    platform_cls = globals().get("Platform")
    descriptor = vars(platform_cls).get("_align_hybrid_block_size") if platform_cls else None
    if not isinstance(descriptor, classmethod):
        return  # not the class this patch knows; the shape check refuses such a file anyway
    original = descriptor.__func__
    if getattr(original, "_hvp_patch_id", None) == _hvp_platform_promotion_id:
        return  # this block already ran on this class object

    @functools.wraps(original)
    def _align_hybrid_block_size(cls, vllm_config, backend_cls):
        block_before = vllm_config.cache_config.block_size
        original(cls, vllm_config, backend_cls)
        try:
            plan = _hvp_draft_aware_block(cls, vllm_config, backend_cls, block_before)
        except Exception:  # anything it cannot compute keeps vLLM's layout
            plan = None
        if plan is None:
            return
        cache = vllm_config.cache_config
        chosen = cache.block_size
        cache.block_size = plan["block_size"]
        if getattr(cache, "mamba_cache_mode", "none") == "align":
            cache.mamba_block_size = cache.block_size  # vLLM's rule for "align", kept
        cache.mamba_page_size_padded = None
        from vllm.logger import init_logger

        init_logger(__name__).info(
            "Hybrid KV cache: attention pages of different bytes per token (a draft's): block"
            " size %d instead of %d, so that the KV planning reaches a common page of %d B"
            " instead of %d B, %d B per request of max_model_len instead of %d B"
            " [hatch-vllm-patch %s]",
            plan["block_size"], chosen, plan["page"], plan["upstream_page"],
            plan["bytes_per_request"], plan["upstream_bytes_per_request"],
            _hvp_platform_promotion_id,
        )

    _align_hybrid_block_size._hvp_patch_id = _hvp_platform_promotion_id
    platform_cls._align_hybrid_block_size = classmethod(_align_hybrid_block_size)


_hvp_install_platform_promotion()
