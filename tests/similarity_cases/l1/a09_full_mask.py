"""L1 by a learner: the padding flag broadcast with tl.full, then one mask."""
import torch
import triton
import triton.language as tl


def slot_mapping(block_table, seq_idx, positions, block_size):
    positions = positions.long()
    return torch.add(positions.remainder(block_size),
                     block_table.long()[seq_idx.long(), positions.div(block_size, rounding_mode="trunc")],
                     alpha=block_size)


@triton.jit
def reshape_and_cache_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
                             key_stride, value_stride, HD, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    sm = tl.load(slot_mapping_ptr + pid).to(tl.int64)
    ar = tl.arange(0, BLOCK)
    not_pad = tl.full([BLOCK], 1, tl.int1) & (tl.full([BLOCK], 0, tl.int64) + sm >= 0)
    msk = not_pad & (ar < HD)
    src_off = pid.to(tl.int64)
    tl.store(k_cache_ptr + (sm * HD + ar), tl.load(key_ptr + (src_off * key_stride + ar), mask=msk), mask=msk)
    tl.store(v_cache_ptr + (sm * HD + ar), tl.load(value_ptr + (src_off * value_stride + ar), mask=msk), mask=msk)


def _same(items):
    return all(x == items[0] for x in items)


def reshape_and_cache(key, value, k_cache, v_cache, slot_mapping):
    if len(key.shape) != 3 or len(k_cache.shape) != 4:
        raise ValueError("key must be [T, H, D] and k_cache [num_blocks, block_size, H, D]")
    if not _same([tuple(key.shape), tuple(value.shape)]) or not _same([tuple(k_cache.shape), tuple(v_cache.shape)]):
        raise ValueError("key/value and k_cache/v_cache must come in equal shapes")
    if tuple(k_cache.shape[-2:]) != tuple(key.shape[-2:]):
        raise ValueError("the caches' heads and head size must be key's")
    if not _same([key.dtype, value.dtype, k_cache.dtype, v_cache.dtype]):
        raise ValueError("all four tensors must share one dtype")
    if not _same([t.device for t in (key, value, k_cache, v_cache, slot_mapping)]):
        raise ValueError("all tensors must live on one device")
    if not k_cache.is_contiguous():
        raise ValueError("k_cache must be contiguous")
    if not v_cache.is_contiguous():
        raise ValueError("v_cache must be contiguous")
    if key.shape[0] and not key[0].is_contiguous():
        raise ValueError("key rows: [H, D] must be contiguous")
    if value.shape[0] and not value[0].is_contiguous():
        raise ValueError("value rows: [H, D] must be contiguous")
    if tuple(slot_mapping.shape) != (key.shape[0],):
        raise ValueError("slot_mapping must be [T]")
    if key.shape[0] == 0:
        return None
    n_el = key.shape[1] * key.shape[2]
    reshape_and_cache_kernel[(key.shape[0],)](key, value, k_cache, v_cache, slot_mapping, key.stride(0),
                                              value.stride(0), n_el, BLOCK=triton.next_power_of_2(n_el))
