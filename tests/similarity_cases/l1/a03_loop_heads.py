"""L1 by a learner: the kernel walks the heads one at a time."""
import torch
import triton
import triton.language as tl


def slot_mapping(block_table, seq_idx, positions, block_size):
    which_block = positions.long() // block_size
    rows = block_table.index_select(0, seq_idx.long())
    blocks = torch.gather(rows.long(), 1, which_block.unsqueeze(1)).squeeze(1)
    return blocks * block_size + positions.long() % block_size


@triton.jit
def reshape_and_cache_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
                             key_stride, value_stride, HD, NUM_HEADS: tl.constexpr, HEAD: tl.constexpr,
                             BLOCK_D: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    where = tl.load(slot_mapping_ptr + i).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    keep = d < tl.where(where < 0, 0, HEAD)
    for h in tl.static_range(NUM_HEADS):
        a = tl.load(key_ptr + i * key_stride + h * HEAD + d, mask=keep)
        b = tl.load(value_ptr + i * value_stride + h * HEAD + d, mask=keep)
        tl.store(k_cache_ptr + where * HD + h * HEAD + d, a, mask=keep)
        tl.store(v_cache_ptr + where * HD + h * HEAD + d, b, mask=keep)


def reshape_and_cache(key, value, k_cache, v_cache, slot_mapping):
    problems = []
    if key.dim() != 3 or key.shape != value.shape:
        problems.append("key and value must share a [T, H, D] shape")
    elif k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.shape[-2:] != key.shape[-2:]:
        problems.append("caches must be [num_blocks, block_size, H, D] like key")
    if not k_cache.is_contiguous() or not v_cache.is_contiguous():
        problems.append("caches must be contiguous")
    if {key.dtype, value.dtype, k_cache.dtype, v_cache.dtype} != {key.dtype}:
        problems.append("one dtype for key, value and the caches")
    if any(t.device != key.device for t in (value, k_cache, v_cache, slot_mapping)):
        problems.append("all on one device")
    if not problems and key.shape[0] and not (key[0].is_contiguous() and value[0].is_contiguous()):
        problems.append("a token's [H, D] must be contiguous")
    if not problems and slot_mapping.shape[0] != key.shape[0]:
        problems.append("one slot per token")
    if problems:
        raise ValueError("; ".join(problems))
    tokens, heads, size = key.shape
    if tokens > 0:
        reshape_and_cache_kernel[(tokens,)](key, value, k_cache, v_cache, slot_mapping, key.stride(0),
                                            value.stride(0), heads * size, NUM_HEADS=heads, HEAD=size,
                                            BLOCK_D=triton.next_power_of_2(size))
