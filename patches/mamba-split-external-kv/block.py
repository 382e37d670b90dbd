# Appended to vllm/v1/core/sched/scheduler.py by hatch-vllm-patch (mamba-split-external-kv).
#
# Rebinds Scheduler._mamba_block_aligned_split. For a hybrid model with prefix caching
# (mamba_cache_mode "align") vLLM cuts each prefill chunk at Mamba block boundaries, counting
# from the tokens already computed: the request's own, the new local prefix-cache hits and the
# tokens an external KV connector provides. vLLM 0.16.0-0.22.1 assert that the connector
# provided none ("External KV connector is not verified yet"), so the first external hit
# stops the engine. The method uses the three counts only through their sum; the wrapper
# passes the external tokens to vLLM's own method as part of the local hits, which gives the
# split vLLM 0.23.0 computes without the assertion. With no external tokens (no connector, or
# a miss) vLLM's method runs unchanged. An asynchronous load (the connector reports tokens it
# will receive later: schedule() then passes no new tokens) is not backported: vLLM 0.23.0
# skips the split there in schedule(), which a wrapper of this method cannot do, and a split
# of zero tokens would stall the waiting queue; it keeps raising AssertionError, with a
# message that says so.
_hvp_mamba_split_patch_id = "mamba-split-external-kv"


def _hvp_mamba_split_install() -> None:
    import functools

    scheduler_cls = globals().get("Scheduler")
    original = vars(scheduler_cls).get("_mamba_block_aligned_split") if scheduler_cls else None
    if not callable(original):
        return  # not the class this patch knows; the shape check refuses such a file anyway
    if getattr(original, "_hvp_patch_id", None) == _hvp_mamba_split_patch_id:
        return  # this block already ran on this class object

    @functools.wraps(original)
    def _mamba_block_aligned_split(
        self,
        request,
        num_new_tokens,
        num_new_local_computed_tokens=0,
        num_external_computed_tokens=0,
    ):
        if not num_external_computed_tokens:
            return original(self, request, num_new_tokens, num_new_local_computed_tokens,
                            num_external_computed_tokens)
        if num_new_tokens == 0:
            raise AssertionError(
                "External KV connector is not verified yet: an asynchronous KV load"
                f" ({num_external_computed_tokens} external tokens for request"
                f" {request.request_id}) of a model with Mamba layers needs vLLM 0.23.0's"
                " change to Scheduler.schedule, which hatch-vllm-patch"
                f" {_hvp_mamba_split_patch_id} does not backport; it covers connectors that"
                " load synchronously"
            )
        return original(
            self,
            request,
            num_new_tokens,
            num_new_local_computed_tokens + num_external_computed_tokens,
            0,
        )

    _mamba_block_aligned_split._hvp_patch_id = _hvp_mamba_split_patch_id
    scheduler_cls._mamba_block_aligned_split = _mamba_block_aligned_split


_hvp_mamba_split_install()
