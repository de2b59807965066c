"""L2's traffic report (tests/_traffic.py): the traffic case, its fewest bytes tensor by
tensor, where a kernel's extra bytes went (garbage block-table entries among them: advice,
the worker's count), and the check of a garbage-column case's answer that those counts
explain when it fails."""
import torch

import _env
from _drill import ELEMENT_SIZE
from _paged import DTYPES, owned_columns, poisoned_out
from _traffic import Part, measure, report, values_decide, was_read

from .bench import decode_bytes
from .cases import paged_decode_case
from .checks import check_paged_decode
from .mistakes import PLANTED

# The bench's shape (32 query heads over 8 KV heads, D = 128, blocks of 16, one
# context for every sequence) shrunk to interpreter size: the same GQA group of 4, a
# partial last block, and garbage block-table columns past it.
TRAFFIC_CASE = dict(num_seqs=4, num_heads=8, num_kv_heads=2, head_size=32, context=72, block_size=16,
                    dtype="float16")


def traffic_case(device="cpu"):
    p = TRAFFIC_CASE
    return paged_decode_case([p["context"]] * p["num_seqs"], num_heads=p["num_heads"], num_kv_heads=p["num_kv_heads"],
                             head_size=p["head_size"], block_size=p["block_size"], dtype=DTYPES[p["dtype"]],
                             extra_columns=2, device=device, seed=5)


def garbage_entries_read(case, traffic, record=3):
    """(sequence, column) of every block-table entry past a sequence's last block that was
    loaded: those entries are garbage (design.md), and reading one is reads_past_seq_len."""
    owned = owned_columns(case.seq_lens, case.block_size, case.block_table.shape[1])
    return [(b, c) for b, c in (~owned).nonzero().tolist()
            if was_read(traffic.tensors[record], case.block_table[b, c])]


def check_table_read_only_to_last_block(module, case):
    """Run paged_decode_attention on `case` (garbage block-table columns past each
    sequence's last block) with its loads counted, and check its answer: the values
    decide. When they are wrong, garbage entries the worker counted as loaded explain it
    too (the worker's word); a kernel that loads them but masks its K/V loads, so that the
    answer comes out right, passes here, and the traffic report names it. Returns False
    where nothing is counted (a GPU: nothing runs), True when checked."""
    if not _env.INTERPRET:
        return False
    out = poisoned_out(case.query.shape, case.query.dtype, case.query.device, torch.Generator().manual_seed(0))
    returned, counted = measure(module, "paged_decode_attention", *case.args(), **case.kwargs(), out=out.view)
    with values_decide(counted, lambda counted: _garbage_finding(case, counted)):
        check_paged_decode(case, out, returned)
    return True


def _garbage_finding(case, counted):
    garbage = garbage_entries_read(case, counted)
    if not garbage:
        return []
    b, c = garbage[0]
    return [(f"block_table[{b}, {c}] was loaded, but sequence {b} has seq_len {int(case.seq_lens[b])}: its last "
             f"block is column {-(-int(case.seq_lens[b]) // case.block_size) - 1}, and the entries past it are "
             f"garbage ({len(garbage)} such entries loaded); mask the block-table load with pos < seq_len "
             f"(content/l2.md §9)", "reads_past_seq_len")]


# A right answer whose host code reads the whole block table, as design.md (L2) allows:
# `block_table.long()` reads every entry, the garbage past each sequence's last block too.
_HOST_READS_THE_TABLE = (
    "    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]\n",
    "    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]\n"
    "    owned = torch.arange(block_table.shape[1], device=block_table.device)[None, :] < (\n"
    "        (seq_lens.long() + block_size - 1) // block_size)[:, None]\n"
    "    if bool((block_table.long()[owned] >= k_cache.shape[0]).any()):\n"
    "        raise ValueError('a block-table entry names a block past the cache')\n")


