"""Drill L6's float64 reference: L3's answer, computed as cascade attention splits it
(the prefix's part and the suffix's part), so that the mistakes of the split and the
merge can be computed too; the rule of cascade_prefix_len; the tolerances."""
import math

import torch

# (atol, rtol) against the float64 reference, as L3's: the reference's parts are in
# the query's dtype (rounded once there, as vLLM's are) and the output once more.
TOLERANCE = {torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.5e-2, 1.5e-2), torch.float32: (1e-4, 1e-4)}


def prefix_len_rule(block_table, query_start_loc, seq_lens, block_size, cap=True):
    """design.md's rule in plain Python: leading columns equal in every row, times
    block_size, capped (unless cap=False: the pitfall) by min(seq_len - q_len), rounded
    down to a multiple of block_size; 0 for fewer than two sequences."""
    table = block_table.cpu().tolist()
    lens = seq_lens.cpu().tolist()
    starts = query_start_loc.cpu().tolist()
    if len(lens) < 2:
        return 0
    shared = 0
    while shared < len(table[0]) and all(row[shared] == table[0][shared] for row in table):
        shared += 1
    prefix = shared * block_size
    if cap:
        prefix = min(prefix, min(n - (starts[b + 1] - starts[b]) for b, n in enumerate(lens)))
    return prefix // block_size * block_size


def ref_cascade(query, k_cache, v_cache, block_table, query_start_loc, seq_lens, common_prefix_len, scale=None,
                mistake=None, kv_heads=(None, None)):
    """float64, [total_q, H_q, D] on the CPU: token t of sequence b, at position pos,
    attends to its keys 0..pos. The keyword `mistake` computes a wrong kernel's answer:
    "prefix_causal" (pass 1 under FlashAttention's bottom-right causal mask over the
    batch as one sequence: token t sees prefix keys 0..P - total_q + t), "prefix_causal_tl"
    (top-left: 0..t), "prefix_twice" (pass 2 starts at key 0: the prefix counted twice),
    "swapped" (the merge weighs the prefix's v by the suffix's LSE and the other way);
    "no_prefix" / "no_suffix", one part alone. `kv_heads`: (the prefix's, the suffix's) KV
    head of each query head, [H_q] each, None for h // group (a head mapping's mistakes).
    Computed on the inputs' device: on one CPU thread, L6's 8192-key GPU test took 22 s."""
    total_q, num_heads, head_size = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    scale = 1.0 / math.sqrt(head_size) if scale is None else scale
    group = num_heads // num_kv_heads
    device = query.device
    kv_head = torch.arange(num_heads, device=device) // group
    prefix_heads, suffix_heads = (kv_head if m is None else torch.as_tensor(m, device=device).long() for m in kv_heads)
    # With one head mapping for both parts, query heads are read in groups against the KV
    # heads as stored; copying K and V out to every query head (as a mistake's mapping or
    # the swapped merge needs) took a minute a call for L6's 8192-key GPU test.
    grouped = kv_heads == (None, None) and mistake != "swapped"
    starts = query_start_loc.long().cpu().tolist()
    lens = seq_lens.long().cpu().tolist()
    table = block_table.long().cpu()
    q = query.double()
    prefix = common_prefix_len
    out = torch.zeros(total_q, num_heads, head_size, dtype=torch.float64, device=device)
    for b, n in enumerate(lens):
        blocks = table[b, :math.ceil(n / block_size)]
        k, v = (c[blocks.to(c.device)].double().to(device).reshape(-1, num_kv_heads, head_size)[:n]
                for c in (k_cache, v_cache))
        if not grouped:
            k, v = (_by_part(kv, prefix, prefix_heads, suffix_heads) for kv in (k, v))
        q_len = starts[b + 1] - starts[b]
        for t in range(starts[b], starts[b + 1]):
            pos = n - q_len + (t - starts[b])
            s = _scores(q[t], k[:pos + 1], group if grouped else 1) * scale  # [H_q, keys]
            keys = torch.arange(pos + 1, device=device)
            in_prefix = keys < prefix
            if mistake == "prefix_twice":
                s = s + torch.where(in_prefix, math.log(2.0), 0.0)
            elif mistake in ("prefix_causal", "prefix_causal_tl"):
                last = prefix - total_q + t if mistake == "prefix_causal" else t
                s = s.masked_fill(in_prefix & (keys > last), float("-inf"))
            elif mistake in ("no_prefix", "no_suffix"):  # one part alone (described, not named)
                s = s.masked_fill(in_prefix if mistake == "no_prefix" else ~in_prefix, float("-inf"))
            if mistake == "swapped":
                out[t] = _swapped(s, v[:pos + 1], in_prefix)
            elif bool(torch.isfinite(s).any()):
                out[t] = _weighted(s.softmax(-1), v[:pos + 1], group if grouped else 1)
    return out.cpu()


def _scores(q, k, group):
    """q [H_q, D] against k [keys, H_q / group, D]: [H_q, keys], query head h reading KV head h // group."""
    return torch.einsum("jgd,kjd->jgk", q.view(k.shape[1], group, -1), k).reshape(q.shape[0], -1)


def _weighted(p, v, group):
    """p [H_q, keys] over v [keys, H_q / group, D]: [H_q, D]."""
    return torch.einsum("jgk,kjd->jgd", p.view(v.shape[1], group, -1), v).reshape(p.shape[0], -1)


def _by_part(kv, prefix, prefix_heads, suffix_heads):
    """[keys, H_kv, D] -> [keys, H_q, D]: keys before `prefix` read through prefix_heads, the rest suffix_heads."""
    in_prefix = (torch.arange(kv.shape[0], device=kv.device) < prefix)[:, None, None]
    return torch.where(in_prefix, kv[:, prefix_heads], kv[:, suffix_heads])


def _swapped(s, v, in_prefix):
    """The merge with its sides swapped: the prefix's v weighted by exp(suffix LSE)."""
    def part(mask):
        sm = s[:, mask]
        if sm.shape[1] == 0:
            return (torch.zeros(s.shape[0], v.shape[-1], dtype=s.dtype, device=s.device),
                    torch.full((s.shape[0],), float("-inf"), dtype=s.dtype, device=s.device))
        return torch.einsum("hk,khd->hd", sm.softmax(-1), v[mask]), torch.logsumexp(sm, -1)
    (v_p, s_p), (v_s, s_s) = part(in_prefix), part(~in_prefix)
    top = torch.maximum(s_p, s_s)
    w_p, w_s = torch.exp(s_s - top), torch.exp(s_p - top)  # swapped
    return (w_p[:, None] * v_p + w_s[:, None] * v_s) / (w_p + w_s)[:, None]
