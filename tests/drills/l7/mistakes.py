"""L7's planted mistakes: the page's pitfalls and the other wrong kernels, as edits of
solutions/l7_mla_decode.py, and PLANTED, what the diagnosis reads."""
from _drill import Mistake, Pitfall, Planted

SECTION = "content/l7.md §10"
HOST_SECTION = "content/l7.md §8"   # the host side: the input checks

_VALUE_DOT = 'acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c, input_precision="ieee")  # value = c, reused'

PITFALLS = {
    "scale_from_row_width": Pitfall(
        says="the scale is computed from the row's width, 1/sqrt(R + P), instead of the scale the caller gives "
             "(the model's: DeepSeek's is 192 ** -0.5 times a YaRN factor)",
        edits=(("float(scale) * LOG2E", "(rank + rope) ** -0.5 * LOG2E"),)),
    "value_loaded_again": Pitfall(
        says="the value is loaded from the cache a second time instead of reusing the first R columns of the key "
             "tile already loaded: right numbers, twice the bytes of c",
        edits=((_VALUE_DOT,
                "v = tl.load(kv_cache_ptr + row[:, None] + c_cols[None, :],  # planted: the value loaded again\n"
                "                    mask=live[:, None] & (c_cols < R)[None, :], other=0.0)\n"
                "        if UPCAST:\n"
                "            v = v.to(tl.float32)\n"
                '        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")'),),
        interpreter_only=True, counts_only=True),  # right values: only the interpreter's counted bytes show it
    "rope_part_left_out": Pitfall(
        says="the rotary part q_pe · k_pe is left out of the score",
        edits=(('        s = tl.dot(q_pe, tl.trans(k_pe), acc=s, input_precision="ieee")\n', ""),)),
    "head_tile_unmasked": Pitfall(
        says="the head tile is not masked: when H is not a multiple of the tile, its spare rows are stored past "
             "the last head, into the next sequence's rows and past the end of out",
        edits=(("c_mask = head_ok[:, None] & (c_cols < R)[None, :]", "c_mask = (c_cols < R)[None, :]"),),
        races=True),  # on a GPU the spare rows race with the next sequence's own
    "empty_sequence_nan": Pitfall(
        says="a sequence of length 0 gives NaN (0/0) instead of out = 0 and lse = -inf",
        edits=(("part = acc / tl.where(l > 0, l, 1.0)[:, None]", "part = acc / l[:, None]"),
               ("out = acc / tl.where(total > 0, total, 1.0)[:, None]", "out = acc / total[:, None]"))),
    "int32_offsets": Pitfall(
        says="offsets are computed in int32 and wrap around once slot * (R + P) passes 2**31",
        edits=(("token = tl.program_id(0).to(tl.int64)", "token = tl.program_id(0)"),
               ("slot = tl.load(slot_mapping_ptr + token).to(tl.int64)",
                "slot = tl.load(slot_mapping_ptr + token).to(tl.int32)"),
               ("row = block.to(tl.int64) * (BLOCK_SIZE", "row = block * (BLOCK_SIZE")),
        crashes=True),
    "padding_written": Pitfall(
        says="padding tokens (slot -1) are not skipped: their rows are read, and written just before the cache",
        edits=(("keep_c = c_cols < tl.where(slot >= 0, R, 0)", "keep_c = c_cols < R"),
               ("keep_pe = pe_cols < tl.where(slot >= 0, P, 0)", "keep_pe = pe_cols < P")),
        races=True),  # every padding token writes the one row before the cache
}

_DIRECT_STORE = "part.to(out_ptr.dtype.element_ty), mask=c_mask)"

# Wrong kernels that are none of the page's pitfalls: the grade must fail each and name
# nothing, saying what is wrong instead.
MISTAKES = {
    # Right, but no Triton kernel writes: the drill is the kernel (tests/_plugin.py fails it).
    "write_in_pytorch": Mistake(shows="no Triton kernel ran", edits=(
        ("    if num_tokens == 0:\n        return\n    concat_and_cache_mla_kernel",
         "    rows = kv_cache.view(-1, rank + rope)  # planted: the copy done in PyTorch, no kernel\n"
         "    rows[slot_mapping[slot_mapping >= 0].long()] = torch.cat([kv_c, k_pe], 1)[slot_mapping >= 0]\n"
         "    return\n    concat_and_cache_mla_kernel"),
    )),
    # The LSE stored in base 2 (m + log2 l, the exp2 softmax's own): out is right with one
    # split, lse is not; with several the merge weighs the chunks wrongly too.
    "lse_base2": Mistake(shows="lse is off", edits=(("lse = (m + tl.log2(l)) * LN2", "lse = m + tl.log2(l)"),)),
    # k_pe read from the row's first P columns (c's) instead of its last P: an address slip.
    "k_pe_read_from_c": Mistake(shows="is off", edits=(
        ("k_pe = tl.load(kv_cache_ptr + row[:, None] + R + pe_cols[None, :],",
         "k_pe = tl.load(kv_cache_ptr + row[:, None] + pe_cols[None, :],"),
    )),
    "chunks_overlap": Mistake(shows="is off", edits=(
        ("end = tl.minimum(start + chunk, seq_len)", "end = tl.minimum(start + chunk + TILE, seq_len)"),
    )),
    "direct_store_forgotten": Mistake(shows="never written", edits=(
        (_DIRECT_STORE, "part.to(out_ptr.dtype.element_ty), mask=c_mask & (heads < 0)[:, None])  # planted: none"),
    )),
    # Right in every other way: out, when the caller gives none, allocated as float32. The
    # big-offset test (pitfall:int32_offsets) calls its two runs the same way, so this is
    # said as the contract error it is, and int32 is not named (issue 48).
    "out_float32_when_not_given": Mistake(shows="the output must have the query's dtype", edits=(
        ("out = torch.empty((num_seqs, num_heads, rank), dtype=q_nope.dtype, device=device)",
         "out = torch.empty((num_seqs, num_heads, rank), dtype=torch.float32, device=device)  # planted"),
    )),
    # The merge weighs the splits by exp(lse) without subtracting the largest: right while
    # every lse stays below 88.7 (the other cases' are near 10), inf / inf past it.
    "merge_without_max": Mistake(shows="exp(lse) overflowing float32", edits=(
        ("    s_max = tl.max(s, axis=1)\n    s_max = tl.where(s_max == float(\"-inf\"), 0.0, s_max)",
         "    s_max = tl.zeros([BLOCK_H], tl.float32)  # planted: no max subtracted"),
    )),
}
# Right values, more bytes: half of every head tile left empty, so twice the programs, each
# reading the latent rows. Only the interpreter's load counts show it, and they decide no
# test (the worker's word): no test fails it, and the traffic line says the rows were read
# twice (tests/test_traffic.py plants it).
HEAD_TILE_HALF_EMPTY = (
    ("heads = head_tile * BLOCK_H + tl.arange(0, BLOCK_H)\n    c_cols",
     "heads = head_tile * (BLOCK_H // 2) + tl.arange(0, BLOCK_H)\n    c_cols"),
    ("head_ok = heads < NUM_HEADS", "head_ok = (heads < NUM_HEADS) & (tl.arange(0, BLOCK_H) < BLOCK_H // 2)"),
    ("mla_decode_kernel[(triton.cdiv(num_heads, block_h),", "mla_decode_kernel[(triton.cdiv(num_heads, block_h // 2),"),
)


PLANTED = Planted(id="l7", stem="l7_mla_decode", section=SECTION, pitfalls=PITFALLS, mistakes=MISTAKES)
