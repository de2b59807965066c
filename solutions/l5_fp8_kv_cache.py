"""L5 reference: an FP8 KV cache, the quantising write and the split-KV decode that reads it.

Mirrors vLLM's reshape_and_cache_flash with kv_cache_dtype="fp8" and the fp8 path of
its unified attention (FlashInfer's decode with k_scale / v_scale folds the scales the
same way). Read it next to content/l5.md, which explains it top to bottom and cites
the line ranges below.
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
def _divide(x, scale, EXACT: tl.constexpr):
    """x / scale in fp32, rounded once (torch's division), for x [H, D] and scale [H, 1].
    A correctly rounded division per element (tl.math.div_rn) costs more than the
    memory traffic; one per head, for the reciprocal, does not."""
    if EXACT:  # the interpreter: its tl.fma rounds twice, so the fix below would not be exact
        q = tl.math.div_rn(x, scale)
    else:
        inv = tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)
        q = x * inv  # within 1.5 units in the last place of x / scale
        # Markstein's correction, q + (x - q * scale) * inv rounded once. His proof needs an
        # exact residual, which a q 1.5 ulp off does not always give; the 16-bit and 64 Mi-value
        # tests vouch for it. Not at 0 (it drops the sign) nor huge q (inf - inf; saturated).
        fixed = tl.fma(tl.fma(-q, scale, x), inv, q)
        q = tl.where((q != 0) & (tl.abs(q) < 1e30), fixed, q)
    return q


@triton.jit
def _quantise_store(ptr, x, scale, mask, FP8_MAX: tl.constexpr, MANT: tl.constexpr, BIAS: tl.constexpr,
                    INT_ENCODE: tl.constexpr):
    # In fp32, correctly rounded: Triton's `/` is not (on an H200 it flipped the fp8
    # rounding of 2 in 5 million fp32 values), and x / scale in x's own 16-bit dtype
    # would round twice.
    q = _divide(x.to(tl.float32), scale, INT_ENCODE)
    q = tl.minimum(tl.maximum(q, -FP8_MAX), FP8_MAX)  # saturate: never NaN or inf in the cache
    if INT_ENCODE:
        tl.store(ptr, _fp8_bits(q, MANT, BIAS), mask=mask)  # ptr is a uint8 view of the cache
    else:
        tl.store(ptr, q.to(ptr.dtype.element_ty), mask=mask)


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
    # L1's kernel: one program per token, int64 offsets, padding (slot -1) touches nothing.
    # The token's row is a tile [H, D], so each head's scale is one value per row.
    token = tl.program_id(axis=0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    heads = tl.arange(0, H_PAD)
    dims = tl.arange(0, D_PAD)
    cols = heads[:, None] * HEAD_SIZE + dims[None, :]
    keep = (heads < tl.where(slot >= 0, NUM_HEADS, 0))[:, None] & (dims < HEAD_SIZE)[None, :]
    k = tl.load(key_ptr + token * key_stride + cols, mask=keep)
    v = tl.load(value_ptr + token * value_stride + cols, mask=keep)
    # A per-tensor scale has stride 0: every head reads the same value.
    k_scale = tl.load(k_scale_ptr + heads * SCALE_STRIDE, mask=heads < NUM_HEADS, other=1.0)[:, None]
    v_scale = tl.load(v_scale_ptr + heads * SCALE_STRIDE, mask=heads < NUM_HEADS, other=1.0)[:, None]
    row = slot * (NUM_HEADS * HEAD_SIZE) + cols
    _quantise_store(k_cache_ptr + row, k, k_scale, keep, FP8_MAX, MANT, BIAS, INT_ENCODE)
    _quantise_store(v_cache_ptr + row, v, v_scale, keep, FP8_MAX, MANT, BIAS, INT_ENCODE)


def reshape_and_cache_fp8(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale):
    """Quantise key/value [T, H, D] into the fp8 caches [num_blocks, block_size, H, D]:
    cache = fp8(saturate(x.float() / scale)), scale [1] or [H] float32 on the device."""
    _check_write_inputs(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    num_tokens, num_heads, head_size = key.shape
    if num_tokens == 0:
        return
    fp8_max, mant, bias = FORMATS[k_cache.dtype]
    if _INTERPRET:  # the byte is computed in the kernel and stored as uint8 (see _INTERPRET)
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    h_pad, d_pad = triton.next_power_of_2(num_heads), triton.next_power_of_2(head_size)
    reshape_and_cache_fp8_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale, key.stride(0), value.stride(0),
        NUM_HEADS=num_heads, HEAD_SIZE=head_size, H_PAD=h_pad, D_PAD=d_pad,
        SCALE_STRIDE=int(k_scale.numel() > 1), FP8_MAX=fp8_max, MANT=mant, BIAS=bias, INT_ENCODE=_INTERPRET,
        num_warps=max(1, min(8, h_pad * d_pad // 512)),  # 2 for 8 x 128, the fastest on an H200 (BENCHMARKS.md)
    )


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
    # L4's phase 2 without the merged LSE (no out_lse_ptr): the parts hold dequantised outputs.
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    parts = tl.arange(0, PARTS_PAD)
    dims = tl.arange(0, D_PAD)
    first = (row * NUM_HEADS + head) * NUM_PARTS
    s = tl.load(lse_ptr + first + parts, mask=parts < NUM_PARTS, other=float("-inf"))
    s_max = tl.max(s, axis=0)
    s_max = tl.where(s_max == float("-inf"), 0.0, s_max)  # every part empty: shift by 0, not -inf
    w = tl.exp(s - s_max)
    v_mask = (parts < NUM_PARTS)[:, None] & (dims < HEAD_SIZE)[None, :]
    v = tl.load(parts_ptr + (first + parts)[:, None] * HEAD_SIZE + dims[None, :], mask=v_mask, other=0.0)
    v = tl.where(w[:, None] > 0, v, 0.0)  # an empty part's v may be garbage, and 0 * NaN = NaN
    total = tl.sum(w, axis=0)
    out = tl.sum(w[:, None] * v, axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + row * out_stride + head * HEAD_SIZE + dims, out.to(out_ptr.dtype.element_ty),
             mask=dims < HEAD_SIZE)


@triton.jit
def split_kv_fp8_kernel(
    out_ptr, parts_ptr, lse_ptr, query_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, seq_lens_ptr,
    k_scale_ptr, v_scale_ptr,
    qk_scale,                  # scale * log2(e): scores in base 2, so exp2 does the softmax
    query_stride, out_stride, table_stride,
    NUM_HEADS, NUM_KV_HEADS, NUM_SPLITS,
    SCALE_STRIDE: tl.constexpr,  # 0: per-tensor scales ([1]); 1: per KV head ([H_kv])
    BLOCK_SIZE: tl.constexpr, HEAD_SIZE: tl.constexpr,
    GROUP: tl.constexpr,       # query heads per KV head
    GROUP_PAD: tl.constexpr,   # GROUP rounded up to a power of two >= 16 (tl.dot's minimum)
    D_PAD: tl.constexpr,       # D rounded up to a power of two >= 16
    TILE: tl.constexpr,        # tokens per iteration
    UPCAST: tl.constexpr,      # interpreter + bfloat16: see _INTERPRET above
    DIRECT: tl.constexpr,      # NUM_SPLITS == 1: write the answer to out, no phase 2
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + seq)
    chunk = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), TILE) * TILE
    start = split * chunk
    end = tl.minimum(start + chunk, seq_len)

    rows = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, D_PAD)
    heads = kv_head * GROUP + rows
    q_mask = (rows < GROUP)[:, None] & (dims < HEAD_SIZE)[None, :]
    q = tl.load(query_ptr + seq * query_stride + heads[:, None] * HEAD_SIZE + dims[None, :],
                mask=q_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    # This program's KV head has one K scale and one V scale: scalars, outside the
    # softmax's sum over tokens. So the K scale folds into the score scale and the V
    # scale multiplies the output once, and the fp8 values widen to q's dtype
    # exactly (every fp8 value is a float16 and a bfloat16).
    k_scale = tl.load(k_scale_ptr + kv_head * SCALE_STRIDE)
    v_scale = tl.load(v_scale_ptr + kv_head * SCALE_STRIDE)

    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    for tile_start in range(start, end, TILE):
        pos = tile_start + tl.arange(0, TILE)
        live = pos < end
        block = tl.load(block_table_ptr + seq * table_stride + pos // BLOCK_SIZE, mask=live, other=0)
        slot = block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
        kv_offs = (slot * NUM_KV_HEADS + kv_head)[:, None] * HEAD_SIZE + dims[None, :]
        kv_mask = live[:, None] & (dims < HEAD_SIZE)[None, :]
        k = tl.load(k_cache_ptr + kv_offs, mask=kv_mask, other=0.0).to(tl.float32).to(q.dtype)
        v = tl.load(v_cache_ptr + kv_offs, mask=kv_mask, other=0.0).to(tl.float32).to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * (qk_scale * k_scale)
        s = tl.where(live[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m = m_new

    part = acc / tl.where(l > 0, l, 1.0)[:, None] * v_scale  # an empty chunk: 0, not 0/0
    lse = (m + tl.log2(l)) * 0.6931471805599453  # base 2 -> natural log
    if DIRECT:
        out_offs = seq * out_stride + heads[:, None] * HEAD_SIZE + dims[None, :]
        tl.store(out_ptr + out_offs, part.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        first = (seq * NUM_HEADS + heads) * NUM_SPLITS + split
        tl.store(parts_ptr + first[:, None] * HEAD_SIZE + dims[None, :], part, mask=q_mask)
        tl.store(lse_ptr + first, lse, mask=rows < GROUP)


def default_num_splits(num_seqs, num_kv_heads, device):
    """L4's rule: about PROGRAMS_PER_SM programs per SM, at most MAX_SPLITS splits."""
    if device.type != "cuda":
        return CPU_NUM_SPLITS
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(MAX_SPLITS, PROGRAMS_PER_SM * sms // max(1, num_seqs * num_kv_heads)))


def paged_decode_attention_fp8(query, k_cache, v_cache, block_table, seq_lens, k_scale, v_scale, scale=None,
                               num_splits=None, out=None):
    """L4's split-KV decode over fp8 caches read as fp8.to(float32) * scale: returns
    [B, H_q, D] in the query's dtype (written into `out` when given)."""
    _check_decode_inputs(query, k_cache, v_cache, block_table, seq_lens, k_scale, v_scale, num_splits, out)
    num_seqs, num_heads, head_size = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    scale = 1.0 / math.sqrt(head_size) if scale is None else float(scale)
    num_splits = default_num_splits(num_seqs, num_kv_heads, query.device) if num_splits is None else num_splits
    if out is None:
        out = torch.empty((num_seqs, num_heads, head_size), dtype=query.dtype, device=query.device)
    if num_seqs == 0:
        return out
    parts = torch.empty((num_seqs, num_heads, num_splits, head_size), dtype=torch.float32, device=query.device)
    lse = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=query.device)
    d_pad = max(16, triton.next_power_of_2(head_size))
    split_kv_fp8_kernel[(num_seqs, num_kv_heads, num_splits)](
        out, parts, lse, query, k_cache, v_cache, block_table, seq_lens, k_scale, v_scale,
        scale * 1.4426950408889634, query.stride(0), out.stride(0), block_table.stride(0),
        num_heads, num_kv_heads, num_splits,
        SCALE_STRIDE=int(k_scale.numel() > 1), BLOCK_SIZE=block_size, HEAD_SIZE=head_size,
        GROUP=num_heads // num_kv_heads, GROUP_PAD=max(16, triton.next_power_of_2(num_heads // num_kv_heads)),
        D_PAD=d_pad,
        TILE=128 if d_pad <= 128 else 64,  # a K or V tile of 16 KiB in fp8, as L4's in 16-bit
        UPCAST=_INTERPRET and query.dtype == torch.bfloat16,
        DIRECT=num_splits == 1,
        num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )
    if num_splits > 1:
        merge_states_kernel[(num_seqs, num_heads)](
            out, parts, lse, out.stride(0), num_heads,
            NUM_PARTS=num_splits, PARTS_PAD=triton.next_power_of_2(num_splits), HEAD_SIZE=head_size,
            D_PAD=triton.next_power_of_2(head_size),
        )
    return out


def _check_scales(k_scale, v_scale, num_kv_heads, device):
    for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a float32 tensor of shape [1] or [H_kv] on the cache's device (a "
                             f"device tensor: reading a Python float back would sync every step); got "
                             f"{type(t).__name__}")
        if t.dtype != torch.float32:
            raise ValueError(f"{name} must be float32, got {t.dtype}; pass {name}.float()")
        if t.shape not in ((1,), (num_kv_heads,)):
            raise ValueError(f"{name} must have shape [1] (per tensor) or [{num_kv_heads}] (per KV head); got "
                             f"{tuple(t.shape)}")
        if t.device != device:
            raise ValueError(f"{name} must be on the cache's device {device}, got {t.device}; pass "
                             f"{name}.to({str(device)!r})")
    if k_scale.shape != v_scale.shape:
        raise ValueError(f"k_scale and v_scale must have one shape (both per tensor or both per KV head); got "
                         f"{tuple(k_scale.shape)} and {tuple(v_scale.shape)}")


