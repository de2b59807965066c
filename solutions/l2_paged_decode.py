"""L2 reference: decode attention over a paged KV cache.

Mirrors vLLM's paged attention v1 and its Triton decode kernel. Read it next to
content/l2.md, which explains it top to bottom and cites the line ranges below.
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
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + seq)

    # This program's query heads: the GROUP heads that share KV head kv_head.
    # Rows GROUP..GROUP_PAD-1 only pad the tile for tl.dot; they are masked.
    rows = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, D_PAD)
    heads = kv_head * GROUP + rows
    q_mask = (rows < GROUP)[:, None] & (dims < HEAD_SIZE)[None, :]
    q = tl.load(query_ptr + seq * query_stride + heads[:, None] * HEAD_SIZE + dims[None, :],
                mask=q_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)  # running max of the scores
    l = tl.zeros([GROUP_PAD], tl.float32)                # running sum of exp(score - m)
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)       # running sum of exp(score - m) * v

    for start in range(0, seq_len, TILE):
        pos = start + tl.arange(0, TILE)  # logical positions inside the sequence
        live = pos < seq_len
        # The block table is read only for live tokens: its entries past
        # ceil(seq_len / BLOCK_SIZE) are garbage.
        block = tl.load(block_table_ptr + seq * table_stride + pos // BLOCK_SIZE, mask=live, other=0)
        slot = block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE  # L1's slot, in int64
        kv_offs = (slot * NUM_KV_HEADS + kv_head)[:, None] * HEAD_SIZE + dims[None, :]
        kv_mask = live[:, None] & (dims < HEAD_SIZE)[None, :]
        # Masked loads: the tail of the last block may hold anything, NaN included,
        # and 0 * NaN is NaN, so masking the scores alone would not be enough.
        k = tl.load(k_cache_ptr + kv_offs, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_offs, mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)

        # Scores of every query head of the group against TILE tokens at once.
        # "ieee": fp32 inputs get fp32 products (the default would be TF32).
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        s = tl.where(live[None, :], s, float("-inf"))

        # Online softmax: move to the new max and rescale what was summed so far.
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)  # 0 on the first tile (m = -inf), 1 if the max did not grow
        p = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m = m_new

    out = acc / l[:, None]
    out_offs = seq * out_stride + heads[:, None] * HEAD_SIZE + dims[None, :]
    tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=q_mask)


def paged_decode_attention(query, k_cache, v_cache, block_table, seq_lens, scale=None, out=None):
    """Attention of one new token per sequence over its paged K/V; returns [B, H_q, D]
    (written into `out` when given, as vLLM lets the caller own the output)."""
    _check_inputs(query, k_cache, v_cache, block_table, seq_lens, out)
    num_seqs, num_heads, head_size = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    scale = 1.0 / math.sqrt(head_size) if scale is None else float(scale)
    if out is None:
        out = torch.empty((num_seqs, num_heads, head_size), dtype=query.dtype, device=query.device)
    if num_seqs == 0:
        return out
    d_pad = max(16, triton.next_power_of_2(head_size))
    paged_decode_kernel[(num_seqs, num_kv_heads)](
        out, query, k_cache, v_cache, block_table, seq_lens,
        scale, query.stride(0), out.stride(0), block_table.stride(0), num_heads, num_kv_heads,
        BLOCK_SIZE=block_size, HEAD_SIZE=head_size, GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)), D_PAD=d_pad,
        TILE=64 if d_pad <= 128 else 32,  # keeps a K or V tile at 16 KiB in 16-bit
        UPCAST=_INTERPRET and query.dtype == torch.bfloat16,
        num_warps=4,
    )
    return out


def _check_inputs(query, k_cache, v_cache, block_table, seq_lens, out):
    # The kernel reads sequence b's query at b * query_stride, a cache token at
    # slot * H_kv * D, and trusts the block table for every live token; refuse
    # every input for which that is not true.
    if query.dim() != 3:
        raise ValueError(f"query must be [B, H_q, D] (one new token per sequence); got shape {tuple(query.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must both be [num_blocks, block_size, H_kv, D]; "
                         f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
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
    if len({query.dtype, k_cache.dtype, v_cache.dtype}) != 1:
        raise ValueError(f"query, k_cache, v_cache must share one dtype; got "
                         f"{query.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if out is not None and (out.shape != query.shape or out.dtype != query.dtype or out.device != query.device):
        raise ValueError(f"out must have the query's shape, dtype and device {tuple(query.shape)}, {query.dtype}, "
                         f"{query.device}; got {tuple(out.shape)}, {out.dtype}, {out.device}")
    if out is not None and num_seqs > 0 and not out[0].is_contiguous():
        raise ValueError(f"each sequence's row of out must be H_q*D contiguous values (got strides {out.stride()})")
    tensors = (query, k_cache, v_cache, block_table, seq_lens)
    if len({t.device for t in tensors}) != 1:
        raise ValueError(f"all tensors must be on one device; got {[str(t.device) for t in tensors]}")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not cache.is_contiguous():
            raise ValueError(f"{name} must be contiguous (got strides {cache.stride()}); "
                             f"pass {name}.contiguous() or allocate it with torch.empty(...)")
    if num_seqs > 0 and not query[0].is_contiguous():
        raise ValueError(f"each sequence's query must be H_q*D contiguous values (got strides {query.stride()}); "
                         f"a row-strided view such as qkv[:, :H_q*D].view(B, H_q, D) is fine, a permuted one is not")
    if block_table.stride(1) != 1:
        raise ValueError(f"each block_table row must be contiguous (got strides {block_table.stride()}); "
                         f"pass block_table.contiguous()")
    if seq_lens.device.type == "cpu" and num_seqs > 0:
        # On the CPU these value checks are free. On a GPU they would cost a
        # device-to-host sync every step, so there (as in vLLM) the kernel
        # trusts the scheduler's seq_lens and block table.
        num_blocks, block_size = k_cache.shape[:2]
        lo, hi = int(seq_lens.min()), int(seq_lens.max())
        capacity = block_table.shape[1] * block_size
        if lo < 1 or hi > capacity:
            raise ValueError(f"seq_lens holds lengths in [{lo}, {hi}], but each must be at least 1 (the new token) "
                             f"and at most max_blocks * block_size = {block_table.shape[1]} * {block_size} = "
                             f"{capacity}; widen block_table or fix seq_lens")
        owned = torch.arange(block_table.shape[1]) < (seq_lens[:, None] + block_size - 1) // block_size
        used = block_table[owned]
        if int(used.min()) < 0 or int(used.max()) >= num_blocks:
            raise ValueError(f"block_table names blocks in [{int(used.min())}, {int(used.max())}] for live tokens, "
                             f"but the cache has blocks 0..{num_blocks - 1}")
