"""L6: cascade attention, a shared prefix read once for the whole batch (vLLM's
cascade_attention in its FlashAttention backend, FlashInfer's MultiLevelCascadeAttentionWrapper).

Read content/l6.md first. Replace each `raise NotImplementedError` with your code;
`make grade` tells you how far you are and what is still wrong.
"""
import math
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # for PDL: optional, a GPU's (hint 6)

# Triton's CPU interpreter computes tl.dot on bfloat16 wrongly (it multiplies the
# raw bits; triton-lang/triton#11584), so there the kernels widen q, K and V to
# fp32 first. On a GPU they stay 16-bit and go through the tensor cores.
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
LOG2E = 1.4426950408889634  # log2(e): exp(x) = exp2(x * LOG2E)


def cascade_prefix_len(block_table, query_start_loc, seq_lens, block_size):
    """The shared prefix cascade attention may use, in tokens, as a Python int: the
    leading block-table columns identical in every row, times block_size, capped by
    the fewest tokens any sequence had cached before this step (min(seq_lens -
    q_lens)), rounded down to a multiple of block_size; 0 for fewer than two
    sequences. Why the cap: content/l6.md §3.

    Plain PyTorch (no kernel): block_table [B, max_blocks], query_start_loc [B + 1],
    seq_lens [B] (each sequence's whole context, this step's chunk included), on any
    device. A host rule: it reads the tensors' values.
    """
    # TODO(l6): your cascade_prefix_len (content/l6.md §3; hints in §7).
    raise NotImplementedError("cascade_prefix_len is not written yet: see content/l6.md §3")


@triton.jit
def prefix_kernel(
    parts_ptr, lse_ptr, query_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr,
    scale_log2, total_q, prefix_len, chunk,
    query_stride,              # elements from one token's [H_q, D] row to the next
    NUM_HEADS, NUM_KV_HEADS, NUM_PARTS,
    BLOCK_SIZE: tl.constexpr, HEAD_SIZE: tl.constexpr, D_PAD: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr,     # query tokens per program, from any sequences
    BLOCK_M: tl.constexpr,     # tile rows: BLOCK_Q * GROUP rounded up to a power of two
    TILE: tl.constexpr, UPCAST: tl.constexpr,
    PDL: tl.constexpr,         # launched ahead of pass 2 (programmatic dependent launch)
):
    """Pass 1: every query of the batch (total_q tokens, whatever their sequences) and
    every query head, attending to the shared prefix's keys 0..prefix_len - 1, cut
    into NUM_PARTS chunks of `chunk` keys; one partial result per chunk.

    The prefix is every sequence's, so any row of the block table names its blocks
    (content/l6.md §3 says why no query needs a causal mask here). For chunk p, query
    token t and query head h: the normalised output in part p of parts [total_q, H_q,
    NUM_PARTS, D] (the query's dtype) and the log-sum-exp of its scores in lse
    [total_q, H_q, NUM_PARTS] (fp32), in whatever base suffix_kernel reads it in; a
    chunk with no key stores v = 0 and lse = -inf, never NaN. The prefix's K/V are read
    once per KV head for the whole batch, not once per sequence. PDL: launched ahead of
    pass 2 on a GPU (optional, content/l6.md §4 and hint 6).
    """
    # TODO(l6): your pass 1 (content/l6.md §4; hints in §7).
    raise NotImplementedError("prefix_kernel is not written yet: see content/l6.md §4")


@triton.jit
def suffix_kernel(
    out_ptr, parts_ptr, lse_ptr, query_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, query_start_loc_ptr,
    seq_lens_ptr, scale_log2, num_seqs, prefix_len,
    query_stride, out_stride, table_stride,
    NUM_HEADS, NUM_KV_HEADS, NUM_PARTS,
    BLOCK_SIZE: tl.constexpr, HEAD_SIZE: tl.constexpr, D_PAD: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, TILE: tl.constexpr, UPCAST: tl.constexpr,
    PDL: tl.constexpr,         # launched while pass 1 runs: wait for it before reading its parts
):
    """Pass 2 and the merge: L3's causal attention of every query (query i of a chunk
    sits at seq_len - q_len + i) over its own sequence's keys from prefix_len on, merged
    with pass 1's NUM_PARTS parts by log-sum-exp (L4's rule), written to out in out's
    dtype: the result is L3's over the whole context.

    NUM_PARTS = 0 (no prefix): plain L3. An empty part (lse = -inf) weighs nothing, and
    its v, which may be anything, must not reach the result. PDL: on a GPU, launched
    while pass 1 may still run (optional, content/l6.md §4 and hint 6); then pass 1's
    parts may be read only once pass 1 has finished.
    """
    # TODO(l6): your pass 2 and merge (content/l3.md §4, content/l6.md §4; hints in §7).
    raise NotImplementedError("suffix_kernel is not written yet: see content/l6.md §4")


def cascade_attention(query, k_cache, v_cache, block_table, query_start_loc, seq_lens, common_prefix_len,
                      scale=None, out=None):
    """L3's causal attention of every query chunk over its sequence's paged K/V, with
    the first common_prefix_len tokens (shared by every sequence) read once for the
    whole batch; returns [total_q, H_q, D] (written into `out` when given).

    L3's arguments and contract (content/l3.md §1), plus common_prefix_len: a whole
    number of blocks that every block-table row shares and that no sequence's cached
    context (seq_len - q_len) is shorter than; 0 means plain L3. The prefix's K/V are
    read once for the whole batch. Raise ValueError, naming the argument and the fix,
    for L3's bad inputs and for a common_prefix_len that is negative, not a multiple
    of block_size or wider than the block table; on the CPU also for one longer than a
    sequence's cached context or over columns not shared by every row (those two read
    the tensors' values: a GPU skips them, as vLLM does, and trusts cascade_prefix_len)
    (content/l6.md §6).
    """
    # TODO(l6): check the inputs, then run both passes (content/l6.md §4 and §6; hints in §7).
    raise NotImplementedError("cascade_attention is not written yet: see content/l6.md §4 and §6")
