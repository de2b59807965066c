"""L1's traffic report (tests/_traffic.py): bytes moved under the CPU interpreter on
its traffic case, padding rows read among them (advice: the worker's count), and the
check of a padded case's values that those counts explain when it fails."""
import torch

import _env
from _traffic import Part, measure, report, values_decide, was_read

from .bench import kv_write_bytes
from .cases import random_kv_write_case
from .checks import check_kv_write
from .mistakes import PLANTED

# The bench's shape (H=8, D=128, blocks of 16) shrunk to interpreter size, with padding
# tokens among the real ones, as a batch padded for a CUDA graph has.
TRAFFIC_CASE = dict(context_lens=[5, 30], new_lens=[4, 6], padding=[0, 7, 12], block_size=16, num_heads=2,
                    head_size=32, dtype=torch.float16, slot_dtype=torch.int64)


def traffic_case(device="cpu"):
    return random_kv_write_case(**TRAFFIC_CASE, device=device, seed=3)


def padding_rows_read(case, traffic):
    """The padding tokens whose key or value row was loaded (L1 promises they read nothing)."""
    pads = (case.slot_mapping < 0).nonzero().flatten().tolist()
    return [t for t in pads if was_read(traffic.tensors[0], case.key[t]) or was_read(traffic.tensors[1], case.value[t])]


def check_padding_not_read(module, case):
    """Run reshape_and_cache on `case` with its loads counted, and check what it wrote: the
    values decide. When they are wrong, padding tokens whose rows the worker counted as
    read explain it too (content/l1.md §8, the worker's word); when they are right, a read
    padding row fails nothing here: the traffic report names it. Returns False where
    nothing is counted (a GPU: nothing runs), True when checked."""
    if not _env.INTERPRET:
        return False
    _, counted = measure(module, "reshape_and_cache", *case.args())

    def explain(counted):
        pads = padding_rows_read(case, counted)
        return [(f"the key/value rows of padding token(s) {pads} (slot -1) were read: a padding token reads "
                 f"nothing, so its loads must be masked by the slot, not only by the row length "
                 f"(content/l1.md §8)", "padding_written")] if pads else []
    with values_decide(counted, explain):
        check_kv_write(case)
    return True


def traffic(module):
    """reshape_and_cache on TRAFFIC_CASE, its bytes against kv_write_bytes (the bandwidth
    report's count), with where the extra bytes went in L1's words."""
    case = traffic_case()
    _, counted = measure(module, "reshape_and_cache", *case.args())
    if counted is None:
        return None
    num_tokens, num_heads, head_size = case.key.shape
    real = int((case.slot_mapping >= 0).sum())
    row = num_heads * head_size * case.key.element_size()
    parts = [Part("key/value", (0, 1), fewest_loaded=2 * real * row),
             Part("slot_mapping", (4,), fewest_loaded=8 * num_tokens),
             Part("caches", (2, 3), fewest_stored=2 * real * row)]
    fewest = kv_write_bytes(num_tokens, num_heads, head_size, "float16", num_padding=num_tokens - real)
    assert sum(p.fewest_loaded + p.fewest_stored for p in parts) == fewest  # the GPU report's bytes
    where = []
    pads = padding_rows_read(case, counted)
    if pads:
        where.append(f"padding rows were read (tokens {pads}): L1 promises that a padding token reads nothing, "
                     f"so load a row only once its slot is known to be >= 0 ({PLANTED.section}, pitfall:padding_written)")
    result = report(PLANTED.id, counted, parts, where)
    rows = result["parts"]["key/value"]
    if rows > 1.05 and not pads:
        result["where"].append(f"key/value rows were loaded {rows:.2f}× their size: each real token's row once "
                               f"is enough")
    if result["stores"] > 1.05:
        result["where"].append(f"the caches were written {result['stores']:.2f}× what the new tokens fill")
    return result
