"""Drill F1's plain-PyTorch reference: the CSR conversion, each appended token's
(batch index, position) and (page, entry), and the copy into a 4-D cache.
"""
import torch


# ---------------------------------------------------------------------------
# The plain-PyTorch reference: loops over sequences and tokens, written apart
# from the solution so the two can disagree.


def ref_block_table_to_csr(block_table, seq_lens, page_size):
    """(kv_indptr, kv_indices, kv_last_page_len), int32 on the CPU."""
    indptr, indices, last = [0], [], []
    for row, n in zip(block_table.tolist(), seq_lens.tolist()):
        pages = -(-n // page_size)
        indices += row[:pages]
        indptr.append(indptr[-1] + pages)
        last.append(n - (pages - 1) * page_size if pages else 0)
    return tuple(torch.tensor(x, dtype=torch.int32) for x in (indptr, indices, last))


def ref_batch_indices_positions(append_indptr, seq_lens, nnz):
    """(batch_indices, positions) int32 on the CPU; tokens past append_indptr[-1] are padding (-1, 0)."""
    batch, positions = [-1] * nnz, [0] * nnz
    indptr, lens = append_indptr.tolist(), seq_lens.tolist()
    for b, n in enumerate(lens):
        start, end = indptr[b], indptr[b + 1]
        for t in range(start, end):
            batch[t], positions[t] = b, n - (end - start) + (t - start)
    return torch.tensor(batch, dtype=torch.int32), torch.tensor(positions, dtype=torch.int32)


def ref_page_entry(batch_indices, positions, kv_indices, kv_indptr, page_size):
    """[(page, entry)] of each token: kv_indices[kv_indptr[b] + pos // page_size], pos % page_size; None for padding."""
    indices, indptr = kv_indices.tolist(), kv_indptr.tolist()
    return [None if b < 0 else (indices[indptr[b] + p // page_size], p % page_size)
            for b, p in zip(batch_indices.tolist(), positions.tolist())]


def as_nhd(cache, layout):
    """A 4-D cache seen as [num_pages, page_size, H, D] whatever its layout (a view)."""
    return cache if layout == "NHD" else cache.transpose(1, 2)


def ref_write(rows, cache, places, layout):
    """Copy rows[t] ([H, D]) to each token's (page, entry) of one 4-D cache."""
    cache = as_nhd(cache, layout)
    for t, place in enumerate(places):
        if place is not None:
            cache[place] = rows[t]
