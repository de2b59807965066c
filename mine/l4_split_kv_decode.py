"""L4: split-KV ("flash decoding") decode attention with a log-sum-exp merge
(vLLM paged attention v2 / unified attention's 3-D path, FlashInfer merge_state).

Read content/l4.md first. Replace each `raise NotImplementedError` with your code;
`make grade` tells you how far you are and what is still wrong. L2's kernel is
your starting point for phase 1.
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
CPU_NUM_SPLITS = 4  # num_splits=None on the CPU: small, but enough to exercise the merge


@triton.jit
def merge_states_kernel(
    out_ptr, out_lse_ptr, parts_ptr, lse_ptr,
    out_stride,                # elements from one row of out to the next (the caller may own out)
    NUM_HEADS,
    NUM_PARTS: tl.constexpr,   # parts merged per (row, head)
    PARTS_PAD: tl.constexpr,   # NUM_PARTS rounded up to a power of two
    HEAD_SIZE: tl.constexpr,   # D
    D_PAD: tl.constexpr,       # D rounded up to a power of two
):
    """Merge, for every (row, head), NUM_PARTS partial results into one: the v and s that
    attention over the union of the parts' keys would give (content/l4.md §3).

    parts is [rows, H, NUM_PARTS, D] and lse [rows, H, NUM_PARTS], both contiguous
    fp32; each part is (v, s) with s the natural-log log-sum-exp of its scores and
    s = -inf for an empty part (whose v may be garbage, NaN included). The merged v
    goes to row `row` of out (rows out_stride elements apart, out's dtype), the merged
    s to out_lse [rows, H] (fp32). When every part is empty: v = 0, s = -inf, never NaN.
    """
    # TODO(l4): your merge kernel (content/l4.md §3 and §4; hints in §7).
    raise NotImplementedError("merge_states_kernel is not written yet: see content/l4.md §3 and §4")


def merge_attention_states(v_a, s_a, v_b, s_b):
    """Merge two partial attention results over disjoint sets of keys: v_* [n, H, D]
    (any float dtype), s_* [n, H] float32 log-sum-exps in natural log (s = -inf: an
    empty set). Returns (v in v_a's dtype, s float32), computed in fp32.

    Merging with an empty side returns the other side unchanged, even when the
    empty side's v is garbage; two empty sides give v = 0, s = -inf, never NaN.
    Raise ValueError, naming the argument, for mismatched shapes, a non-float v,
    s that is not float32, or tensors on different devices.
    """
    # TODO(l4): check the inputs, then merge (content/l4.md §3, §4 and §6; hints in §7).
    raise NotImplementedError("merge_attention_states is not written yet: see content/l4.md §3 and §4")


@triton.jit
def split_kv_kernel(
    out_ptr, parts_ptr, lse_ptr, query_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, seq_lens_ptr,
    qk_scale,                  # scale * log2(e)
    query_stride,              # elements from one sequence's query row to the next
    out_stride,                # the same for out
    table_stride,              # elements from one block-table row to the next
    NUM_HEADS, NUM_KV_HEADS, NUM_SPLITS,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    HEAD_SIZE: tl.constexpr,   # D
    GROUP: tl.constexpr,       # query heads per KV head: NUM_HEADS // NUM_KV_HEADS
    GROUP_PAD: tl.constexpr,   # GROUP rounded up to a power of two, at least 16
    D_PAD: tl.constexpr,       # D rounded up to a power of two >= 16
    TILE: tl.constexpr,        # tokens per iteration: several blocks at once
    UPCAST: tl.constexpr,      # interpreter + bfloat16: see _INTERPRET above
    DIRECT: tl.constexpr,      # NUM_SPLITS == 1: write the answer to out, no phase 2
):
    """Phase 1: attention of every sequence's query heads over NUM_SPLITS contiguous
    chunks of its context, one partial result per chunk (content/l4.md §5).

    For chunk p of sequence b and query head h: the normalised output (fp32) in parts
    [B, H_q, NUM_SPLITS, D] and the natural-log log-sum-exp of its scores in lse
    [B, H_q, NUM_SPLITS]. The chunks split the sequence's own seq_len and together
    cover it once; a chunk with no key stores v = 0 and lse = -inf, never NaN. With
    DIRECT (NUM_SPLITS is 1) the one chunk's output goes straight into out instead, in
    out's dtype. L2's rules on the block table and the cache hold.
    """
    # TODO(l4): your phase 1 (content/l4.md §3 to §5; hints in §7).
    raise NotImplementedError("split_kv_kernel is not written yet: see content/l4.md §5")


def default_num_splits(num_seqs, num_kv_heads, device):
    """The split count (an int, at least 1) paged_decode_attention_split uses when
    num_splits is None: on a GPU, from the batch, the KV heads and the device's SM
    count (content/l4.md §5.3); on the CPU, CPU_NUM_SPLITS."""
    # TODO(l4): your rule (content/l4.md §5.3; hints in §7).
    raise NotImplementedError("default_num_splits is not written yet: see content/l4.md §5")


def paged_decode_attention_split(query, k_cache, v_cache, block_table, seq_lens, scale=None, num_splits=None,
                                 out=None):
    """L2's paged decode attention, split over the context: returns [B, H_q, D]
    (written into `out` when given). Phase 1 attends each of num_splits chunks of
    every sequence separately; phase 2 merges the chunks by their log-sum-exps.

    Inputs as L2's paged_decode_attention; num_splits=None picks a count
    (default_num_splits). Raise ValueError, naming the argument and the fix, for
    num_splits < 1 (or not a whole number), an `out` of the wrong shape, dtype or
    device, and every input L2 refuses (content/l4.md §6).
    """
    # TODO(l4): check the inputs, then run both phases (content/l4.md §5 and §6; hints in §7).
    raise NotImplementedError("paged_decode_attention_split is not written yet: see content/l4.md §5 and §6")
