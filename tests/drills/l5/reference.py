"""L5's plain-PyTorch reference: the quantising write (in fp32, clamped before the cast:
torch's own cast gives NaN or inf above the format's largest value), the write's wrong
twins the diagnosis replays, the decode in float64 over the dequantised cache (the
kernel's error) and over the unquantised inputs (the format's error), and the tolerances."""
import math

import torch

from _paged import owned_columns

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
FP8_DTYPES = {"e4m3fn": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def fp8_bytes(t):
    """The raw bytes of an fp8 tensor (NaN bytes compare equal to themselves)."""
    return t.view(torch.uint8)


def cut_to_bfloat16(t):
    """fp32 -> bfloat16 -> fp32 by dropping the low 16 bits: how Triton's CPU interpreter
    converts fp32 to bfloat16 (it does not round to nearest)."""
    return (t.float().view(torch.int32) & ~0xFFFF).view(torch.float32)


def _to_source(t, dtype, cut):
    """fp32 `t` rounded to the 16-bit `dtype` and back: to nearest, or cut (bfloat16 only)."""
    return cut_to_bfloat16(t) if cut and dtype == torch.bfloat16 else t.to(dtype).float()


def quantise(x, scale, dtype, how="right"):
    """x [..., H, D] (any float dtype) into fp8 with scale [1] or [H]: fp8(saturate(x.float() / scale)).
    `how` replays a mistake: "multiplied" (x * scale), "source_dtype" (x / scale in x's own
    dtype: rounded twice; "source_dtype_scale": only the scale rounded to it; "source_dtype_quotient":
    the fp32 quotient rounded to it; a "_cut" suffix: rounded to bfloat16 as Triton's
    interpreter does, by dropping bits), "unsaturated" (no clamp: torch's cast gives NaN or inf there)."""
    s = scale.to(x.device).view(-1, 1)
    cut = how.endswith("_cut")
    if how == "multiplied":
        q = x.float() * s
    elif how == "source_dtype":
        q = (x / s.to(x.dtype)).float()
    elif how.startswith("source_dtype_scale"):  # the mistake as Triton's interpreter runs `x / scale.to(x.dtype)`:
        q = x.float() / _to_source(s, x.dtype, cut)  # the scale rounded to x's dtype, the quotient kept in fp32
    elif how.startswith("source_dtype_quotient"):  # `(x.to(fp32) / scale).to(x.dtype)`, or torch's x / a 0-dim scale
        q = _to_source(x.float() / s, x.dtype, cut)
    else:
        q = x.float() / s  # fp32 / fp32: correctly rounded, as the contract says
    if how == "unsaturated":
        return q.to(dtype)
    return q.clamp(-FP8_MAX[dtype], FP8_MAX[dtype]).to(dtype)


def ref_cache_write(rows, cache, slot_mapping, scale, how="right"):
    """Quantise each real token's [H, D] row into its slot of `cache`; slot -1 is skipped."""
    real = slot_mapping.cpu() >= 0
    hd = rows.shape[1] * rows.shape[2]
    slots = slot_mapping.cpu()[real].long()
    quantised = quantise(rows.cpu()[real], scale.cpu(), cache.dtype, how)
    cache.view(-1, hd)[slots.to(cache.device)] = quantised.reshape(-1, hd).to(cache.device)


def dequantised_attention(case, k_power=1, v_power=1, scale_of_query_head=False, unquantised=False):
    """softmax(q·K^T · scale) · V per sequence and query head, float64 on the CPU, with K and
    V read as fp8 · scale (the contract). The knobs replay mistakes: the scale raised to
    k_power / v_power (0: never applied, 2: applied twice), the scale of query head h taken
    at index h of the scale's memory (per-KV-head scales only), or the unquantised inputs
    (the format's own error). Returns [B, H_q, D]."""
    num_seqs, num_heads, head_size = case.query.shape
    num_kv_heads = case.k_cache.shape[2]
    scale = 1.0 / math.sqrt(head_size) if case.scale is None else case.scale
    kv_head = torch.arange(num_heads) // (num_heads // num_kv_heads)
    per_head = case.k_scale.numel() > 1
    if scale_of_query_head and per_head:
        k_s, v_s = case.k_scale_memory[:num_heads].double(), case.v_scale_memory[:num_heads].double()
    else:
        k_s = case.k_scale.cpu().double().expand(num_kv_heads)[kv_head]
        v_s = case.v_scale.cpu().double().expand(num_kv_heads)[kv_head]
    owned = owned_columns(case.seq_lens, case.block_size, case.block_table.shape[1])
    k_cache, v_cache = (case.key_full, case.value_full) if unquantised else (case.k_cache.cpu(), case.v_cache.cpu())
    out = torch.zeros(case.query.shape, dtype=torch.float64)
    for b in range(num_seqs):
        n = int(case.seq_lens[b])
        blocks = case.block_table[b].cpu()[owned[b]].long()
        k, v = (c[blocks].flatten(0, 1)[:n].double()[:, kv_head] for c in (k_cache, v_cache))  # [n, H_q, D]
        if not unquantised:
            k = k * (k_s ** k_power)[None, :, None]
            v = v * (v_s ** v_power)[None, :, None]
        scores = torch.einsum("hd,nhd->hn", case.query[b].cpu().double(), k) * scale
        out[b] = torch.einsum("hn,nhd->hd", scores.softmax(-1), v)
    return out


# (atol, rtol) against the float64 reference on the dequantised cache: L2's and L4's.
TOLERANCE = {torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.5e-2, 1.5e-2), torch.float32: (1e-4, 1e-4)}
# vLLM's own fp8 attention test compares with the unquantised inputs at atol = rtol = 0.15
# when Q, K and V are all fp8 (not for an fp8 KV cache alone): the format's error, reported
# here as a yardstick, never failed on alone.
FORMAT_TOLERANCE = 0.15