def check_a_host_read_of_the_whole_table_fails_no_test(device):
    """The reference behind host code that reads the whole block table passes L2's
    block-table cases: garbage columns that name NaN blocks, blocks far past the cache, and
    negative numbers, and the counted case. Reading the tensor the caller passed never
    fails a right answer; a kernel's whole-row loads are reported as traffic (advice)."""
    import tempfile

    from _tree import parameters
    from _worker import tree_module
    from _wrong import plant_edits
    from .cases import far_garbage_case, small_case

    negative = far_garbage_case(device)
    garbage = ~owned_columns(negative.seq_lens, negative.block_size, negative.block_table.shape[1])
    numbers = torch.tensor([-1, -2 ** 31], dtype=torch.int32).repeat(int(garbage.sum()))[:int(garbage.sum())]
    negative.block_table[garbage.to(negative.block_table.device)] = numbers.to(negative.block_table.device)
    with tempfile.TemporaryDirectory() as folder:
        contract = {fn: (names, ("out",) if fn == "paged_decode_attention" else ())  # the drill's `writes`
                    for fn, names in parameters(PLANTED.stem).items()}
        # the tree in a folder of its own: mkdtemp's is 0700, and as root the worker reads as another user
        module = tree_module(plant_edits(PLANTED, (_HOST_READS_THE_TABLE,), f"{folder}/tree"), PLANTED.stem, contract)
        for case in (small_case(device, [128, 32, 1, 20], extra_columns=0, seed=4), far_garbage_case(device), negative,
                     small_case(device, [5, 17, 32, 40], extra_columns=3, seed=6)):
            out = poisoned_out(case.query.shape, case.query.dtype, case.query.device, torch.Generator().manual_seed(0))
            check_paged_decode(case, out, module.paged_decode_attention(*case.args(), **case.kwargs(), out=out.view))
        check_table_read_only_to_last_block(module, small_case(device, [5, 17, 32, 40], extra_columns=3, seed=6))


def traffic_parts(p):
    """The fewest bytes of a decode step, tensor by tensor; they sum to decode_bytes (the
    bandwidth report's count). The indices are the tensors' places in the call."""
    size = ELEMENT_SIZE[p["dtype"]]
    kv = 2 * p["num_seqs"] * p["context"] * p["num_kv_heads"] * p["head_size"] * size
    rows = p["num_seqs"] * p["num_heads"] * p["head_size"] * size
    parts = [Part("K/V", (1, 2), fewest_loaded=kv), Part("query", (0,), fewest_loaded=rows),
             Part("block table", (3,), fewest_loaded=4 * p["num_seqs"] * -(-p["context"] // p["block_size"])),
             Part("seq_lens", (4,), fewest_loaded=4 * p["num_seqs"]),
             Part("out", (5,), fewest_stored=rows)]
    assert sum(x.fewest_loaded + x.fewest_stored for x in parts) == decode_bytes(**p)
    return parts


def traffic_where(result, case, counted, section):
    """Where a decode kernel's extra bytes went, in the words of content/l2.md."""
    group = case.query.shape[1] // case.k_cache.shape[2]
    kv, table = result["parts"]["K/V"], result["parts"]["block table"]
    where = []
    if kv > 1.5 and group > 1 and abs(kv - group) < 0.25 * group:
        where.append(f"K and V are read {kv:.0f}× — once per query head; content/l2.md §5 reads them once per "
                     f"KV head, for its {group} query heads at once (GQA)")
    elif kv > 1.05:
        where.append(f"K and V are read {kv:.2f}× their size: each cached token's K/V once per KV head is enough")
    # Each KV head's program reads its sequence's owned entries once: H_kv× a tiny table.
    if table > 2 * max(kv, 1) * case.k_cache.shape[2]:
        where.append(f"the block table was read once per token instead of once per block ({table:.0f}× its owned "
                     f"entries): load a tile's entries in one tl.load, lanes of one block share an entry")
    garbage = garbage_entries_read(case, counted)
    if garbage:
        where.append(f"block-table entries past a sequence's last block were read ({len(garbage)} of them, first: "
                     f"sequence {garbage[0][0]}, column {garbage[0][1]}): they are garbage; mask the table load "
                     f"with pos < seq_len ({section}, pitfall:reads_past_seq_len)")
    if result["parts"]["query"] > 1.05:
        where.append(f"the query was read {result['parts']['query']:.2f}×: each program reads its heads' rows once")
    return where


def traffic(module):
    """paged_decode_attention on TRAFFIC_CASE, its bytes against decode_bytes (the bandwidth
    report's count), with where the extra bytes went in L2's words."""
    case = traffic_case()
    out = torch.empty_like(case.query)
    _, counted = measure(module, "paged_decode_attention", *case.args(), out=out)
    if counted is None:
        return None
    result = report(PLANTED.id, counted, traffic_parts(TRAFFIC_CASE))
    result["where"] = traffic_where(result, case, counted, PLANTED.section) + result["where"]
    return result
