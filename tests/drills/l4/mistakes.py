"""L4's planted mistakes: the page's pitfalls (content/l4.md §8) and the other wrong
kernels, as edits of solutions/l4_split_kv_decode.py, and PLANTED, what the diagnosis reads."""
from _drill import Mistake, Pitfall, Planted

SECTION = "content/l4.md §8"


# ---------------------------------------------------------------------------
# The pitfalls (content/l4.md §8): what each mistake is, and the edits that plant
# it in solutions/l4_split_kv_decode.py.

PITFALLS = {
    "lse_base2": Pitfall(
        says="phase 1 runs its softmax in base 2 (exp2) and stores the LSE as m + log2(l), which the merge reads "
             "as a natural log",
        edits=(("lse = (m + tl.log2(l)) * 0.6931471805599453", "lse = m + tl.log2(l)"),)),
    "empty_split_nan": Pitfall(
        says="an empty chunk (past a short sequence's end) or an empty merge side produces NaN: 0/0 in phase 1, "
             "0 · garbage in the merge, or 0/0 when both sides are empty",
        edits=(("part = acc / tl.where(l > 0, l, 1.0)[:, None]", "part = acc / l[:, None]"),
               ("    v = tl.where(w[:, None] > 0, v, 0.0)\n", ""),
               ("/ tl.where(total > 0, total, 1.0)", "/ total"))),
    "merge_in_fp16": Pitfall(
        says="the merge works in float16: the LSEs lose their fractions and the weighted sum can overflow",
        edits=(('s = tl.load(lse_ptr + first + parts, mask=parts < NUM_PARTS, other=float("-inf"))',
                's = tl.load(lse_ptr + first + parts, mask=parts < NUM_PARTS, other=float("-inf")).to(tl.float16)'),
               ("dims[None, :], mask=v_mask, other=0.0)", "dims[None, :], mask=v_mask, other=0.0).to(tl.float16)"))),
    "unnormalised_partial": Pitfall(
        says="phase 1 stores its chunk's accumulator acc instead of acc / l, while the LSE it stores already "
             "counts l (so the sum is divided in twice, or never)",
        edits=(("part = acc / tl.where(l > 0, l, 1.0)[:, None]", "part = acc"),)),
    "num_splits_ignored": Pitfall(
        says="num_splits is ignored: the function always uses its own default split count",
        edits=(("num_splits = default_num_splits(num_seqs, num_kv_heads, query.device) if num_splits is None "
                "else num_splits", "num_splits = default_num_splits(num_seqs, num_kv_heads, query.device)"),)),
    "last_chunk_dropped": Pitfall(
        says="the merge stops one chunk early: the last chunk (or merge side b) is left out",
        edits=(('mask=parts < NUM_PARTS, other=float("-inf"))', 'mask=parts < NUM_PARTS - 1, other=float("-inf"))'),)),
}

_DIRECT_STORE = "tl.store(out_ptr + out_offs, part.to(out_ptr.dtype.element_ty), mask=q_mask)"

# Wrong kernels that are none of the page's pitfalls: the grade must fail each and
# name nothing, saying what is wrong instead.
MISTAKES = {
    "direct_store_forgotten": Mistake(shows="never written", edits=(
        (_DIRECT_STORE, "pass  # planted: with one split, the answer is never stored"),
    )),
    "chunks_overlap": Mistake(shows="is off", edits=(
        ("end = tl.minimum(start + chunk, seq_len)", "end = tl.minimum(start + chunk + TILE, seq_len)"),
    )),
    # The head group padded to a power of two (no 16-row minimum) with its spare slots left
    # unmasked: with a group of 1, 2, 4 or 8 there is no spare slot, so only a group such as 3
    # shows it; the last KV head's spare row is then stored past the end of out.
    "head_group_spare_slot_unmasked": Mistake(shows="written past the end of out", edits=(
        ("GROUP_PAD=max(16, triton.next_power_of_2(group))", "GROUP_PAD=triton.next_power_of_2(group)"),
        ("q_mask = (rows < GROUP)[:, None] & (dims < HEAD_SIZE)[None, :]", "q_mask = (dims < HEAD_SIZE)[None, :]"),
    )),
    # Each part weighted by another's exp(s - max) (with two parts: a by b's, b by a's); the
    # merged LSE is still right. With one side empty it turns NaN as an unguarded empty side
    # does, but it is wrong where no side is empty too: the page's example (2.21386, not 2.78614).
    "merge_weights_swapped": Mistake(shows="got 2.21386", edits=(
        ("s = tl.load(lse_ptr + first + parts, mask=parts < NUM_PARTS",
         "s = tl.load(lse_ptr + first + (NUM_PARTS - 1 - parts), mask=parts < NUM_PARTS"),
    )),
}


PLANTED = Planted(id="l4", stem="l4_split_kv_decode", section=SECTION, pitfalls=PITFALLS, mistakes=MISTAKES)
