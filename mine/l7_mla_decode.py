"""L7: DeepSeek's multi-head latent attention (MLA) at decode, over a paged latent cache
(vLLM's concat_and_cache_mla and its Triton MLA decode backend; FlashMLA).

Read content/l7.md first. Replace each `raise NotImplementedError` with your code;
`make grade` tells you how far you are and what is still wrong. L1's write and L4's
split decode are your starting points.
"""
import math
import os

import torch
import triton
import triton.language as tl

# Triton's CPU interpreter computes bfloat16 arithmetic wrongly (tl.dot, +, *,
# tl.maximum: numpy has no bfloat16; triton-lang/triton#11584), so there the decode
# kernel widens q and the latent tiles to fp32 first. On a GPU they stay 16-bit and
# go through the tensor cores, accumulating in fp32.
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
CPU_NUM_SPLITS = 4  # num_splits=None on the CPU: small, but enough to exercise the merge


@triton.jit
def concat_and_cache_mla_kernel(
    kv_c_ptr, k_pe_ptr, kv_cache_ptr, slot_mapping_ptr,
    c_stride, pe_stride,     # elements from one token's kv_c (k_pe) row to the next
    R: tl.constexpr,         # kv_lora_rank: the latent's width
    P: tl.constexpr,         # the rotary part's width
    R_PAD: tl.constexpr,     # R and P rounded up to powers of two
    P_PAD: tl.constexpr,
):
    """Write each token's latent row into its slot of the contiguous cache
    [num_blocks, block_size, R + P]: its R values of kv_c, then its P values of k_pe.

    kv_c_ptr/k_pe_ptr: token rows c_stride / pe_stride elements apart, each row
    contiguous. slot_mapping_ptr: one slot per token (int32 or int64); a token whose
    slot is -1 is padding: nothing of it is read, nothing is written. Every offset must
    hold for caches past 2**31 elements (content/l7.md §5).
    """
    # TODO(l7): your write kernel (content/l7.md §5; hints in §9).
    raise NotImplementedError("concat_and_cache_mla_kernel is not written yet: see content/l7.md §5")


@triton.jit
def mla_decode_kernel(
    out_ptr, lse_ptr, parts_ptr, part_lse_ptr,
    q_nope_ptr, q_pe_ptr, kv_cache_ptr, block_table_ptr, seq_lens_ptr,
    qk_scale,                  # scale * log2(e)
    qn_stride_b, qn_stride_h,  # q_nope's strides (sequence, head); each head's R values contiguous
    qp_stride_b, qp_stride_h,  # the same for q_pe
    out_stride,                # elements from one sequence's row of out to the next
    table_stride,              # elements from one block-table row to the next
    NUM_HEADS, NUM_SPLITS,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    R: tl.constexpr, P: tl.constexpr,
    R_PAD: tl.constexpr,       # R and P rounded up to powers of two >= 16 (tl.dot's minimum)
    P_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,     # query heads per program: the rows of both matrix products
    TILE: tl.constexpr,        # latent rows (tokens) per step
    UPCAST: tl.constexpr,      # interpreter + bfloat16: see _INTERPRET above
    DIRECT: tl.constexpr,      # NUM_SPLITS == 1: the answer goes straight to out and lse
):
    """Phase 1: attention of a group of query heads of one sequence over one of
    NUM_SPLITS contiguous chunks of its latent rows (content/l7.md §6).

    Every head reads the same rows: score = (q_nope · c + q_pe · k_pe) * scale, value = c,
    the row's first R values. For chunk p of sequence b and head h: the normalised output
    (fp32) in parts [B, H, NUM_SPLITS, R] and the natural-log log-sum-exp of its scores in
    part_lse [B, H, NUM_SPLITS]; with DIRECT (NUM_SPLITS is 1) the output goes to out
    (out's dtype) and the log-sum-exp to lse [B, H] instead. A chunk with no token stores
    0 and -inf, never NaN. Heads past NUM_HEADS are never stored. L2's rules on the block
    table hold; every offset must hold past 2**31 elements.
    """
    # TODO(l7): your decode kernel (content/l7.md §6; hints in §9).
    raise NotImplementedError("mla_decode_kernel is not written yet: see content/l7.md §6")


