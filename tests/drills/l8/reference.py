"""Drill L8's float64 reference: dense masked attention, as transformers defines gpt-oss's
(eager_attention_forward: the sink is one more logit per query head, concatenated to the
scores, and dropped after the softmax), and its tolerance per dtype."""
import math

import torch


def ref_window_attention(query, k_cache, v_cache, block_table, query_start_loc, seq_lens, window_left, sinks=None,
                         scale=None, kv_head=None, sink_of_head=None):
    """float64 on the CPU: query token t of sequence b, at position p = seq_len - q_len + i,
    attends to its cache's keys [max(p - window_left, 0), p] (all of 0..p for window_left
    = -1). `sinks` [H_q] (natural log, not scaled) joins each softmax as one more logit.

    Only blocks the window reaches are gathered: entries before it may be garbage. The
    keyword arguments compute mistakes for the diagnosis: kv_head[h], the KV head query
    head h reads; sink_of_head, the sinks tensor to use instead (already remapped)."""
    total_q, num_heads, head_size = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    scale = 1.0 / math.sqrt(head_size) if scale is None else scale
    group = num_heads // num_kv_heads
    kv_head = torch.arange(num_heads) // group if kv_head is None else torch.as_tensor(kv_head)
    sinks = sinks if sink_of_head is None else sink_of_head
    sinks = None if sinks is None else torch.as_tensor(sinks).double().cpu()
    starts = query_start_loc.long().cpu().tolist()
    lens = seq_lens.long().cpu().tolist()
    table = block_table.long().cpu()
    q = query.double().cpu()
    out = torch.zeros(total_q, num_heads, head_size, dtype=torch.float64)
    for b, n in enumerate(lens):
        q_len = starts[b + 1] - starts[b]
        if q_len == 0:
            continue
        first_pos = n - q_len
        lo_seq = 0 if window_left < 0 else max(first_pos - window_left, 0)
        first_block, last_block = lo_seq // block_size, -(-n // block_size)
        base = first_block * block_size  # key position of the first gathered row
        k, v = (_gather(cache, table[b, first_block:last_block])[:n - base] for cache in (k_cache, v_cache))
        for i in range(q_len):
            t, p = starts[b] + i, first_pos + i
            lo = 0 if window_left < 0 else max(p - window_left, 0)
            keys_k, keys_v = k[lo - base:p + 1 - base][:, kv_head], v[lo - base:p + 1 - base][:, kv_head]
            logits = torch.einsum("hd,khd->hk", q[t], keys_k) * scale               # [H_q, keys]
            if sinks is not None:
                logits = torch.cat([logits, sinks[:, None]], dim=1)                  # the sink: one more logit
            probs = logits.softmax(-1)
            if sinks is not None:
                probs = probs[:, :-1]                                                # ... dropped after the softmax
            out[t] = torch.einsum("hk,khd->hd", probs, keys_v)
    return out


def _gather(cache, blocks):
    """The rows of `blocks` (a table row's slice), float64 on the CPU, [tokens, H_kv, D]. A
    number no block has (a dead entry a mistake's window reaches) gives NaN rows."""
    blocks = blocks.long()
    valid = (blocks >= 0) & (blocks < cache.shape[0])
    rows = cache[blocks.clamp(0, cache.shape[0] - 1).to(cache.device)].double().cpu()
    rows[~valid] = float("nan")
    return rows.reshape(-1, *cache.shape[2:])


# (atol, rtol) against the float64 reference, as L3's and L4's: 16-bit runs round p to the
# value dtype before p·V; fp32 runs use "ieee" dot products.
TOLERANCE = {torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.5e-2, 1.5e-2), torch.float32: (1e-4, 1e-4)}
