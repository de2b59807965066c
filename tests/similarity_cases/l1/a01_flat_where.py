"""L1 by a learner: one program per token, a flat H*D tile, padding skipped with an early return."""
import torch
import triton
import triton.language as tl


def slot_mapping(block_table, seq_idx, positions, block_size):
    logical = torch.div(positions, block_size, rounding_mode="floor")
    physical = block_table[seq_idx.long(), logical.long()].to(torch.int64)
    return physical * block_size + torch.remainder(positions, block_size)


@triton.jit
def reshape_and_cache_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
                             key_stride, value_stride, HD, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    s = tl.load(slot_mapping_ptr + t).to(tl.int64)
    if s >= 0:
        offs = tl.arange(0, BLOCK)
        inside = offs < HD
        src_k = key_ptr + t.to(tl.int64) * key_stride + offs
        src_v = value_ptr + t.to(tl.int64) * value_stride + offs
        dst = s * HD + offs
        tl.store(k_cache_ptr + dst, tl.load(src_k, mask=inside), mask=inside)
        tl.store(v_cache_ptr + dst, tl.load(src_v, mask=inside), mask=inside)


def reshape_and_cache(key, value, k_cache, v_cache, slot_mapping):
    if key.ndim != 3 or value.shape != key.shape:
        raise ValueError("key and value must be [T, H, D] of one shape")
    if k_cache.shape != v_cache.shape or k_cache.shape[2:] != key.shape[1:]:
        raise ValueError("k_cache/v_cache must be [num_blocks, block_size, H, D] matching key")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the caches must be contiguous: call .contiguous() first")
    if key.stride(2) != 1 or key.stride(1) != key.shape[2] or value.stride(2) != 1 or value.stride(1) != value.shape[2]:
        raise ValueError("each token's [H, D] must be contiguous in key and value")
    if key.dtype != value.dtype or key.dtype != k_cache.dtype or k_cache.dtype != v_cache.dtype:
        raise ValueError("key, value and both caches need the same dtype")
    if len(slot_mapping) != key.shape[0]:
        raise ValueError("slot_mapping needs one slot per token")
    if len({key.device, value.device, k_cache.device, v_cache.device, slot_mapping.device}) > 1:
        raise ValueError("every tensor must be on the same device")
    n = key.shape[0]
    hd = key.shape[1] * key.shape[2]
    if n:
        reshape_and_cache_kernel[(n,)](key, value, k_cache, v_cache, slot_mapping, key.stride(0), value.stride(0), hd,
                                       BLOCK=triton.next_power_of_2(hd))
