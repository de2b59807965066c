"""L7's traffic (tests/_traffic.py): its traffic case, traffic(module) with where the extra
bytes went (the value loaded again among them: advice, the worker's count), and the checks
of a decode's answer and of a padded write's values, which the worker's counts (a latent
row read more than once, a padding row read) explain when they fail."""
import torch

import _env
from _paged import DTYPES
from _traffic import Part, measure, report, values_decide, was_read

from .bench import mla_bytes
from .cases import decode_case, random_write_case
from .checks import check_decode, check_write
from .mistakes import PLANTED, SECTION

# The bench's memory-bound shape (H = 16, R = 512, P = 64, blocks of 64, bf16) shrunk to
# interpreter size: two sequences, a partial last block, two splits.
TRAFFIC_CASE = dict(num_seqs=2, num_heads=16, rank=512, rope=64, context=200, block_size=64, dtype="bfloat16",
                    num_splits=2)
LATENT = 2  # the cache's index among the call's tensors: q_nope, q_pe, kv_cache, block_table, seq_lens, out


def traffic_case(device="cpu"):
    p = TRAFFIC_CASE
    return decode_case([p["context"]] * p["num_seqs"], num_heads=p["num_heads"], rank=p["rank"], rope=p["rope"],
                       block_size=p["block_size"], dtype=DTYPES[p["dtype"]], num_splits=p["num_splits"], seed=5,
                       device=device)


