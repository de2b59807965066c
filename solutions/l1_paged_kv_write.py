"""L1 reference: write the new tokens' K/V into a paged KV cache.

Mirrors vLLM's `reshape_and_cache_flash`. Read it next to content/l1.md, which
explains it top to bottom and cites the line ranges below.
"""
import torch
import triton
import triton.language as tl


def slot_mapping(block_table, seq_idx, positions, block_size):
    """Slot of each new token: which row of the flattened cache it goes to."""
    page = positions // block_size  # which page of its own sequence the token is on
    # One gather answers "which physical block holds that page?" for every token at once.
    block = block_table[seq_idx, page].long()
    return positions % block_size + block * block_size


@triton.jit
def reshape_and_cache_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    key_stride, value_stride,  # elements from one token's row to the next
    HD,                        # num_kv_heads * head_size: one slot's length
    BLOCK: tl.constexpr,       # next power of two >= HD
):
    # Widen to int64 before any multiply: slot * HD passes 2**31 in a large cache.
    token = tl.program_id(axis=0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    cols = tl.arange(0, BLOCK)  # one token's H*D values, seen as one row
    # A padding token (slot -1) keeps no column, so it reads and writes nothing.
    # The scalar where() picks the row length first; `(cols < HD) & (slot >= 0)`
    # would mix a scalar into a vector `&`, which the CPU interpreter rejects.
    keep = cols < tl.where(slot >= 0, HD, 0)
    k = tl.load(key_ptr + token * key_stride + cols, mask=keep)
    v = tl.load(value_ptr + token * value_stride + cols, mask=keep)
    row = slot * HD + cols  # §3: slot s is row s of the flattened cache
    tl.store(k_cache_ptr + row, k, mask=keep)
    tl.store(v_cache_ptr + row, v, mask=keep)


def reshape_and_cache(key, value, k_cache, v_cache, slot_mapping):
    """Copy key/value [T, H, D] into the caches [num_blocks, block_size, H, D]."""
    _check_inputs(key, value, k_cache, v_cache, slot_mapping)
    num_tokens, num_heads, head_size = key.shape
    if num_tokens == 0:
        return
    hd = num_heads * head_size
    block = triton.next_power_of_2(hd)
    reshape_and_cache_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), value.stride(0), hd,
        BLOCK=block, num_warps=max(1, min(8, block // 256)),
    )


def _check_inputs(key, value, k_cache, v_cache, slot_mapping):
    # The kernel addresses slot s at s * H * D and reads a token as H * D
    # consecutive values; refuse every input for which that is not true.
    if key.dim() != 3 or key.shape != value.shape:
        raise ValueError(f"key and value must both be [T, H, D]; got {tuple(key.shape)} and {tuple(value.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must both be [num_blocks, block_size, H, D]; "
                         f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if k_cache.shape[2:] != key.shape[1:]:
        raise ValueError(f"cache heads/head size {tuple(k_cache.shape[2:])} do not match key's {tuple(key.shape[1:])}")
    if slot_mapping.shape != key.shape[:1]:
        raise ValueError(f"slot_mapping must have one entry per token: shape {tuple(slot_mapping.shape)}, "
                         f"key has {key.shape[0]} tokens")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be int32 or int64, got {slot_mapping.dtype}")
    if len({key.dtype, value.dtype, k_cache.dtype, v_cache.dtype}) != 1:
        raise ValueError(f"key, value, k_cache, v_cache must share one dtype; got "
                         f"{key.dtype}, {value.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    tensors = (key, value, k_cache, v_cache, slot_mapping)
    if len({t.device for t in tensors}) != 1:
        raise ValueError(f"all tensors must be on one device; got {[str(t.device) for t in tensors]}")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not cache.is_contiguous():
            raise ValueError(f"{name} must be contiguous (got strides {cache.stride()}); "
                             f"pass {name}.contiguous() or allocate it with torch.empty(...)")
    for name, t in (("key", key), ("value", value)):
        if t.shape[0] > 0 and not t[0].is_contiguous():
            raise ValueError(f"each token of {name} must be H*D contiguous values (got strides {t.stride()}); "
                             f"a row-strided view such as qkv[:, 1] is fine, a permuted one is not")
    if slot_mapping.device.type == "cpu" and slot_mapping.numel() > 0:
        # On the CPU the range check is free. On a GPU it would cost a
        # device-to-host sync every step, so there (as in vLLM) the kernel
        # trusts the scheduler's slots.
        num_slots = k_cache.shape[0] * k_cache.shape[1]
        lo, hi = int(slot_mapping.min()), int(slot_mapping.max())
        if lo < -1 or hi >= num_slots:
            raise ValueError(f"slot_mapping holds slots in [{lo}, {hi}], but the cache has slots 0..{num_slots - 1} "
                             f"(and -1 marks padding)")
