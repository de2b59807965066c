"""L1: write the new tokens' K/V into a paged KV cache (vLLM reshape_and_cache_flash).

Read content/l1.md first. Replace each `raise NotImplementedError` with your code;
`make grade` tells you how far you are and what is still wrong.
"""
import torch
import triton
import triton.language as tl


def slot_mapping(block_table, seq_idx, positions, block_size):
    """The slot (row of the flattened cache) of each new token, as a LongTensor[T].

    block_table [B, max_blocks] int32: column i of row b is the physical block that holds
    sequence b's logical block i. seq_idx [T]: the sequence of each new token.
    positions [T]: each token's position inside its own sequence. Plain PyTorch, no
    Python loop over the tokens. What a slot is: content/l1.md §3 and §4.
    """
    # TODO(l1): your slot_mapping (content/l1.md §4; hints in §7).
    raise NotImplementedError("slot_mapping is not written yet: see content/l1.md §4")


@triton.jit
def reshape_and_cache_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    key_stride, value_stride,  # elements from one token's row to the next
    HD,                        # num_kv_heads * head_size: one slot's length
    BLOCK: tl.constexpr,       # next power of two >= HD
):
    """Copy each token's H*D key values and H*D value values into its slot of k_cache and
    v_cache (contiguous [num_blocks, block_size, H, D]).

    key_ptr/value_ptr: token rows key_stride / value_stride elements apart, each row's
    H*D values contiguous. slot_mapping_ptr: one slot per token (int32 or int64); a
    token whose slot is -1 is padding: nothing of it is read, nothing is written. Every
    offset must hold for caches past 2**31 elements (content/l1.md §5).
    """
    # TODO(l1): your kernel (content/l1.md §5; hints in §7).
    raise NotImplementedError("reshape_and_cache_kernel is not written yet: see content/l1.md §5")


def reshape_and_cache(key, value, k_cache, v_cache, slot_mapping):
    """Copy key/value [T, H, D] into k_cache/v_cache [num_blocks, block_size, H, D], in
    place; returns None.

    key/value may be views with any row stride (e.g. rows of a fused QKV tensor; they
    are read in place, not copied) but each token's [H, D] must be contiguous; the
    caches must be contiguous. float16, bfloat16 or float32, one dtype for all four.
    slot_mapping [T] is int32 or int64; -1 marks padding. Raise ValueError, naming the
    argument and the fix, for a non-contiguous cache, a token whose [H, D] is not
    contiguous, mismatched shapes, dtypes or devices, and (on the CPU) slots outside
    the cache (content/l1.md §6).
    """
    # TODO(l1): check the inputs, then run your kernel (content/l1.md §5 and §6; hints in §7).
    raise NotImplementedError("reshape_and_cache is not written yet: see content/l1.md §5 and §6")
