"""L1 by a learner: each program moves a [TOKENS, H*D] tile, several tokens at once."""
import torch
import triton
import triton.language as tl

TOKENS = 4


def slot_mapping(block_table, seq_idx, positions, block_size):
    nth = positions // block_size
    return block_table[seq_idx, nth].long() * block_size + positions % block_size


@triton.jit
def reshape_and_cache_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
                             key_stride, value_stride, HD, n_tokens, BLOCK: tl.constexpr, TILE: tl.constexpr):
    first = tl.program_id(0).to(tl.int64) * TILE
    rows = first + tl.arange(0, TILE)
    in_batch = rows < n_tokens
    slots = tl.load(slot_mapping_ptr + rows, mask=in_batch, other=-1).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    grid_mask = (slots >= 0)[:, None] & (cols < HD)[None, :]
    kt = tl.load(key_ptr + rows[:, None] * key_stride + cols[None, :], mask=grid_mask)
    vt = tl.load(value_ptr + rows[:, None] * value_stride + cols[None, :], mask=grid_mask)
    where = slots[:, None] * HD + cols[None, :]
    tl.store(k_cache_ptr + where, kt, mask=grid_mask)
    tl.store(v_cache_ptr + where, vt, mask=grid_mask)


def reshape_and_cache(key, value, k_cache, v_cache, slot_mapping):
    if key.ndim != 3:
        raise ValueError(f"key must be [T, H, D], got shape {list(key.shape)}")
    if value.shape != key.shape:
        raise ValueError(f"value shape {list(value.shape)} must equal key shape {list(key.shape)}")
    if k_cache.ndim != 4 or v_cache.shape != k_cache.shape or k_cache.shape[2:] != key.shape[1:]:
        raise ValueError(f"caches {list(k_cache.shape)}/{list(v_cache.shape)} do not fit key {list(key.shape)}")
    if slot_mapping.ndim != 1 or slot_mapping.numel() != key.shape[0]:
        raise ValueError(f"slot_mapping must be [{key.shape[0]}]")
    if k_cache.dtype != key.dtype or v_cache.dtype != key.dtype or value.dtype != key.dtype:
        raise ValueError("mixed dtypes")
    if k_cache.device != key.device or v_cache.device != key.device or value.device != key.device \
            or slot_mapping.device != key.device:
        raise ValueError("mixed devices")
    if not k_cache.is_contiguous() or not v_cache.is_contiguous():
        raise ValueError("make the caches contiguous (.contiguous())")
    D = key.shape[2]
    if key.stride(2) != 1 or key.stride(1) != D or value.stride(2) != 1 or value.stride(1) != D:
        raise ValueError("key/value: each token's heads must be packed contiguously")
    T = key.shape[0]
    if T == 0:
        return
    hd = key.shape[1] * D
    reshape_and_cache_kernel[(triton.cdiv(T, TOKENS),)](key, value, k_cache, v_cache, slot_mapping, key.stride(0),
                                                        value.stride(0), hd, T, BLOCK=triton.next_power_of_2(hd),
                                                        TILE=TOKENS)
