"""L1 by a learner: padding clamped to slot 0 and masked off; checks driven by a table."""
import torch
import triton
import triton.language as tl


def slot_mapping(block_table, seq_idx, positions, block_size):
    pos = positions.to(torch.int64)
    q, r = pos // block_size, pos % block_size
    return r + block_size * block_table.to(torch.int64)[seq_idx.to(torch.int64), q]


@triton.jit
def reshape_and_cache_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
                             key_stride, value_stride, HD, BLOCK: tl.constexpr):
    me = tl.cast(tl.program_id(0), tl.int64)
    raw = tl.cast(tl.load(slot_mapping_ptr + me), tl.int64)
    real = raw >= 0
    safe = tl.maximum(raw, 0)
    n_live = tl.where(real, HD, 0)
    k = tl.arange(0, BLOCK)
    live = k < n_live
    key_row = tl.load(key_ptr + me * key_stride + k, mask=live)
    val_row = tl.load(value_ptr + me * value_stride + k, mask=live)
    base = safe * HD
    tl.store(k_cache_ptr + base + k, key_row, mask=live)
    tl.store(v_cache_ptr + base + k, val_row, mask=live)


RULES = (
    (lambda k, v, kc, vc, s: k.dim() == 3 and v.shape == k.shape, "key/value must be equal [T, H, D]"),
    (lambda k, v, kc, vc, s: kc.dim() == 4 and kc.shape == vc.shape, "caches must be equal 4-D tensors"),
    (lambda k, v, kc, vc, s: kc.shape[2:] == k.shape[1:], "cache [H, D] must equal key's"),
    (lambda k, v, kc, vc, s: kc.is_contiguous() and vc.is_contiguous(), "caches must be contiguous"),
    (lambda k, v, kc, vc, s: k.dtype == v.dtype == kc.dtype == vc.dtype, "one dtype for all four"),
    (lambda k, v, kc, vc, s: len({k.device, v.device, kc.device, vc.device, s.device}) == 1, "one device"),
    (lambda k, v, kc, vc, s: s.shape == k.shape[:1], "slot_mapping: one per token"),
    (lambda k, v, kc, vc, s: k.shape[0] == 0 or (k[0].is_contiguous() and v[0].is_contiguous()),
     "every token's [H, D] contiguous"),
)


def reshape_and_cache(key, value, k_cache, v_cache, slot_mapping):
    for rule, text in RULES:
        if not rule(key, value, k_cache, v_cache, slot_mapping):
            raise ValueError(text)
    count = key.shape[0]
    per_slot = key[0].numel() if count else 0
    if count:
        reshape_and_cache_kernel[(count,)](key, value, k_cache, v_cache, slot_mapping, key.stride(0),
                                           value.stride(0), per_slot, BLOCK=triton.next_power_of_2(per_slot))
