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
    GROUP_PAD: tl.constexpr,   # GROUP rounded up to a power of two >= 16 (tl.dot's minimum)
    D_PAD: tl.constexpr,       # D rounded up to a power of two >= 16
    TILE: tl.constexpr,        # tokens per iteration: several blocks at once
    UPCAST: tl.constexpr,      # interpreter + bfloat16: see _INTERPRET above
):
    """One program per (sequence, KV head): the GROUP query heads of that KV head
    attend to the sequence's seq_len cached tokens, TILE tokens per iteration.

    Each token's K/V sits at slot = block_table[seq, pos // BLOCK_SIZE] * BLOCK_SIZE
    + pos % BLOCK_SIZE (L1's layout). Read no block-table entry past
    ceil(seq_len / BLOCK_SIZE); mask the tokens past seq_len; keep a running max,
    a running sum and an fp32 accumulator per query head (online softmax).
    """
    # TODO(l2): the program's sequence and KV head, its GROUP query heads as the
    # rows of a [GROUP_PAD, D_PAD] tile (masked), then a loop over the sequence
    # TILE tokens at a time: block-table look-up, masked K/V loads, scores with
    # tl.dot, the online-softmax update; last, acc / l stored in out's dtype
    # (content/l2.md §5; the addresses in §4, the update in §3).
    raise NotImplementedError("paged_decode_kernel is not written yet: see content/l2.md §5")


def paged_decode_attention(query, k_cache, v_cache, block_table, seq_lens, scale=None, out=None):
    """Attention of one new token per sequence over its paged K/V; returns [B, H_q, D].

    query [B, H_q, D]: a row-strided view is fine, each sequence's [H_q, D] must
    be contiguous. k_cache/v_cache [num_blocks, block_size, H_kv, D], contiguous,
    H_q a multiple of H_kv. block_table [B, max_blocks] and seq_lens [B] (>= 1,
    the new token included) are int32 or int64. scale=None means 1/sqrt(D).
    The output has query's shape and dtype: written into `out` when one is
    given (each sequence's [H_q, D] contiguous; return `out` itself), else a
    new tensor. Raise ValueError, naming the
    argument and the fix, for mismatched shapes, dtypes or devices, H_q not a
    multiple of H_kv, a non-contiguous cache and (on the CPU) seq_lens outside
    1..max_blocks * block_size or blocks outside the cache.
    """
    # TODO(l2): check the inputs (content/l2.md §7), allocate the output with
    # torch.empty unless `out` was given, then launch one program per (sequence, KV head) (§5, §7).
    raise NotImplementedError("paged_decode_attention is not written yet: see content/l2.md §5 and §7")
