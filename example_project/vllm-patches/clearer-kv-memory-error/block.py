# Added by hatch-vllm-patch: patch clearer-kv-memory-error, made by `vllm-patch create` from an edit
# of vllm.v1.core.kv_cache_utils (vllm 0.20.2). `vllm-patch revert` removes this block.
# It redefines: _check_enough_kv_cache_memory.


def _check_enough_kv_cache_memory(
    available_memory: int,
    get_needed_memory: Callable[[], int],
    max_model_len: int,
    estimate_max_model_len: Callable[[int], int],
):
    if available_memory <= 0:
        raise ValueError(
            "No memory is left for the KV cache: after the model weights, activations "
            f"and graphs, {format_gib(available_memory)} GiB remain of the memory vLLM "
            "may use (a negative amount: the model alone takes more than that). "
            f"At least one request of max_model_len={max_model_len} needs "
            f"{format_gib(get_needed_memory())} GiB of KV cache. "
            "Try increasing `gpu_memory_utilization`, a higher tensor parallel size, "
            "or a quantized model. "
            "See https://docs.vllm.ai/en/latest/configuration/conserving_memory/ "
            "for more details."
        )

    needed_memory = get_needed_memory()

    if needed_memory > available_memory:
        estimated_max_len = estimate_max_model_len(available_memory)
        estimated_msg = ""
        if estimated_max_len > 0:
            estimated_msg = (
                "Based on the available memory, "
                f"the estimated maximum model length is {estimated_max_len}. "
            )

        raise ValueError(
            f"To serve at least one request with the model's max seq len "
            f"({max_model_len}), ({format_gib(needed_memory)} GiB KV "
            f"cache is needed, which is larger than the available KV cache "
            f"memory ({format_gib(available_memory)} GiB). {estimated_msg}"
            f"Try increasing `gpu_memory_utilization` or decreasing `max_model_len` "
            f"when initializing the engine. "
            f"See https://docs.vllm.ai/en/latest/configuration/conserving_memory/ "
            f"for more details."
        )
