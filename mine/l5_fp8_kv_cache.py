"""L5: an FP8 KV cache, the quantising write and the split-KV decode that reads it
(vLLM reshape_and_cache_flash with kv_cache_dtype="fp8" and unified attention's fp8
path; FlashInfer's decode with k_scale / v_scale).

Read content/l5.md first. Replace each `raise NotImplementedError` with your code;
`make grade` tells you how far you are and what is still wrong. L1's write and L4's
split decode are your starting points; `_fp8_bits` below is given (content/l5.md §5):
it only works around the CPU interpreter and is not part of the exercise.
"""
import math
import os

import torch
import triton
import triton.language as tl

# Triton's CPU interpreter converts fp32 to fp8 wrongly: it rounds ties away from zero,
# drops a mantissa carry (31.5 becomes 16, not 32) and does not saturate (content/l5.md
# §5). So there the write computes the fp8 byte itself with integer operations and
# stores it through a uint8 view of the cache; on a GPU the hardware conversion is
# right. The interpreter also computes tl.dot on bfloat16 wrongly
# (triton-lang/triton#11584), so there the decode widens q, K and V to fp32 first.
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
FORMATS = {  # dtype: (largest finite value, mantissa bits, exponent bias)
    torch.float8_e4m3fn: (448.0, 3, 7),
    torch.float8_e5m2: (57344.0, 2, 15),
}
CPU_NUM_SPLITS = 4   # num_splits=None on the CPU: small, but enough to exercise the merge
PROGRAMS_PER_SM = 4  # num_splits=None on a GPU aims at this many phase-1 programs per SM ...
MAX_SPLITS = 32      # ... with at most this many splits
NUM_WARPS, NUM_STAGES = 2, 1  # phase 1's launch: the fastest tried on an H200 (BENCHMARKS.md)


@triton.jit
def _fp8_bits(y, MANT: tl.constexpr, BIAS: tl.constexpr):
    """The fp8 byte of y (fp32, finite, already saturated), rounded to nearest even,
    from y's bits alone: the interpreter's own conversion is wrong (see _INTERPRET)."""
    a = y.to(tl.int32, bitcast=True)
    sign = (a >> 24) & 0x80
    a = a & 0x7FFFFFFF
    exp = a >> 23                  # fp32's biased exponent
    SHIFT: tl.constexpr = 23 - MANT  # mantissa bits fp8 drops
    # A normal fp8 value: round away SHIFT bits, ties to even; a carry out of the
    # mantissa lands in the exponent, as it should. Then rebias the exponent.
    normal = ((a + ((1 << (SHIFT - 1)) - 1) + ((a >> SHIFT) & 1)) >> SHIFT) - ((127 - BIAS) << MANT)
    # Below fp8's smallest normal: the byte is y / 2**(1 - BIAS - MANT), rounded the same way.
    mant = (a & 0x7FFFFF) | 0x800000
    shift = tl.maximum(tl.minimum(SHIFT + 128 - BIAS - exp, 31), 1)
    sub = (mant + (1 << (shift - 1)) - 1 + ((mant >> shift) & 1)) >> shift
    return (tl.where(exp >= 128 - BIAS, normal, sub) | sign).to(tl.uint8)


@triton.jit
def reshape_and_cache_fp8_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, k_scale_ptr, v_scale_ptr,
    key_stride, value_stride,    # elements from one token's row to the next
    NUM_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr,
    H_PAD: tl.constexpr, D_PAD: tl.constexpr,  # H and D rounded up to powers of two
    SCALE_STRIDE: tl.constexpr,  # 0: one scale for the tensor ([1]); 1: one per KV head ([H_kv])
    FP8_MAX: tl.constexpr, MANT: tl.constexpr, BIAS: tl.constexpr,  # the cache's format (FORMATS)
    INT_ENCODE: tl.constexpr,    # interpreter: see _INTERPRET above
):
    """L1's kernel into fp8 caches: each token's [H, D] key and value values x, head h
    with scale s_h, stored in its slot as fp8(saturate(x / s_h)).

    The quotient is the fp32 one, correctly rounded, as torch's x.float() / s gives it;
    saturate means clamped to +-FP8_MAX, the format's largest finite value (448 for
    e4m3fn, 57344 for e5m2); the fp8 value is the nearest, ties to even. A finite x
    never becomes NaN or inf. k_scale_ptr/v_scale_ptr hold one scale (SCALE_STRIDE 0)
    or one per KV head (SCALE_STRIDE 1); nothing past them is read. A token whose
    slot is -1 is padding: nothing of it is read, nothing is written. With INT_ENCODE
    (the CPU interpreter, whose own fp8 conversion is wrong) the cache pointers are
    uint8 views of the caches and each byte stored is the fp8 value's bits
    (content/l5.md §5).
    """
    # TODO(l5): your write kernel (content/l5.md §4 and §5; hints in §9).
    raise NotImplementedError("reshape_and_cache_fp8_kernel is not written yet: see content/l5.md §5")


