"""L1: write the new tokens' K/V into a paged KV cache (vLLM reshape_and_cache_flash).

Read content/l1.md first. Replace each `raise NotImplementedError` with your code;
`make grade` tells you how far you are and what is still wrong.
"""
import torch
import triton
import triton.language as tl


def slot_mapping(block_table, seq_idx, positions, block_size):
    """Slot of each new token, as a LongTensor[T]. Pure PyTorch, no loop.

    block_table [B, max_blocks] int32: physical block of each sequence's pages.
    seq_idx [T]: the sequence each new token belongs to.
    positions [T]: each token's position inside its own sequence.
    slot = block_table[seq, pos // block_size] * block_size + pos % block_size
    """
    # TODO(l1): one gather from block_table for all T tokens, then the formula above (content/l1.md §4).
    raise NotImplementedError("slot_mapping is not written yet: see content/l1.md §4")


@triton.jit
def reshape_and_cache_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    key_stride, value_stride,  # elements from one token's row to the next
    HD,                        # num_kv_heads * head_size: one slot's length
    BLOCK: tl.constexpr,       # next power of two >= HD
):
    """One program per token: copy its H*D key and value values into its slot.

    A token whose slot is -1 is padding: read nothing, write nothing.
    """
    # TODO(l1): token index, its slot, a masked range of HD offsets, then two
    # loads and two stores (content/l1.md §5).
    raise NotImplementedError("reshape_and_cache_kernel is not written yet: see content/l1.md §5")


def reshape_and_cache(key, value, k_cache, v_cache, slot_mapping):
    """Copy key/value [T, H, D] into k_cache/v_cache [num_blocks, block_size, H, D], in place.

    key/value may be row-strided views (e.g. of a fused QKV tensor) but each
    token's [H, D] must be contiguous. slot_mapping [T] is int32 or int64; -1
    marks padding. Raise ValueError, naming the argument and the fix, for a
    non-contiguous cache, a token whose [H, D] is not contiguous, mismatched
    shapes, dtypes or devices, and (on the CPU) slots outside the cache.
    """
    # TODO(l1): check the inputs (content/l1.md §6), then launch one program per token (§5).
    raise NotImplementedError("reshape_and_cache is not written yet: see content/l1.md §5 and §6")
