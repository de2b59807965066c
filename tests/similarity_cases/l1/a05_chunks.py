"""L1 by a learner: fixed-size chunks walked in a loop, so any H*D fits one small tile."""
import torch
import triton
import triton.language as tl

CHUNK = 128


def slot_mapping(block_table, seq_idx, positions, block_size):
    table = block_table.to(torch.int64)
    flat = table.flatten()
    idx = seq_idx.to(torch.int64) * table.shape[1] + positions.to(torch.int64) // block_size
    return flat[idx] * block_size + positions.to(torch.int64) % block_size


@triton.jit
def reshape_and_cache_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
                             key_stride, value_stride, HD, STEP: tl.constexpr, N_STEPS: tl.constexpr):
    p = tl.program_id(0).to(tl.int64)
    dest = tl.load(slot_mapping_ptr + p).to(tl.int64)
    limit = tl.where(dest >= 0, HD, 0)
    for c in tl.static_range(N_STEPS):
        j = c * STEP + tl.arange(0, STEP)
        ok = j < limit
        x = tl.load(key_ptr + p * key_stride + j, mask=ok)
        tl.store(k_cache_ptr + dest * HD + j, x, mask=ok)
        y = tl.load(value_ptr + p * value_stride + j, mask=ok)
        tl.store(v_cache_ptr + dest * HD + j, y, mask=ok)


def reshape_and_cache(key, value, k_cache, v_cache, slot_mapping):
    if not (key.dim() == 3 and tuple(value.shape) == tuple(key.shape)):
        raise ValueError(f"bad key/value shapes {tuple(key.shape)}, {tuple(value.shape)}")
    if not (k_cache.dim() == 4 and k_cache.shape == v_cache.shape and k_cache.shape[2:] == key.shape[1:]):
        raise ValueError(f"bad cache shapes {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    for t, nm in ((k_cache, "k_cache"), (v_cache, "v_cache")):
        if not t.is_contiguous():
            raise ValueError(f"{nm} must be contiguous")
    for t, nm in ((key, "key"), (value, "value")):
        if t.stride(-1) != 1 or t.stride(-2) != t.shape[-1]:
            raise ValueError(f"{nm}: per-token [H, D] block must be contiguous")
    kinds = [key.dtype, value.dtype, k_cache.dtype, v_cache.dtype]
    if kinds.count(kinds[0]) != 4:
        raise ValueError(f"dtypes differ: {kinds}")
    places = [x.device for x in (key, value, k_cache, v_cache, slot_mapping)]
    if places.count(places[0]) != 5:
        raise ValueError(f"devices differ: {places}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != key.shape[0]:
        raise ValueError("slot_mapping must be [T]")
    hd = key.shape[1] * key.shape[2]
    if key.shape[0]:
        reshape_and_cache_kernel[(key.shape[0],)](key, value, k_cache, v_cache, slot_mapping, key.stride(0),
                                                  value.stride(0), hd, STEP=CHUNK, N_STEPS=triton.cdiv(hd, CHUNK))
