"""Drill L8's traffic (tests/_traffic.py): its traffic case and report, with where the extra
bytes went, and the count of K/V rows read in blocks wholly before the window. Counts are
made beside the learner's code: the worker's word, advice in the report, never a verdict
(the tests decide on values, which the NaN-filled dead blocks make show the same mistake)."""
from _drill import ELEMENT_SIZE
from _paged import DTYPES
from _traffic import COUNTS_WORD, Part, measure, report, was_read

from .bench import window_bytes
from .cases import window_case
from .mistakes import PLANTED

# The bench's decode shrunk to interpreter size: a window of 41 keys at the end of contexts of
# 200 and 120, two splits. Every block is live (no dead entry): a kernel that loads the tiles
# before the window and masks them gets every value right, and only the bytes show it.
TRAFFIC_CASE = dict(num_seqs=2, contexts=(200, 120), window_left=40, num_heads=8, num_kv_heads=2, head_size=32,
                    block_size=16, dtype="float16", num_splits=2)


def traffic_case(decode=True, device="cpu"):
    p = TRAFFIC_CASE
    q_lens = [1] * p["num_seqs"] if decode else [5] * p["num_seqs"]
    return window_case(q_lens, list(p["contexts"]), window_left=p["window_left"], num_heads=p["num_heads"],
                       num_kv_heads=p["num_kv_heads"], head_size=p["head_size"], block_size=p["block_size"],
                       dtype=DTYPES[p["dtype"]], decode=decode, num_splits=p["num_splits"],
                       dead="live", extra_columns=1, device=device, seed=5)


def rows_read_before_window(case, traffic):
    """(sequence, column) of every block wholly before its sequence's first window start
    (seq_len - q_len - window_left) of which some K or V byte was loaded."""
    found = []
    lens, bs = case.seq_lens.long().tolist(), case.block_size
    for b, (n, q_len) in enumerate(zip(lens, case.q_lens)):
        start = n - q_len - case.window_left
        for column in range(max(start, 0) // bs):
            block = int(case.block_table[b, column])
            if was_read(traffic.tensors[1], case.k_cache[block]) or was_read(traffic.tensors[2], case.v_cache[block]):
                found.append((b, column))
    return found


def measured(module, case):
    """The case's call with its loads counted: (result, Traffic), or (None, None) on a GPU."""
    return measure(module, case.function, *case.args(), **case.kwargs())


def traffic_parts(p):
    """window_bytes (the bench's count) tensor by tensor (indices: the call's tensors, query,
    k_cache, v_cache, block_table, seq_lens, sinks, out), plus what it leaves out: the block
    table, seq_lens, the sinks, and the fp32 partials each split writes and the merge reads."""
    size = ELEMENT_SIZE[p["dtype"]]
    keys = p["window_left"] + 1
    kv = 2 * p["num_seqs"] * keys * p["num_kv_heads"] * p["head_size"] * size
    rows = p["num_seqs"] * p["num_heads"] * p["head_size"] * size
    blocks = sum((c // p["block_size"]) - (c - p["window_left"]) // p["block_size"] + 1 for c in p["contexts"])
    partials = p["num_seqs"] * p["num_heads"] * p["num_splits"] * (p["head_size"] + 1) * 4
    parts = [Part("K/V", (1, 2), fewest_loaded=kv), Part("query", (0,), fewest_loaded=rows),
             Part("block table", (3,), fewest_loaded=4 * blocks), Part("seq_lens", (4,), fewest_loaded=4 * p["num_seqs"]),
             Part("sinks", (5,), fewest_loaded=4 * p["num_heads"] * p["num_seqs"]),
             Part("out", (6,), fewest_stored=rows),
             Part("partials", ("scratch",), fewest_loaded=partials, fewest_stored=partials)]
    assert kv + 2 * rows == window_bytes(p["num_seqs"], 1, p["contexts"][0], p["window_left"], p["num_heads"],
                                         p["num_kv_heads"], p["head_size"], p["dtype"])
    return parts


def traffic(module):
    """paged_decode_attention_window on TRAFFIC_CASE: its bytes against the fewest, with where
    the extra bytes went in L8's words."""
    case = traffic_case()
    _, counted = measured(module, case)
    if counted is None:
        return None
    result = report(PLANTED.id, counted, traffic_parts(TRAFFIC_CASE))
    kv = result["parts"]["K/V"]
    where = []
    before = rows_read_before_window(case, counted)
    if before:
        where.append(f"K/V rows of {len(before)} blocks wholly before the window were loaded ({COUNTS_WORD}): "
                     f"tiles before the window loaded and then masked are right in value here, where those blocks "
                     f"are live, and cost the context, not the window (content/l8.md §10, "
                     f"tiles_outside_window_loaded)")
    elif kv > 1.05:
        where.append(f"K and V are read {kv:.2f}× what the window holds: each key of the window once, per KV head")
    result["where"] = where + result["where"]
    return result
