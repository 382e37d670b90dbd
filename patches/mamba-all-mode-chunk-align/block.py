# Appended to vllm/model_executor/models/config.py by hatch-vllm-patch (mamba-all-mode-chunk-align).
#
# Rebinds MambaModelConfig.verify_and_update_config, the start-up step that settles the Mamba
# cache mode (every Mamba and hybrid model runs it, a hybrid through
# HybridAttentionMambaModelConfig). In mamba_cache_mode "all" the Mamba2 kernels cache a state
# every mamba_block_size tokens by taking every (mamba_block_size // chunk_size)-th chunk end,
# and chunk ends sit at multiples of the model's chunk size: a block size that is not a multiple
# of the chunk size caches states taken at other positions (wrong answers after a prefix hit) or
# none at all (an empty slice: the engine core dies). vLLM's platform step
# (Platform._align_hybrid_block_size) aligns the block to the chunk size only when the user gave
# no --mamba-block-size; a user's value becomes the base instead of the chunk size. The wrapper
# runs vLLM's method first; then, only in "all" mode, with a user-given mamba_block_size that
# is not a multiple of the chunk size the model's config names (mamba_chunk_size, else
# chunk_size, the order vLLM reads them in), it raises mamba_block_size to lcm(the user's value,
# the chunk size) and logs a warning. The platform step then starts from a base that is a
# multiple of both, so everything it derives is one too. Everywhere else (another mode, no
# user value, a value already a multiple of the chunk size, a model whose config names no chunk
# size: Mamba1 kernels chunk by the block size) vLLM's settings stay exactly as vLLM set them.
_hvp_all_mode_chunk_patch_id = "mamba-all-mode-chunk-align"


def _hvp_all_mode_chunk_install() -> None:
    import functools
    import math

    config_cls = globals().get("MambaModelConfig")
    bound = vars(config_cls).get("verify_and_update_config") if config_cls else None
    if not isinstance(bound, classmethod):
        return  # not the class this patch knows; the shape check refuses such a file anyway
    original = bound.__func__
    if getattr(original, "_hvp_patch_id", None) == _hvp_all_mode_chunk_patch_id:
        return  # this block already ran on this class object

    def chunk_size_of(model_config):
        text_config = getattr(model_config, "hf_text_config", None)
        chunk = getattr(text_config, "mamba_chunk_size", None)
        if chunk is None:
            chunk = getattr(text_config, "chunk_size", None)
        return chunk if isinstance(chunk, int) and chunk > 0 else None

    @functools.wraps(original)
    def verify_and_update_config(cls, vllm_config):
        result = original(cls, vllm_config)
        cache_config = vllm_config.cache_config
        if (getattr(cache_config, "mamba_cache_mode", None) != "all"
                or not getattr(cache_config, "user_specified_mamba_block_size", False)):
            return result
        requested = cache_config.mamba_block_size
        chunk = chunk_size_of(vllm_config.model_config)
        if not isinstance(requested, int) or requested <= 0 or chunk is None:
            return result
        if requested % chunk == 0:
            return result
        aligned = math.lcm(requested, chunk)
        cache_config.mamba_block_size = aligned
        from vllm.logger import init_logger

        init_logger(__name__).warning(
            "--mamba-block-size %d is not a multiple of the model's Mamba chunk size %d, which "
            "mamba_cache_mode 'all' needs (states are cached at chunk ends): using %d, the "
            "least common multiple, as the base of the Mamba block size "
            "[hatch-vllm-patch %s]", requested, chunk, aligned, _hvp_all_mode_chunk_patch_id)
        return result

    verify_and_update_config._hvp_patch_id = _hvp_all_mode_chunk_patch_id
    config_cls.verify_and_update_config = classmethod(verify_and_update_config)


_hvp_all_mode_chunk_install()
