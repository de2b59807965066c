"""Drill L3's traffic report (tests/_traffic.py): bytes moved under the CPU interpreter on
its traffic case (garbage block-table entries loaded among them: advice, the worker's
count), and the check of a garbage-column case's answer that those counts explain."""
import torch

import _env
from _drill import ELEMENT_SIZE
from _traffic import Part, measure, report, values_decide, was_read
from _paged import DTYPES

from .bench import prefill_bytes
from .cases import paged_prefill_case
from .checks import check_paged_prefill
from .mistakes import PLANTED

# The bench's "8x512 on 4096" (a chunk of new tokens over a long cached prefix) shrunk to
# interpreter size: each chunk fits one query block of the interpreter's tile, so each
# KV head's program reads its sequence's K/V once; a partial last block and garbage
# block-table columns past it.
TRAFFIC_CASE = dict(num_seqs=3, q_len=4, context=68, num_heads=8, num_kv_heads=2, head_size=32, block_size=16,
                    dtype="float16")


def traffic_case(device="cpu"):
    p = TRAFFIC_CASE
    return paged_prefill_case([p["q_len"]] * p["num_seqs"], [p["context"]] * p["num_seqs"], num_heads=p["num_heads"],
                              num_kv_heads=p["num_kv_heads"], head_size=p["head_size"], block_size=p["block_size"],
                              dtype=DTYPES[p["dtype"]], extra_columns=2, device=device, seed=5)


def garbage_entries_read(case, traffic, record=3):
    """(sequence, column) of every block-table entry past a sequence's last block that was loaded."""
    width = case.block_table.shape[1]
    owned = torch.arange(width) < (case.seq_lens.cpu()[:, None] + case.block_size - 1) // case.block_size
    return [(b, c) for b, c in (~owned).nonzero().tolist()
            if was_read(traffic.tensors[record], case.block_table[b, c])]


def check_table_read_only_to_last_block(module, case):
    """paged_prefill_attention on `case` (garbage block-table columns) with its loads
    counted, and its answer checked: the values decide. When they are wrong, garbage
    entries the worker counted as loaded explain it too (its word); a right answer that
    loaded them passes here, and the traffic report names it. Returns False where nothing
    is counted (a GPU: nothing runs), True when checked."""
    if not _env.INTERPRET:
        return False
    returned, counted = measure(module, "paged_prefill_attention", *case.args(), **case.kwargs())

    def explain(counted):
        garbage = garbage_entries_read(case, counted)
        if not garbage:
            return []
        b, c = garbage[0]
        return [(f"block_table[{b}, {c}] was loaded, but sequence {b} has seq_len {int(case.seq_lens[b])}: the "
                 f"entries past its last block are garbage ({len(garbage)} such entries loaded); mask the "
                 f"block-table load with key < seq_len", None)]
    with values_decide(counted, explain):
        check_paged_prefill(case, case.out if case.out is not None else returned, returned)
    return True


def traffic_parts(p):
    """prefill_bytes (the bench's count) tensor by tensor. Indices: places in the call."""
    size = ELEMENT_SIZE[p["dtype"]]
    seq_len = p["context"] + p["q_len"]
    kv = 2 * p["num_seqs"] * seq_len * p["num_kv_heads"] * p["head_size"] * size
    rows = p["num_seqs"] * p["q_len"] * p["num_heads"] * p["head_size"] * size
    parts = [Part("K/V", (1, 2), fewest_loaded=kv), Part("query", (0,), fewest_loaded=rows),
             Part("block table", (3,), fewest_loaded=4 * p["num_seqs"] * -(-seq_len // p["block_size"])),
             Part("lengths", (4, 5), fewest_loaded=4 * (2 * p["num_seqs"] + 1)),
             Part("out", (6,), fewest_stored=rows)]
    assert sum(x.fewest_loaded + x.fewest_stored for x in parts) == prefill_bytes(**p)
    return parts


def traffic(module):
    """paged_prefill_attention on TRAFFIC_CASE, its bytes against prefill_bytes, with where
    the extra bytes went in L3's words."""
    case = traffic_case()
    _, counted = measure(module, "paged_prefill_attention", *case.args(), **case.kwargs())
    if counted is None:
        return None
    result = report(PLANTED.id, counted, traffic_parts(TRAFFIC_CASE))
    kv, table = result["parts"]["K/V"], result["parts"]["block table"]
    group = case.query.shape[1] // case.k_cache.shape[2]
    where = []
    if kv > 1.5 and group > 1 and abs(kv - group) < 0.25 * group:
        where.append(f"K and V are read {kv:.0f}× — once per query head; read them once per KV head, for its "
                     f"{group} query heads at once (GQA)")
    elif kv > 1.05:
        where.append(f"K and V are read {kv:.2f}× their size: here each sequence's new tokens fit one query block, "
                     f"so each KV head's program can read its sequence's keys once")
    if table > 2 * max(kv, 1) * case.k_cache.shape[2]:
        where.append(f"the block table was read once per token instead of once per block ({table:.0f}×)")
    garbage = garbage_entries_read(case, counted)
    if not garbage:  # here a tile of keys stays in its sequence's blocks; with blocks of 4 it spans past them
        small = garbage_case()
        _, small_counted = measure(module, "paged_prefill_attention", *small.args(), **small.kwargs())
        garbage = garbage_entries_read(small, small_counted) if small_counted is not None else []
    if garbage:
        where.append(f"block-table entries past a sequence's last block were read ({len(garbage)} of them): they "
                     f"are garbage; mask the table load with key < seq_len")
    result["where"] = where + result["where"]
    return result


def garbage_case(device="cpu"):
    """Blocks of 4 tokens and garbage columns past each sequence's: a tile of keys spans
    several blocks, so one reaching past seq_len meets the garbage (the read-side test's case)."""
    return paged_prefill_case([3, 20, 1], [2, 30, 47], num_heads=8, num_kv_heads=2, head_size=16, block_size=4,
                              extra_columns=3, device=device, seed=6)