def _check_caches(k_cache, v_cache):
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must both be [num_blocks, block_size, H_kv, D]; "
                         f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if k_cache.dtype not in FORMATS or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"k_cache and v_cache must share one fp8 dtype, torch.float8_e4m3fn or torch.float8_e5m2; "
                         f"got {k_cache.dtype} and {v_cache.dtype}")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not cache.is_contiguous():
            raise ValueError(f"{name} must be contiguous (got strides {cache.stride()}); "
                             f"pass {name}.contiguous() or allocate it with torch.empty(...)")


def _check_write_inputs(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale):
    # L1's checks with the cache fp8 and the scales added; repeated here because trees import nothing.
    if key.dim() != 3 or key.shape != value.shape:
        raise ValueError(f"key and value must both be [T, H, D]; got {tuple(key.shape)} and {tuple(value.shape)}")
    _check_caches(k_cache, v_cache)
    if k_cache.shape[2:] != key.shape[1:]:
        raise ValueError(f"cache heads/head size {tuple(k_cache.shape[2:])} do not match key's {tuple(key.shape[1:])}")
    if slot_mapping.shape != key.shape[:1]:
        raise ValueError(f"slot_mapping must have one entry per token: shape {tuple(slot_mapping.shape)}, "
                         f"key has {key.shape[0]} tokens")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be int32 or int64, got {slot_mapping.dtype}")
    if key.dtype not in (torch.float16, torch.bfloat16, torch.float32) or value.dtype != key.dtype:
        raise ValueError(f"key and value must share one dtype, float16, bfloat16 or float32; got {key.dtype} and "
                         f"{value.dtype}")
    tensors = (key, value, k_cache, v_cache, slot_mapping)
    if len({t.device for t in tensors}) != 1:
        raise ValueError(f"all tensors must be on one device; got {[str(t.device) for t in tensors]}")
    _check_scales(k_scale, v_scale, k_cache.shape[2], k_cache.device)
    for name, t in (("key", key), ("value", value)):
        if t.shape[0] > 0 and not t[0].is_contiguous():
            raise ValueError(f"each token of {name} must be H*D contiguous values (got strides {t.stride()}); "
                             f"a row-strided view such as qkv[:, 1] is fine, a permuted one is not")
    if slot_mapping.device.type == "cpu" and slot_mapping.numel() > 0:
        # Free on the CPU; on a GPU a device-to-host sync every step, so there the kernel trusts the slots.
        num_slots = k_cache.shape[0] * k_cache.shape[1]
        lo, hi = int(slot_mapping.min()), int(slot_mapping.max())
        if lo < -1 or hi >= num_slots:
            raise ValueError(f"slot_mapping holds slots in [{lo}, {hi}], but the cache has slots 0..{num_slots - 1} "
                             f"(and -1 marks padding)")


