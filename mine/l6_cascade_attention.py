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
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # for PDL, a GPU's (hint 6)

# Triton's CPU interpreter computes tl.dot on bfloat16 wrongly (it multiplies the
# raw bits; triton-lang/triton#11584), so there the kernels widen q, K and V to
# fp32 first. On a GPU they stay 16-bit and go through the tensor cores.
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
LOG2E = 1.4426950408889634  # log2(e): exp(x) = exp2(x * LOG2E)


def cascade_prefix_len(block_table, query_start_loc, seq_lens, block_size):
    """The shared prefix cascade attention may use, in tokens: the leading block-table
    columns identical in every row, times block_size, capped by the fewest tokens any
    sequence had cached before this step, rounded down to a multiple of block_size;
    0 for fewer than two sequences. A host rule: it reads the tensors' values.

    Plain PyTorch (no kernel): block_table [B, max_blocks], query_start_loc [B + 1],
    seq_lens [B] (each sequence's whole context, this step's chunk included), on any
    device. Returns a Python int.
    """
    # TODO(l6): count the leading columns equal in every row, times block_size; cap by
    # min(seq_lens - q_lens); round down to a multiple of block_size (content/l6.md §3).
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
    """Pass 1: BLOCK_Q tokens of the whole batch (whatever their sequences) times the
    GROUP query heads of one KV head, against keys [split * chunk, ...) of the prefix.

    Grid (H_kv, ceil(total_q / BLOCK_Q), num_splits). Tile row r is token
    program_id(1) * BLOCK_Q + r // GROUP, query head kv_head * GROUP + r % GROUP. The
    prefix's blocks are the first prefix_len // BLOCK_SIZE entries of block-table row 0
    (every row holds the same ones). No causal mask: every query sits past the prefix.
    Store this chunk's acc / l (0 for a row that saw no key, never NaN) as part `split`
    of parts [total_q, H_q, NUM_PARTS, D] (the query's dtype; fp32 works too), and its
    log-sum-exp in base 2 (m + log2(l); -inf for no key) in lse [total_q, H_q, NUM_PARTS]
    fp32. PDL (only ever True on a GPU, hint 6): call gdc_launch_dependents() first.
    """
    # TODO(l6): the rows and their q (content/l6.md §4); the chunk's keys through
    # block-table row 0, no causal mask; L3's online softmax; store part and lse.
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
    """Pass 2: L3's program (one KV head, one query block of one sequence) over keys
    prefix_len .. position only, then pass 1's NUM_PARTS parts folded in (the merge).

    L3's grid, search and causal mask (query i of a chunk sits at seq_len - q_len + i),
    but every key loop starts at prefix_len. Then the merge, L4's rule in online form:
    each part p of pass 1 is one more "key" with score lse[.., p] (base 2) and value
    parts[.., p, :]; an empty part (lse = -inf) weighs 0 and its v is never multiplied
    in. NUM_PARTS = 0 (no prefix): nothing to fold. Write acc / l to out in out's
    dtype. PDL (only ever True on a GPU, hint 6): gdc_wait() before the first part.
    """
    # TODO(l6): L3's kernel (content/l3.md §4), its key loops starting at prefix_len;
    # then fold pass 1's parts into m, l, acc (content/l6.md §4); store to out.
    raise NotImplementedError("suffix_kernel is not written yet: see content/l6.md §4")


def cascade_attention(query, k_cache, v_cache, block_table, query_start_loc, seq_lens, common_prefix_len,
                      scale=None, out=None):
    """L3's causal attention of every query chunk over its sequence's paged K/V, with
    the first common_prefix_len tokens (shared by every sequence) read once for the
    whole batch; returns [total_q, H_q, D] (written into `out` when given).

    L3's arguments and contract (content/l3.md §1), plus common_prefix_len: a whole
    number of blocks that every block-table row shares and that no sequence's cached
    context (seq_len - q_len) is shorter than; 0 means plain L3. Raise ValueError,
    naming the argument and the fix, for L3's bad inputs and, on the CPU, a prefix
    that is not a block multiple, longer than a cached context, or over columns not
    shared by every row. Pass 1 (prefix_kernel), then pass 2 (suffix_kernel), which
    also merges.
    """
    # TODO(l6): check the inputs (content/l6.md §6); allocate out; with a prefix,
    # parts (the query's dtype) and fp32 lse for num_splits parts and pass 1; then pass 2 (§4).
    raise NotImplementedError("cascade_attention is not written yet: see content/l6.md §4 and §6")
