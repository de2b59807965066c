"""Drill L6's traffic (tests/_traffic.py): its traffic case, traffic(module) with where the
extra bytes went (the prefix read once per sequence among them: advice, the worker's
count), and the check of a decode batch's answer that those counts explain when it fails."""
import torch

import _env
from _drill import ELEMENT_SIZE
from _paged import DTYPES, owned_columns
from _traffic import Part, measure, report, values_decide, was_read
from _counting import bytes_of

from .bench import cascade_bytes
from .cases import cascade_case
from .checks import check_cascade
from .mistakes import PLANTED, SECTION

# The bench's decode step shrunk to interpreter size: 4 decode rows sharing a prefix of
# 64 tokens (4 blocks of 16), each with 20 tokens of its own (a partly filled last block,
# garbage columns past it). Its 4 tokens x 4 query heads per KV head fit one tile of
# pass 1, so the prefix's K/V should be read once.
TRAFFIC_CASE = dict(num_seqs=4, prefix=64, suffix=20, num_heads=8, num_kv_heads=2, head_size=32, block_size=16,
                    dtype="float16", num_splits=2)


def traffic_case(device="cpu", num_seqs=None, seed=5):
    p = TRAFFIC_CASE
    b = num_seqs or p["num_seqs"]
    return cascade_case([1] * b, [p["prefix"] + p["suffix"] - 1] * b, p["prefix"] // p["block_size"],
                        num_heads=p["num_heads"], num_kv_heads=p["num_kv_heads"], head_size=p["head_size"],
                        block_size=p["block_size"], dtype=DTYPES[p["dtype"]], extra_columns=2, device=device,
                        seed=seed)


def garbage_entries_read(case, traffic, record=3):
    """(sequence, column) of every block-table entry past a sequence's last block that was
    loaded: those entries are garbage (design.md); a host read of the table is not counted."""
    owned = owned_columns(case.seq_lens, case.block_size, case.block_table.shape[1])
    return [(b, c) for b, c in (~owned).nonzero().tolist()
            if was_read(traffic.tensors[record], case.block_table[b, c])]


def prefix_reads(case, counted):
    """How many times, on average, each byte of the prefix's K was loaded."""
    record = counted.tensors[1]
    blocks = case.block_table[0, :case.common_prefix_len // case.block_size].long().cpu()
    where = torch.cat([torch.from_numpy(bytes_of(case.k_cache[int(x)])) for x in blocks])
    return float(torch.from_numpy(record.read)[where].double().mean())


def check_prefix_read_once(module, case):
    """cascade_attention on a decode batch with its loads counted, and its answer checked:
    the values decide. When they are wrong, the worker's count of the prefix's reads
    explains it too (its word). A right answer that reads the prefix once per sequence
    (pitfall:prefix_per_sequence) passes here: only the counts show it, so the traffic
    report names it, as advice. Returns False where nothing is counted (a GPU: nothing
    runs), True when checked."""
    if not _env.INTERPRET:
        return False
    returned, counted = measure(module, "cascade_attention", *case.args(), **case.kwargs())

    def explain(counted):
        reads, num_seqs = prefix_reads(case, counted), len(case.q_lens)
        if reads < num_seqs - 0.01:
            return []
        per = abs(reads - num_seqs) < 0.01
        return [(f"each byte of the shared prefix's K was loaded {reads:.2f} times for {num_seqs} decode rows"
                 + (f": once per sequence (pitfall:prefix_per_sequence, {SECTION})" if per else
                    ", more than once per sequence (content/l6.md §4)"), "prefix_per_sequence" if per else None)]
    with values_decide(counted, explain):
        check_cascade(case, case.out if case.out is not None else returned, returned)
    return True


def traffic_parts(p):
    """cascade_bytes (the bench's count) tensor by tensor, plus what it leaves out: the
    block table (the prefix's columns once, each sequence's own), the lengths, and the
    parts (in the query's dtype, their LSEs fp32) each chunk of pass 1 stores once and
    pass 2 loads once (its merge)."""
    size = ELEMENT_SIZE[p["dtype"]]
    b, bs = p["num_seqs"], p["block_size"]
    kv_token = 2 * p["num_kv_heads"] * p["head_size"] * size
    kv = p["prefix"] * kv_token + b * p["suffix"] * kv_token
    rows = b * p["num_heads"] * p["head_size"] * size
    partials = b * p["num_heads"] * p["num_splits"] * (p["head_size"] * size + 4)
    table = 4 * (p["prefix"] // bs + b * -(-p["suffix"] // bs))
    parts = [Part("K/V", (1, 2), fewest_loaded=kv), Part("query", (0,), fewest_loaded=rows),
             Part("block table", (3,), fewest_loaded=table), Part("lengths", (4, 5), fewest_loaded=4 * (2 * b + 1)),
             Part("out", (6,), fewest_stored=rows),
             Part("parts", ("scratch",), fewest_loaded=partials, fewest_stored=partials)]
    assert kv + 2 * rows == cascade_bytes(**p)
    return parts


def traffic(module):
    """cascade_attention on TRAFFIC_CASE, its bytes against the fewest, with where the
    extra bytes went in L6's words."""
    case = traffic_case()
    _, counted = measure(module, "cascade_attention", *case.args(), **case.kwargs())
    if counted is None:
        return None
    result = report(PLANTED.id, counted, traffic_parts(TRAFFIC_CASE))
    where = []
    reads = prefix_reads(case, counted)
    if reads > 1.05:
        per = abs(reads - len(case.q_lens)) < 0.01
        where.append(f"the shared prefix's K/V were read {reads:.2f}× (once per sequence would be "
                     f"{len(case.q_lens)}×): pass 1 takes the batch's queries together, so each prefix tile is "
                     f"loaded once for all of them" + (f" ({SECTION}, pitfall:prefix_per_sequence)" if per else ""))
    if result["parts"]["query"] > 1.05:
        where.append(f"the query was read {result['parts']['query']:.2f}×: once by each chunk of pass 1 and once "
                     f"by pass 2 (the price of two passes; vLLM's two kernel calls read it twice too)")
    garbage = garbage_entries_read(case, counted)
    if garbage:
        where.append(f"block-table entries past a sequence's last block were loaded ({len(garbage)} of them, first: "
                     f"sequence {garbage[0][0]}, column {garbage[0][1]}): they are garbage (a freed row may hold "
                     f"anything); mask the table load with pos < seq_len, as in L2 (content/l2.md §9)")
    result["where"] = where + result["where"]
    return result
