"""L7's plain-PyTorch reference (float64, on the CPU): the latent write, MLA decode as
plain attention over each sequence's latent rows (with the two mistakes the diagnosis
replays: another scale, the rotary part left out), and the tolerances."""
import math

import torch


def ref_concat_and_cache(kv_c, k_pe, kv_cache, slot_mapping):
    """Each real token's row, kv_c then k_pe, into its slot of kv_cache (contiguous); slot -1 skipped."""
    real = slot_mapping >= 0
    rank = kv_c.shape[1]
    rows = kv_cache.view(-1, kv_cache.shape[-1])
    slots = slot_mapping[real].long()
    rows[slots, :rank] = kv_c[real]
    rows[slots, rank:] = k_pe[real]


def latent_rows(kv_cache, block_table, seq_lens):
    """Per sequence, its seq_lens[b] cached latent rows [n, R + P] in float64 on the CPU,
    in position order (the block table read only up to the sequence's last block)."""
    block_size = kv_cache.shape[1]
    rows = []
    for b, n in enumerate(seq_lens.tolist()):
        blocks = block_table[b, :math.ceil(n / block_size)].long().to(kv_cache.device)
        rows.append(kv_cache[blocks].flatten(0, 1)[:n].cpu().double())
    return rows


def ref_mla_decode(q_nope, q_pe, rows, scale, rope=True):
    """softmax((q_nope · c + q_pe · k_pe) * scale) · c per sequence and head, float64, from
    `latent_rows`. Returns (out [B, H, R], lse [B, H]): an empty sequence gives out = 0 and
    lse = -inf. `rope=False` leaves q_pe · k_pe out (a mistake the diagnosis replays)."""
    num_seqs, num_heads, rank = q_nope.shape
    out = torch.zeros(num_seqs, num_heads, rank, dtype=torch.float64)
    lse = torch.full((num_seqs, num_heads), float("-inf"), dtype=torch.float64)
    for b, row in enumerate(rows):
        if not len(row):
            continue
        c, k_pe = row[:, :rank], row[:, rank:]
        s = q_nope[b].cpu().double() @ c.T
        if rope:
            s = s + q_pe[b].cpu().double() @ k_pe.T
        s = s * scale
        lse[b] = torch.logsumexp(s, dim=-1)
        out[b] = torch.softmax(s, dim=-1) @ c
    return out, lse


# (atol, rtol) of out against the float64 reference, by dtype: the partials are fp32
# whatever the input, and the second product takes the weights in the input's dtype.
TOLERANCE = {torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.5e-2, 1.5e-2), torch.float32: (1e-4, 1e-4)}
# lse's: the scores are exact products summed in fp32 (16-bit inputs) whatever the dtype.
LSE_TOLERANCE = (1e-3, 1e-4)
