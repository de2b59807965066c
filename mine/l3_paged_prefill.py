"""L3: chunked-prefill attention over a paged KV cache (vLLM unified attention, 2-D path).

Read content/l3.md first. Replace each `raise NotImplementedError` with your code;
`make grade` tells you how far you are and what is still wrong.
"""
import math
import os

import torch
import triton
import triton.language as tl

# Triton's CPU interpreter computes tl.dot on bfloat16 wrongly (it multiplies the
# raw bits; triton-lang/triton#11584), so there the kernel widens q, K and V to
# fp32 first. On a GPU they stay 16-bit and go through the tensor cores.
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
LOG2E = 1.4426950408889634  # log2(e): exp(x) = exp2(x * LOG2E)


@triton.jit
def paged_prefill_kernel(
    out_ptr, query_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, query_start_loc_ptr, seq_lens_ptr,
    scale_log2,                # scale * log2(e)
    num_seqs,
    short_q_len,               # chunks of at most this many queries belong to the other launch (0: none)
    query_stride, out_stride,  # elements from one token's [H_q, D] row to the next
    table_stride,              # elements from one block-table row to the next
    NUM_KV_HEADS,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    HEAD_SIZE: tl.constexpr,   # D
    D_PAD: tl.constexpr,       # D rounded up to a power of two >= 16
    GROUP: tl.constexpr,       # query heads per KV head
    BLOCK_Q: tl.constexpr,     # query positions per program
    BLOCK_M: tl.constexpr,     # tile rows: BLOCK_Q * GROUP rounded up to a power of two
    TILE: tl.constexpr,        # keys per iteration
    UPCAST: tl.constexpr,      # interpreter + bfloat16: see _INTERPRET above
    SHORT: tl.constexpr,       # the launch for short chunks (decode rows): one program per sequence
):
    """Write into out, for every query token of every chunk and every query head h,
    causal attention over its sequence's cached keys of KV head h // GROUP, accumulated
    in fp32 and stored in out's dtype.

    Query i of a chunk of q_len queries sits at position seq_len - q_len + i and sees
    the keys at positions up to its own (content/l3.md §3). The cache is L1's layout;
    block-table entries past a sequence's last owned block must not be read. The host
    may launch this kernel more than once over one batch (short_q_len and SHORT tell a
    launch which chunks are its own, content/l3.md §4): every output row is written by
    exactly one launch.
    """
    # TODO(l3): your kernel (content/l3.md §4 and §5; hints in §7).
    raise NotImplementedError("paged_prefill_kernel is not written yet: see content/l3.md §4 and §5")


def paged_prefill_attention(query, k_cache, v_cache, block_table, query_start_loc, seq_lens, scale=None,
                            out=None):
    """Causal attention of every query chunk over its sequence's paged K/V; returns
    [total_q, H_q, D] (written into `out` when given, as vLLM lets the caller own it).

    query [total_q, H_q, D]: the chunks of all sequences one after another; a
    row-strided view is fine, each token's [H_q, D] must be contiguous.
    k_cache/v_cache [num_blocks, block_size, H_kv, D], contiguous, H_q a multiple
    of H_kv. block_table [B, max_blocks]; query_start_loc [B + 1], 0 first, the
    running sum of the chunk lengths; seq_lens [B], each sequence's whole context,
    its chunk included (that K/V is already in the cache). All int32 or int64.
    float16, bfloat16 or float32, one dtype for query and caches. scale=None means
    1/sqrt(D). `out`, if given, has the query's shape and dtype
    with contiguous rows; it is written and returned. Raise ValueError, naming the
    argument and the fix, for mismatched shapes, dtypes or devices, a
    non-contiguous cache, and (on the CPU) query_start_loc not starting at 0 or not
    non-decreasing, q_len > seq_len, seq_lens past the block table, blocks outside
    the cache (content/l3.md §6).
    """
    # TODO(l3): check the inputs, then run your kernel (content/l3.md §4 and §6; hints in §7).
    raise NotImplementedError("paged_prefill_attention is not written yet: see content/l3.md §4 and §6")
