"""Known-wrong variants of solutions/l1_paged_kv_write.py, one per pitfall on
content/l1.md §8: what the mistake is (`says`, shown by the grader when a
learner's output matches the variant's) and the (exact text, replacement)
edits that plant it in the reference. tests/_wrong.py builds them;
tests/test_wrong.py proves the tests catch and name every one."""

SECTION = "content/l1.md §8"

PITFALLS = {
    "int32_offsets": dict(says="offsets are computed in int32 and wrap around once slot * H * D passes 2**31", edits=[
        ("token = tl.program_id(axis=0).to(tl.int64)", "token = tl.program_id(axis=0)"),
        ("slot = tl.load(slot_mapping_ptr + token).to(tl.int64)", "slot = tl.load(slot_mapping_ptr + token).to(tl.int32)"),
    ]),
    "padding_written": dict(says="padding tokens (slot -1) are written too, to just before the cache", edits=[
        ("keep = cols < tl.where(slot >= 0, HD, 0)", "keep = cols < HD"),
    ]),
    "position_as_slot": dict(says="the position is used as the slot: the block table is never consulted", edits=[
        ("return positions % block_size + block * block_size", "return positions.long()"),
    ]),
    "token_index_as_position": dict(says="the token's index in the batch is used as its position in its sequence", edits=[
        ("    page = positions // block_size",
         "    positions = torch.arange(len(positions), device=positions.device)\n"
         "    page = positions // block_size"),
    ]),
    "logical_as_physical": dict(says="the logical block number is used as the physical block: the block table is never consulted", edits=[
        ("block = block_table[seq_idx, page].long()", "block = page.long()"),
    ]),
    "row_stride_ignored": dict(says="key/value rows are read H*D apart instead of key_stride apart, so fused-QKV views read the wrong rows", edits=[
        ("key_ptr + token * key_stride + cols", "key_ptr + token * HD + cols"),
        ("value_ptr + token * value_stride + cols", "value_ptr + token * HD + cols"),
    ]),
    "unmasked_tail": dict(says="the tile's tail past H*D is not masked and spills into the next slot", edits=[
        ("keep = cols < tl.where(slot >= 0, HD, 0)", "keep = cols < tl.where(slot >= 0, BLOCK, 0)"),
    ]),
    "offset_without_heads": dict(says="a slot's offset is computed as slot * D instead of slot * H * D", edits=[
        ("    HD,                        # num_kv_heads * head_size: one slot's length", "    HD, D,"),
        ("key.stride(0), value.stride(0), hd,", "key.stride(0), value.stride(0), hd, head_size,"),
        ("row = slot * HD + cols", "row = slot * D + cols"),
    ]),
    "noncontiguous_cache_accepted": dict(says="a non-contiguous cache is accepted instead of refused", edits=[
        ("        if not cache.is_contiguous():", "        if False:"),
    ]),
}
