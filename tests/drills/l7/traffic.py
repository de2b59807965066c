"""L7's traffic (tests/_traffic.py): its traffic case, traffic(module) with where the extra
bytes went, the check that every latent row is read once per (sequence, split) with its
value never loaded again, and the check that padding tokens' rows are not read."""
import torch

from _diagnose import Mismatch
from _paged import DTYPES
from _traffic import Part, measure, report, was_read

from .bench import mla_bytes
from .cases import decode_case
from .checks import check_decode, check_write, describe_decode
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
    """mla_decode_attention on `case` with its loads counted: the answer first, then every
    latent row read once per (sequence, split), its c (the value) never loaded again.
    Returns False where nothing can be counted (a GPU), True when checked."""
    out = torch.full_like(case.q_nope, float("nan"))
    result, counted = measure(module, "mla_decode_attention", *case.args(), **case.kwargs(), out=out)
    if counted is None:
        return False
    check_decode(case, result)
    c_reads, pe_reads = latent_reads(case, counted)
    if bool((c_reads == 1).all()) and bool((pe_reads == 1).all()):
        return True
    if bool((pe_reads >= 1).all()) and bool((c_reads == 2 * pe_reads).all()):
        raise Mismatch(f"right answer, but the first R columns of every latent row (c, the value) were loaded twice "
                       f"as often as its last P (k_pe): the value was loaded again instead of reusing the key tile "
                       f"already loaded, twice the bytes of the biggest tensor (pitfall:value_loaded_again, "
                       f"{SECTION})\n  {describe_decode(case)}", ["value_loaded_again"])
    most = max(int(c_reads.max()), int(pe_reads.max()))
    raise Mismatch(f"right answer, but latent rows were read up to {most}× (c {int(c_reads.min())}× to "
                   f"{int(c_reads.max())}×, k_pe {int(pe_reads.min())}× to {int(pe_reads.max())}×): with "
                   f"H = {case.q_nope.shape[1]}, one head tile holds every head, so each row should be read once per "
                   f"(sequence, split); reading it once per head tile (or per head) multiplies the biggest tensor's "
                   f"bytes\n  {describe_decode(case)}")


def check_padding_not_read(module, case):
    """concat_and_cache_mla on `case` with its loads counted: no padding token's kv_c or
    k_pe row is read (slot -1 reads nothing). Returns False on a GPU, True when checked."""
    _, counted = measure(module, "concat_and_cache_mla", *case.args())
    if counted is None:
        return False
    pads = [t for t in (case.slot_mapping < 0).nonzero().flatten().tolist()
            if was_read(counted.tensors[0], case.kv_c[t]) or was_read(counted.tensors[1], case.k_pe[t])]
    if pads:
        raise Mismatch(f"the kv_c/k_pe rows of padding token(s) {pads} (slot -1) were read: a padding token reads and "
                       f"writes nothing, so its loads must be masked by the slot (pitfall:padding_written, {SECTION})",
                       ["padding_written"])
    check_write(case)
    return True


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
    if result["parts"].get("partials, lse", 0) > 1.05:
        where.append(f"the partial outputs moved {result['parts']['partials, lse']:.2f}× what num_splits of them "
                     f"need (each split writes its part once, the merge reads it once)")
    result["where"] = where + result["where"]
    return result
