"""L4 reference: split-KV ("flash decoding") decode attention over a paged KV cache.

Mirrors vLLM's paged attention v2 and the 3-D path of its unified attention
(phase 1), and FlashInfer's merge_state (phase 2). Read it next to
content/l4.md, which explains it top to bottom and cites the line ranges below.
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
CPU_NUM_SPLITS = 4   # num_splits=None on the CPU: small, but enough to exercise the merge
PROGRAMS_PER_SM = 4  # num_splits=None on a GPU aims at this many phase-1 programs per SM ...
MAX_SPLITS = 32      # ... with at most this many splits
NUM_WARPS, NUM_STAGES = 4, 3  # phase 1's launch; measured on an H200 (BENCHMARKS.md)


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
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    parts = tl.arange(0, PARTS_PAD)
    dims = tl.arange(0, D_PAD)
    # parts is [rows, H, NUM_PARTS, D] and lse [rows, H, NUM_PARTS], contiguous fp32.
    first = (row * NUM_HEADS + head) * NUM_PARTS
    s = tl.load(lse_ptr + first + parts, mask=parts < NUM_PARTS, other=float("-inf"))
    s_max = tl.max(s, axis=0)
    # Every part empty: -inf - (-inf) would be NaN, so shift by 0 instead.
    s_max = tl.where(s_max == float("-inf"), 0.0, s_max)
    w = tl.exp(s - s_max)  # natural log; 0 for an empty part, at most 1
    v_mask = (parts < NUM_PARTS)[:, None] & (dims < HEAD_SIZE)[None, :]
    v = tl.load(parts_ptr + (first + parts)[:, None] * HEAD_SIZE + dims[None, :], mask=v_mask, other=0.0)
    # An empty part's v may be garbage, NaN included, and 0 * NaN = NaN.
    v = tl.where(w[:, None] > 0, v, 0.0)
    total = tl.sum(w, axis=0)
    out = tl.sum(w[:, None] * v, axis=0) / tl.where(total > 0, total, 1.0)  # all empty: v = 0
    tl.store(out_ptr + row * out_stride + head * HEAD_SIZE + dims, out.to(out_ptr.dtype.element_ty),
             mask=dims < HEAD_SIZE)
    tl.store(out_lse_ptr + row * NUM_HEADS + head, s_max + tl.log(total))  # log(0) = -inf: still empty


def merge_attention_states(v_a, s_a, v_b, s_b):
    """Merge two partial attention results over disjoint sets of keys: v_* [n, H, D]
    (any float dtype), s_* [n, H] float32 log-sum-exps in natural log (s = -inf: an
    empty set). Returns (v in v_a's dtype, s float32), computed in fp32."""
    _check_merge_inputs(v_a, s_a, v_b, s_b)
    rows, num_heads, head_size = v_a.shape
    v = torch.empty(v_a.shape, dtype=v_a.dtype, device=v_a.device)
    s = torch.empty(s_a.shape, dtype=torch.float32, device=s_a.device)
    if v.numel() == 0:
        s.fill_(float("-inf"))
        return v, s
    # Phase 2 of the decode below, with two parts: v_a and v_b side by side, in fp32.
    parts = torch.stack((v_a.float(), v_b.float()), dim=2)  # [n, H, 2, D]
    lse = torch.stack((s_a, s_b), dim=2).contiguous()        # [n, H, 2]
    merge_states_kernel[(rows, num_heads)](
        v, s, parts, lse, v.stride(0), num_heads,
        NUM_PARTS=2, PARTS_PAD=2, HEAD_SIZE=head_size, D_PAD=triton.next_power_of_2(head_size),
    )
    return v, s


@triton.jit
def split_kv_kernel(
    out_ptr, parts_ptr, lse_ptr, query_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, seq_lens_ptr,
    qk_scale,                  # scale * log2(e): scores in base 2, so exp2 does the softmax
    query_stride,              # elements from one sequence's query row to the next
    out_stride,                # the same for out
    table_stride,              # elements from one block-table row to the next
    NUM_HEADS, NUM_KV_HEADS, NUM_SPLITS,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    HEAD_SIZE: tl.constexpr,   # D
    GROUP: tl.constexpr,       # query heads per KV head: NUM_HEADS // NUM_KV_HEADS
    GROUP_PAD: tl.constexpr,   # GROUP rounded up to a power of two >= 16 (tl.dot's minimum)
    D_PAD: tl.constexpr,       # D rounded up to a power of two >= 16
    TILE: tl.constexpr,        # tokens per iteration: several blocks at once
    UPCAST: tl.constexpr,      # interpreter + bfloat16: see _INTERPRET above
    DIRECT: tl.constexpr,      # NUM_SPLITS == 1: write the answer to out, no phase 2
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + seq)

    # This program's chunk: tokens [start, end) of the sequence. Chunks are whole
    # tiles long, and sized from this sequence's own length, so the splits share
    # its tokens evenly; a chunk that starts past seq_len is empty (short sequences).
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

    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)  # running max of the scores (base 2)
    l = tl.zeros([GROUP_PAD], tl.float32)                # running sum of exp2(score - m)
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)       # running sum of exp2(score - m) * v

    # L2's loop, over this chunk only.
    for tile_start in range(start, end, TILE):
        pos = tile_start + tl.arange(0, TILE)
        live = pos < end
        block = tl.load(block_table_ptr + seq * table_stride + pos // BLOCK_SIZE, mask=live, other=0)
        slot = block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
        kv_offs = (slot * NUM_KV_HEADS + kv_head)[:, None] * HEAD_SIZE + dims[None, :]
        kv_mask = live[:, None] & (dims < HEAD_SIZE)[None, :]
        k = tl.load(k_cache_ptr + kv_offs, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_offs, mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
        s = tl.where(live[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m = m_new

    # The chunk's own attention output and its log-sum-exp, both fp32. An empty
    # chunk has acc = 0 and l = 0: it stores v = 0 (not 0/0 = NaN) and lse = -inf.
    part = acc / tl.where(l > 0, l, 1.0)[:, None]
    lse = (m + tl.log2(l)) * 0.6931471805599453  # base 2 -> natural log: times ln 2
    if DIRECT:  # the one chunk is the whole sequence: its output is the answer
        out_offs = seq * out_stride + heads[:, None] * HEAD_SIZE + dims[None, :]
        tl.store(out_ptr + out_offs, part.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        first = (seq * NUM_HEADS + heads) * NUM_SPLITS + split  # [B, H_q, NUM_SPLITS, ...]
        tl.store(parts_ptr + first[:, None] * HEAD_SIZE + dims[None, :], part, mask=q_mask)
        tl.store(lse_ptr + first, lse, mask=rows < GROUP)


def default_num_splits(num_seqs, num_kv_heads, device):
    """About PROGRAMS_PER_SM (sequence, KV head, split) programs per SM, at most
    MAX_SPLITS splits; one split when the batch alone fills the GPU (content/l4.md §5)."""
    if device.type != "cuda":
        return CPU_NUM_SPLITS
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(MAX_SPLITS, PROGRAMS_PER_SM * sms // max(1, num_seqs * num_kv_heads)))


def paged_decode_attention_split(query, k_cache, v_cache, block_table, seq_lens, scale=None, num_splits=None,
                                 out=None):
    """L2's paged decode attention, split over the context: returns [B, H_q, D]
    (written into `out` when given). Phase 1 attends each of num_splits chunks of
    every sequence separately; phase 2 merges the chunks by their log-sum-exps."""
    _check_inputs(query, k_cache, v_cache, block_table, seq_lens, num_splits, out)
    num_seqs, num_heads, head_size = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    scale = 1.0 / math.sqrt(head_size) if scale is None else float(scale)
    num_splits = default_num_splits(num_seqs, num_kv_heads, query.device) if num_splits is None else num_splits
    if out is None:
        out = torch.empty((num_seqs, num_heads, head_size), dtype=query.dtype, device=query.device)
    if num_seqs == 0:
        return out
    # fp32 partials, [B, H_q, num_splits, D] and [B, H_q, num_splits] (unused when num_splits == 1)
    parts = torch.empty((num_seqs, num_heads, num_splits, head_size), dtype=torch.float32, device=query.device)
    lse = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=query.device)
    d_pad = max(16, triton.next_power_of_2(head_size))
    split_kv_kernel[(num_seqs, num_kv_heads, num_splits)](
        out, parts, lse, query, k_cache, v_cache, block_table, seq_lens,
        scale * 1.4426950408889634, query.stride(0), out.stride(0), block_table.stride(0),
        num_heads, num_kv_heads, num_splits,
        BLOCK_SIZE=block_size, HEAD_SIZE=head_size, GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)), D_PAD=d_pad,
        TILE=64 if d_pad <= 128 else 32,  # keeps a K or V tile at 16 KiB in 16-bit
        UPCAST=_INTERPRET and query.dtype == torch.bfloat16,
        DIRECT=num_splits == 1,
        num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )
    if num_splits == 1:
        return out
    merged_lse = torch.empty((num_seqs, num_heads), dtype=torch.float32, device=query.device)
    merge_states_kernel[(num_seqs, num_heads)](
        out, merged_lse, parts, lse, out.stride(0), num_heads,
        NUM_PARTS=num_splits, PARTS_PAD=triton.next_power_of_2(num_splits), HEAD_SIZE=head_size,
        D_PAD=triton.next_power_of_2(head_size),
    )
    return out


def _check_merge_inputs(v_a, s_a, v_b, s_b):
    if v_a.dim() != 3 or v_a.shape != v_b.shape:
        raise ValueError(f"v_a and v_b must both be [n, H, D]; got {tuple(v_a.shape)} and {tuple(v_b.shape)}")
    if s_a.shape != v_a.shape[:2] or s_b.shape != v_a.shape[:2]:
        raise ValueError(f"s_a and s_b must be [n, H] = {tuple(v_a.shape[:2])}; got {tuple(s_a.shape)} and "
                         f"{tuple(s_b.shape)}")
    if not (v_a.dtype.is_floating_point and v_b.dtype.is_floating_point):
        raise ValueError(f"v_a and v_b must be floating point; got {v_a.dtype} and {v_b.dtype}")
    if s_a.dtype != torch.float32 or s_b.dtype != torch.float32:
        raise ValueError(f"s_a and s_b must be float32 log-sum-exps (16 bits cannot hold them precisely enough); "
                         f"got {s_a.dtype} and {s_b.dtype}")
    if len({t.device for t in (v_a, s_a, v_b, s_b)}) != 1:
        raise ValueError(f"all tensors must be on one device; got {[str(t.device) for t in (v_a, s_a, v_b, s_b)]}")


def _check_inputs(query, k_cache, v_cache, block_table, seq_lens, num_splits, out):
    # L2's checks (the kernel reads the query, the cache and the block table the
    # same way), plus num_splits; repeated here because trees import nothing.
    if num_splits is not None and (not isinstance(num_splits, int) or isinstance(num_splits, bool)
                                   or num_splits < 1):
        raise ValueError(f"num_splits must be a whole number >= 1 (or None to pick one); got {num_splits!r}")
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
