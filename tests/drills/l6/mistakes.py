"""Drill L6's planted mistakes: the pitfalls content/l6.md §8 names and the other wrong
kernels, each by exact edits of solutions/l6_cascade_attention.py; PLANTED, what the
diagnosis reads of them."""
from _drill import Mistake, Pitfall, Planted

SECTION = "content/l6.md §8"

_PREFIX_MASK = 's = tl.where(key[None, :] < end, s, float("-inf"))  # the last tile\'s keys past the chunk'

PITFALLS = {
    "prefix_causal": Pitfall(
        says="pass 1 runs under a causal mask (FlashAttention's causal=True over the batch's queries as one "
             "sequence), so early tokens of the batch lose prefix keys they may see",
        edits=((_PREFIX_MASK, 's = tl.where((key[None, :] < end) & (key[None, :] <= prefix_len - total_q + '
                              'token[:, None]), s, float("-inf"))'),)),
    "prefix_uncapped": Pitfall(
        says="cascade_prefix_len counts the shared columns but does not cap them by the fewest cached tokens, "
             "so pass 1 would show a chunk's queries prefix keys past their own positions",
        edits=(("prefix = min(shared_blocks * block_size, int(cached.min()))", "prefix = shared_blocks * block_size"),)),
    "suffix_not_offset": Pitfall(
        says="pass 2 attends to each sequence's whole context from key 0, as L3 does, so the prefix is counted "
             "twice: once in pass 1 and again in pass 2",
        edits=(("full_end = prefix_len + (context_len + first + 1 - prefix_len) // TILE * TILE",
                "full_end = (context_len + first + 1) // TILE * TILE"),
               ("key = prefix_len + tl.arange(0, TILE)", "key = tl.arange(0, TILE)"),
               ("for start in range(prefix_len, full_end, TILE):", "for start in range(0, full_end, TILE):"))),
    "prefix_per_sequence": Pitfall(
        says="pass 1 gives each program one token's queries (one sequence's, in a decode batch), so the prefix's "
             "K/V are read once per sequence instead of once for the batch: right, but no faster than L3",
        edits=(("block_q1 = block_m1 // group", "block_q1 = 1"),),
        # Right answers, more bytes: only the interpreter's load counts see it (advice, the traffic report).
        interpreter_only=True, counts_only=True),
    "merge_swapped": Pitfall(
        says="the merge weighs each side by the other side's log-sum-exp (the sides swapped): what is folded "
             "so far by the incoming part's, the part by what is folded so far",
        edits=(("keep = tl.exp2(m - base)", "keep = tl.exp2(s - base)"),
               ("w = tl.exp2(s - base)     # the part's", "w = tl.exp2(m - base)     # the part's"))),
    "empty_part_nan": Pitfall(
        says="an empty part (a chunk of the prefix past its end: no key) stores 0/0 = NaN, and the merge "
             "multiplies it by its weight 0: 0 · NaN = NaN",
        edits=(("v = acc / tl.where(l > 0, l, 1.0)[:, None]", "v = acc / l[:, None]"),
               ("        v = tl.where(w[:, None] > 0, v, 0.0)  # an empty part's v is never trusted: 0 * NaN = NaN\n",
                ""))),
}

# Other wrong kernels: the grade must fail each one and name no pitfall.
_MERGE_STORE = ("tl.store(out_ptr + out_offs, (acc / l[:, None]).to(out_ptr.dtype.element_ty),\n"
                "             mask=row_live[:, None] & dim_live[None, :])")

MISTAKES = {
    "merge_store_forgotten": Mistake(shows="never written", edits=(
        (_MERGE_STORE, "pass  # planted: the merged row is never stored"),)),
    "suffix_one_key_more": Mistake(shows="wrong for", edits=(
        ('s = tl.where(key[None, :] <= pos[:, None], s, float("-inf"))',
         's = tl.where(key[None, :] <= pos[:, None] + 1, s, float("-inf"))'),)),
    "prefix_chunks_overlap": Mistake(shows="wrong for", edits=(
        ("end = tl.minimum(start + chunk, prefix_len)", "end = tl.minimum(start + chunk + TILE, prefix_len)"),)),
    # L3's GQA pitfall in pass 1 alone: its diagnosis must point at pass 1's heads, not at pass 2.
    "prefix_gqa_head_mapping": Mistake(shows="pass 1 (the prefix's part) reading KV heads", edits=(
        ("    heads = kv_head * GROUP + rows % GROUP\n    row_live = (rows < BLOCK_Q * GROUP) & (token < total_q)",
         "    heads = kv_head + (rows % GROUP) * NUM_KV_HEADS\n"
         "    row_live = (rows < BLOCK_Q * GROUP) & (token < total_q)"),
    )),
}

PLANTED = Planted(id="l6", stem="l6_cascade_attention", section=SECTION, pitfalls=PITFALLS, mistakes=MISTAKES)
