"""L2's plain-PyTorch reference (content/l2.md): the scores and values gathered through
the block table, softmax attention over them, the online softmax of §3 step by step, and
the tolerances against the fp32 reference."""
import math

import torch

from _paged import owned_columns


def decode_scores_values(query, k_cache, v_cache, block_table, seq_lens, scale=None, kv_head=None):
    """Per sequence, (scores [H_q, n] · scale, values [H_q, n, D]) in fp32 on the CPU:
    gather the sequence's blocks through the block table, keep its first n = seq_len
    tokens, give query head h the KV head kv_head[h] (default h // (H_q / H_kv)).
    """
    num_seqs, num_heads, head_size = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    scale = 1.0 / math.sqrt(head_size) if scale is None else scale
    kv_head = (torch.arange(num_heads) // (num_heads // num_kv_heads) if kv_head is None else kv_head).cpu()
    owned = owned_columns(seq_lens, block_size, block_table.shape[1])
    result = []
    for b in range(num_seqs):
        n = int(seq_lens[b])
        blocks = block_table[b].cpu()[owned[b]].long().to(k_cache.device)
        k, v = (cache[blocks].flatten(0, 1)[:n].float().cpu()[:, kv_head] for cache in (k_cache, v_cache))
        scores = torch.einsum("hd,nhd->hn", query[b].float().cpu(), k) * scale
        result.append((scores, v.transpose(0, 1)))
    return result


def ref_paged_decode(query, k_cache, v_cache, block_table, seq_lens, scale=None, kv_head=None):
    """The reference of L2: softmax(q·K^T · scale) · V for each sequence and query head,
    in fp32, from the K/V gathered through the block table. Returns [B, H_q, D] fp32 (CPU).

    `kv_head` replaces the GQA mapping and other `seq_lens` than the true ones
    attend over more or fewer tokens: the diagnosis tries such mistakes.
    """
    out = torch.empty(query.shape)
    for b, (scores, values) in enumerate(decode_scores_values(query, k_cache, v_cache, block_table, seq_lens,
                                                             scale, kv_head)):
        out[b] = torch.einsum("hn,hnd->hd", scores.softmax(dim=-1), values)
    return out


def online_softmax(scores, values, tile, rescale_sum=True, rescale_acc=True, zero_scores=False):
    """content/l2.md §3's online softmax over tiles of `tile` tokens: scores [H, n], values
    [H, n, D] in fp32. Returns the state after each tile, [(m, alpha, p, l, acc)], so the
    page's worked example can be checked step by step; the output is acc / l of the last.

    The flags replay a kernel's mistakes for the diagnosis: no rescaling of the running
    sum and/or accumulator when the max grows, or the positions past n in the last tile
    left at score 0 (value 0) instead of -inf.
    """
    heads, n = scores.shape
    if zero_scores:
        pad = -n % tile
        scores = torch.cat([scores, scores.new_zeros(heads, pad)], dim=1)
        values = torch.cat([values, values.new_zeros(heads, pad, values.shape[2])], dim=1)
    m = torch.full((heads,), float("-inf"))
    l, acc, steps = torch.zeros(heads), torch.zeros(heads, values.shape[2]), []
    for start in range(0, scores.shape[1], tile):
        s, v = scores[:, start:start + tile], values[:, start:start + tile]
        m_new = torch.maximum(m, s.max(dim=1).values)
        alpha = torch.exp(m - m_new)
        p = torch.exp(s - m_new[:, None])
        l = (l * alpha if rescale_sum else l) + p.sum(dim=1)
        acc = (acc * alpha[:, None] if rescale_acc else acc) + torch.einsum("hn,hnd->hd", p, v)
        m = m_new
        steps.append((m, alpha, p, l, acc))
    return steps


# (atol, rtol) against the fp32 reference. 16-bit runs round p to the value
# dtype before p·V (as the tensor cores want) and round the output once; fp32
# runs compute in fp32 throughout ("ieee" dot products, no TF32).
DECODE_TOLERANCE = {torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.5e-2, 1.5e-2), torch.float32: (1e-4, 1e-4)}
