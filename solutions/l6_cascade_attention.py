"""L6 reference: cascade attention, a shared prefix read once for the whole batch.

With prefix caching, the block tables of a batch often start with the same
physical blocks (a system prompt, a shared document). Pass 1 attends every query
of the batch, unmasked, to that shared prefix, reading its K/V once per KV head
for many query rows; pass 2 is L3 over the rest of each sequence; L4's merge joins
them by log-sum-exp. Mirrors vLLM's cascade_attention (FlashAttention backend) and
FlashInfer's MultiLevelCascadeAttentionWrapper. Read it next to content/l6.md,
which explains it top to bottom and cites the line ranges below.
"""
import math
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

# Triton's CPU interpreter computes tl.dot on bfloat16 wrongly (it multiplies the
# raw bits; triton-lang/triton#11584), so there the kernels widen q, K and V to
# fp32 first. On a GPU they stay 16-bit and go through the tensor cores.
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
LOG2E = 1.4426950408889634  # log2(e): exp(x) = exp2(x * LOG2E)
CPU_PREFIX_SPLITS = 2       # pass 1's chunks of the prefix under the interpreter
MIN_SPLIT_KEYS = 256        # on a GPU, each chunk of the prefix holds at least this many keys ...
MAX_SPLITS = 8              # ... and there are at most this many (pass 2 folds them in one by one)


def cascade_prefix_len(block_table, query_start_loc, seq_lens, block_size):
    """The shared prefix cascade attention may use, in tokens: the leading block-table
    columns identical in every row, times block_size, capped by the fewest tokens any
    sequence had cached before this step, rounded down to a multiple of block_size;
    0 for fewer than two sequences. A host rule: it reads the tensors' values."""
    num_seqs = seq_lens.shape[0]
    if num_seqs < 2:
        return 0
    table = block_table.cpu()
    lens = seq_lens.cpu().long()
    starts = query_start_loc.cpu().long()
    cached = lens - (starts[1:] - starts[:-1])  # tokens in the cache before this step's chunk
    same = (table == table[:1]).all(dim=0).long()
    shared_blocks = int(same.cumprod(0).sum())  # leading columns equal in every row
    # The cap makes pass 1's missing mask legal: every query sits at a position
    # >= its sequence's cached length, so it may see every key before that.
    prefix = min(shared_blocks * block_size, int(cached.min()))
    return prefix // block_size * block_size


@triton.jit
def _load_kv(k_cache_ptr, v_cache_ptr, block, key, key_live, kv_head, NUM_KV_HEADS, dims, dim_live,
             BLOCK_SIZE: tl.constexpr, HEAD_SIZE: tl.constexpr, UPCAST: tl.constexpr):
    """K and V [TILE, D_PAD] of keys `key`, which sit in cache blocks `block` (their
    block-table entries); masked keys read nothing."""
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
    """One online-softmax update (L3's) in base 2, safe for rows that see no key yet."""
    m_new = tl.maximum(m, tl.max(s, axis=1))
    base = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: 0, not NaN
    alpha = tl.exp2(m - base)
    p = tl.exp2(s - base[:, None])
    l = l * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return m_new, l, acc


@triton.jit
def _store_part(parts_ptr, lse_ptr, token, heads, row_live, dims, dim_live, m, l, acc, part,
                NUM_HEADS, NUM_PARTS, HEAD_SIZE: tl.constexpr):
    """Row r's partial output acc / l, in the parts' dtype (the query's: vLLM's merge
    reads its parts in the model's dtype too), and its LSE in base 2 (FlashInfer's
    base) in fp32, as part `part` of [total_q, H_q, NUM_PARTS, D] and [total_q, H_q,
    NUM_PARTS]. A row that saw no key stores v = 0 and lse = -inf (log 0): an empty
    part, which the fold skips."""
    v = acc / tl.where(l > 0, l, 1.0)[:, None]
    first = (token * NUM_HEADS + heads) * NUM_PARTS + part
    tl.store(parts_ptr + first[:, None] * HEAD_SIZE + dims[None, :], v.to(parts_ptr.dtype.element_ty),
             mask=row_live[:, None] & dim_live[None, :])
    tl.store(lse_ptr + first, m + tl.log2(l), mask=row_live)


