"""L1 by a learner: a second grid axis picks K or V, so each program copies one tensor's row."""
import torch
import triton
import triton.language as tl


def slot_mapping(block_table, seq_idx, positions, block_size):
    start_of_block = block_table[seq_idx, positions // block_size].long() * block_size
    return start_of_block + positions % block_size


@triton.jit
def _copy_row(src, dst, n, BLOCK: tl.constexpr):
    o = tl.arange(0, BLOCK)
    tl.store(dst + o, tl.load(src + o, mask=o < n), mask=o < n)


@triton.jit
def reshape_and_cache_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
                             key_stride, value_stride, HD, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    is_value = tl.program_id(1)
    target = tl.load(slot_mapping_ptr + row).to(tl.int64)
    if target != -1:
        if is_value == 0:
            _copy_row(key_ptr + row * key_stride, k_cache_ptr + target * HD, HD, BLOCK)
        else:
            _copy_row(value_ptr + row * value_stride, v_cache_ptr + target * HD, HD, BLOCK)


def reshape_and_cache(key, value, k_cache, v_cache, slot_mapping):
    shapes_ok = key.dim() == 3 and value.shape == key.shape and k_cache.dim() == 4 and v_cache.shape == k_cache.shape
    if not shapes_ok or tuple(k_cache.shape[2:]) != tuple(key.shape[1:]):
        raise ValueError("expected key/value [T, H, D] and caches [N, B, H, D] with the same H and D")
    if slot_mapping.shape != (key.shape[0],):
        raise ValueError("slot_mapping must hold exactly one slot for each token")
    if not all(c.is_contiguous() for c in (k_cache, v_cache)):
        raise ValueError("non-contiguous cache: pass k_cache.contiguous() / v_cache.contiguous()")
    for which, x in (("key", key), ("value", value)):
        if x.numel() and x[0].stride() != (x.shape[2], 1):
            raise ValueError(f"{which} tokens need contiguous [H, D] rows")
    if not (key.dtype is value.dtype is k_cache.dtype is v_cache.dtype):
        raise ValueError("dtype mismatch between key, value and the caches")
    if not (key.device == value.device == k_cache.device == v_cache.device == slot_mapping.device):
        raise ValueError("device mismatch")
    width = key.shape[1] * key.shape[2]
    if key.shape[0] != 0:
        grid = (key.shape[0], 2)
        reshape_and_cache_kernel[grid](key, value, k_cache, v_cache, slot_mapping, key.stride(0), value.stride(0),
                                       width, BLOCK=triton.next_power_of_2(width))
