"""L5's traffic (tests/_traffic.py): its decode traffic case, traffic(module) with where the
extra bytes went, bytes of an unowned block or of a last block's unused end among them
(advice, the worker's count: the interpreter reads fp8 NaN bytes as finite numbers, so
there the NaN poison alone does not show an unmasked load; on a GPU it does), and the check
of such a case's answer that those counts explain when it fails."""
import torch

import _env
from _paged import owned_columns
from _traffic import Part, measure, report, values_decide, was_read

from .bench import decode_bytes
from .cases import decode_case
from .checks import check_fp8_decode
from .mistakes import PLANTED

# The bench's shape (32 query heads over 8 KV heads, D = 128, blocks of 16) shrunk to
# interpreter size: two sequences of 200 tokens, four splits, per-KV-head scales.
TRAFFIC_CASE = dict(num_seqs=2, num_heads=8, num_kv_heads=2, head_size=32, context=200, block_size=16,
                    dtype="float16", num_splits=4)


def traffic_case(device="cpu"):
    p = TRAFFIC_CASE
    return decode_case([p["context"]] * p["num_seqs"], num_heads=p["num_heads"], num_kv_heads=p["num_kv_heads"],
                       head_size=p["head_size"], block_size=p["block_size"], dtype=torch.float16,
                       num_splits=p["num_splits"], extra_columns=2, device=device, seed=5)


def poisoned_bytes_read(case, counted):
    """(cache name, block, first slot) of each unowned block or unused last-block tail that was loaded."""
    owned = owned_columns(case.seq_lens, case.block_size, case.block_table.shape[1])
    used = set(case.block_table.cpu()[owned].tolist())
    found = []
    for index, name, cache in ((1, "k_cache", case.k_cache), (2, "v_cache", case.v_cache)):
        for block in range(cache.shape[0]):
            if block not in used and was_read(counted.tensors[index], cache[block]):
                found.append((name, block, 0))
        for b, n in enumerate(case.seq_lens.tolist()):
            if n % case.block_size:
                block = int(case.block_table[b, n // case.block_size])
                if was_read(counted.tensors[index], cache[block, n % case.block_size:]):
                    found.append((name, block, n % case.block_size))
    return found


def garbage_entries_read(case, traffic, record=3):
    """(sequence, column) of every block-table entry past a sequence's last block that was
    loaded: those entries are garbage (design.md); a host read of the table is not counted."""
    owned = owned_columns(case.seq_lens, case.block_size, case.block_table.shape[1])
    return [(b, c) for b, c in (~owned).nonzero().tolist()
            if was_read(traffic.tensors[record], case.block_table[b, c])]


def check_only_live_tokens_loaded(module, case):
    """paged_decode_attention_fp8 on `case` (fp8 NaN bytes in every unowned block and past
    each seq_len) with its loads counted, and its answer checked: the values decide. When
    they are wrong, garbage bytes the worker counted as loaded explain it too (its word).
    The CPU interpreter reads fp8 NaN bytes as finite numbers, so there a load of them can
    leave the answer right: it passes here, and the traffic report names it (on a GPU the
    NaN bytes themselves fail the answer). Returns False where nothing is counted (a GPU:
    nothing runs), True when checked."""
    if not _env.INTERPRET:
        return False
    out = torch.full_like(case.query, float("nan"))
    returned, counted = measure(module, "paged_decode_attention_fp8", *case.args(), **case.kwargs(), out=out)

    def explain(counted):
        found = poisoned_bytes_read(case, counted)
        if not found:
            return []
        name, block, first = found[0]
        where = f"block {block} (no sequence owns it)" if first == 0 else f"block {block} from slot {first} on " \
                                                                             f"(past its sequence's seq_len)"
        return [(f"{name}: {where} was loaded ({len(found)} such places): those bytes are garbage (fp8 NaN here); "
                 f"mask the K/V loads with pos < seq_len (content/l5.md §6)", None)]
    with values_decide(counted, explain):
        check_fp8_decode(case, out, returned)
    return True


def traffic_parts(p):
    """decode_bytes tensor by tensor, plus the fp32 partials each split writes once and the merge reads once."""
    kv = 2 * p["num_seqs"] * p["context"] * p["num_kv_heads"] * p["head_size"]
    rows = p["num_seqs"] * p["num_heads"] * p["head_size"] * 2
    pages = p["num_seqs"] * -(-p["context"] // p["block_size"])
    partials = p["num_seqs"] * p["num_heads"] * p["num_splits"] * (p["head_size"] + 1) * 4
    parts = [Part("K/V", (1, 2), fewest_loaded=kv), Part("query", (0,), fewest_loaded=rows),
             Part("block table", (3,), fewest_loaded=4 * pages), Part("seq_lens", (4,), fewest_loaded=4 * p["num_seqs"]),
             Part("scales", (5, 6), fewest_loaded=2 * 4 * p["num_kv_heads"]),
             Part("out", (7,), fewest_stored=rows),
             Part("partials", ("scratch",), fewest_loaded=partials, fewest_stored=partials)]
    assert kv + 2 * rows + 4 * pages + 2 * 4 * p["num_kv_heads"] == decode_bytes(**p)
    return parts


def traffic(module):
    """paged_decode_attention_fp8 on TRAFFIC_CASE, its bytes against the fewest."""
    case = traffic_case()
    out = torch.empty_like(case.query)
    _, counted = measure(module, "paged_decode_attention_fp8", *case.args(), **case.kwargs(), out=out)
    if counted is None:
        return None
    result = report(PLANTED.id, counted, traffic_parts(TRAFFIC_CASE))
    kv = result["parts"]["K/V"]
    where = []
    group = case.query.shape[1] // case.k_cache.shape[2]
    if kv > 1.5 and group > 1 and abs(kv - group) < 0.25 * group:
        where.append(f"K and V are read {kv:.0f}× — once per query head; read them once per KV head (content/l2.md §5)")
    elif kv > 1.05:
        where.append(f"K and V are read {kv:.2f}× their size: each token's bytes once is enough")
    if result["parts"]["scales"] > 20:
        where.append(f"the scales were loaded {result['parts']['scales']:.0f}× their size: once per program is enough")
    if poisoned_bytes_read(case, counted):
        where.append("bytes of unowned blocks or past seq_len were read: mask the K/V loads with pos < seq_len "
                     "(on a GPU those bytes are NaN, and the answer with them)")
    garbage = garbage_entries_read(case, counted)
    if garbage:
        where.append(f"block-table entries past a sequence's last block were loaded ({len(garbage)} of them, first: "
                     f"sequence {garbage[0][0]}, column {garbage[0][1]}): they are garbage (a freed row may hold "
                     f"anything); mask the table load with pos < seq_len, as in L2 (content/l2.md §9)")
    result["where"] = where + result["where"]
    return result
