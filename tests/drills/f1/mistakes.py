"""Drill F1's planted mistakes: the page's pitfalls and the other wrong kernels, as
edits of solutions/f1_csr_page_table.py, and PLANTED (where they are planted and explained).
"""
from _drill import Mistake, Pitfall, Planted

# ---------------------------------------------------------------------------
# Pitfalls: (exact text, replacement) edits of solutions/f1_csr_page_table.py.

PITFALLS = {
    "indptr_off_by_one": Pitfall(
        says="the kernel starts sequence b's pages at kv_indptr[b + 1] instead of kv_indptr[b]: it writes into "
             "the next sequence's pages", edits=(
            ("page_iter = tl.load(kv_indptr_ptr + b) + pos // page_size",
             "page_iter = tl.load(kv_indptr_ptr + b + 1) + pos // page_size"),),
        races=True),  # two sequences' tokens land on the same pages
    "layout_swapped": Pitfall(
        says="NHD and HND are swapped: the entry and head strides are exchanged", edits=(
            ("page_size, stride_entry, stride_head = k_cache.shape[1], k_cache.stride(1), k_cache.stride(2)",
             "page_size, stride_entry, stride_head = k_cache.shape[1], k_cache.stride(2), k_cache.stride(1)"),
            ("page_size, stride_entry, stride_head = k_cache.shape[2], k_cache.stride(2), k_cache.stride(1)",
             "page_size, stride_entry, stride_head = k_cache.shape[2], k_cache.stride(1), k_cache.stride(2)"),)),
    "token_index_as_position": Pitfall(
        says="the token's global index in the batch is used as its position in its sequence", edits=(
            ("positions = seq_lens_[batch] - append_len_[batch] + (token - append_indptr[batch])",
             "positions = token"),)),
    "int32_offsets": Pitfall(
        says="page * stride_page is computed in int32 and wraps around once the cache passes 2**31 elements", edits=(
            ("token = tl.program_id(axis=0).to(tl.int64)", "token = tl.program_id(axis=0)"),
            ("page = tl.load(kv_indices_ptr + page_iter).to(tl.int64)",
             "page = tl.load(kv_indices_ptr + page_iter)"),),
        crashes=True),  # the wrapped offset lands far before the cache: usually a crash
    "last_page_len_as_position": Pitfall(
        says="every token is written at the end of the last page (kv_last_page_len - 1), where a decode step's "
             "single token goes, instead of at its own position", edits=(
            ("batch_indices_ptr, positions_ptr, kv_indices_ptr, kv_indptr_ptr,\n",
             "batch_indices_ptr, positions_ptr, kv_indices_ptr, kv_indptr_ptr, kv_last_page_len_ptr,\n"),
            ("page_iter = tl.load(kv_indptr_ptr + b) + pos // page_size",
             "page_iter = tl.load(kv_indptr_ptr + b + 1) - 1"),
            ("entry = pos % page_size", "entry = tl.load(kv_last_page_len_ptr + b) - 1"),
            ("batch_indices, positions, kv_indices, kv_indptr,\n",
             "batch_indices, positions, kv_indices, kv_indptr, kv_last_page_len,\n"),),
        races=True),  # every token of a sequence writes the same entry
    "full_last_page_as_zero": Pitfall(
        says="kv_last_page_len is seq_len % page_size, so a full last page gets 0 instead of page_size", edits=(
            ("torch.where(seq_lens > 0, (seq_lens - 1) % page_size + 1, 0)", "seq_lens % page_size"),)),
}


# Wrong kernels that are none of the page's pitfalls: the grade must fail them and
# name no pitfall; each first failure must show the phrase `shows`.
MISTAKES = {
    "entry_one_too_far": Mistake(shows="wrong entry", edits=(
        ("entry = pos % page_size", "entry = (pos + 1) % page_size"),)),
    "page_not_looked_up": Mistake(shows="wrong page", edits=(
        ("page = tl.load(kv_indices_ptr + page_iter).to(tl.int64)", "page = page_iter.to(tl.int64)"),)),
    "key_stored_as_value": Mistake(shows="v_cache", edits=(
        ("tl.store(v_cache_ptr + dst, v, mask=keep)", "tl.store(v_cache_ptr + dst, k, mask=keep)"),)),
    # Right whenever key and value share their strides (contiguous, or both views of fused QKV).
    "value_read_with_key_strides": Mistake(shows="v_cache: page", edits=(
        ("v = tl.load(value_ptr + token * value_stride_n + heads * value_stride_h + feats, mask=keep)",
         "v = tl.load(value_ptr + token * key_stride_n + heads * key_stride_h + feats, mask=keep)"),)),
}


PLANTED = Planted(id="f1", stem="f1_csr_page_table", section="content/f1.md §9", pitfalls=PITFALLS,
                  mistakes=MISTAKES)
