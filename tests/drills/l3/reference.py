"""Drill L3's float64 reference (every query token's attention over its paged cache, under
the bottom-right causal mask, or under a mistake's mask) and its tolerance per dtype."""
import math

import torch


def ref_paged_prefill(query, k_cache, v_cache, block_table, query_start_loc, seq_lens, scale=None,
                      mask="bottom_right", kv_head=None):
    """float64, returned on the CPU: every query token's attention over its sequence's
    cache, gathered through the block table, under the bottom-right causal mask. Computed
    on the inputs' device (a GPU test's chunks of hundreds of queries took seconds a call
    on one CPU thread).

    The keyword arguments compute mistakes for the diagnosis: mask "top_left" (query i
    sees keys 0..i: no seq_len - q_len offset), "chunk_only" (keys context_len..pos:
    the prefix ignored), "one_more" / "one_less" (the diagonal one key off); kv_head[h],
    the KV head query head h reads.
    """
    total_q, num_heads, head_size = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    scale = 1.0 / math.sqrt(head_size) if scale is None else scale
    device = query.device
    kv_head = torch.arange(num_heads) // (num_heads // num_kv_heads) if kv_head is None else torch.as_tensor(kv_head)
    kv_head = kv_head.to(device)
    starts = query_start_loc.long().cpu().tolist()
    lens = seq_lens.long().cpu().tolist()
    table = block_table.long().cpu()
    q = query.double()
    out = torch.zeros(total_q, num_heads, head_size, dtype=torch.float64, device=device)
    kv = {}
    for b, n in enumerate(lens):
        blocks = table[b, :math.ceil(n / block_size)]
        kv[b] = (k_cache[blocks.to(k_cache.device)].double().to(device).reshape(-1, num_kv_heads, head_size)[:n],
                 v_cache[blocks.to(v_cache.device)].double().to(device).reshape(-1, num_kv_heads, head_size)[:n])
    for b in range(len(lens)):
        for t in range(starts[b], starts[b + 1]):
            n, q_len = lens[b], starts[b + 1] - starts[b]
            i = t - starts[b]
            context = n - q_len
            lo, hi = {"bottom_right": (0, context + i), "top_left": (0, i), "chunk_only": (context, context + i),
                      "one_more": (0, context + i + 1), "one_less": (0, context + i - 1)}[mask]
            hi = min(hi, n - 1)
            if hi < lo:
                continue
            k, v = kv[b][0][lo:hi + 1][:, kv_head], kv[b][1][lo:hi + 1][:, kv_head]  # [keys, H_q, D]
            p = (torch.einsum("hd,khd->hk", q[t], k) * scale).softmax(-1)
            out[t] = torch.einsum("hk,khd->hd", p, v)
    return out.cpu()


# (atol, rtol) against the float64 reference: 16-bit runs round p to the value
# dtype before p·V and round the output once; fp32 runs use "ieee" dot products.
TOLERANCE = {torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.5e-2, 1.5e-2), torch.float32: (1e-4, 1e-4)}
