"""L8: sliding-window attention with attention sinks over a paged KV cache
(gpt-oss, Gemma 3, Mistral; vLLM's Triton unified attention SLIDING_WINDOW / USE_SINKS,
FlashInfer's window_left).

Read content/l8.md first. Replace each `raise NotImplementedError` with your code;
`make grade` tells you how far you are and what is still wrong. Your L3 kernel is the
starting point of the prefill, your L4 kernels of the decode.
"""
import math
import os

import torch
import triton
import triton.language as tl

# Triton's CPU interpreter computes tl.dot on bfloat16 wrongly (it multiplies the
# raw bits; triton-lang/triton#11584), so there the kernels widen q, K and V to
# fp32 first. On a GPU they stay 16-bit and go through the tensor cores.
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@triton.jit
def window_prefill_kernel(
    out_ptr, query_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, query_start_loc_ptr, seq_lens_ptr, sinks_ptr,
    scale_log2,                # scale * log2(e): scores in base 2
    window,                    # window_left (NO_WINDOW for -1)
    num_seqs, short_q_len, query_stride, out_stride, table_stride, NUM_KV_HEADS,
    BLOCK_SIZE: tl.constexpr, HEAD_SIZE: tl.constexpr, D_PAD: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, TILE: tl.constexpr, UPCAST: tl.constexpr,
    USE_SINKS: tl.constexpr,
    SHORT: tl.constexpr,       # one program per sequence for short chunks (decode rows), as in L3
):
    """L3's prefill kernel with a window and sinks: every query of the chunk at position p
    attends to the cached keys [p - window, p] of its sequence, and its softmax's
    denominator holds e^sinks[h] once for query head h (content/l8.md §5 and §6).

    The cost must follow the window: no K/V row, and no block-table entry, of a key before
    the earliest window start of a program's queries is read; entries before the window may
    be dead (garbage). Change the parameters as you like: only the wrapper calls it.
    """
    # TODO(l8): your prefill kernel (content/l8.md §5 and §6; hints: make hint DRILL=l8).
    raise NotImplementedError("window_prefill_kernel is not written yet: see content/l8.md §5 and §6")


def paged_prefill_attention_window(query, k_cache, v_cache, block_table, query_start_loc, seq_lens, window_left,
                                   sinks=None, scale=None, out=None):
    """L3's chunked-prefill attention where query position p sees keys [p - window_left, p]
    (window_left = -1: no window) and query head h's sink adds e^sinks[h] once to its
    softmax's denominator. Returns [total_q, H_q, D] (written into `out` when given).

    query [total_q, H_q, D] (each token's [H_q, D] contiguous), k_cache/v_cache
    [num_blocks, block_size, H_kv, D] contiguous, block_table [B, max_blocks],
    query_start_loc [B + 1], seq_lens [B] (int32 or int64): L3's contract. window_left is a
    Python int >= -1 (a model's sliding_window W is window_left = W - 1). sinks is None or a
    contiguous float32 [H_q] tensor on the query's device: natural log, not scaled, joining
    no value; -inf means no sink. Entries of blocks wholly before the window of a sequence's
    first new token may be garbage: never use them as block numbers, never refuse them.
    Raise ValueError, naming the argument, for L3's bad inputs and for a window_left or
    sinks that breaks the above (content/l8.md §8).
    """
    # TODO(l8): check the inputs, then launch your kernel (content/l8.md §8).
    raise NotImplementedError("paged_prefill_attention_window is not written yet: see content/l8.md §8")


@triton.jit
def window_decode_kernel(
    out_ptr, parts_ptr, lse_ptr, query_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, seq_lens_ptr, sinks_ptr,
    scale_log2, window, query_stride, out_stride, table_stride, NUM_HEADS, NUM_KV_HEADS, NUM_SPLITS,
    BLOCK_SIZE: tl.constexpr, HEAD_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    D_PAD: tl.constexpr, TILE: tl.constexpr, UPCAST: tl.constexpr, USE_SINKS: tl.constexpr,
    DIRECT: tl.constexpr,      # NUM_SPLITS == 1: write the answer to out, no merge
):
    """L4's phase 1 over the window: each split attends to its share of the keys
    [seq_len - 1 - window, seq_len - 1] and stores its partial output and natural-log
    log-sum-exp; the sink joins exactly one split's (content/l8.md §5 and §6). A split
    with no key stores an output of 0 and a log-sum-exp of -inf, never NaN.
    """
    # TODO(l8): your decode kernel (content/l8.md §5 and §6).
    raise NotImplementedError("window_decode_kernel is not written yet: see content/l8.md §5 and §6")


@triton.jit
def merge_kernel(out_ptr, parts_ptr, lse_ptr, out_stride, NUM_HEADS, NUM_PARTS: tl.constexpr,
                 PARTS_PAD: tl.constexpr, HEAD_SIZE: tl.constexpr, D_PAD: tl.constexpr):
    """L4's phase 2: merge each (sequence, head)'s parts by their log-sum-exps into out
    (content/l8.md §6). Parts of log-sum-exp -inf weigh nothing, whatever their v."""
    # TODO(l8): your merge (content/l8.md §6).
    raise NotImplementedError("merge_kernel is not written yet: see content/l8.md §6")


def paged_decode_attention_window(query, k_cache, v_cache, block_table, seq_lens, window_left, sinks=None,
                                  scale=None, num_splits=None, out=None):
    """L4's split-KV decode over the window [seq_len - 1 - window_left, seq_len - 1], with
    L8's sinks: returns [B, H_q, D] (written into `out` when given).

    L4's contract and checks (num_splits None or >= 1; None picks a count), plus the window
    and sinks of paged_prefill_attention_window. The sink joins the denominator exactly
    once, whatever the number of splits; a split with no key of the window contributes
    nothing and never NaN. Entries of blocks wholly before seq_len - 1 - window_left may be
    garbage: never use them as block numbers, never refuse them (content/l8.md §8).
    """
    # TODO(l8): check the inputs, launch phase 1, then merge (content/l8.md §6 and §8).
    raise NotImplementedError("paged_decode_attention_window is not written yet: see content/l8.md §8")
