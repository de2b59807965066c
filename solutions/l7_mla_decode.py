"""L7 reference: DeepSeek's multi-head latent attention (MLA) at decode, over a paged latent cache.

Mirrors vLLM's `concat_and_cache_mla` and its Triton MLA decode backend (FlashMLA is
the CUDA one). Read it next to content/l7.md, which explains it top to bottom and
cites the line ranges below.

The cache holds one latent row per token, [num_blocks, block_size, R + P]: the
compressed latent c (R values, the same bytes for the key and the value) followed
by the rotary part k_pe (P values). Slot s is row s of the cache seen as
[num_slots, R + P], so its first element sits at s * (R + P), an int64 offset.
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
LOG2E, LN2 = 1.4426950408889634, tl.constexpr(0.6931471805599453)  # a kernel reads only constexpr globals
CPU_NUM_SPLITS = 4     # num_splits=None on the CPU: small, but enough to exercise the merge
MAX_SPLITS = 32        # num_splits=None on a GPU: at most this many splits
# The decode launch on a GPU, measured on an H200 (BENCHMARKS.md, L7): heads per program, tokens
# per step, warps, pipeline stages, and the programs per SM that num_splits=None aims at. Up to 16
# heads, memory bounds it: 16 heads (tl.dot's smallest tile), two programs an SM. Past 16, the
# tensor cores: 64 heads share each latent tile, and one such program keeps an SM busy.
MEMORY_BOUND_LAUNCH, TENSOR_CORE_LAUNCH = (16, 64, 4, 3, 2), (64, 64, 8, 1, 1)
MERGE_BLOCK_H = 4  # heads per merge program on a GPU: many small programs, every SM busy


@triton.jit
def concat_and_cache_mla_kernel(
    kv_c_ptr, k_pe_ptr, kv_cache_ptr, slot_mapping_ptr,
    c_stride, pe_stride,     # elements from one token's kv_c (k_pe) row to the next
    R: tl.constexpr,         # kv_lora_rank: the latent's width
    P: tl.constexpr,         # the rotary part's width
    R_PAD: tl.constexpr,     # R and P rounded up to powers of two
    P_PAD: tl.constexpr,
):
    # L1's write for one latent "head": one program per token, int64 before any multiply.
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    c_cols = tl.arange(0, R_PAD)
    pe_cols = tl.arange(0, P_PAD)
    # A padding token (slot -1) keeps no column: it reads and writes nothing (L1's scalar where).
    keep_c = c_cols < tl.where(slot >= 0, R, 0)
    keep_pe = pe_cols < tl.where(slot >= 0, P, 0)
    c = tl.load(kv_c_ptr + token * c_stride + c_cols, mask=keep_c)
    pe = tl.load(k_pe_ptr + token * pe_stride + pe_cols, mask=keep_pe)
    row = kv_cache_ptr + slot * (R + P)  # the row is c, then k_pe
    tl.store(row + c_cols, c, mask=keep_c)
    tl.store(row + R + pe_cols, pe, mask=keep_pe)


@triton.jit
def mla_decode_kernel(
    out_ptr, lse_ptr, parts_ptr, part_lse_ptr,
    q_nope_ptr, q_pe_ptr, kv_cache_ptr, block_table_ptr, seq_lens_ptr,
    qk_scale,                  # scale * log2(e): scores in base 2, so exp2 does the softmax
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
    # Head tiles vary fastest, so the programs that share a (sequence, split) run side
    # by side and the second one finds the latent tiles in L2.
    head_tile = tl.program_id(0)
    seq = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)

    # L4's chunk of this split: whole tiles, from this sequence's own length; empty past its end.
    chunk = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), TILE) * TILE
    start = split * chunk
    end = tl.minimum(start + chunk, seq_len)

    # A tile of query heads, all against the same latent rows: every head of MLA
    # reads the one latent "KV head", so the scores are a real matrix product.
    heads = head_tile * BLOCK_H + tl.arange(0, BLOCK_H)
    c_cols = tl.arange(0, R_PAD)
    pe_cols = tl.arange(0, P_PAD)
    head_ok = heads < NUM_HEADS  # the last tile's spare rows (H % BLOCK_H != 0): read as 0, never stored
    c_mask = head_ok[:, None] & (c_cols < R)[None, :]
    q_nope = tl.load(q_nope_ptr + seq * qn_stride_b + heads[:, None] * qn_stride_h + c_cols[None, :],
                     mask=c_mask, other=0.0)
    q_pe = tl.load(q_pe_ptr + seq * qp_stride_b + heads[:, None] * qp_stride_h + pe_cols[None, :],
                   mask=head_ok[:, None] & (pe_cols < P)[None, :], other=0.0)
    if UPCAST:
        q_nope = q_nope.to(tl.float32)
        q_pe = q_pe.to(tl.float32)

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)  # running max of the scores (base 2)
    l = tl.zeros([BLOCK_H], tl.float32)                # running sum of exp2(score - m)
    acc = tl.zeros([BLOCK_H, R_PAD], tl.float32)       # running sum of exp2(score - m) * c

    for tile_start in range(start, end, TILE):
        pos = tile_start + tl.arange(0, TILE)
        live = pos < end
        # int64: the block's start + the row in it (as one product, Triton 3.6 misaligns loads when R + P is odd)
        block = tl.load(block_table_ptr + seq * table_stride + pos // BLOCK_SIZE, mask=live, other=0)
        row = block.to(tl.int64) * (BLOCK_SIZE * (R + P)) + pos % BLOCK_SIZE * (R + P)
        # The latent tile, loaded once: its first R columns are the key's c AND the value.
        c = tl.load(kv_cache_ptr + row[:, None] + c_cols[None, :],
                    mask=live[:, None] & (c_cols < R)[None, :], other=0.0)
        k_pe = tl.load(kv_cache_ptr + row[:, None] + R + pe_cols[None, :],
                       mask=live[:, None] & (pe_cols < P)[None, :], other=0.0)
        if UPCAST:
            c = c.to(tl.float32)
            k_pe = k_pe.to(tl.float32)
        # score = q_nope · c + q_pe · k_pe: two matrix products into one accumulator.
        s = tl.dot(q_nope, tl.trans(c), input_precision="ieee")
        s = tl.dot(q_pe, tl.trans(k_pe), acc=s, input_precision="ieee")
        s = tl.where(live[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c, input_precision="ieee")  # value = c, reused
        m = m_new

    # The chunk's output and log-sum-exp, fp32. An empty chunk (or sequence) has
    # acc = 0 and l = 0: it stores 0 (not 0/0 = NaN) and lse = -inf.
    part = acc / tl.where(l > 0, l, 1.0)[:, None]
    lse = (m + tl.log2(l)) * LN2  # base 2 -> natural log
    if DIRECT:  # one split: this chunk is the whole sequence
        tl.store(out_ptr + seq * out_stride + heads[:, None] * R + c_cols[None, :],
                 part.to(out_ptr.dtype.element_ty), mask=c_mask)
        tl.store(lse_ptr + seq * NUM_HEADS + heads, lse, mask=head_ok)
    else:
        first = (seq * NUM_HEADS + heads) * NUM_SPLITS + split  # parts [B, H, NUM_SPLITS, R]
        tl.store(parts_ptr + first[:, None] * R + c_cols[None, :], part, mask=c_mask)
        tl.store(part_lse_ptr + first, lse, mask=head_ok)


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
    # L4's merge for a tile of heads of one sequence: weights exp(lse - max), in fp32.
    head_tile = tl.program_id(0)
    seq = tl.program_id(1).to(tl.int64)
    heads = head_tile * BLOCK_H + tl.arange(0, BLOCK_H)
    splits = tl.arange(0, SPLITS_PAD)
    cols = tl.arange(0, R_PAD)
    live = heads < NUM_HEADS
    first = (seq * NUM_HEADS + heads) * NUM_SPLITS  # part_lse [B, H, NUM_SPLITS]
    s = tl.load(part_lse_ptr + first[:, None] + splits[None, :],
                mask=live[:, None] & (splits < NUM_SPLITS)[None, :], other=float("-inf"))
    s_max = tl.max(s, axis=1)
    s_max = tl.where(s_max == float("-inf"), 0.0, s_max)  # every chunk empty: not -inf - (-inf)
    total = tl.sum(tl.exp(s - s_max[:, None]), axis=1)     # an empty chunk weighs exp(-inf) = 0
    acc = tl.zeros([BLOCK_H, R_PAD], tl.float32)
    for i in range(NUM_SPLITS):
        w = tl.exp(tl.load(part_lse_ptr + first + i, mask=live, other=float("-inf")) - s_max)
        v = tl.load(parts_ptr + (first + i)[:, None] * R + cols[None, :],
                    mask=live[:, None] & (cols < R)[None, :], other=0.0)
        acc += tl.where(w[:, None] > 0, w[:, None] * v, 0.0)  # an empty chunk's part never reaches the sum
    out = acc / tl.where(total > 0, total, 1.0)[:, None]     # an empty sequence: 0
    tl.store(out_ptr + seq * out_stride + heads[:, None] * R + cols[None, :], out.to(out_ptr.dtype.element_ty),
             mask=live[:, None] & (cols < R)[None, :])
    tl.store(lse_ptr + seq * NUM_HEADS + heads, s_max + tl.log(total), mask=live)  # log(0) = -inf: still empty


def concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping):
    """Write each token's latent row (kv_c [T, R] then k_pe [T, P]) into its slot of
    kv_cache [num_blocks, block_size, R + P]; slot -1 is padding. In place."""
    _check_write_inputs(kv_c, k_pe, kv_cache, slot_mapping)
    num_tokens, rank = kv_c.shape
    rope = k_pe.shape[1]
    if num_tokens == 0:
        return
    concat_and_cache_mla_kernel[(num_tokens,)](
        kv_c, k_pe, kv_cache, slot_mapping, kv_c.stride(0), k_pe.stride(0),
        R=rank, P=rope, R_PAD=triton.next_power_of_2(rank), P_PAD=triton.next_power_of_2(rope),
        num_warps=4,
    )


def default_num_splits(num_seqs, num_heads, device):
    """About the launch's programs per SM ((head tile, sequence, split) programs), at most
    MAX_SPLITS splits; one split when the batch alone fills the GPU (L4's rule)."""
    if device.type != "cuda":
        return CPU_NUM_SPLITS
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    block_h, *_, per_sm = _launch(num_heads, torch.bfloat16, device)  # a 16-bit query's launch
    return max(1, min(MAX_SPLITS, per_sm * sms // max(1, num_seqs * triton.cdiv(num_heads, block_h))))


def _launch(num_heads, dtype, device):
    """(BLOCK_H, TILE, num_warps, num_stages, programs per SM) of the decode kernel."""
    if device.type != "cuda":  # the interpreter: the bigger the tiles, the fewer Python steps
        return min(64, max(16, triton.next_power_of_2(num_heads))), 64, 4, 1, 1
    if dtype == torch.float32:  # 4-byte tiles: smaller, or they spill
        return 16, 16, 4, 2, 2
    return MEMORY_BOUND_LAUNCH if num_heads <= 16 else TENSOR_CORE_LAUNCH


def mla_decode_attention(q_nope, q_pe, kv_cache, block_table, seq_lens, scale, num_splits=None, out=None):
    """MLA decode: every query head attends to its sequence's latent rows with score
    (q_nope · c + q_pe · k_pe) * scale and value c. Returns (out [B, H, R] in the query's
    dtype, written into `out` when given; lse [B, H] float32, natural log)."""
    _check_decode_inputs(q_nope, q_pe, kv_cache, block_table, seq_lens, scale, num_splits, out)
    num_seqs, num_heads, rank = q_nope.shape
    rope = q_pe.shape[2]
    block_size = kv_cache.shape[1]
    device = q_nope.device
    num_splits = default_num_splits(num_seqs, num_heads, device) if num_splits is None else num_splits
    if out is None:
        out = torch.empty((num_seqs, num_heads, rank), dtype=q_nope.dtype, device=device)
    lse = torch.empty((num_seqs, num_heads), dtype=torch.float32, device=device)
    if num_seqs == 0:
        return out, lse
    # fp32 partials, [B, H, num_splits, R] and [B, H, num_splits] (unused when num_splits == 1)
    parts = torch.empty((num_seqs, num_heads, num_splits, rank), dtype=torch.float32, device=device)
    part_lse = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=device)
    block_h, tile, num_warps, num_stages, _ = _launch(num_heads, q_nope.dtype, device)
    r_pad, p_pad = max(16, triton.next_power_of_2(rank)), max(16, triton.next_power_of_2(rope))
    mla_decode_kernel[(triton.cdiv(num_heads, block_h), num_seqs, num_splits)](
        out, lse, parts, part_lse, q_nope, q_pe, kv_cache, block_table, seq_lens,
        float(scale) * LOG2E, q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1),
        out.stride(0), block_table.stride(0), num_heads, num_splits,
        BLOCK_SIZE=block_size, R=rank, P=rope, R_PAD=r_pad, P_PAD=p_pad, BLOCK_H=block_h, TILE=tile,
        UPCAST=_INTERPRET and q_nope.dtype == torch.bfloat16, DIRECT=num_splits == 1,
        num_warps=num_warps, num_stages=num_stages,
    )
    if num_splits > 1:
        merge_h = block_h if device.type != "cuda" else MERGE_BLOCK_H
        mla_merge_kernel[(triton.cdiv(num_heads, merge_h), num_seqs)](
            out, lse, parts, part_lse, out.stride(0), num_heads,
            NUM_SPLITS=num_splits, SPLITS_PAD=triton.next_power_of_2(num_splits), R=rank,
            R_PAD=triton.next_power_of_2(rank), BLOCK_H=merge_h, num_warps=4,
        )
    return out, lse


def _check_write_inputs(kv_c, k_pe, kv_cache, slot_mapping):
    # L1's rules for one latent row per token: refuse every input the kernel would misread.
    if kv_c.dim() != 2 or k_pe.dim() != 2 or kv_c.shape[0] != k_pe.shape[0]:
        raise ValueError(f"kv_c must be [T, R] and k_pe [T, P] with the same T; got {tuple(kv_c.shape)} and "
                         f"{tuple(k_pe.shape)}")
    if kv_cache.dim() != 3 or kv_cache.shape[2] != kv_c.shape[1] + k_pe.shape[1]:
        raise ValueError(f"kv_cache must be [num_blocks, block_size, R + P] = [..., {kv_c.shape[1]} + "
                         f"{k_pe.shape[1]}]; got {tuple(kv_cache.shape)}")
    if slot_mapping.shape != kv_c.shape[:1]:
        raise ValueError(f"slot_mapping must have one entry per token: shape {tuple(slot_mapping.shape)}, "
                         f"kv_c has {kv_c.shape[0]} tokens")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be int32 or int64, got {slot_mapping.dtype}")
    if len({kv_c.dtype, k_pe.dtype, kv_cache.dtype}) != 1 or kv_c.dtype not in _FLOATS:
        raise ValueError(f"kv_c, k_pe and kv_cache must share one dtype of float16, bfloat16 or float32; got "
                         f"{kv_c.dtype}, {k_pe.dtype}, {kv_cache.dtype}")
    _check_device_and_cache((kv_c, k_pe, kv_cache, slot_mapping), kv_cache)
    for name, t in (("kv_c", kv_c), ("k_pe", k_pe)):
        if t.shape[0] > 0 and t.stride(1) != 1:
            raise ValueError(f"each token's row of {name} must be contiguous (got strides {t.stride()}); a row-"
                             f"strided view such as kv[:, :R] is fine, a transposed one is not")
    if slot_mapping.device.type == "cpu" and slot_mapping.numel() > 0:
        # Free on the CPU; on a GPU it would cost a device-to-host sync every step (as in L1).
        num_slots = kv_cache.shape[0] * kv_cache.shape[1]
        lo, hi = int(slot_mapping.min()), int(slot_mapping.max())
        if lo < -1 or hi >= num_slots:
            raise ValueError(f"slot_mapping holds slots in [{lo}, {hi}], but the cache has slots 0..{num_slots - 1} "
                             f"(and -1 marks padding)")


_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def _check_device_and_cache(tensors, kv_cache):
    # Both functions: one device for everything, and the cache the kernels address as slot * (R + P).
    if len({t.device for t in tensors}) != 1:
        raise ValueError(f"all tensors must be on one device; got {[str(t.device) for t in tensors]}")
    if not kv_cache.is_contiguous():
        raise ValueError(f"kv_cache must be contiguous (got strides {kv_cache.stride()}); pass kv_cache.contiguous() "
                         f"or allocate it with torch.empty(...)")


def _check_decode_inputs(q_nope, q_pe, kv_cache, block_table, seq_lens, scale, num_splits, out):
    # L4's checks, for a latent cache [num_blocks, block_size, R + P] read by every head.
    if scale is None or isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) \
            or scale <= 0:
        raise ValueError(f"scale must be a positive number: the model's softmax scale (for DeepSeek "
                         f"qk_head_dim ** -0.5 times its YaRN factor), not 1/sqrt(R + P); got {scale!r}")
    if num_splits is not None and (not isinstance(num_splits, int) or isinstance(num_splits, bool)
                                   or num_splits < 1):
        raise ValueError(f"num_splits must be a whole number >= 1 (or None to pick one); got {num_splits!r}")
    if q_nope.dim() != 3 or q_pe.dim() != 3 or q_nope.shape[:2] != q_pe.shape[:2]:
        raise ValueError(f"q_nope must be [B, H, R] and q_pe [B, H, P] with the same B and H; got "
                         f"{tuple(q_nope.shape)} and {tuple(q_pe.shape)}")
    num_seqs, num_heads, rank = q_nope.shape
    if num_heads < 1:
        raise ValueError(f"q_nope needs at least one head; got shape {tuple(q_nope.shape)}")
    if kv_cache.dim() != 3 or kv_cache.shape[2] != rank + q_pe.shape[2]:
        raise ValueError(f"kv_cache must be [num_blocks, block_size, R + P] = [..., {rank} + {q_pe.shape[2]}]; "
                         f"got {tuple(kv_cache.shape)}")
    if block_table.dim() != 2 or block_table.shape[0] != num_seqs:
        raise ValueError(f"block_table must be [B, max_blocks] with B = {num_seqs}; got {tuple(block_table.shape)}")
    if seq_lens.shape != (num_seqs,):
        raise ValueError(f"seq_lens must be [B] with B = {num_seqs}; got {tuple(seq_lens.shape)}")
    for name, t in (("block_table", block_table), ("seq_lens", seq_lens)):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
    if q_nope.dtype not in _FLOATS or len({q_nope.dtype, q_pe.dtype, kv_cache.dtype}) != 1:
        raise ValueError(f"q_nope, q_pe and kv_cache must share one dtype of float16, bfloat16 or float32; got "
                         f"{q_nope.dtype}, {q_pe.dtype}, {kv_cache.dtype}")
    if out is not None and (out.shape != q_nope.shape or out.dtype != q_nope.dtype or out.device != q_nope.device):
        raise ValueError(f"out must have q_nope's shape, dtype and device {tuple(q_nope.shape)}, {q_nope.dtype}, "
                         f"{q_nope.device}; got {tuple(out.shape)}, {out.dtype}, {out.device}")
    if out is not None and num_seqs > 0 and not out[0].is_contiguous():
        raise ValueError(f"each sequence's row of out must be H*R contiguous values (got strides {out.stride()})")
    _check_device_and_cache((q_nope, q_pe, kv_cache, block_table, seq_lens), kv_cache)
    for name, q in (("q_nope", q_nope), ("q_pe", q_pe)):
        if q.stride(2) != 1:
            raise ValueError(f"each head's row of {name} must be contiguous (got strides {q.stride()}); a view such "
                             f"as q[..., :R] or a transposed [H, B, R] product is fine, a transposed last axis is not")
    if block_table.stride(1) != 1:
        raise ValueError(f"each block_table row must be contiguous (got strides {block_table.stride()}); "
                         f"pass block_table.contiguous()")
    if seq_lens.device.type == "cpu" and num_seqs > 0:
        # Free on the CPU; on a GPU these value checks would cost a device-to-host sync
        # every step, so there (as in vLLM) the kernel trusts the scheduler's tensors.
        num_blocks, block_size = kv_cache.shape[:2]
        lo, hi = int(seq_lens.min()), int(seq_lens.max())
        capacity = block_table.shape[1] * block_size
        if lo < 0 or hi > capacity:
            raise ValueError(f"seq_lens holds lengths in [{lo}, {hi}], but each must be in [0, max_blocks * "
                             f"block_size] = [0, {block_table.shape[1]} * {block_size}]; widen block_table or fix "
                             f"seq_lens")
        owned = torch.arange(block_table.shape[1]) < (seq_lens[:, None] + block_size - 1) // block_size
        used = block_table[owned]
        if used.numel() and (int(used.min()) < 0 or int(used.max()) >= num_blocks):
            raise ValueError(f"block_table names blocks in [{int(used.min())}, {int(used.max())}] for live tokens, "
                             f"but the cache has blocks 0..{num_blocks - 1}")
