"""Drill L8's planted mistakes: the pitfalls content/l8.md §10 names and the other wrong
kernels, each by exact edits of solutions/l8_sliding_window.py; PLANTED, what the diagnosis reads."""
from _drill import Mistake, Pitfall, Planted

SECTION = "content/l8.md §10"

_PREFILL_SEED = "m, l = _seed(sinks_ptr, heads, row_live, USE_SINKS, BLOCK_M)"
_DECODE_SEED = "m, l = _seed(sinks_ptr, heads, rows < tl.where(split == 0, GROUP, 0), USE_SINKS, GROUP_PAD)"

PITFALLS = {
    "window_off_by_one": Pitfall(
        says="the window holds window_left keys counting the query's own, one short: a query at p must see "
             "[p - window_left, p]",
        edits=(("    return pos - window\n", "    return pos - window + 1\n"),)),
    "tiles_outside_window_loaded": Pitfall(
        says="tiles before the window are loaded and then masked: the values come out right where those blocks "
             "are still live, but the cost follows the context, and a dead block's garbage leaks in (0 · NaN)",
        edits=(("lo = tl.maximum(_window_start(pos_first, window), 0)", "lo = 0"),
               ("lo = tl.maximum(_window_start(seq_len - 1, window), 0)", "lo = 0"))),
    "dead_entries_as_block_numbers": Pitfall(
        says="the first live tile's keys before the window are gathered through their block-table entries, which "
             "may be dead (freed blocks: -1, huge, another sequence's): mask those keys' loads, entry included",
        edits=(("key_live = (key >= lo) & (key < end)", "key_live = key < end"),), crashes=True),
    "sink_scaled": Pitfall(
        says="the sink is multiplied by the softmax scale like a q·k score; it is a logit as it stands",
        edits=((_PREFILL_SEED, _PREFILL_SEED + "\n    m = m * (scale_log2 / LOG2E)"),
               (_DECODE_SEED, _DECODE_SEED + "\n    m = m * (scale_log2 / LOG2E)"))),
    "sink_base_e": Pitfall(
        says="the sink enters a base-2 kernel (exp2) without the factor log2(e): it counts as e^(sink · ln 2)",
        edits=(('other=float("-inf")) * LOG2E', 'other=float("-inf"))'),)),
    "sink_every_split": Pitfall(
        says="every split adds the sink to its own denominator, so the merge counts it once per split",
        edits=(("rows < tl.where(split == 0, GROUP, 0)", "rows < GROUP"),)),
    "sink_per_kv_head": Pitfall(
        says="the sink is read per KV head (sinks[h // group]) instead of per query head (sinks[h])",
        edits=((_PREFILL_SEED, _PREFILL_SEED.replace("heads,", "kv_head + 0 * heads,")),
               (_DECODE_SEED, _DECODE_SEED.replace("heads,", "kv_head + 0 * heads,")))),
    "split_outside_window_nan": Pitfall(
        says="a split that holds no key of the window (past a short window's end, or before its start) divides "
             "0 by 0, and the merge lets the NaN in",
        edits=(("part = acc / tl.where(l > 0, l, 1.0)[:, None]", "part = acc / l[:, None]"),
               ("    v = tl.where(w[:, None] > 0, v, 0.0)", "    pass"))),
    "int32_offsets": Pitfall(
        says="cache offsets are computed in int32: past 2**31 elements they wrap around",
        edits=(("slot = block.to(tl.int64) * BLOCK_SIZE + key % BLOCK_SIZE", "slot = block * BLOCK_SIZE + key % BLOCK_SIZE"),
               ("offs = (slot * NUM_KV_HEADS + kv_head)[:, None]", "offs = (slot * NUM_KV_HEADS + kv_head.to(tl.int32))[:, None]")),
        crashes=True),
}

# Other wrong kernels: the grade must fail each and name no pitfall.
MISTAKES = {
    "direct_store_forgotten": Mistake(shows="never written", edits=(
        ("        tl.store(out_ptr + seq * out_stride + heads[:, None] * HEAD_SIZE + dims[None, :],\n"
         "                 part.to(out_ptr.dtype.element_ty), mask=q_mask)\n",
         "        pass  # planted: with one split, the answer is never stored\n"),)),
    "sink_ignored": Mistake(shows="without the sinks", edits=(
        ("USE_SINKS=sinks is not None, SHORT=is_short", "USE_SINKS=False, SHORT=is_short"),)),
    "last_split_dropped": Mistake(shows="wrong for", edits=(
        ('s = tl.load(lse_ptr + first + parts, mask=parts < NUM_PARTS, other=float("-inf"))',
         's = tl.load(lse_ptr + first + parts, mask=parts < NUM_PARTS - 1, other=float("-inf"))'),)),
}

PLANTED = Planted(id="l8", stem="l8_sliding_window", section=SECTION, pitfalls=PITFALLS, mistakes=MISTAKES)
