# Appended to vllm/v1/worker/gpu/model_states/mamba_hybrid.py by hatch-vllm-patch
# (hybrid-prefix-mamba-block).
#
# Rebinds MambaHybridModelState.add_request. In mamba_cache_mode "align" vLLM's method seeds a
# new or resumed request's running Mamba state from column
# (num_computed_tokens - 1) // cache_config.block_size of its Mamba block table (vLLM 0.29 -
# 0.31; 0.32 divides by cache_config.mamba_block_size). The columns are Mamba blocks, and
# EngineCore lowers cache_config.block_size to a drafter group's smaller block (an in-process
# worker shares that config): a hit of 320 tokens with 64-token Mamba blocks and a 32-token
# drafter block seeds column 9 where the state is in column 4. The wrapper runs vLLM's method,
# then, only where cache_config.mamba_block_size is set and differs from
# cache_config.block_size, seeds the same request from the column in Mamba blocks, as vLLM
# 0.32 does. Everywhere else vLLM's result stands.
_hvp_mamba_seed_patch_id = "hybrid-prefix-mamba-block"


def _hvp_mamba_seed_install():
    import functools

    state_cls = globals().get("MambaHybridModelState")
    original = vars(state_cls).get("add_request") if state_cls else None
    if not callable(original):
        return  # not the class this patch knows; the shape check refuses such a file anyway
    if getattr(original, "_hvp_patch_id", None) == _hvp_mamba_seed_patch_id:
        return  # this block already ran on this class object

    @functools.wraps(original)
    def add_request(self, req_index, new_req_data):
        original(self, req_index, new_req_data)
        cache_config = self.cache_config
        mamba_block = getattr(cache_config, "mamba_block_size", None)
        if (getattr(self, "_align_mode", False) and mamba_block
                and mamba_block != cache_config.block_size):
            self._mamba_state_idx_gpu[req_index].fill_(
                (new_req_data.num_computed_tokens - 1) // mamba_block)

    add_request._hvp_patch_id = _hvp_mamba_seed_patch_id
    state_cls.add_request = add_request


_hvp_mamba_seed_install()
