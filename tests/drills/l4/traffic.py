"""L4's traffic (tests/_traffic.py): its traffic case, traffic(module) with where the
extra bytes went (garbage block-table entries among them: advice, the worker's count),
and the check of a garbage-column case's answer that those counts explain."""
import torch

import _env
from _paged import DTYPES, owned_columns
from _traffic import Part, measure, report, values_decide, was_read

from .bench import split_bytes
from .cases import split_case
from .checks import check_split_decode
from .mistakes import PLANTED


# The traffic report (tests/_traffic.py): bytes moved under the CPU interpreter

# The bench's small-batch shape (B=8, 32 query heads over 8 KV heads, D = 128, blocks
# of 16) shrunk to interpreter size: few sequences, a long context, four splits, a
# partial last block and garbage block-table columns past it.
TRAFFIC_CASE = dict(num_seqs=2, num_heads=8, num_kv_heads=2, head_size=32, context=200, block_size=16,
                    dtype="float16", num_splits=4)


def traffic_case(device="cpu"):
    p = TRAFFIC_CASE
    return split_case([p["context"]] * p["num_seqs"], num_heads=p["num_heads"], num_kv_heads=p["num_kv_heads"],
                      head_size=p["head_size"], block_size=p["block_size"], dtype=DTYPES[p["dtype"]],
                      num_splits=p["num_splits"], extra_columns=2, device=device, seed=5)


def garbage_entries_read(case, traffic, record=3):
    """(sequence, column) of every block-table entry past a sequence's last block that was loaded."""
    owned = owned_columns(case.seq_lens, case.block_size, case.block_table.shape[1])
    return [(b, c) for b, c in (~owned).nonzero().tolist()
            if was_read(traffic.tensors[record], case.block_table[b, c])]


def check_table_read_only_to_last_block(module, case):
    """paged_decode_attention_split on `case` (garbage block-table columns) with its loads
    counted, and its answer checked: the values decide. When they are wrong, garbage
    entries the worker counted as loaded explain it too (its word); a right answer that
    loaded them passes here, and the traffic report names it. Returns False where nothing
    is counted (a GPU: nothing runs), True when checked."""
    if not _env.INTERPRET:
        return False
    out = torch.full_like(case.query, float("nan"))
    returned, counted = measure(module, "paged_decode_attention_split", *case.args(), **case.kwargs(), out=out)

    def explain(counted):
        garbage = garbage_entries_read(case, counted)
        if not garbage:
            return []
        b, c = garbage[0]
        return [(f"block_table[{b}, {c}] was loaded, but sequence {b} has seq_len {int(case.seq_lens[b])}: the "
                 f"entries past its last block are garbage ({len(garbage)} such entries loaded); mask the "
                 f"block-table load with pos < seq_len (content/l2.md §9)", None)]
    with values_decide(counted, explain):
        check_split_decode(case, out, returned, case.num_splits)
    return True


def traffic_parts(p):
    """split_bytes (the bandwidth report's count: K/V, query, out) tensor by tensor, plus what
    it leaves out: the block table and seq_lens, and the fp32 partial outputs and lse that
    each split writes once and the merge reads once (the price of splitting)."""
    size = DTYPES[p["dtype"]].itemsize
    kv = 2 * p["num_seqs"] * p["context"] * p["num_kv_heads"] * p["head_size"] * size
    rows = p["num_seqs"] * p["num_heads"] * p["head_size"] * size
    partials = p["num_seqs"] * p["num_heads"] * p["num_splits"] * (p["head_size"] + 1) * 4
    parts = [Part("K/V", (1, 2), fewest_loaded=kv), Part("query", (0,), fewest_loaded=rows),
             Part("block table", (3,), fewest_loaded=4 * p["num_seqs"] * -(-p["context"] // p["block_size"])),
             Part("seq_lens", (4,), fewest_loaded=4 * p["num_seqs"]),
             Part("out", (5,), fewest_stored=rows),
             Part("partials", ("scratch",), fewest_loaded=partials, fewest_stored=partials)]
    assert kv + 2 * rows == split_bytes(**p)
    return parts


def traffic(module):
    """paged_decode_attention_split on TRAFFIC_CASE, its bytes against the fewest, with where
    the extra bytes went in L4's words."""
    case = traffic_case()
    out = torch.empty_like(case.query)
    _, counted = measure(module, "paged_decode_attention_split", *case.args(), **case.kwargs(), out=out)
    if counted is None:
        return None
    result = report(PLANTED.id, counted, traffic_parts(TRAFFIC_CASE))
    kv, table = result["parts"]["K/V"], result["parts"]["block table"]
    where = []
    group = case.query.shape[1] // case.k_cache.shape[2]
    if kv > 1.5 and group > 1 and abs(kv - group) < 0.25 * group:
        where.append(f"K and V are read {kv:.0f}× — once per query head; read them once per KV head, for its "
                     f"{group} query heads at once (GQA, content/l2.md §5)")
    elif kv > 1.05:
        where.append(f"K and V are read {kv:.2f}× their size: the splits should share each sequence's tokens, "
                     f"each token in exactly one chunk")
    if table > 2 * max(kv, 1) * case.k_cache.shape[2]:
        where.append(f"the block table was read once per token instead of once per block ({table:.0f}×)")
    if result["parts"]["partials"] > 1.05:
        where.append(f"the partial outputs moved {result['parts']['partials']:.2f}× what num_splits of them need "
                     f"(each split writes its part once, the merge reads it once)")
    garbage = garbage_entries_read(case, counted)
    if garbage:
        where.append(f"block-table entries past a sequence's last block were read ({len(garbage)} of them): they "
                     f"are garbage; mask the table load with pos < seq_len")
    result["where"] = where + result["where"]
    return result
