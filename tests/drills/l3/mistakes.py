"""Drill L3's planted mistakes: the pitfalls content/l3.md §8 names and the other wrong
kernels, each by exact edits of the reference; PLANTED, what the diagnosis reads of them."""
from _drill import Mistake, Pitfall, Planted

SECTION = "content/l3.md §8"

# The pitfalls (content/l3.md §8): each planted in the reference by exact edits

_DIAG_LOOP = ("for start in range(num_full * TILE, end, TILE):\n        key = start + tl.arange(0, TILE)\n"
              "        k, v = _load_kv(k_cache_ptr, v_cache_ptr, block_table_ptr, seq, table_stride, key, key < end,")

PITFALLS = {
    "causal_offset_missing": Pitfall(
        says="the causal mask is aligned top-left (query i sees keys 0..i): the seq_len - q_len offset is missing",
        edits=(("context_len = seq_len - q_len", "context_len = 0"),)),
    "prefix_ignored": Pitfall(
        says="only the chunk's own keys are attended: the cached prefix before the chunk is skipped",
        edits=(("num_full = (context_len + first + 1) // TILE", "num_full = 0"),
               ("for start in range(num_full * TILE, end, TILE):", "for start in range(context_len, end, TILE):"))),
    "last_block_unmasked": Pitfall(
        says="K/V are loaded for the whole last block, past seq_len, and 0 * NaN = NaN",
        edits=((_DIAG_LOOP, _DIAG_LOOP.replace("key, key < end,", "key, key < tl.cdiv(end, BLOCK_SIZE) * BLOCK_SIZE,")),)),
    "masked_row_nan": Pitfall(
        says="a row that sees no key in a tile gets max -inf, and exp(-inf - (-inf)) = NaN poisons it",
        edits=(('base = tl.where(m_new == float("-inf"), 0.0, m_new)', "base = m_new"),)),
    "wrong_seq_lookup": Pitfall(
        says="query blocks are cut from the flat token array, so a block that straddles two chunks attends all of "
             "its rows against the first chunk's sequence",
        edits=(("if tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= q_block:",
                "if tl.load(query_start_loc_ptr + mid) <= q_block * BLOCK_Q:"),
               ("first = (q_block - q_start // BLOCK_Q - seq) * BLOCK_Q", "first = q_block * BLOCK_Q - q_start"),
               ("row_live = (rows < BLOCK_Q * GROUP) & (i < q_len)",
                "row_live = (rows < BLOCK_Q * GROUP) & (q_start + i < tl.load(query_start_loc_ptr + num_seqs))"))),
    "gqa_head_mapping": Pitfall(
        says="query head h is paired with KV head h % H_kv instead of h // (H_q / H_kv)",
        edits=(("heads = kv_head * GROUP + rows % GROUP", "heads = kv_head + (rows % GROUP) * NUM_KV_HEADS"),)),
}


# Other wrong kernels: the grade must fail each one and name no pitfall.
_STORE = "tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=row_live[:, None] & dim_live[None, :])"

MISTAKES = {
    "store_forgotten": Mistake(shows="never written", edits=(
        (_STORE, "pass  # planted: the store is forgotten"),)),
    "stores_padded_rows": Mistake(shows="written past the end of out", edits=(
        (_STORE, _STORE.replace("mask=row_live[:, None] & dim_live[None, :]", "mask=dim_live[None, :]")),)),
    "last_partial_block_dropped": Mistake(shows="last, partly filled block", edits=(
        ("end = tl.minimum(context_len + first + BLOCK_Q, seq_len)",
         "end = tl.minimum(context_len + first + BLOCK_Q, "
         "tl.where(seq_len >= BLOCK_SIZE, seq_len // BLOCK_SIZE * BLOCK_SIZE, seq_len))"),)),
    # The tile's BLOCK_M rows hold BLOCK_Q * GROUP live ones; with a group of 3, 5 or 6 the
    # spare rows past them are another query block's first query, stored seeing too few keys.
    "spare_group_rows_unmasked": Mistake(shows="only some query heads", edits=(
        ("row_live = (rows < BLOCK_Q * GROUP) & (i < q_len)", "row_live = i < q_len"),)),
}


PLANTED = Planted(id="l3", stem="l3_paged_prefill", section=SECTION, pitfalls=PITFALLS, mistakes=MISTAKES)