@triton.jit
def prefix_kernel(
    parts_ptr, lse_ptr, query_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr,
    scale_log2, total_q, prefix_len, chunk,
    query_stride,              # elements from one token's [H_q, D] row to the next
    NUM_HEADS, NUM_KV_HEADS, NUM_PARTS,
    BLOCK_SIZE: tl.constexpr, HEAD_SIZE: tl.constexpr, D_PAD: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr,     # query tokens per program, from any sequences
    BLOCK_M: tl.constexpr,     # tile rows: BLOCK_Q * GROUP rounded up to a power of two
    TILE: tl.constexpr, UPCAST: tl.constexpr,
    PDL: tl.constexpr,         # launched ahead of pass 2 (programmatic dependent launch)
):
    """Pass 1: BLOCK_Q tokens of the whole batch (whatever their sequences) times the
    GROUP query heads of one KV head, against keys [split * chunk, ...) of the prefix."""
    if PDL:
        gdc_launch_dependents()  # pass 2 may start now: it reads our parts only after gdc_wait
    kv_head = tl.program_id(0).to(tl.int64)
    rows = tl.arange(0, BLOCK_M)
    token = tl.program_id(1).to(tl.int64) * BLOCK_Q + rows // GROUP
    heads = kv_head * GROUP + rows % GROUP
    row_live = (rows < BLOCK_Q * GROUP) & (token < total_q)
    dims = tl.arange(0, D_PAD)
    dim_live = dims < HEAD_SIZE
    q = tl.load(query_ptr + token[:, None] * query_stride + heads[:, None] * HEAD_SIZE + dims[None, :],
                mask=row_live[:, None] & dim_live[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)

    # The prefix is every sequence's, so row 0 of the block table names its blocks,
    # and no causal mask: every query sits past the prefix (cascade_prefix_len's cap).
    split = tl.program_id(2)
    start = split * chunk
    end = tl.minimum(start + chunk, prefix_len)
    # Each tile's block numbers are loaded one tile ahead: the K/V loads need them for
    # their addresses, and waiting for both loads in turn each tile is what made pass 1 slow.
    key = start + tl.arange(0, TILE)
    block_next = tl.load(block_table_ptr + key // BLOCK_SIZE, mask=key < end, other=0)
    for tile_start in range(start, end, TILE):
        key = tile_start + tl.arange(0, TILE)
        block = block_next
        block_next = tl.load(block_table_ptr + (key + TILE) // BLOCK_SIZE, mask=key + TILE < end, other=0)
        k, v = _load_kv(k_cache_ptr, v_cache_ptr, block, key, key < end, kv_head, NUM_KV_HEADS, dims,
                        dim_live, BLOCK_SIZE, HEAD_SIZE, UPCAST)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale_log2
        s = tl.where(key[None, :] < end, s, float("-inf"))  # the last tile's keys past the chunk
        m, l, acc = _softmax_step(s, v, m, l, acc)
    _store_part(parts_ptr, lse_ptr, token, heads, row_live, dims, dim_live, m, l, acc, split,
                NUM_HEADS, NUM_PARTS, HEAD_SIZE)


@triton.jit
def _find_seq(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q: tl.constexpr):
    """L3's search: sequence b's query blocks are numbered from query_start_loc[b] // BLOCK_Q + b."""
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
def suffix_kernel(
    out_ptr, parts_ptr, lse_ptr, query_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, query_start_loc_ptr,
    seq_lens_ptr, scale_log2, num_seqs, prefix_len,
    query_stride, out_stride, table_stride,
    NUM_HEADS, NUM_KV_HEADS, NUM_PARTS,
    BLOCK_SIZE: tl.constexpr, HEAD_SIZE: tl.constexpr, D_PAD: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, TILE: tl.constexpr, UPCAST: tl.constexpr,
    PDL: tl.constexpr,         # launched while pass 1 runs: wait for it before reading its parts
):
    """Pass 2: L3's program (one KV head, one query block of one sequence) over keys
    prefix_len .. position only, then pass 1's NUM_PARTS parts folded in (the merge)."""
    kv_head = tl.program_id(0).to(tl.int64)
    q_block = tl.num_programs(1) - 1 - tl.program_id(1)  # heaviest blocks first, as in L3
    seq = _find_seq(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    first = (q_block - q_start // BLOCK_Q - seq) * BLOCK_Q
    if first >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len

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
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)

    # L3's two loops, shifted to start at the prefix's end: keys prefix_len ..
    # context_len + first are seen by every row (no mask); the diagonal goes first.
    table_row = block_table_ptr + seq.to(tl.int64) * table_stride
    end = tl.minimum(context_len + first + BLOCK_Q, seq_len)
    full_end = prefix_len + (context_len + first + 1 - prefix_len) // TILE * TILE
    for start in range(full_end, end, TILE):
        key = start + tl.arange(0, TILE)
        block = tl.load(table_row + key // BLOCK_SIZE, mask=key < end, other=0)
        k, v = _load_kv(k_cache_ptr, v_cache_ptr, block, key, key < end, kv_head, NUM_KV_HEADS, dims,
                        dim_live, BLOCK_SIZE, HEAD_SIZE, UPCAST)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale_log2
        s = tl.where(key[None, :] <= pos[:, None], s, float("-inf"))
        m, l, acc = _softmax_step(s, v, m, l, acc)
    # As in pass 1, each tile's block numbers are loaded one tile ahead.
    key = prefix_len + tl.arange(0, TILE)
    block_next = tl.load(table_row + key // BLOCK_SIZE, mask=key < full_end, other=0)
    for start in range(prefix_len, full_end, TILE):
        key = start + tl.arange(0, TILE)
        block = block_next
        block_next = tl.load(table_row + (key + TILE) // BLOCK_SIZE, mask=key + TILE < full_end, other=0)
        k, v = _load_kv(k_cache_ptr, v_cache_ptr, block, key, key < end, kv_head, NUM_KV_HEADS, dims,
                        dim_live, BLOCK_SIZE, HEAD_SIZE, UPCAST)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale_log2
        m, l, acc = _softmax_step(s, v, m, l, acc)

    # The merge (L4's rule), folded into the online softmax: each of pass 1's parts is
    # one more "key" whose score is its LSE and whose value is its output.
    if PDL:
        gdc_wait()  # pass 1 has finished and its parts are visible
    for part in range(0, NUM_PARTS):
        at = (token * NUM_HEADS + heads) * NUM_PARTS + part
        s = tl.load(lse_ptr + at, mask=row_live, other=float("-inf"))
        v = tl.load(parts_ptr + at[:, None] * HEAD_SIZE + dims[None, :],
                    mask=row_live[:, None] & dim_live[None, :]).to(tl.float32)
        m_new = tl.maximum(m, s)
        base = tl.where(m_new == float("-inf"), 0.0, m_new)  # as in _softmax_step
        keep = tl.exp2(m - base)  # the weight of what is folded so far
        w = tl.exp2(s - base)     # the part's weight: 0 for an empty part (lse = -inf)
        l = l * keep + w
        v = tl.where(w[:, None] > 0, v, 0.0)  # an empty part's v is never trusted: 0 * NaN = NaN
        acc = acc * keep[:, None] + w[:, None] * v
        m = m_new
    out_offs = token[:, None] * out_stride + heads[:, None] * HEAD_SIZE + dims[None, :]
    tl.store(out_ptr + out_offs, (acc / l[:, None]).to(out_ptr.dtype.element_ty),
             mask=row_live[:, None] & dim_live[None, :])


def cascade_attention(query, k_cache, v_cache, block_table, query_start_loc, seq_lens, common_prefix_len,
                      scale=None, out=None):
    """L3's causal attention of every query chunk over its sequence's paged K/V, with
    the first common_prefix_len tokens (shared by every sequence) read once for the
    whole batch; returns [total_q, H_q, D] (written into `out` when given)."""
    _check_inputs(query, k_cache, v_cache, block_table, query_start_loc, seq_lens, common_prefix_len, out)
    total_q, num_heads, head_size = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    group = num_heads // num_kv_heads
    scale = 1.0 / math.sqrt(head_size) if scale is None else float(scale)
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    if total_q == 0 or num_seqs == 0:
        return out
    d_pad = max(16, triton.next_power_of_2(head_size))
    common = dict(BLOCK_SIZE=block_size, HEAD_SIZE=head_size, D_PAD=d_pad, GROUP=group,
                  UPCAST=_INTERPRET and query.dtype == torch.bfloat16)
    rows = max(16, triton.next_power_of_2(group))
    on_cpu = query.device.type == "cpu"

    # Pass 1: the whole batch's tokens in blocks of block_q1, against the prefix cut
    # into num_splits chunks (a GPU needs enough programs; the batch alone is few).
    num_splits, parts, lse, pdl = 0, out, out, False
    if common_prefix_len > 0:
        pdl = not on_cpu and torch.cuda.get_device_capability(query.device)[0] >= 9  # Hopper and later
        block_m1 = rows if on_cpu else max(rows, 64)
        block_q1 = block_m1 // group
        q_blocks = triton.cdiv(total_q, block_q1)
        if on_cpu:
            num_splits = CPU_PREFIX_SPLITS
        else:
            sms = torch.cuda.get_device_properties(query.device).multi_processor_count
            fit = 2 * sms // (num_kv_heads * q_blocks)  # chunks that keep it to two programs an SM
            prefix_bytes = common_prefix_len * num_kv_heads * head_size * 2 * query.element_size()
            part_bytes = 2 * total_q * num_heads * head_size * query.element_size()  # a chunk's part: stored, read
            num_splits = max(1, min(fit, MAX_SPLITS, common_prefix_len // MIN_SPLIT_KEYS,
                                     prefix_bytes // (4 * part_bytes)))
        tile1 = 16 if on_cpu else (64 if d_pad <= 128 else 32)
        chunk = triton.cdiv(triton.cdiv(common_prefix_len, num_splits), tile1) * tile1
        parts = torch.empty((total_q, num_heads, num_splits, head_size), dtype=query.dtype, device=query.device)
        lse = torch.empty((total_q, num_heads, num_splits), dtype=torch.float32, device=query.device)
        prefix_kernel[(num_kv_heads, q_blocks, num_splits)](
            parts, lse, query, k_cache, v_cache, block_table, scale * LOG2E, total_q, common_prefix_len, chunk,
            query.stride(0), num_heads, num_kv_heads, num_splits,
            BLOCK_Q=block_q1, BLOCK_M=block_m1, TILE=tile1, PDL=pdl, **common,
            num_warps=4, num_stages=1 if on_cpu else 3)

    # Pass 2: L3 over each sequence's own keys, prefix_len onwards, then pass 1's parts.
    # With PDL it is launched while pass 1 runs: pass 1's programs are placed first and
    # pass 2's fill the rest of each SM, memory-bound work beside tensor-core work.
    if on_cpu:
        block_m2, tile2, warps, stages = rows, 16, 4, 1
    elif total_q / num_seqs >= 16:
        block_m2, tile2, warps, stages = max(rows, 128), 32, 8, 2  # L3's prefill tile
    else:
        block_m2, tile2, warps, stages = rows, (64 if d_pad <= 128 else 32), 4, 2  # L3's decode tile, 2 stages
    block_q2 = block_m2 // group
    suffix_kernel[(num_kv_heads, total_q // block_q2 + num_seqs)](
        out, parts, lse, query, k_cache, v_cache, block_table, query_start_loc, seq_lens, scale * LOG2E,
        num_seqs, common_prefix_len, query.stride(0), out.stride(0), block_table.stride(0),
        num_heads, num_kv_heads, num_splits,
        BLOCK_Q=block_q2, BLOCK_M=block_m2, TILE=tile2, PDL=pdl, **common,
        num_warps=warps, num_stages=stages, **({"launch_pdl": True} if pdl else {}))
    return out


def _check_inputs(query, k_cache, v_cache, block_table, query_start_loc, seq_lens, common_prefix_len, out):
    # L3's checks (the kernels read the same tensors the same way), then the prefix's.
    if query.dim() != 3:
        raise ValueError(f"query must be [total_q, H_q, D]; got shape {tuple(query.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must both be [num_blocks, block_size, H_kv, D]; "
                         f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    total_q, num_heads, head_size = query.shape
    num_blocks, block_size, num_kv_heads = k_cache.shape[:3]
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
    if not isinstance(common_prefix_len, int) or isinstance(common_prefix_len, bool) or common_prefix_len < 0:
        raise ValueError(f"common_prefix_len must be a whole number of tokens >= 0 (cascade_prefix_len gives one); "
                         f"got {common_prefix_len!r}")
    if common_prefix_len % block_size:
        raise ValueError(f"common_prefix_len = {common_prefix_len} is not a multiple of block_size = {block_size}: "
                         f"the prefix is whole shared blocks; round it down (cascade_prefix_len does)")
    if common_prefix_len > block_table.shape[1] * block_size:
        raise ValueError(f"common_prefix_len = {common_prefix_len} is longer than the block table "
                         f"({block_table.shape[1]} columns of {block_size} tokens)")
    if seq_lens.device.type != "cpu":
        # On a GPU the value checks below would cost a device-to-host sync every step;
        # there, as in vLLM, the kernels trust the scheduler (cascade_prefix_len's rule).
        return
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
    capacity = block_table.shape[1] * block_size
    if int(lens.max()) > capacity:
        raise ValueError(f"seq_lens reaches {int(lens.max())}, past max_blocks * block_size = "
                         f"{block_table.shape[1]} * {block_size} = {capacity}; widen block_table or fix seq_lens")
    owned = torch.arange(block_table.shape[1]) < (lens[:, None] + block_size - 1) // block_size
    used = block_table[owned]
    if used.numel() and (int(used.min()) < 0 or int(used.max()) >= num_blocks):
        raise ValueError(f"block_table names blocks in [{int(used.min())}, {int(used.max())}] for live tokens, "
                         f"but the cache has blocks 0..{num_blocks - 1}")
    cached = lens - q_lens
    if common_prefix_len > int(cached.min()):
        b = int(cached.argmin())
        raise ValueError(f"common_prefix_len = {common_prefix_len} is longer than sequence {b}'s cached context "
                         f"seq_len - q_len = {int(cached[b])}: its queries would see prefix keys past their own "
                         f"positions unmasked; cap it by min(seq_lens - q_lens) (cascade_prefix_len does)")
    shared = common_prefix_len // block_size
    differs = (block_table[:, :shared] != block_table[:1, :shared]).any(dim=0)
    if bool(differs.any()):
        c = int(differs.nonzero()[0])
        b = int((block_table[:, c] != block_table[0, c]).nonzero()[0])
        raise ValueError(f"common_prefix_len = {common_prefix_len} covers block-table column {c}, but sequence {b} "
                         f"holds block {int(block_table[b, c])} there and sequence 0 block {int(block_table[0, c])}: "
                         f"the prefix must be columns every row shares (cascade_prefix_len counts them)")