def reshape_and_cache_fp8(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale):
    """Quantise key/value [T, H, D] into the fp8 caches [num_blocks, block_size, H, D]:
    cache = fp8(saturate(x.float() / scale)), scale [1] or [H] float32 on the device.

    L1's contract (any row stride with each token's [H, D] contiguous, read in place;
    slot -1 = padding; returns None) into caches of dtype torch.float8_e4m3fn or
    torch.float8_e5m2. key and value share one dtype, float16, bfloat16 or float32;
    the two caches share one fp8 dtype. k_scale and v_scale are both [1] or both [H].
    Raise ValueError, naming the argument and the fix, for everything L1 refuses, a
    cache that is not fp8, and a scale of the wrong shape, dtype or device
    (content/l5.md §8).
    """
    # TODO(l5): check the inputs, then run your write kernel (content/l5.md §5 and §8; hints in §9).
    raise NotImplementedError("reshape_and_cache_fp8 is not written yet: see content/l5.md §5 and §8")


@triton.jit
def merge_states_kernel(
    out_ptr, parts_ptr, lse_ptr,
    out_stride,                # elements from one row of out to the next (the caller may own out)
    NUM_HEADS,
    NUM_PARTS: tl.constexpr,   # parts merged per (row, head)
    PARTS_PAD: tl.constexpr,   # NUM_PARTS rounded up to a power of two
    HEAD_SIZE: tl.constexpr,   # D
    D_PAD: tl.constexpr,       # D rounded up to a power of two
):
    """L4's phase 2 without the merged log-sum-exp: for every (row, head), the merge of
    NUM_PARTS partial outputs (parts [rows, H, NUM_PARTS, D], lse [rows, H, NUM_PARTS],
    fp32, natural log; lse = -inf marks an empty part) into row `row` of out (rows
    out_stride elements apart, out's dtype). L4's merge_states_kernel also stores the
    merged lse (its out_lse_ptr); this one has no such argument."""
    # TODO(l5): your merge (content/l4.md §3 and §4, content/l5.md §6).
    raise NotImplementedError("merge_states_kernel is not written yet: see content/l5.md §6")


@triton.jit
def split_kv_fp8_kernel(
    out_ptr, parts_ptr, lse_ptr, query_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, seq_lens_ptr,
    k_scale_ptr, v_scale_ptr,
    qk_scale,                  # scale * log2(e)
    query_stride, out_stride, table_stride,
    NUM_HEADS, NUM_KV_HEADS, NUM_SPLITS,
    SCALE_STRIDE: tl.constexpr,  # 0: per-tensor scales ([1]); 1: per KV head ([H_kv])
    BLOCK_SIZE: tl.constexpr, HEAD_SIZE: tl.constexpr,
    GROUP: tl.constexpr,       # query heads per KV head
    GROUP_PAD: tl.constexpr,   # GROUP rounded up to a power of two, at least 16
    D_PAD: tl.constexpr,       # D rounded up to a power of two >= 16
    TILE: tl.constexpr,        # tokens per iteration
    UPCAST: tl.constexpr,      # interpreter + bfloat16: see _INTERPRET above
    DIRECT: tl.constexpr,      # NUM_SPLITS == 1: write the answer to out, no phase 2
):
    """L4's phase 1 over fp8 caches: the same parts and natural-log lse (DIRECT: the
    output straight into out), with K and V meaning fp8.to(float32) * scale, the KV
    head's scale (SCALE_STRIDE 1) or the one scale (SCALE_STRIDE 0) (content/l5.md §6)."""
    # TODO(l5): your phase 1 (content/l5.md §6; hints in §9).
    raise NotImplementedError("split_kv_fp8_kernel is not written yet: see content/l5.md §6")


def default_num_splits(num_seqs, num_kv_heads, device):
    """The split count paged_decode_attention_fp8 uses when num_splits is None
    (L4's rule; CPU_NUM_SPLITS on the CPU)."""
    # TODO(l5): L4's rule (content/l4.md §5).
    raise NotImplementedError("default_num_splits is not written yet: see content/l5.md §6")


def paged_decode_attention_fp8(query, k_cache, v_cache, block_table, seq_lens, k_scale, v_scale, scale=None,
                               num_splits=None, out=None):
    """L4's split-KV decode over fp8 caches read as fp8.to(float32) * scale: returns
    [B, H_q, D] in the query's dtype (written into `out` when given).

    query float16, bfloat16 or float32; caches float8_e4m3fn or float8_e5m2; k_scale
    and v_scale float32, both [1] or both [H_kv], on the cache's device; scale=None
    means 1/sqrt(D). Raise ValueError, naming the argument and the fix, for
    everything L4 refuses (the cache dtype apart), a cache that is not fp8 and a
    scale of the wrong shape, dtype or device (content/l5.md §8).
    """
    # TODO(l5): check the inputs, then run both phases (content/l5.md §6 and §8; hints in §9).
    raise NotImplementedError("paged_decode_attention_fp8 is not written yet: see content/l5.md §6 and §8")
