# Appended to vllm/v1/core/sched/scheduler.py by hatch-vllm-patch (hybrid-prefix-mamba-block).
#
# Rebinds Scheduler._mamba_block_aligned_split. In mamba_cache_mode "align" the Mamba state is
# kept per Mamba block (slot p holds the state after (p + 1) * mamba_block tokens), so prefill
# chunks must end on the Mamba group's block grid. vLLM's method reads that grid from
# cache_config.block_size, which EngineCore lowers after KV cache planning to the smallest
# block of any group: a drafter's attention group with smaller blocks (an MTP or DFlash head
# whose page unification gives 32 where Mamba and attention have 64) drags it below the Mamba
# block, chunks end mid-block, and a later prefix hit resumes from a state of the wrong
# position (0.29 - 0.31) or finds none (0.32+). The wrapper runs vLLM's method unchanged
# whenever cache_config.block_size already is the Mamba group's block size (every model
# without such a drafter); otherwise it runs vLLM's method on a view of the scheduler whose
# cache_config reports the Mamba group's block size, every other attribute being the
# scheduler's own.
_hvp_mamba_block_patch_id = "hybrid-prefix-mamba-block"


class _hvp_MambaBlockCacheConfig:
    """vLLM's CacheConfig as the split reads it: block_size is the Mamba group's."""

    __slots__ = ("_hvp_config", "block_size")

    def __init__(self, config, block_size):
        object.__setattr__(self, "_hvp_config", config)
        object.__setattr__(self, "block_size", block_size)

    def __getattr__(self, name):
        return getattr(object.__getattribute__(self, "_hvp_config"), name)

    def __setattr__(self, name, value):
        setattr(object.__getattribute__(self, "_hvp_config"), name, value)


class _hvp_MambaBlockScheduler:
    """The scheduler as the split reads it: its own attributes, but the cache config above."""

    __slots__ = ("_hvp_scheduler", "cache_config")

    def __init__(self, scheduler, cache_config):
        object.__setattr__(self, "_hvp_scheduler", scheduler)
        object.__setattr__(self, "cache_config", cache_config)

    def __getattr__(self, name):
        return getattr(object.__getattribute__(self, "_hvp_scheduler"), name)

    def __setattr__(self, name, value):
        setattr(object.__getattribute__(self, "_hvp_scheduler"), name, value)


def _hvp_mamba_block_size(scheduler):
    """The block size of the scheduler's Mamba groups, or None (none, or several sizes)."""
    from vllm.v1.kv_cache_interface import MambaSpec

    config = getattr(scheduler, "kv_cache_config", None)
    sizes = {group.kv_cache_spec.block_size for group in getattr(config, "kv_cache_groups", ())
             if isinstance(group.kv_cache_spec, MambaSpec)}
    return sizes.pop() if len(sizes) == 1 else None


def _hvp_mamba_block_install():
    import functools

    scheduler_cls = globals().get("Scheduler")
    original = vars(scheduler_cls).get("_mamba_block_aligned_split") if scheduler_cls else None
    if not callable(original):
        return  # not the class this patch knows; the shape check refuses such a file anyway
    if getattr(original, "_hvp_patch_id", None) == _hvp_mamba_block_patch_id:
        return  # this block already ran on this class object

    @functools.wraps(original)
    def _mamba_block_aligned_split(self, request, num_new_tokens, *args, **kwargs):
        mamba_block = _hvp_mamba_block_size(self)
        if mamba_block is None or mamba_block == self.cache_config.block_size:
            return original(self, request, num_new_tokens, *args, **kwargs)
        view = _hvp_MambaBlockScheduler(
            self, _hvp_MambaBlockCacheConfig(self.cache_config, mamba_block))
        return original(view, request, num_new_tokens, *args, **kwargs)

    _mamba_block_aligned_split._hvp_patch_id = _hvp_mamba_block_patch_id
    scheduler_cls._mamba_block_aligned_split = _mamba_block_aligned_split


_hvp_mamba_block_install()
