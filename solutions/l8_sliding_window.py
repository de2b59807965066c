"""L8 reference: sliding-window attention with attention sinks over a paged KV cache.

L3's prefill kernel and L4's split-KV decode, with two changes each: a query at
position p sees only keys [p - window_left, p], and whole key tiles before that
are skipped, never loaded and masked; and each query head's sink logit joins the
softmax's denominator once. Mirrors vLLM's Triton unified attention
(SLIDING_WINDOW, USE_SINKS). Read it next to content/l8.md.
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
LOG2E = tl.constexpr(1.4426950408889634)  # log2(e): e^x = 2^(x * LOG2E)
NO_WINDOW = 1 << 30  # window_left = -1 becomes a window longer than any context: one code path
CPU_NUM_SPLITS = 4   # num_splits=None on the CPU: enough to exercise the merge


@triton.jit
def _window_start(pos, window):
    """The first key position a query at `pos` sees: window_left keys before it, then itself."""
    return pos - window


@triton.jit
def _seed(sinks_ptr, heads, live, USE_SINKS: tl.constexpr, ROWS: tl.constexpr):
    """The online softmax's starting (m, l): with a sink, as if one key of score `sink`
    (natural log, not scaled) had been seen already and joined no value: m = sink in
    base 2, l = e^sink / 2^m = 1. Without one, nothing seen: m = -inf, l = 0."""
    if USE_SINKS:
        m = tl.load(sinks_ptr + heads, mask=live, other=float("-inf")) * LOG2E
        l = tl.where(m == float("-inf"), 0.0, 1.0)
    else:
        m = tl.full([ROWS], float("-inf"), tl.float32)
        l = tl.zeros([ROWS], tl.float32)
    return m, l


@triton.jit
def _load_kv(k_cache_ptr, v_cache_ptr, table_row_ptr, key, lo, end, kv_head, NUM_KV_HEADS, dims, dim_live,
             BLOCK_SIZE: tl.constexpr, HEAD_SIZE: tl.constexpr, UPCAST: tl.constexpr):
    """K and V [TILE, D_PAD] of keys `key` in [lo, end), gathered through the sequence's
    block-table row. Keys outside read nothing, not even their block-table entry: one
    before the window may sit in a dead block, whose entry is garbage (vLLM freed it)."""
    key_live = (key >= lo) & (key < end)
    block = tl.load(table_row_ptr + key // BLOCK_SIZE, mask=key_live, other=0)
    slot = block.to(tl.int64) * BLOCK_SIZE + key % BLOCK_SIZE  # L1's slot, in int64
    offs = (slot * NUM_KV_HEADS + kv_head)[:, None] * HEAD_SIZE + dims[None, :]
    mask = key_live[:, None] & dim_live[None, :]
    k = tl.load(k_cache_ptr + offs, mask=mask, other=0.0)
    v = tl.load(v_cache_ptr + offs, mask=mask, other=0.0)
    if UPCAST:
        k, v = k.to(tl.float32), v.to(tl.float32)
    return k, v


@triton.jit
def _softmax_step(s, v, m, l, acc):
    """One online-softmax update in base 2 (L3's), safe for rows that see no key yet."""
    m_new = tl.maximum(m, tl.max(s, axis=1))
    base = tl.where(m_new == float("-inf"), 0.0, m_new)  # all masked so far: exp2(-inf - 0) = 0, not NaN
    alpha = tl.exp2(m - base)
    p = tl.exp2(s - base[:, None])
    l = l * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return m_new, l, acc


@triton.jit
def _find_seq(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q: tl.constexpr):
    """L3's: the last sequence b whose first query block, query_start_loc[b] // BLOCK_Q + b, is <= q_block."""
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
    kv_head = tl.program_id(0).to(tl.int64)
    # Which sequence and which block of its queries: L3's two launches, unchanged.
    if SHORT:
        seq = tl.program_id(1)
        q_start = tl.load(query_start_loc_ptr + seq)
        q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
        first = 0
        if (q_len == 0) | (q_len > BLOCK_Q):
            return
    else:
        q_block = tl.num_programs(1) - 1 - tl.program_id(1)
        seq = _find_seq(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q)
        q_start = tl.load(query_start_loc_ptr + seq)
        q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
        first = (q_block - q_start // BLOCK_Q - seq) * BLOCK_Q
        if (first >= q_len) | (q_len <= short_q_len):
            return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len
    table_row_ptr = block_table_ptr + seq.to(tl.int64) * table_stride

    rows = tl.arange(0, BLOCK_M)
    i = first + rows // GROUP
    heads = kv_head * GROUP + rows % GROUP
    row_live = (rows < BLOCK_Q * GROUP) & (i < q_len)
    pos = context_len + i
    dims = tl.arange(0, D_PAD)
    dim_live = dims < HEAD_SIZE
    token = (q_start + i).to(tl.int64)
    q = tl.load(query_ptr + token[:, None] * query_stride + heads[:, None] * HEAD_SIZE + dims[None, :],
                mask=row_live[:, None] & dim_live[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    m, l = _seed(sinks_ptr, heads, row_live, USE_SINKS, BLOCK_M)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)

    # The block's queries sit at positions pos_first..end - 1; together they see keys
    # [lo, end). Every row sees [end - 1 - window, pos_first]: whole tiles in there need
    # no mask (the second loop, L3's). The tiles on either side are masked (the first
    # loop): the diagonal's, then the window's first ones, of which the very first is
    # partial: its keys before lo are never loaded. Tiles before it are skipped.
    pos_first = context_len + first
    end = tl.minimum(pos_first + BLOCK_Q, seq_len)
    lo = tl.maximum(_window_start(pos_first, window), 0)
    free_hi = (pos_first + 1) // TILE * TILE
    free_lo = tl.minimum(tl.cdiv(tl.maximum(_window_start(end - 1, window), 0), TILE) * TILE, free_hi)
    num_diag = tl.cdiv(end - free_hi, TILE)
    for j in range(0, num_diag + (free_lo - lo // TILE * TILE) // TILE):
        start = tl.where(j < num_diag, free_hi + j * TILE, lo // TILE * TILE + (j - num_diag) * TILE)
        key = start + tl.arange(0, TILE)
        k, v = _load_kv(k_cache_ptr, v_cache_ptr, table_row_ptr, key, lo, end,
                        kv_head, NUM_KV_HEADS, dims, dim_live, BLOCK_SIZE, HEAD_SIZE, UPCAST)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale_log2
        s = tl.where((key[None, :] <= pos[:, None]) & (key[None, :] >= _window_start(pos, window)[:, None]),
                     s, float("-inf"))
        m, l, acc = _softmax_step(s, v, m, l, acc)
    for start in range(free_lo, free_hi, TILE):
        key = start + tl.arange(0, TILE)
        k, v = _load_kv(k_cache_ptr, v_cache_ptr, table_row_ptr, key, lo, end,
                        kv_head, NUM_KV_HEADS, dims, dim_live, BLOCK_SIZE, HEAD_SIZE, UPCAST)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale_log2
        m, l, acc = _softmax_step(s, v, m, l, acc)

    out = acc / l[:, None]  # l counts the sink's e^sink too: the denominator, once
    out_offs = token[:, None] * out_stride + heads[:, None] * HEAD_SIZE + dims[None, :]
    tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=row_live[:, None] & dim_live[None, :])


@triton.jit
def window_decode_kernel(
    out_ptr, parts_ptr, lse_ptr, query_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, seq_lens_ptr, sinks_ptr,
    scale_log2, window, query_stride, out_stride, table_stride, NUM_HEADS, NUM_KV_HEADS, NUM_SPLITS,
    BLOCK_SIZE: tl.constexpr, HEAD_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    D_PAD: tl.constexpr, TILE: tl.constexpr, UPCAST: tl.constexpr, USE_SINKS: tl.constexpr,
    DIRECT: tl.constexpr,      # NUM_SPLITS == 1: write the answer to out, no merge
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    table_row_ptr = block_table_ptr + seq * table_stride

    # L4's chunks, cut from the window's tiles only: the splits share the window, not
    # the context. The first tile is partial (keys before lo are never loaded); a chunk
    # past the end (a window shorter than NUM_SPLITS tiles) is empty.
    lo = tl.maximum(_window_start(seq_len - 1, window), 0)
    first_tile = lo // TILE * TILE
    chunk = tl.cdiv(tl.cdiv(seq_len - first_tile, NUM_SPLITS), TILE) * TILE
    start = first_tile + split * chunk
    end = tl.minimum(start + chunk, seq_len)

    rows = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, D_PAD)
    heads = kv_head * GROUP + rows
    q_mask = (rows < GROUP)[:, None] & (dims < HEAD_SIZE)[None, :]
    q = tl.load(query_ptr + seq * query_stride + heads[:, None] * HEAD_SIZE + dims[None, :], mask=q_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    # The sink joins split 0 alone: seeded in every split, the merge would count it NUM_SPLITS times.
    # (The row bound is picked by a scalar where: the interpreter refuses vector & scalar masks.)
    m, l = _seed(sinks_ptr, heads, rows < tl.where(split == 0, GROUP, 0), USE_SINKS, GROUP_PAD)
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    for tile_start in range(start, end, TILE):
        key = tile_start + tl.arange(0, TILE)
        k, v = _load_kv(k_cache_ptr, v_cache_ptr, table_row_ptr, key, lo, end,
                        kv_head, NUM_KV_HEADS, dims, dims < HEAD_SIZE, BLOCK_SIZE, HEAD_SIZE, UPCAST)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale_log2
        s = tl.where(((key >= _window_start(seq_len - 1, window)) & (key < end))[None, :], s, float("-inf"))
        m, l, acc = _softmax_step(s, v, m, l, acc)

    # The chunk's output and log-sum-exp (natural log: times ln 2), the sink inside
    # split 0's. An empty chunk has l = 0: it stores 0, not 0/0 = NaN, and lse = -inf.
    part = acc / tl.where(l > 0, l, 1.0)[:, None]
    lse = (m + tl.log2(l)) * 0.6931471805599453
    if DIRECT:
        tl.store(out_ptr + seq * out_stride + heads[:, None] * HEAD_SIZE + dims[None, :],
                 part.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        first = (seq * NUM_HEADS + heads) * NUM_SPLITS + split  # [B, H_q, NUM_SPLITS, ...]
        tl.store(parts_ptr + first[:, None] * HEAD_SIZE + dims[None, :], part, mask=q_mask)
        tl.store(lse_ptr + first, lse, mask=rows < GROUP)


@triton.jit
def merge_kernel(out_ptr, parts_ptr, lse_ptr, out_stride, NUM_HEADS, NUM_PARTS: tl.constexpr,
                 PARTS_PAD: tl.constexpr, HEAD_SIZE: tl.constexpr, D_PAD: tl.constexpr):
    """L4's merge of one (sequence, head)'s parts by their log-sum-exps. The sink is in
    part 0's, so it weighs in once, however many parts there are."""
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    parts = tl.arange(0, PARTS_PAD)
    dims = tl.arange(0, D_PAD)
    first = (row * NUM_HEADS + head) * NUM_PARTS
    s = tl.load(lse_ptr + first + parts, mask=parts < NUM_PARTS, other=float("-inf"))
    s_max = tl.max(s, axis=0)
    w = tl.exp(s - tl.where(s_max == float("-inf"), 0.0, s_max))
    v = tl.load(parts_ptr + (first + parts)[:, None] * HEAD_SIZE + dims[None, :],
                mask=(parts < NUM_PARTS)[:, None] & (dims < HEAD_SIZE)[None, :], other=0.0)
    v = tl.where(w[:, None] > 0, v, 0.0)  # a part of weight 0 stays out even if its v were NaN (0 * NaN)
    total = tl.sum(w, axis=0)
    out = tl.sum(w[:, None] * v, axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + row * out_stride + head * HEAD_SIZE + dims, out.to(out_ptr.dtype.element_ty),
             mask=dims < HEAD_SIZE)


def paged_prefill_attention_window(query, k_cache, v_cache, block_table, query_start_loc, seq_lens, window_left,
                                   sinks=None, scale=None, out=None):
    """L3's chunked-prefill attention where query position p sees keys [p - window_left, p]
    (window_left = -1: no window) and query head h's sink adds e^sinks[h] once to its
    softmax's denominator. Returns [total_q, H_q, D] (written into `out` when given)."""
    _check_inputs(query, k_cache, v_cache, block_table, seq_lens, window_left, sinks, None, out,
                  query_start_loc=query_start_loc)
    total_q, num_heads, head_size = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_seqs, group = seq_lens.shape[0], num_heads // num_kv_heads
    scale = 1.0 / math.sqrt(head_size) if scale is None else float(scale)
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    if total_q == 0 or num_seqs == 0:
        return out
    short, tall = _tile_configs(query, group, head_size)
    for (block_m, tile, num_warps, num_stages), is_short in ((tall, False), (short, True)):
        block_q = block_m // group
        grid = (num_kv_heads, num_seqs if is_short else total_q // block_q + num_seqs)
        window_prefill_kernel[grid](
            out, query, k_cache, v_cache, block_table, query_start_loc, seq_lens, _sinks_arg(sinks, query),
            scale * LOG2E.value, NO_WINDOW if window_left == -1 else window_left, num_seqs, short[0] // group,
            query.stride(0), out.stride(0), block_table.stride(0), num_kv_heads,
            BLOCK_SIZE=block_size, HEAD_SIZE=head_size, D_PAD=max(16, triton.next_power_of_2(head_size)),
            GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m, TILE=tile,
            UPCAST=_INTERPRET and query.dtype == torch.bfloat16, USE_SINKS=sinks is not None, SHORT=is_short,
            num_warps=num_warps, num_stages=num_stages,
        )
    return out


def paged_decode_attention_window(query, k_cache, v_cache, block_table, seq_lens, window_left, sinks=None,
                                  scale=None, num_splits=None, out=None):
    """L4's split-KV decode over the window [seq_len - 1 - window_left, seq_len - 1], with
    L8's sinks: returns [B, H_q, D] (written into `out` when given)."""
    _check_inputs(query, k_cache, v_cache, block_table, seq_lens, window_left, sinks, num_splits, out)
    num_seqs, num_heads, head_size = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    scale = 1.0 / math.sqrt(head_size) if scale is None else float(scale)
    if num_splits is None:
        num_splits = CPU_NUM_SPLITS if query.device.type != "cuda" else max(1, min(32, 4 * torch.cuda.get_device_properties(
            query.device).multi_processor_count // max(1, num_seqs * num_kv_heads)))
    if out is None:
        out = torch.empty((num_seqs, num_heads, head_size), dtype=query.dtype, device=query.device)
    if num_seqs == 0:
        return out
    parts = torch.empty((num_seqs, num_heads, num_splits, head_size), dtype=torch.float32, device=query.device)
    lse = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=query.device)
    d_pad = max(16, triton.next_power_of_2(head_size))
    window_decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        out, parts, lse, query, k_cache, v_cache, block_table, seq_lens, _sinks_arg(sinks, query),
        scale * LOG2E.value, NO_WINDOW if window_left == -1 else window_left, query.stride(0), out.stride(0),
        block_table.stride(0), num_heads, num_kv_heads, num_splits,
        BLOCK_SIZE=block_size, HEAD_SIZE=head_size, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
        D_PAD=d_pad, TILE=16 if _INTERPRET else (64 if d_pad <= 128 else 32),
        UPCAST=_INTERPRET and query.dtype == torch.bfloat16, USE_SINKS=sinks is not None, DIRECT=num_splits == 1,
        num_warps=4, num_stages=3,
    )
    if num_splits > 1:
        merge_kernel[(num_seqs, num_heads)](out, parts, lse, out.stride(0), num_heads, NUM_PARTS=num_splits,
                                           PARTS_PAD=triton.next_power_of_2(num_splits), HEAD_SIZE=head_size,
                                           D_PAD=triton.next_power_of_2(head_size))
    return out


def _sinks_arg(sinks, query):
    """What the kernels get for `sinks`: the tensor, or any pointer when USE_SINKS is off."""
    return query if sinks is None else sinks


def _tile_configs(query, group, head_size):
    """(BLOCK_M, TILE, warps, stages) of the short launch and of the tall one: L3's, but the tall
    one reads 64 keys a step (on an H100, 347 TFLOP/s at 4 x 8192 with a window of 4096 against
    249 with L3's 32: BENCHMARKS.md)."""
    rows = max(16, triton.next_power_of_2(group))
    if query.device.type == "cpu":
        return (rows, 16, 4, 1), (rows, 16, 4, 1)
    d_pad = max(16, triton.next_power_of_2(head_size))
    return (rows, 64 if d_pad <= 128 else 32, 4, 2), (max(rows, 128), 64, 8, 2)


def _check_inputs(query, k_cache, v_cache, block_table, seq_lens, window_left, sinks, num_splits, out,
                  query_start_loc=None):
    # L3's and L4's checks (repeated: trees import nothing), plus window_left and sinks.
    # The block numbers are checked only where the kernels may use them: entries before
    # the window may be garbage.
    decode = query_start_loc is None
    if not isinstance(window_left, int) or isinstance(window_left, bool) or window_left < -1:
        raise ValueError(f"window_left must be an int >= -1 (-1: no window; a model's sliding_window W is "
                         f"window_left = W - 1); got {window_left!r}")
    if num_splits is not None and (not isinstance(num_splits, int) or isinstance(num_splits, bool) or num_splits < 1):
        raise ValueError(f"num_splits must be a whole number >= 1 (or None to pick one); got {num_splits!r}")
    if query.dim() != 3:
        raise ValueError(f"query must be [{'B' if decode else 'total_q'}, H_q, D]; got shape {tuple(query.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must both be [num_blocks, block_size, H_kv, D]; "
                         f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    rows, num_heads, head_size = query.shape
    num_blocks, block_size, num_kv_heads = k_cache.shape[:3]
    if k_cache.shape[3] != head_size:
        raise ValueError(f"the cache's head size {k_cache.shape[3]} does not match query's {head_size}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"query has {num_heads} heads, not a multiple of the cache's {num_kv_heads} KV heads")
    if seq_lens.dim() != 1 or (decode and seq_lens.shape[0] != rows):
        raise ValueError(f"seq_lens must be [B]{f' with B = {rows}' if decode else ''}; got {tuple(seq_lens.shape)}")
    num_seqs = seq_lens.shape[0]
    if not decode and query_start_loc.shape != (num_seqs + 1,):
        raise ValueError(f"query_start_loc must be [B + 1] = [{num_seqs + 1}]; got {tuple(query_start_loc.shape)}")
    if block_table.dim() != 2 or block_table.shape[0] != num_seqs:
        raise ValueError(f"block_table must be [B, max_blocks] with B = {num_seqs}; got {tuple(block_table.shape)}")
    ints = (("block_table", block_table), ("seq_lens", seq_lens)) + (() if decode else
                                                                      (("query_start_loc", query_start_loc),))
    for name, t in ints:
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
    if query.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"query must be float16, bfloat16 or float32, got {query.dtype}")
    if len({query.dtype, k_cache.dtype, v_cache.dtype}) != 1:
        raise ValueError(f"query, k_cache, v_cache must share one dtype; got {query.dtype}, {k_cache.dtype}, "
                         f"{v_cache.dtype}")
    if sinks is not None and (not isinstance(sinks, torch.Tensor) or sinks.shape != (num_heads,)
                              or sinks.dtype != torch.float32 or not sinks.is_contiguous()):
        raise ValueError(f"sinks must be None or a contiguous float32 [H_q] = [{num_heads}] tensor (cast a model's "
                         f"bf16 sinks with .float()); got {getattr(sinks, 'dtype', type(sinks).__name__)} "
                         f"{tuple(getattr(sinks, 'shape', ()))}")
    tensors = [t for t in (query, k_cache, v_cache, block_table, seq_lens, query_start_loc, sinks) if t is not None]
    if len({t.device for t in tensors}) != 1:
        raise ValueError(f"all tensors must be on one device; got {[str(t.device) for t in tensors]}")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not cache.is_contiguous():
            raise ValueError(f"{name} must be contiguous (got strides {cache.stride()}); pass {name}.contiguous()")
    if rows > 0 and not query[0].is_contiguous():
        raise ValueError(f"each token's query must be H_q*D contiguous values (got strides {query.stride()})")
    if block_table.stride(1) != 1 or seq_lens.stride(0) != 1 or (not decode and query_start_loc.stride(0) != 1):
        raise ValueError("block_table rows, seq_lens and query_start_loc must be contiguous; pass .contiguous()")
    if out is not None and (out.shape != query.shape or out.dtype != query.dtype or out.device != query.device
                            or (rows > 0 and not out[0].is_contiguous())):
        raise ValueError(f"out must have the query's shape, dtype and device with contiguous rows; got "
                         f"{tuple(out.shape)}, {out.dtype}, {out.device}")
    if seq_lens.device.type != "cpu" or num_seqs == 0:
        return  # on a GPU the values would cost a device sync: trusted, as in vLLM
    lens = seq_lens.long()
    starts = torch.arange(num_seqs + 1) if decode else query_start_loc.long()
    q_lens = starts[1:] - starts[:-1]
    if int(starts[0]) != 0 or int(starts[-1]) != rows or bool((q_lens < 0).any()):
        raise ValueError(f"query_start_loc must rise from 0 to total_q = {rows}; got {starts.tolist()}")
    if bool((q_lens > lens).any()) or (decode and int(lens.min()) < 1):
        raise ValueError(f"seq_lens counts the whole context, the new tokens included: each must be >= q_len "
                         f"(>= 1 in decode); got seq_lens {lens.tolist()}, q_lens {q_lens.tolist()}")
    if int(lens.max()) > block_table.shape[1] * block_size:
        raise ValueError(f"seq_lens reaches {int(lens.max())}, past max_blocks * block_size = "
                         f"{block_table.shape[1] * block_size}; widen block_table or fix seq_lens")
    # The columns a kernel may use: from the block holding the first query's window start to the last block.
    window = NO_WINDOW if window_left == -1 else window_left
    first = (lens - q_lens - window).clamp(min=0) // block_size
    columns = torch.arange(block_table.shape[1])
    used = block_table[(columns >= first[:, None]) & (columns < (lens[:, None] + block_size - 1) // block_size)]
    if used.numel() and (int(used.min()) < 0 or int(used.max()) >= num_blocks):
        raise ValueError(f"block_table names blocks in [{int(used.min())}, {int(used.max())}] for tokens in the "
                         f"window, but the cache has blocks 0..{num_blocks - 1}")
