"""The pitfalls of content/l1.md §8 and the wrong kernels that are none of them, as
edits that plant each in the reference, and `PLANTED`, what the checks diagnose with."""
import _env
from _drill import Mistake, Pitfall, Planted

PITFALLS = {
    "int32_offsets": Pitfall(says="offsets are computed in int32 and wrap around once slot * H * D passes 2**31", edits=[
        ("token = tl.program_id(axis=0).to(tl.int64)", "token = tl.program_id(axis=0)"),
        ("slot = tl.load(slot_mapping_ptr + token).to(tl.int64)", "slot = tl.load(slot_mapping_ptr + token).to(tl.int32)"),
    ], crashes=True),
    "padding_written": Pitfall(says="padding tokens (slot -1) are not skipped: their rows are read, or written to just "
                                    "before the cache", edits=[
        ("keep = cols < tl.where(slot >= 0, HD, 0)", "keep = cols < HD"),
    ], races=True),  # every padding token writes the one row before the cache
    "position_as_slot": Pitfall(says="the position is used as the slot: the block table is never consulted", edits=[
        ("return positions % block_size + block * block_size", "return positions.long()"),
    ], races=True),  # tokens of different sequences at one position share a slot
    "token_index_as_position": Pitfall(says="the token's index in the batch is used as its position in its sequence", edits=[
        ("    page = positions // block_size",
         "    positions = torch.arange(len(positions), device=positions.device)\n"
         "    page = positions // block_size"),
    ]),
    "logical_as_physical": Pitfall(says="the logical block number is used as the physical block: the block table is never consulted", edits=[
        ("block = block_table[seq_idx, page].long()", "block = page.long()"),
    ], races=True),  # sequences share logical block numbers, so they share slots
    "row_stride_ignored": Pitfall(says="key/value rows are read H*D apart instead of key_stride apart, so fused-QKV views read the wrong rows", edits=[
        ("key_ptr + token * key_stride + cols", "key_ptr + token * HD + cols"),
        ("value_ptr + token * value_stride + cols", "value_ptr + token * HD + cols"),
    ]),
    "unmasked_tail": Pitfall(says="the tile's tail past H*D is not masked and spills into the next slot", edits=[
        ("keep = cols < tl.where(slot >= 0, HD, 0)", "keep = cols < tl.where(slot >= 0, BLOCK, 0)"),
    ], races=True),  # the spill lands on the next slot's row, which its own program writes
    "offset_without_heads": Pitfall(says="a slot's offset is computed as slot * D instead of slot * H * D", edits=[
        ("    HD,                        # num_kv_heads * head_size: one slot's length", "    HD, D,"),
        ("key.stride(0), value.stride(0), hd,", "key.stride(0), value.stride(0), hd, head_size,"),
        ("row = slot * HD + cols", "row = slot * D + cols"),
    ], races=True),  # with H > 1, neighbouring slots' rows overlap
    "noncontiguous_cache_accepted": Pitfall(says="a non-contiguous cache is accepted instead of refused", edits=[
        ("        if not cache.is_contiguous():", "        if False:"),
    ]),
}

# Wrong kernels that are none of the page's pitfalls: the grade must fail each and
# name nothing, describing what went wrong instead (issue: a grade that tells the truth).
MISTAKES = {
    "slot_from_position_minus_one": Mistake(shows="should get slot 13, got 12", edits=(
        ("    page = positions // block_size", "    positions = positions - 1\n    page = positions // block_size"),
    )),
    "value_read_with_key_stride": Mistake(shows="v_cache", edits=(
        ("value_ptr + token * value_stride + cols", "value_ptr + token * key_stride + cols"),
    )),
    "crashes_on_five_heads": Mistake(shows="killed by SIGSEGV", edits=(
        ("    if num_tokens == 0:\n        return",
         "    if num_heads == 5:  # planted: the process dies (a stand-in for a wild write)\n"
         "        import os, signal\n        os.kill(os.getpid(), signal.SIGSEGV)\n"
         "    if num_tokens == 0:\n        return"),
    )),
    # Right, but no Triton kernel runs: the drill is the kernel (tests/_plugin.py fails it).
    "written_in_pytorch": Mistake(shows="no Triton kernel ran", edits=(
        ("    hd = num_heads * head_size\n    block = triton.next_power_of_2(hd)\n",
         "    real = slot_mapping >= 0  # planted: the copy done in PyTorch, no kernel\n"
         "    k_cache.view(-1, num_heads, head_size)[slot_mapping[real].long()] = key[real]\n"
         "    v_cache.view(-1, num_heads, head_size)[slot_mapping[real].long()] = value[real]\n"
         "    return\n    hd = num_heads * head_size\n    block = triton.next_power_of_2(hd)\n"),
    )),
}
if _env.INTERPRET:  # on a GPU this mask compiles, and is right
    MISTAKES["scalar_in_mask"] = Mistake(shows="choose the bound with a scalar tl.where", edits=(
        ("keep = cols < tl.where(slot >= 0, HD, 0)", "keep = (cols < HD) & (slot >= 0)"),
    ))


PLANTED = Planted(id="l1", stem="l1_paged_kv_write", section="content/l1.md §8", pitfalls=PITFALLS, mistakes=MISTAKES)
