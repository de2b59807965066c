"""L1 by a learner: a 2-D [heads, dims] tile per token, padding masked out."""
import torch
import triton
import triton.language as tl


def slot_mapping(block_table, seq_idx, positions, block_size):
    pages = block_table.long()[seq_idx, positions // block_size]
    offsets = positions - (positions // block_size) * block_size
    return (pages * block_size + offsets).long()


@triton.jit
def reshape_and_cache_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
                             key_stride, value_stride, HD, H: tl.constexpr, D: tl.constexpr,
                             BH: tl.constexpr, BD: tl.constexpr):
    tok = tl.program_id(axis=0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    heads = tl.arange(0, BH)[:, None]
    dims = tl.arange(0, BD)[None, :]
    valid = (heads < H) & (dims < D)
    valid = valid & (tl.zeros([BH, BD], dtype=tl.int64) + slot >= 0)
    inner = heads * D + dims
    kv = tl.load(key_ptr + tok * key_stride + inner, mask=valid, other=0.0)
    vv = tl.load(value_ptr + tok * value_stride + inner, mask=valid, other=0.0)
    tl.store(k_cache_ptr + slot * HD + inner, kv, mask=valid)
    tl.store(v_cache_ptr + slot * HD + inner, vv, mask=valid)


def _fail(message):
    raise ValueError(message)


def reshape_and_cache(key, value, k_cache, v_cache, slot_mapping):
    T, H, D = key.shape if key.dim() == 3 else _fail(f"key must be 3-D, got {key.dim()} dims")
    if tuple(value.shape) != (T, H, D):
        _fail(f"value shape {tuple(value.shape)} != key shape {(T, H, D)}")
    for name, c in {"k_cache": k_cache, "v_cache": v_cache}.items():
        if c.dim() != 4 or tuple(c.shape[2:]) != (H, D):
            _fail(f"{name} must be [blocks, block_size, {H}, {D}]")
        if not c.is_contiguous():
            _fail(f"{name} is not contiguous; use {name}.contiguous()")
        if c.dtype != key.dtype:
            _fail(f"{name} dtype {c.dtype} differs from key dtype {key.dtype}")
        if c.device != key.device:
            _fail(f"{name} is on {c.device}, key on {key.device}")
    if k_cache.shape != v_cache.shape:
        _fail("k_cache and v_cache shapes differ")
    if value.dtype != key.dtype or value.device != key.device or slot_mapping.device != key.device:
        _fail("value/slot_mapping must match key's dtype and device")
    for name, x in {"key": key, "value": value}.items():
        if x.stride(2) != 1 or x.stride(1) != D:
            _fail(f"{name}: every token's [H, D] must be contiguous")
    if slot_mapping.numel() != T:
        _fail(f"slot_mapping has {slot_mapping.numel()} entries for {T} tokens")
    if T == 0:
        return
    reshape_and_cache_kernel[(T,)](key, value, k_cache, v_cache, slot_mapping, key.stride(0), value.stride(0), H * D,
                                   H=H, D=D, BH=triton.next_power_of_2(H), BD=triton.next_power_of_2(D))
