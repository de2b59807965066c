"""L1 by a learner: a fixed number of programs, each striding over the tokens."""
import torch
import triton
import triton.language as tl

PROGRAMS = 64


def slot_mapping(block_table, seq_idx, positions, block_size):
    out = torch.empty_like(positions, dtype=torch.int64)
    out.copy_(block_table[seq_idx, positions // block_size])
    out.mul_(block_size).add_(positions % block_size)
    return out


@triton.jit
def reshape_and_cache_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
                             key_stride, value_stride, HD, num_tokens, BLOCK: tl.constexpr, STRIDE: tl.constexpr):
    lanes = tl.arange(0, BLOCK)
    for tok in range(tl.program_id(0), num_tokens, STRIDE):
        t64 = tl.zeros([], tl.int64) + tok
        s = tl.load(slot_mapping_ptr + t64).to(tl.int64)
        use = lanes < tl.where(s < 0, 0, HD)
        tl.store(k_cache_ptr + s * HD + lanes, tl.load(key_ptr + t64 * key_stride + lanes, mask=use), mask=use)
        tl.store(v_cache_ptr + s * HD + lanes, tl.load(value_ptr + t64 * value_stride + lanes, mask=use), mask=use)


def reshape_and_cache(key, value, k_cache, v_cache, slot_mapping):
    try:
        T, H, D = key.shape
        NB, BS, CH, CD = k_cache.shape
    except ValueError:
        raise ValueError("key must be 3-D [T, H, D] and k_cache 4-D [num_blocks, block_size, H, D]") from None
    if value.shape != key.shape or v_cache.shape != k_cache.shape or (CH, CD) != (H, D):
        raise ValueError("shapes of key/value/k_cache/v_cache do not agree")
    if slot_mapping.shape != (T,):
        raise ValueError(f"slot_mapping must be of shape ({T},)")
    dtypes = {key.dtype, value.dtype, k_cache.dtype, v_cache.dtype}
    devices = {key.device, value.device, k_cache.device, v_cache.device, slot_mapping.device}
    if len(dtypes) != 1 or len(devices) != 1:
        raise ValueError(f"need a single dtype and device, got {dtypes} and {devices}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("caches must be contiguous: use .contiguous()")
    if T and (key.stride()[1:] != (D, 1) or value.stride()[1:] != (D, 1)):
        raise ValueError("within a token, key/value [H, D] must be contiguous")
    if T:
        programs = min(T, PROGRAMS)
        reshape_and_cache_kernel[(programs,)](key, value, k_cache, v_cache, slot_mapping, key.stride(0),
                                              value.stride(0), H * D, T, BLOCK=triton.next_power_of_2(H * D),
                                              STRIDE=programs)