def _check_decode_inputs(query, k_cache, v_cache, block_table, seq_lens, k_scale, v_scale, num_splits, out):
    # L4's checks with the cache fp8 and the scales added.
    if num_splits is not None and (not isinstance(num_splits, int) or isinstance(num_splits, bool)
                                   or num_splits < 1):
        raise ValueError(f"num_splits must be a whole number >= 1 (or None to pick one); got {num_splits!r}")
    if query.dim() != 3:
        raise ValueError(f"query must be [B, H_q, D] (one new token per sequence); got shape {tuple(query.shape)}")
    _check_caches(k_cache, v_cache)
    num_seqs, num_heads, head_size = query.shape
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_size:
        raise ValueError(f"the cache's head size {k_cache.shape[3]} does not match query's {head_size}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"query has {num_heads} heads, not a multiple of the cache's {num_kv_heads} KV heads; "
                         f"GQA needs H_q = group * H_kv (query head h reads KV head h // group)")
    if block_table.dim() != 2 or block_table.shape[0] != num_seqs:
        raise ValueError(f"block_table must be [B, max_blocks] with B = {num_seqs}; got {tuple(block_table.shape)}")
    if seq_lens.shape != (num_seqs,):
        raise ValueError(f"seq_lens must be [B] with B = {num_seqs}; got {tuple(seq_lens.shape)}")
    for name, t in (("block_table", block_table), ("seq_lens", seq_lens)):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
    if query.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"query must be float16, bfloat16 or float32, got {query.dtype}")
    if out is not None and (out.shape != query.shape or out.dtype != query.dtype or out.device != query.device):
        raise ValueError(f"out must have the query's shape, dtype and device {tuple(query.shape)}, {query.dtype}, "
                         f"{query.device}; got {tuple(out.shape)}, {out.dtype}, {out.device}")
    if out is not None and num_seqs > 0 and not out[0].is_contiguous():
        raise ValueError(f"each sequence's row of out must be H_q*D contiguous values (got strides {out.stride()})")
    tensors = (query, k_cache, v_cache, block_table, seq_lens)
    if len({t.device for t in tensors}) != 1:
        raise ValueError(f"all tensors must be on one device; got {[str(t.device) for t in tensors]}")
    _check_scales(k_scale, v_scale, num_kv_heads, k_cache.device)
    if num_seqs > 0 and not query[0].is_contiguous():
        raise ValueError(f"each sequence's query must be H_q*D contiguous values (got strides {query.stride()})")
    if block_table.stride(1) != 1:
        raise ValueError(f"each block_table row must be contiguous (got strides {block_table.stride()}); "
                         f"pass block_table.contiguous()")
    if seq_lens.device.type == "cpu" and num_seqs > 0:
        # Free on the CPU; on a GPU a device-to-host sync every step, so there the kernel trusts them.
        num_blocks, block_size = k_cache.shape[:2]
        lo, hi = int(seq_lens.min()), int(seq_lens.max())
        capacity = block_table.shape[1] * block_size
        if lo < 1 or hi > capacity:
            raise ValueError(f"seq_lens holds lengths in [{lo}, {hi}], but each must be at least 1 and at most "
                             f"max_blocks * block_size = {capacity}; widen block_table or fix seq_lens")
        owned = torch.arange(block_table.shape[1]) < (seq_lens[:, None] + block_size - 1) // block_size
        used = block_table[owned]
        if int(used.min()) < 0 or int(used.max()) >= num_blocks:
            raise ValueError(f"block_table names blocks in [{int(used.min())}, {int(used.max())}] for live tokens, "
                             f"but the cache has blocks 0..{num_blocks - 1}")
