# Appended by hatch-vllm-patch (kv-cache-page-promotion) to vllm/platforms/interface.py
# (0.29.0 - 0.33.0), the module of Platform._align_hybrid_block_size: the platform step that
# raises the attention block size of a hybrid model until the target's attention page covers the
# state page, and pads the state page to it. It counts the target's bytes per token only. With a
# draft model whose attention has other bytes per token (an EAGLE-3 head with a bf16 KV cache on
# an fp8 target, a DFlash draft), the draft's page at that block size is larger, and the KV
# planning then pads every state page up to the draft's page.
#
# Rebinds Platform._align_hybrid_block_size to a wrapper of vLLM's own method, which runs first
# (its errors propagate, its result stays wherever this patch has nothing smaller). Then, only
# for a draft with its own KV cache and mamba_cache_mode "none" or "align" (vLLM's default with
# prefix caching; "all" keeps vLLM's layout),
# it computes the smallest common page P that every attention page, the draft's included,
# divides at whole multiples of the kernel's block unit and that covers the state page. Where P
# is smaller than the page vLLM's layout ends on and no request of max_model_len needs more
# bytes in any layer, it sets the block size to gcd(P / target bytes per token, P / draft bytes
# per token) and leaves the state page unpadded: this patch's wrapper of
# unify_kv_cache_spec_page_size (the other targets) then promotes every attention layer to page P
# and pads the states to P. Anything it cannot compute exactly as vLLM does (MLA, packed or
# skipped KV dtypes, a target page that differs from the one vLLM just used) keeps vLLM's result.
import typing as _hvp_typing

if _hvp_typing.TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.attention.backend import AttentionBackend

_hvp_platform_promotion_id = "kv-cache-page-promotion"


def _hvp_page_bytes_per_token(
    model_config: _hvp_typing.Any,
    parallel_config: _hvp_typing.Any,
    cache_dtype: str,
    backend_cls: "type[AttentionBackend]",
    vllm_config: "VllmConfig",
) -> int:
    """The bytes one token of one full-attention layer holds, as vLLM computes the target's."""
    from vllm.config.vllm import set_current_vllm_config
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE
    from vllm.v1 import kv_cache_interface

    auto = cache_dtype == "auto"
    dtype = model_config.dtype if auto else STR_DTYPE_TO_TORCH_DTYPE[cache_dtype]
    spec_cls = kv_cache_interface.FullAttentionSpec
    kwargs: dict[str, _hvp_typing.Any] = {
        "block_size": 1,
        "num_kv_heads": model_config.get_num_kv_heads(parallel_config),
        "head_size": model_config.get_head_size(),
        "dtype": dtype,
    }
    if "kv_quant_mode" in getattr(spec_cls, "__dataclass_fields__", {}):
        kwargs["kv_quant_mode"] = kv_cache_interface.get_kv_quant_mode(cache_dtype)
    with set_current_vllm_config(vllm_config):
        return int(backend_cls.customize_spec(spec_cls(**kwargs)).page_size_bytes)


def _hvp_state_page(vllm_config: "VllmConfig") -> int:
    """The state page of the model's class, unpadded, as vLLM's platform step computes it."""
    from vllm.model_executor.models import ModelRegistry
    from vllm.v1.kv_cache_interface import MambaSpec

    model_config = vllm_config.model_config
    model_cls, _ = ModelRegistry.resolve_model_cls(
        model_config.architecture, model_config=model_config
    )
    if hasattr(model_cls, "get_mamba_specs_from_config"):
        return max(
            int(spec.page_size_bytes)
            for spec in model_cls.get_mamba_specs_from_config(vllm_config)
        )
    return int(
        MambaSpec(
            shapes=model_cls.get_mamba_state_shape_from_config(vllm_config),
            dtypes=model_cls.get_mamba_state_dtype_from_config(vllm_config),
            block_size=-1,
        ).page_size_bytes
    )


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


def _hvp_layer_counts(
    model_config: _hvp_typing.Any,
    parallel: _hvp_typing.Any,
    draft_model: _hvp_typing.Any,
    draft_parallel: _hvp_typing.Any,
) -> "tuple[int, int, int] | None":
    """(state layers, attention layers, draft layers) of this rank, as vLLM's model config
    counts them; None where it cannot. The state count never exceeds the layers that are not
    attention (an undercount only understates what a smaller state page saves)."""
    try:
        total = int(model_config.get_num_layers(parallel))
        attention = int(model_config.get_num_layers_by_block_type(parallel, "attention"))
        states = sum(int(model_config.get_num_layers_by_block_type(parallel, kind))
                     for kind in ("mamba", "linear_attention"))
        drafts = int(draft_model.get_num_layers(draft_parallel))
    except Exception:  # a hybrid vLLM's config cannot count: vLLM's layout stays
        return None
    states = min(states, total - attention)
    if states < 1 or attention < 1 or drafts < 1:
        return None
    return states, attention, drafts


