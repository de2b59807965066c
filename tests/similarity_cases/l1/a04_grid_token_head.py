"""L1 by a learner: a 2-D grid, one program per (token, head)."""
import torch
import triton
import triton.language as tl


def slot_mapping(block_table, seq_idx, positions, block_size):
    blk, off = positions // block_size, positions % block_size
    return block_table[seq_idx, blk].to(torch.long) * block_size + off


@triton.jit
def reshape_and_cache_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
                             key_stride, value_stride, HD, D, BD: tl.constexpr):
    token_id = tl.program_id(0)
    head_id = tl.program_id(1)
    slot_id = tl.load(slot_mapping_ptr + token_id).to(tl.int64)
    if slot_id < 0:
        return
    lane = tl.arange(0, BD)
    m = lane < D
    col = head_id.to(tl.int64) * D + lane
    tl.store(k_cache_ptr + slot_id * HD + col, tl.load(key_ptr + token_id.to(tl.int64) * key_stride + col, mask=m),
             mask=m)
    tl.store(v_cache_ptr + slot_id * HD + col,
             tl.load(value_ptr + token_id.to(tl.int64) * value_stride + col, mask=m), mask=m)


def check(cond, msg):
    if not cond:
        raise ValueError(msg)


def reshape_and_cache(key, value, k_cache, v_cache, slot_mapping):
    check(key.dim() == 3 and value.shape == key.shape, "key, value: [T, H, D], same shape")
    check(k_cache.dim() == 4 and k_cache.shape == v_cache.shape, "k_cache, v_cache: same 4-D shape")
    check(k_cache.shape[2] == key.shape[1] and k_cache.shape[3] == key.shape[2], "cache H, D must match key")
    check(k_cache.is_contiguous(), "k_cache must be contiguous (k_cache.contiguous())")
    check(v_cache.is_contiguous(), "v_cache must be contiguous (v_cache.contiguous())")
    check(key.dtype == value.dtype == k_cache.dtype == v_cache.dtype, "dtypes must all be equal")
    check(key.device == value.device == k_cache.device == v_cache.device == slot_mapping.device, "devices differ")
    check(slot_mapping.numel() == key.shape[0], "slot_mapping length must be T")
    check(key.shape[0] == 0 or key[0].is_contiguous(), "key's [H, D] per token must be contiguous")
    check(value.shape[0] == 0 or value[0].is_contiguous(), "value's [H, D] per token must be contiguous")
    n, h, d = key.shape
    if n == 0:
        return
    reshape_and_cache_kernel[(n, h)](key, value, k_cache, v_cache, slot_mapping, key.stride(0), value.stride(0),
                                     h * d, d, BD=triton.next_power_of_2(d))
