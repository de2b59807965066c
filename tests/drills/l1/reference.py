"""L1's plain-PyTorch reference: the slot of each token, and the write of each real
token's row into its slot (slot -1 skipped)."""


def ref_slot_mapping(block_table, seq_idx, positions, block_size):
    """Slot of each token: block_table[seq, pos // block_size] * block_size + pos % block_size."""
    positions = positions.long()
    physical = block_table[seq_idx.long(), positions // block_size].long()
    return physical * block_size + positions % block_size


def ref_cache_write(rows, cache, slot_mapping):
    """Plain PyTorch: copy each real token's [H, D] row into its slot; skip slot -1."""
    real = slot_mapping >= 0
    hd = rows.shape[1] * rows.shape[2]
    cache.view(-1, hd)[slot_mapping[real].long()] = rows[real].reshape(-1, hd)


def ref_reshape_and_cache(key, value, k_cache, v_cache, slot_mapping):
    """The reference of L1's reshape_and_cache (caches must be contiguous)."""
    ref_cache_write(key, k_cache, slot_mapping)
    ref_cache_write(value, v_cache, slot_mapping)