def latent_reads(case, traffic):
    """(c reads, k_pe reads): for every cached row a sequence owns, how many loads touched
    its least-read byte of c (the first R columns) and of k_pe (the last P)."""
    read = torch.from_numpy(traffic.tensors[LATENT].read)
    rank, width, size = case.q_nope.shape[2], case.kv_cache.shape[2], case.kv_cache.element_size()
    slots = [case.block_table[b, :n // case.block_size + 1].cpu().long().repeat_interleave(case.block_size)[:n]
             * case.block_size + torch.arange(n) % case.block_size for b, n in enumerate(case.seq_lens.tolist())]
    first = (case.kv_cache.storage_offset() + torch.cat(slots) * width) * size  # each row's first byte
    c_bytes = first[:, None] + torch.arange(rank * size)
    pe_bytes = first[:, None] + rank * size + torch.arange((width - rank) * size)
    return read[c_bytes].amin(dim=1), read[pe_bytes].amin(dim=1)


def check_latent_read_once(module, case):
    """mla_decode_attention on `case` with its loads counted, and its answer checked: the
    values decide. When they are wrong, the worker's count of each latent row's reads
    explains it too (its word). A right answer that loads the value again
    (pitfall:value_loaded_again) passes here: only the counts show it, so the traffic
    report names it, as advice. Returns False where nothing is counted (a GPU: nothing
    runs), True when checked."""
    if not _env.INTERPRET:
        return False
    out = torch.full_like(case.q_nope, float("nan"))
    result, counted = measure(module, "mla_decode_attention", *case.args(), **case.kwargs(), out=out)

    def explain(counted):
        c_reads, pe_reads = latent_reads(case, counted)
        if bool((c_reads == 1).all()) and bool((pe_reads == 1).all()):
            return []
        if bool((pe_reads >= 1).all()) and bool((c_reads == 2 * pe_reads).all()):
            return [(f"the first R columns of every latent row (c, the value) were loaded twice as often as its last "
                     f"P (k_pe): the value was loaded again instead of reusing the key tile already loaded "
                     f"(pitfall:value_loaded_again, {SECTION})", "value_loaded_again")]
        most = max(int(c_reads.max()), int(pe_reads.max()))
        return [(f"latent rows were read up to {most}× (c {int(c_reads.min())}× to {int(c_reads.max())}×, k_pe "
                 f"{int(pe_reads.min())}× to {int(pe_reads.max())}×), where once per (sequence, split) is enough",
                 None)]
    with values_decide(counted, explain):
        check_decode(case, result)
    return True


def check_padding_not_read(module, case):
    """concat_and_cache_mla on `case` with its loads counted, and what it wrote checked: the
    values decide. When they are wrong, padding tokens whose kv_c or k_pe rows the worker
    counted as read explain it too (its word); a right write that read them passes here.
    Returns False where nothing is counted (a GPU: nothing runs), True when checked."""
    if not _env.INTERPRET:
        return False
    _, counted = measure(module, "concat_and_cache_mla", *case.args())

    def explain(counted):
        pads = padding_rows_read(case, counted)
        return [(f"the kv_c/k_pe rows of padding token(s) {pads} (slot -1) were read: a padding token reads and "
                 f"writes nothing, so its loads must be masked by the slot (pitfall:padding_written, {SECTION})",
                 "padding_written")] if pads else []
    with values_decide(counted, explain):
        check_write(case)
    return True


def padding_rows_read(case, counted):
    """The padding tokens (slot -1) whose kv_c or k_pe row was loaded."""
    return [t for t in (case.slot_mapping < 0).nonzero().flatten().tolist()
            if was_read(counted.tensors[0], case.kv_c[t]) or was_read(counted.tensors[1], case.k_pe[t])]


def traffic_parts(p):
    """mla_bytes (the bandwidth report's count: the cache once, q, out) tensor by tensor,
    plus what it leaves out: the block table and seq_lens, and the fp32 partials (each
    split writes its part once, the merge reads it once) and lse the function returns."""
    size = DTYPES[p["dtype"]].itemsize
    width = p["rank"] + p["rope"]
    latent = p["num_seqs"] * p["context"] * width * size
    q = p["num_seqs"] * p["num_heads"] * width * size
    out = p["num_seqs"] * p["num_heads"] * p["rank"] * size
    # One split stores straight into out and lse: no partials (the reference's DIRECT path).
    partials = p["num_seqs"] * p["num_heads"] * p["num_splits"] * (p["rank"] + 1) * 4 if p["num_splits"] > 1 else 0
    lse = p["num_seqs"] * p["num_heads"] * 4
    parts = [Part("latent cache", (LATENT,), fewest_loaded=latent), Part("q", (0, 1), fewest_loaded=q),
             Part("block table", (3,), fewest_loaded=4 * p["num_seqs"] * -(-p["context"] // p["block_size"])),
             Part("seq_lens", (4,), fewest_loaded=4 * p["num_seqs"]),
             Part("out", (5,), fewest_stored=out),
             Part("partials, lse", ("scratch",), fewest_loaded=partials, fewest_stored=partials + lse)]
    assert latent + q + out == mla_bytes(**p)
    return parts


def traffic(module):
    """mla_decode_attention on TRAFFIC_CASE, its bytes against the fewest, with where the
    extra bytes went in L7's words."""
    case = traffic_case()
    out = torch.empty_like(case.q_nope)
    _, counted = measure(module, "mla_decode_attention", *case.args(), **case.kwargs(), out=out)
    if counted is None:
        return None
    # A kernel that reads no partial back did not split the work (one pass per sequence, straight
    # into out and lse, as num_splits = 1 does): the fewest bytes are those of one split.
    p = TRAFFIC_CASE if counted.scratch.loaded else dict(TRAFFIC_CASE, num_splits=1)
    result = report(PLANTED.id, counted, traffic_parts(p))
    where = []
    c_reads, pe_reads = latent_reads(case, counted)
    if bool((c_reads == 2 * pe_reads).all()) and bool((pe_reads >= 1).all()):
        where.append(f"the latent rows' c was loaded twice as often as their k_pe: the value was loaded again "
                     f"instead of reusing the key tile ({SECTION}, pitfall:value_loaded_again)")
    elif int(c_reads.max()) > 1 or int(pe_reads.max()) > 1:
        where.append(f"latent rows were read up to {max(int(c_reads.max()), int(pe_reads.max()))}×: one head tile "
                     f"holds all {case.q_nope.shape[1]} heads, so each row is needed once per (sequence, split)")
    # The write's padding rows: a right write may still read them, which only the counts show.
    write = random_write_case(6, num_blocks=3, block_size=16, rank=p["rank"], rope=p["rope"], padding=[0, 3],
                              dtype=DTYPES[p["dtype"]], seed=5)
    _, written = measure(module, "concat_and_cache_mla", *write.args())
    pads = padding_rows_read(write, written) if written is not None else []
    if pads:
        where.append(f"concat_and_cache_mla read the kv_c/k_pe rows of padding tokens {pads} (slot -1): a padding "
                     f"token reads nothing; mask its loads by the slot ({SECTION}, pitfall:padding_written)")
    if result["parts"].get("partials, lse", 0) > 1.05:
        where.append(f"the partial outputs moved {result['parts']['partials, lse']:.2f}× what num_splits of them "
                     f"need (each split writes its part once, the merge reads it once)")
    result["where"] = where + result["where"]
    return result
