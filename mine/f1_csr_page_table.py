"""F1: FlashInfer's CSR page table and its append kernel (FlashInfer append_paged_kv_cache).

Read content/f1.md first. Replace each `raise NotImplementedError` with your code;
`make grade` tells you how far you are and what is still wrong.
"""
import torch
import triton
import triton.language as tl

LAYOUTS = ("NHD", "HND")


def block_table_to_csr(block_table, seq_lens, page_size):
    """The same pages as a block table, in CSR form: (kv_indptr, kv_indices, kv_last_page_len).

    block_table [B, max_pages] int32, seq_lens [B] int32 (tokens per sequence), page_size int.
    kv_indptr [B+1]: kv_indptr[0] = 0, kv_indptr[b+1] = kv_indptr[b] + ceil(seq_lens[b] / page_size).
    kv_indices: each row's first ceil(seq_len / page_size) block-table entries, row after row.
    kv_last_page_len [B]: tokens in each sequence's last page, 1..page_size (a full page is
    page_size, not 0); 0 for a sequence of length 0, which owns no page.
    All three int32, on the block table's device. Plain PyTorch, no Python loop over sequences.
    Raise ValueError for non-int32 inputs, page_size < 1, mismatched batch sizes or devices,
    and (on the CPU) a seq_len that is negative or needs more pages than the row has.
    """
    # TODO(f1): your block_table_to_csr (content/f1.md §2 and §4; hints in §8).
    raise NotImplementedError("block_table_to_csr is not written yet: see content/f1.md §2 and §4")


def batch_indices_positions(append_indptr, seq_lens, nnz):
    """Sequence and position of each of the nnz appended tokens (FlashInfer's
    get_batch_indices_positions); seq_lens already count the appended tokens.

    append_indptr [B+1] int32: sequence b appended tokens append_indptr[b]..append_indptr[b+1]-1.
    Returns (batch_indices [nnz], positions [nnz]), int32: token t of sequence b that is its
    i-th new token sits at position seq_lens[b] - append_len[b] + i. Tokens t >= append_indptr[-1]
    are padding: batch index -1, position 0. Plain PyTorch, no Python loop over sequences.
    Raise ValueError for non-int32 inputs, a wrong length, and (on the CPU) an append_indptr
    that does not start at 0 or decreases, nnz < append_indptr[-1], or seq_lens < append_len.
    """
    # TODO(f1): your batch_indices_positions (content/f1.md §5; hints in §8).
    raise NotImplementedError("batch_indices_positions is not written yet: see content/f1.md §5")


@triton.jit
def append_paged_kv_cache_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr,
    batch_indices_ptr, positions_ptr, kv_indices_ptr, kv_indptr_ptr,
    key_stride_n, key_stride_h, value_stride_n, value_stride_h,  # append_key/value [nnz, H, D]
    stride_page, stride_entry, stride_head,  # the cache's; the layout decided which dim is which
    page_size, H, D,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,  # next powers of two >= H and >= D
):
    """Copy each appended token's [H, D] key and value into entry pos % page_size of page
    kv_indices[kv_indptr[b] + pos // page_size] of the caches, b and pos being the
    token's batch index and position (FlashInfer's page look-up, content/f1.md §6).

    The caches are addressed through stride_page, stride_entry and stride_head (the
    layout decides which is which); append_key/value rows through their own strides.
    A token whose batch index is -1 is padding: nothing of it is read, nothing is
    written. Every offset must hold for caches past 2**31 elements.
    """
    # TODO(f1): your kernel (content/f1.md §6; hints in §8).
    raise NotImplementedError("append_paged_kv_cache_kernel is not written yet: see content/f1.md §6")


def append_paged_kv_cache(append_key, append_value, batch_indices, positions, paged_kv_cache,
                          kv_indices, kv_indptr, kv_last_page_len, kv_layout="NHD"):
    """Write append_key/append_value [nnz, H, D] into the paged cache, in place.

    FlashInfer's signature and argument order. paged_kv_cache is a (k_cache, v_cache) tuple of
    4-D tensors or one 5-D tensor whose dim 1 holds K then V; kv_layout "NHD" is
    [num_pages, page_size, H, D], "HND" is [num_pages, H, page_size, D]. Caches and rows are
    read through their strides (the last dim, D, contiguous). Index arrays are int32;
    kv_indptr and kv_last_page_len already count the appended tokens.
    Raise ValueError, naming the argument and the fix, for an unknown layout, non-int32
    index arrays, mismatched shapes, dtypes or devices, and (on the CPU) an indptr that is
    not non-decreasing, a last_page_len out of range or a position beyond the allocated pages.
    """
    # TODO(f1): check the inputs, then run your kernel (content/f1.md §6 and §7; hints in §8).
    raise NotImplementedError("append_paged_kv_cache is not written yet: see content/f1.md §6 and §7")