@triton.jit
def mla_merge_kernel(
    out_ptr, lse_ptr, parts_ptr, part_lse_ptr,
    out_stride, NUM_HEADS,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,  # NUM_SPLITS rounded up to a power of two
    R: tl.constexpr,
    R_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,     # heads merged per program
):
    """Phase 2: merge, for every (sequence, head), the NUM_SPLITS partial results of
    mla_decode_kernel into one, as L4's merge does (content/l7.md §7).

    parts [B, H, NUM_SPLITS, R] and part_lse [B, H, NUM_SPLITS], both contiguous fp32,
    s = -inf marking an empty chunk. The merged output goes to out (rows out_stride
    elements apart, out's dtype), its natural-log log-sum-exp to lse [B, H] (fp32).
    When every chunk is empty: 0 and -inf, never NaN.
    """
    # TODO(l7): your merge kernel (content/l7.md §7; hints in §9).
    raise NotImplementedError("mla_merge_kernel is not written yet: see content/l7.md §7")


def concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping):
    """Write each token's latent row into kv_cache [num_blocks, block_size, R + P], in
    place; returns None. The row of token t is kv_c[t] (R values) followed by k_pe[t] (P values).

    kv_c [T, R] and k_pe [T, P] may be views with any row stride (e.g. the two column
    ranges of one projection output) but each row must be contiguous; the cache must be
    contiguous. float16, bfloat16 or float32, one dtype for all three. slot_mapping [T]
    is int32 or int64; -1 marks padding. Raise ValueError, naming the argument and the
    fix, for a non-contiguous cache, a row that is not contiguous, mismatched shapes,
    dtypes or devices, and (on the CPU) slots outside the cache (content/l7.md §8).
    """
    # TODO(l7): check the inputs, then run your write kernel (content/l7.md §5 and §8; hints in §9).
    raise NotImplementedError("concat_and_cache_mla is not written yet: see content/l7.md §5 and §8")


def default_num_splits(num_seqs, num_heads, device):
    """The split count (an int, at least 1) mla_decode_attention uses when num_splits is
    None: on a GPU, from the batch, the heads and the device's SM count (content/l7.md
    §7); on the CPU, CPU_NUM_SPLITS."""
    # TODO(l7): your rule (content/l7.md §7; hints in §9).
    raise NotImplementedError("default_num_splits is not written yet: see content/l7.md §7")


def mla_decode_attention(q_nope, q_pe, kv_cache, block_table, seq_lens, scale, num_splits=None, out=None):
    """MLA decode over a paged latent cache. Returns (out, lse): out [B, H, R] in the
    query's dtype (written into `out` when given, and `out` returned), lse [B, H] float32,
    the natural-log log-sum-exp of each head's scores.

    q_nope [B, H, R] (already absorbed) and q_pe [B, H, P], each head's row contiguous
    (any other strides); kv_cache [num_blocks, block_size, R + P] contiguous; block_table
    [B, max_blocks] and seq_lens [B] int32 or int64 (entries past a sequence's last block
    are garbage). Each head h of sequence b attends to the seq_lens[b] cached rows:
    score = (q_nope · c + q_pe · k_pe) * scale, value = c (the row's first R values).
    `scale` is the model's, never derived from the widths. seq_lens[b] = 0 gives out = 0
    and lse = -inf. num_splits=None picks a count (default_num_splits). Raise ValueError,
    naming the argument and the fix, for a missing or non-positive scale, num_splits < 1,
    an `out` of the wrong shape, dtype or device, and every input L4 refuses (content/l7.md §8).
    """
    # TODO(l7): check the inputs, then run both phases (content/l7.md §6 to §8; hints in §9).
    raise NotImplementedError("mla_decode_attention is not written yet: see content/l7.md §6 and §8")
