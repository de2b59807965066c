"""Drill F1's traffic case and `traffic(module)`: the bytes append_paged_kv_cache moves
under the CPU interpreter, against append_bytes (the bench's count), tensor by tensor.
"""
from _drill import ELEMENT_SIZE
from _paged import DTYPES
from _traffic import Part, measure, report

from .bench import append_bytes, bench_layout
from .cases import append_case
from .mistakes import PLANTED

# The traffic report (tests/_traffic.py): bytes moved under the CPU interpreter

# The bench's workload (requests with random contexts up to 1200 tokens each appending the
# same number of new tokens, pages of 16) shrunk to interpreter size: 4 requests of 8 new
# tokens, H=2, D=32. Its fewest bytes are append_bytes itself, the bench's formula.
TRAFFIC_CASE = dict(num_requests=4, new_tokens=8, num_heads=2, head_size=32, page_size=16, dtype="float16")


def traffic_case(device="cpu"):
    p = TRAFFIC_CASE
    context, _ = bench_layout(p["num_requests"], p["new_tokens"], p["page_size"])
    return append_case(context.tolist(), [p["new_tokens"]] * p["num_requests"], p["page_size"],
                       num_heads=p["num_heads"], head_size=p["head_size"], dtype=DTYPES[p["dtype"]], device=device,
                       seed=5)


def traffic_parts(p):
    """append_bytes tensor by tensor. Indices: places in the call (key, value, batch_indices,
    positions, k_cache, v_cache, kv_indices, kv_indptr, kv_last_page_len)."""
    context, _ = bench_layout(p["num_requests"], p["new_tokens"], p["page_size"])
    touched = int(((context + p["new_tokens"] - 1) // p["page_size"] - context // p["page_size"] + 1).sum())
    tokens = p["num_requests"] * p["new_tokens"]
    rows = tokens * p["num_heads"] * p["head_size"] * ELEMENT_SIZE[p["dtype"]]
    parts = [Part("key/value", (0, 1), fewest_loaded=2 * rows),
             Part("batch_indices/positions", (2, 3), fewest_loaded=8 * tokens),
             Part("kv_indptr", (7,), fewest_loaded=4 * (p["num_requests"] + 1)),
             Part("kv_indices", (6,), fewest_loaded=4 * touched),
             Part("caches", (4, 5), fewest_stored=2 * rows)]
    assert sum(x.fewest_loaded + x.fewest_stored for x in parts) == append_bytes(**p)
    return parts


def traffic(module):
    """append_paged_kv_cache on TRAFFIC_CASE, its bytes against append_bytes (the bench's
    count), with where the extra bytes went in F1's words."""
    case = traffic_case()
    _, counted = measure(module, "append_paged_kv_cache", *case.args())
    if counted is None:
        return None
    result = report(PLANTED.id, counted, traffic_parts(TRAFFIC_CASE))
    where = []
    if result["parts"]["key/value"] > 1.05:
        where.append(f"the appended key/value rows were loaded {result['parts']['key/value']:.2f}× their size: "
                     f"each token's row once is enough")
    if result["stores"] > 1.05:
        where.append(f"the caches were written {result['stores']:.2f}× what the appended tokens fill")
    result["where"] = where + result["where"]
    return result
