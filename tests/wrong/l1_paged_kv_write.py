"""Known-wrong variants of solutions/l1_paged_kv_write.py, one per pitfall on
content/l1.md §8. Each is a list of (exact text, replacement) edits applied to
the reference; tests/_wrong.py builds them and tests/test_wrong.py proves the
tests catch every one."""

PITFALLS = {
    "int32_offsets": [
        ("token = tl.program_id(0).to(tl.int64)", "token = tl.program_id(0)"),
        ("slot = tl.load(slot_mapping_ptr + token).to(tl.int64)", "slot = tl.load(slot_mapping_ptr + token).to(tl.int32)"),
    ],
    "padding_written": [
        ("mask = offs < tl.where(slot >= 0, HD, 0)", "mask = offs < HD"),
    ],
    "position_as_slot": [
        ("return physical_block * block_size + positions % block_size", "return positions.long()"),
    ],
    "token_index_as_position": [
        ("    logical_block = positions // block_size",
         "    positions = torch.arange(len(positions), device=positions.device)\n"
         "    logical_block = positions // block_size"),
    ],
    "logical_as_physical": [
        ("physical_block = block_table[seq_idx, logical_block].long()", "physical_block = logical_block.long()"),
    ],
    "row_stride_ignored": [
        ("key_ptr + token * key_stride + offs", "key_ptr + token * HD + offs"),
        ("value_ptr + token * value_stride + offs", "value_ptr + token * HD + offs"),
    ],
    "unmasked_tail": [
        ("mask = offs < tl.where(slot >= 0, HD, 0)", "mask = offs < tl.where(slot >= 0, BLOCK, 0)"),
    ],
    "offset_without_heads": [  # the slot's offset counts one head: slot * D
        ("    HD,                        # num_kv_heads * head_size: one slot's length", "    HD, D,"),
        ("key.stride(0), value.stride(0), hd,", "key.stride(0), value.stride(0), hd, head_size,"),
        ("k_cache_ptr + slot * HD + offs", "k_cache_ptr + slot * D + offs"),
        ("v_cache_ptr + slot * HD + offs", "v_cache_ptr + slot * D + offs"),
    ],
    "noncontiguous_cache_accepted": [
        ("        if not cache.is_contiguous():", "        if False:"),
    ],
}