def _hvp_draft_aware_block(
    cls: _hvp_typing.Any,
    vllm_config: "VllmConfig",
    backend_cls: "type[AttentionBackend]",
    block_before: int,
) -> "dict[str, int] | None":
    """The block size that lets the KV planning reach the smallest common page with this draft,
    with the pages it implies; None where vLLM's layout stays (nothing smaller, or a setting
    this patch does not compute exactly as vLLM does)."""
    from math import gcd, lcm

    cache = vllm_config.cache_config
    model_config = vllm_config.model_config
    spec = vllm_config.speculative_config
    draft_model = getattr(spec, "draft_model_config", None) if spec is not None else None
    if draft_model is None:
        return None  # no draft, or one without a model (n-gram, suffix): no draft KV cache
    method = getattr(spec, "method", None)
    uses_eagle = getattr(spec, "use_eagle", None)
    if not ((callable(uses_eagle) and uses_eagle()) or method == "draft_model"):
        return None
    if getattr(cache, "mamba_cache_mode", "none") not in ("none", "align"):
        return None  # "all" caches a state per block: the block size is its cost
    if model_config.use_mla or getattr(cache, "kv_cache_dtype_skip_layers", None):
        return None
    block_up, padded = cache.block_size, cache.mamba_page_size_padded
    parallel = vllm_config.parallel_config
    target = _hvp_page_bytes_per_token(model_config, parallel, cache.cache_dtype, backend_cls,
                                       vllm_config)
    state = _hvp_state_page(vllm_config)
    # vLLM's step left the target's page block_up * target >= the state, and the state padded
    # to it unless equal: anything else means this patch counts otherwise than vLLM did
    if not block_up or not state or block_up * target != (padded or state):
        return None
    draft_dtype = getattr(spec, "kv_cache_dtype", None) or cache.cache_dtype
    if draft_dtype.startswith(("turboquant_", "ultraquant_", "nvfp4")):
        return None
    draft = _hvp_page_bytes_per_token(
        draft_model, getattr(spec, "draft_parallel_config", None) or parallel, draft_dtype,
        backend_cls, vllm_config)
    if draft == target:
        return None  # the draft's page equals the target's: vLLM's layout is the smallest
    unit = _hvp_kernel_unit(cls, vllm_config, backend_cls, block_before)
    common = lcm(unit * target, unit * draft)
    page = max(1, -(-state // common)) * common
    # vLLM's layout: every page padded to the largest at block_up (the state to the target's,
    # then everything to the draft's when the draft's is larger)
    upstream_page = block_up * max(target, draft)
    if page >= upstream_page:
        return None
    # bytes one request of max_model_len holds, per layer kind; a state layer holds at least
    # one page (more with speculative or checkpoint blocks: more saved than counted here)
    layers = _hvp_layer_counts(model_config, parallel, draft_model,
                               getattr(spec, "draft_parallel_config", None) or parallel)
    if layers is None:
        return None
    states, attention, drafts = layers
    max_len = int(model_config.max_model_len)
    ours = states * page + sum(n * -(-max_len * per_token // page) * page
                               for n, per_token in ((attention, target), (drafts, draft)))
    vllms = (states + attention + drafts) * upstream_page
    vllms += (attention + drafts) * (-(-max_len // block_up) - 1) * upstream_page
    if ours >= vllms:
        return None  # a request of max_model_len would not need fewer bytes
    block = gcd(page // target, page // draft)
    if block < block_before or block % unit:
        return None
    return {"block_size": block, "page": page, "upstream_page": upstream_page,
            "target_bytes_per_token": target, "draft_bytes_per_token": draft,
            "state_page": state, "unit": unit}


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
            "Hybrid KV cache with a draft of %d B per token beside the target's %d B: block"
            " size %d instead of %d, so that the KV planning can reach a common page of %d B"
            " instead of %d B [hatch-vllm-patch %s]",
            plan["draft_bytes_per_token"], plan["target_bytes_per_token"],
            plan["block_size"], chosen, plan["page"], plan["upstream_page"],
            _hvp_platform_promotion_id,
        )

    _align_hybrid_block_size._hvp_patch_id = _hvp_platform_promotion_id
    platform_cls._align_hybrid_block_size = classmethod(_align_hybrid_block_size)


_hvp_install_platform_promotion()
