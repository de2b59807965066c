"""L2: decode attention over a paged KV cache (vLLM paged attention v1 / Triton decode).

Read content/l2.md first. Replace each `raise NotImplementedError` with your code;
`make grade` tells you how far you are and what is still wrong.
"""
import math
import os

import torch
import triton
import triton.language as tl

# Triton's CPU interpreter computes tl.dot on bfloat16 wrongly (it multiplies the
# raw bits; triton-lang/triton#11584), so there the kernel widens K, V and q to
# fp32 first. On a GPU they stay 16-bit and go through the tensor cores.
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@triton.jit
def paged_decode_kernel(
    out_ptr, query_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, seq_lens_ptr,
    scale,
    query_stride,              # elements from one sequence's query row to the next
    out_stride,                # the same for the output (the caller may own it)
    table_stride,              # elements from one block-table row to the next
    NUM_HEADS, NUM_KV_HEADS,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    HEAD_SIZE: tl.constexpr,   # D
    GROUP: tl.constexpr,       # query heads per KV head: NUM_HEADS // NUM_KV_HEADS
    GROUP_PAD: tl.constexpr,   # GROUP rounded up to a power of two, at least 16
    D_PAD: tl.constexpr,       # D rounded up to a power of two >= 16
    TILE: tl.constexpr,        # tokens per iteration: several blocks at once
    UPCAST: tl.constexpr,      # interpreter + bfloat16: see _INTERPRET above
):
    """Write into out, for every sequence and query head h, softmax(q_h . K^T * scale) . V
    over the sequence's seq_len cached tokens of KV head h // GROUP, accumulated in fp32
    and stored in out's dtype.

    The cache is L1's layout (content/l2.md §4). Only the first ceil(seq_len /
    BLOCK_SIZE) entries of a block-table row belong to the sequence: the rest, and the
    slots of its last block past seq_len, may hold garbage (NaN included) and must not
    reach the result; block-table entries past the row's owned ones must not be read.
    """
    # TODO(l2): your kernel (content/l2.md §3 to §5; hints in §8).
    raise NotImplementedError("paged_decode_kernel is not written yet: see content/l2.md §5")


def paged_decode_attention(query, k_cache, v_cache, block_table, seq_lens, scale=None, out=None):
    """Attention of one new token per sequence over its paged K/V; returns [B, H_q, D].

    query [B, H_q, D]: a row-strided view is fine, each sequence's [H_q, D] must
    be contiguous. k_cache/v_cache [num_blocks, block_size, H_kv, D], contiguous,
    H_q a multiple of H_kv. block_table [B, max_blocks] and seq_lens [B] (>= 1,
    the new token included) are int32 or int64. scale=None means 1/sqrt(D).
    The output has query's shape and dtype: written into `out` when one is
    given (each sequence's [H_q, D] contiguous; return `out` itself), else a
    new tensor. float16, bfloat16 or float32, one dtype for query and caches.
    Raise ValueError, naming the argument and the fix, for mismatched shapes,
    dtypes or devices, H_q not a multiple of H_kv, a non-contiguous cache and (on
    the CPU) seq_lens outside 1..max_blocks * block_size or blocks outside the
    cache (content/l2.md §7).
    """
    # TODO(l2): check the inputs, then run your kernel (content/l2.md §5 and §7; hints in §8).
    raise NotImplementedError("paged_decode_attention is not written yet: see content/l2.md §5 and §7")
