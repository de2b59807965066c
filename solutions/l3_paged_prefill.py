"""L3 reference: chunked-prefill attention over a paged KV cache.

One kernel for every row a serving step brings: pure prefill (no prefix),
a chunk over a cached prefix, and decode rows (q_len = 1), mixed in one batch.
Mirrors the 2-D path of vLLM's Triton unified attention. Read it next to
content/l3.md, which explains it top to bottom and cites the line ranges below.
"""
import math
import os

import torch
import triton
import triton.language as tl

# Triton's CPU interpreter computes tl.dot on bfloat16 wrongly (it multiplies the
# raw bits; triton-lang/triton#11584), so there the kernel widens q, K and V to
# fp32 first. On a GPU they stay 16-bit and go through the tensor cores.
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
LOG2E = 1.4426950408889634  # log2(e): exp(x) = exp2(x * LOG2E)


@triton.jit
def _find_seq(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence that query block `q_block` belongs to. Sequence b's blocks are
    numbered from query_start_loc[b] // BLOCK_Q + b on (the wrapper's grid), so
    binary-search for the last b whose first block is <= q_block."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def paged_prefill_kernel(
    out_ptr, query_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, query_start_loc_ptr, seq_lens_ptr,
    scale_log2,                # scale * log2(e): scores in base 2, so exp2 is exact softmax
    num_seqs,
    short_q_len,               # chunks of at most this many queries belong to the other launch (0: none)
    query_stride, out_stride,  # elements from one token's [H_q, D] row to the next
    table_stride,              # elements from one block-table row to the next
    NUM_KV_HEADS,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    HEAD_SIZE: tl.constexpr,   # D
    D_PAD: tl.constexpr,       # D rounded up to a power of two >= 16
    GROUP: tl.constexpr,       # query heads per KV head
    BLOCK_Q: tl.constexpr,     # query positions per program
    BLOCK_M: tl.constexpr,     # tile rows: BLOCK_Q * GROUP rounded up to a power of two
    TILE: tl.constexpr,        # keys per iteration
    UPCAST: tl.constexpr,      # interpreter + bfloat16: see _INTERPRET above
    SHORT: tl.constexpr,       # the launch for short chunks (decode rows): one program per sequence
):
    kv_head = tl.program_id(0).to(tl.int64)
    if SHORT:
        # Program b takes sequence b's chunk whole, if it fits in one block of BLOCK_Q.
        seq = tl.program_id(1)
        q_start = tl.load(query_start_loc_ptr + seq)
        q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
        first = 0
        if (q_len == 0) | (q_len > BLOCK_Q):
            return  # nothing to do, or a long chunk: the other launch's
    else:
        # Which query block, which sequence. Blocks are taken last first: under the
        # causal mask a chunk's last block sees the most keys, so starting the long
        # programs first leaves short ones to fill the tail.
        q_block = tl.num_programs(1) - 1 - tl.program_id(1)
        seq = _find_seq(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q)
        q_start = tl.load(query_start_loc_ptr + seq)
        q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
        first = (q_block - q_start // BLOCK_Q - seq) * BLOCK_Q  # this block's first query, counted in its chunk
        if (first >= q_len) | (q_len <= short_q_len):
            return  # a spare program of the upper-bound grid, or a short chunk: the other launch's
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len  # tokens cached before this chunk: query i sits at context_len + i

    # Row r of the tile is query first + r // GROUP with query head kv_head * GROUP + r % GROUP:
    # the GROUP heads that share this KV head read each K/V tile once, together.
    rows = tl.arange(0, BLOCK_M)
    i = first + rows // GROUP
    heads = kv_head * GROUP + rows % GROUP
    row_live = (rows < BLOCK_Q * GROUP) & (i < q_len)
    pos = context_len + i  # bottom-right causal: query i sees keys 0..pos
    dims = tl.arange(0, D_PAD)
    dim_live = dims < HEAD_SIZE
    token = (q_start + i).to(tl.int64)
    q = tl.load(query_ptr + token[:, None] * query_stride + heads[:, None] * HEAD_SIZE + dims[None, :],
                mask=row_live[:, None] & dim_live[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max of the scores (base 2)
    l = tl.zeros([BLOCK_M], tl.float32)                # running sum of exp2(score - m)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)       # running sum of exp2(score - m) * v

    # Every row of the block sees keys 0..context_len + first; past that, each row
    # stops at its own position. Tiles wholly inside the first range need no mask.
    # The rest, the diagonal, goes first, under the causal mask; it ends at the
    # block's last live position + 1, so no key past seq_len is ever looked up.
    end = tl.minimum(context_len + first + BLOCK_Q, seq_len)
    num_full = (context_len + first + 1) // TILE
    for start in range(num_full * TILE, end, TILE):
        key = start + tl.arange(0, TILE)
        k, v = _load_kv(k_cache_ptr, v_cache_ptr, block_table_ptr, seq, table_stride, key, key < end,
                        kv_head, NUM_KV_HEADS, dims, dim_live, BLOCK_SIZE, HEAD_SIZE, UPCAST)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale_log2
        s = tl.where(key[None, :] <= pos[:, None], s, float("-inf"))
        m, l, acc = _softmax_step(s, v, m, l, acc)
    for start in range(0, num_full * TILE, TILE):
        key = start + tl.arange(0, TILE)
        k, v = _load_kv(k_cache_ptr, v_cache_ptr, block_table_ptr, seq, table_stride, key, key < end,
                        kv_head, NUM_KV_HEADS, dims, dim_live, BLOCK_SIZE, HEAD_SIZE, UPCAST)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale_log2
        m, l, acc = _softmax_step(s, v, m, l, acc)

    out = acc / l[:, None]
    out_offs = token[:, None] * out_stride + heads[:, None] * HEAD_SIZE + dims[None, :]
    tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=row_live[:, None] & dim_live[None, :])


@triton.jit
def _load_kv(k_cache_ptr, v_cache_ptr, block_table_ptr, seq, table_stride, key, key_live,
             kv_head, NUM_KV_HEADS, dims, dim_live,
             BLOCK_SIZE: tl.constexpr, HEAD_SIZE: tl.constexpr, UPCAST: tl.constexpr):
    """K and V [TILE, D_PAD] of keys `key` of sequence `seq`, gathered through its
    block-table row; masked keys read nothing (not even their block-table entry)."""
    block = tl.load(block_table_ptr + seq.to(tl.int64) * table_stride + key // BLOCK_SIZE, mask=key_live, other=0)
    slot = block.to(tl.int64) * BLOCK_SIZE + key % BLOCK_SIZE  # L1's slot, in int64
    offs = (slot * NUM_KV_HEADS + kv_head)[:, None] * HEAD_SIZE + dims[None, :]
    mask = key_live[:, None] & dim_live[None, :]
    k = tl.load(k_cache_ptr + offs, mask=mask, other=0.0)
    v = tl.load(v_cache_ptr + offs, mask=mask, other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v


@triton.jit
def _softmax_step(s, v, m, l, acc):
    """One online-softmax update (L2's) in base 2, safe for rows that see no key yet."""
    m_new = tl.maximum(m, tl.max(s, axis=1))
    # A row whose keys are all masked so far has m_new = -inf, and exp2(-inf - -inf)
    # is NaN; measure from 0 instead, so its p and alpha come out 0, not NaN.
    base = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - base)
    p = tl.exp2(s - base[:, None])
    l = l * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return m_new, l, acc


def paged_prefill_attention(query, k_cache, v_cache, block_table, query_start_loc, seq_lens, scale=None,
                            out=None):
    """Causal attention of every query chunk over its sequence's paged K/V; returns
    [total_q, H_q, D] (written into `out` when given, as vLLM lets the caller own it)."""
    _check_inputs(query, k_cache, v_cache, block_table, query_start_loc, seq_lens, out)
    total_q, num_heads, head_size = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    group = num_heads // num_kv_heads
    scale = 1.0 / math.sqrt(head_size) if scale is None else float(scale)
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    if total_q == 0 or num_seqs == 0:
        return out
    # Two launches, one per kind of chunk (content/l3.md §4): short chunks (decode
    # rows) fill one short tile each, long ones are cut into tall tiles. Neither
    # launch reads the chunk lengths on the host (on a GPU that would cost a sync):
    # every program looks at its own chunk and returns if it is the other launch's.
    short, tall = _tile_configs(query, group, head_size)
    short_q = short[0] // group
    for (block_m, tile, num_warps, num_stages), is_short in ((tall, False), (short, True)):
        block_q = block_m // group
        # The short launch: one program per sequence. The tall one: sequence b's query
        # blocks start at query_start_loc[b] // block_q + b, so total_q // block_q +
        # num_seqs programs cover every chunk, whatever its length.
        grid = (num_kv_heads, num_seqs if is_short else total_q // block_q + num_seqs)
        paged_prefill_kernel[grid](
            out, query, k_cache, v_cache, block_table, query_start_loc, seq_lens,
            scale * LOG2E, num_seqs, short_q, query.stride(0), out.stride(0), block_table.stride(0), num_kv_heads,
            BLOCK_SIZE=block_size, HEAD_SIZE=head_size, D_PAD=max(16, triton.next_power_of_2(head_size)),
            GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m, TILE=tile,
            UPCAST=_INTERPRET and query.dtype == torch.bfloat16, SHORT=is_short,
            num_warps=num_warps, num_stages=num_stages,
        )
    return out


def _tile_configs(query, group, head_size):
    """(BLOCK_M, TILE, warps, stages) of the short launch and of the tall one. Any
    choice gives the same answer; these are for speed (BENCHMARKS.md, H200).

    A decode row brings one query, times the group's heads: a tall tile would be
    mostly padding, so short chunks get 16 rows (as in L2 and vLLM). Prefill is
    compute-bound: 128 rows (e.g. 32 positions x 4 heads) share each K/V tile.
    """
    rows = max(16, triton.next_power_of_2(group))
    if query.device.type == "cpu":  # the interpreter: small tiles, few wasted rows
        return (rows, 16, 4, 1), (rows, 16, 4, 1)
    d_pad = max(16, triton.next_power_of_2(head_size))
    return (rows, 64 if d_pad <= 128 else 32, 4, 2), (max(rows, 128), 32, 8, 2)


def _check_inputs(query, k_cache, v_cache, block_table, query_start_loc, seq_lens, out):
    # The kernel reads token t's query at t * query_stride, a cache token at
    # slot * H_kv * D, and trusts query_start_loc, seq_lens and the block table;
    # refuse every input for which that is not true.
    if query.dim() != 3:
        raise ValueError(f"query must be [total_q, H_q, D]; got shape {tuple(query.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must both be [num_blocks, block_size, H_kv, D]; "
                         f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    total_q, num_heads, head_size = query.shape
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_size:
        raise ValueError(f"the cache's head size {k_cache.shape[3]} does not match query's {head_size}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"query has {num_heads} heads, not a multiple of the cache's {num_kv_heads} KV heads; "
                         f"GQA needs H_q = group * H_kv (query head h reads KV head h // group)")
    if seq_lens.dim() != 1:
        raise ValueError(f"seq_lens must be [B]; got shape {tuple(seq_lens.shape)}")
    num_seqs = seq_lens.shape[0]
    if query_start_loc.shape != (num_seqs + 1,):
        raise ValueError(f"query_start_loc must be [B + 1] = [{num_seqs + 1}] (0, then each chunk's end); "
                         f"got shape {tuple(query_start_loc.shape)}")
    if block_table.dim() != 2 or block_table.shape[0] != num_seqs:
        raise ValueError(f"block_table must be [B, max_blocks] with B = {num_seqs}; got {tuple(block_table.shape)}")
    for name, t in (("block_table", block_table), ("query_start_loc", query_start_loc), ("seq_lens", seq_lens)):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
    if query.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"query must be float16, bfloat16 or float32, got {query.dtype}")
    if len({query.dtype, k_cache.dtype, v_cache.dtype}) != 1:
        raise ValueError(f"query, k_cache, v_cache must share one dtype; got "
                         f"{query.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    tensors = (query, k_cache, v_cache, block_table, query_start_loc, seq_lens)
    if len({t.device for t in tensors}) != 1:
        raise ValueError(f"all tensors must be on one device; got {[str(t.device) for t in tensors]}")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not cache.is_contiguous():
            raise ValueError(f"{name} must be contiguous (got strides {cache.stride()}); "
                             f"pass {name}.contiguous() or allocate it with torch.empty(...)")
    if total_q > 0 and not query[0].is_contiguous():
        raise ValueError(f"each token's query must be H_q*D contiguous values (got strides {query.stride()}); "
                         f"a row-strided view such as qkv[:, :H_q*D].view(T, H_q, D) is fine, a permuted one is not")
    if block_table.stride(1) != 1 or query_start_loc.stride(0) != 1 or seq_lens.stride(0) != 1:
        raise ValueError("block_table rows, query_start_loc and seq_lens must be contiguous; pass .contiguous()")
    if out is not None and (out.shape != query.shape or out.dtype != query.dtype or out.device != query.device):
        raise ValueError(f"out must have the query's shape, dtype and device {tuple(query.shape)}, {query.dtype}, "
                         f"{query.device}; got {tuple(out.shape)}, {out.dtype}, {out.device}")
    if out is not None and total_q > 0 and not out[0].is_contiguous():
        raise ValueError(f"each token's row of out must be H_q*D contiguous values (got strides {out.stride()})")
    if seq_lens.device.type == "cpu":
        # On the CPU these value checks are free. On a GPU they would cost a
        # device-to-host sync every step, so there (as in vLLM) the kernel
        # trusts the scheduler's query_start_loc, seq_lens and block table.
        starts = query_start_loc.long()
        q_lens = starts[1:] - starts[:-1]
        if int(starts[0]) != 0 or int(starts[-1]) != total_q:
            raise ValueError(f"query_start_loc must start at 0 and end at total_q = {total_q}; "
                             f"got {starts[0].item()} ... {starts[-1].item()}")
        if bool((q_lens < 0).any()):
            b = int((q_lens < 0).nonzero()[0])
            raise ValueError(f"query_start_loc must be non-decreasing (it is the running sum of the chunk lengths); "
                             f"it falls from {int(starts[b])} to {int(starts[b + 1])} at sequence {b}")
        if num_seqs == 0:
            return
        lens = seq_lens.long()
        if bool((q_lens > lens).any()):
            b = int((q_lens > lens).nonzero()[0])
            raise ValueError(f"sequence {b} brings {int(q_lens[b])} new tokens but seq_lens[{b}] = {int(lens[b])}: "
                             f"seq_lens counts the whole context, the chunk's own tokens included, so it is >= q_len")
        num_blocks, block_size = k_cache.shape[:2]
        capacity = block_table.shape[1] * block_size
        if int(lens.max()) > capacity:
            raise ValueError(f"seq_lens reaches {int(lens.max())}, past max_blocks * block_size = "
                             f"{block_table.shape[1]} * {block_size} = {capacity}; widen block_table or fix seq_lens")
        owned = torch.arange(block_table.shape[1]) < (lens[:, None] + block_size - 1) // block_size
        used = block_table[owned]
        if used.numel() and (int(used.min()) < 0 or int(used.max()) >= num_blocks):
            raise ValueError(f"block_table names blocks in [{int(used.min())}, {int(used.max())}] for live tokens, "
                             f"but the cache has blocks 0..{num_blocks - 1}")
