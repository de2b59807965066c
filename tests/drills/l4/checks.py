"""L4's checks and their diagnosis: check_split_decode and check_merge compare with the
reference and, on a mismatch, rebuild the chunk and merge mistakes to name the one that
reproduces it (only on evidence)."""
import torch

from _diagnose import Mismatch, output_of, reproduces

from .mistakes import SECTION
from .reference import LN2, TOLERANCE, chunk_bounds, chunk_states, merge_all, ref_merge

_ALIGNS = (1, 16, 32, 64, 128, 256)  # chunk lengths a kernel may round to (1: none; or its block size)


def _close(a, b, atol, rtol):
    return torch.isclose(a.double(), b.double(), rtol=rtol, atol=atol).all(dim=-1)


def check_split_decode(case, got, returned=None, num_splits=None):
    """paged_decode_attention_split's output. `got` is the Guarded buffer passed as out=
    (or, for a call without out=, the tensor returned). The out= contract first (returned
    itself, nothing written around it, nothing left unwritten), then non-finite outputs
    as such, then the tolerance; a wrong output is explained by the chunk mistake that
    reproduces it, named only on evidence (content/l4.md §8)."""
    query = case.query
    got = output_of(got, returned, query, "paged_decode_attention_split", "content/l4.md §1")
    out, want = got.cpu().double(), case.reference()
    atol, rtol = TOLERANCE[query.dtype]
    splits = num_splits or case.num_splits
    bad = ~torch.isfinite(out).all(dim=-1)
    if bad.any():
        raise _non_finite(case, out, bad, splits)
    wrong = ~_close(out, want, atol, rtol)
    if not wrong.any():
        return
    b, h = (int(i) for i in wrong.nonzero()[0])
    pitfall, text = _explain_wrong(case, out, want, wrong, splits, atol, rtol, b, h)
    d = int((out[b, h] - want[b, h]).abs().argmax())
    rows = ", ".join(f"({int(i)}, {int(j)})" for i, j in wrong.nonzero()[:6])
    raise Mismatch(f"{_where(case, b, h, splits)} is off: {text}\n"
                   f"  sequence {b}, query head {h}, element {d}: expected {float(want[b, h, d]):.5g}, got "
                   f"{float(out[b, h, d]):.5g} (tolerance {atol} + {rtol}·|expected|)\n"
                   f"  {int(wrong.sum())} of {wrong.numel()} (sequence, query head) outputs wrong: {rows}"
                   f"{', ...' if int(wrong.sum()) > 6 else ''}\n  {_describe(case, splits)}",
                   [pitfall] if pitfall else [])


def _where(case, b, h, splits):
    n = int(case.seq_lens[b])
    group = case.query.shape[1] // case.k_cache.shape[2]
    cut = f", cut into {splits} chunks" if splits else ""
    return f"sequence {b} (seq_len {n}{cut}), query head {h} (KV head {h // group})"


def _describe(case, splits):
    num_seqs, num_heads, head_size = case.query.shape
    scale = "default 1/sqrt(D)" if case.scale is None else f"{case.scale:g}"
    return (f"case: B={num_seqs}, H_q={num_heads}, H_kv={case.k_cache.shape[2]}, D={head_size}, "
            f"block_size={case.block_size}, dtype={str(case.query.dtype).replace('torch.', '')}, scale={scale}, "
            f"num_splits={splits if splits else 'None (the function picks)'}, seq_lens={case.seq_lens.tolist()}, "
            f"unused end of each last block holds {case.tail}")


def _non_finite(case, out, bad, splits):
    """NaN/inf in the output. Named empty_split_nan only when the bad outputs are exactly
    those of sequences shorter than num_splits (whose last chunks are empty however a
    kernel rounds its chunks) and the sequences no rounding leaves a chunk empty in are
    finite; otherwise described."""
    b, h = (int(i) for i in bad.nonzero()[0])
    lens = case.seq_lens.cpu().long()
    head = f"{_where(case, b, h, splits)}: the output holds NaN or inf ({int(bad.sum())} of {bad.numel()} outputs)"
    pitfalls = []
    if splits and splits > 1:
        surely_empty = lens < splits                     # fewer tokens than chunks
        never_empty = lens % (splits * max(_ALIGNS)) == 0  # every rounding cuts it into full chunks
        rows_bad = bad.any(dim=1)
        if surely_empty.any() and never_empty.any() and bool((rows_bad == surely_empty)[surely_empty | never_empty]
                                                             .all()) and not bool(rows_bad[~surely_empty].any()):
            pitfalls = ["empty_split_nan"]
            text = (f"{head}; exactly the sequences shorter than num_splits = {splits} are NaN, and their chunks "
                    f"past the end hold no token: an empty chunk's 0/0 (acc / l with l = 0), or its garbage v "
                    f"times weight 0, reached the output (pitfall:empty_split_nan, {SECTION})")
    if not pitfalls:
        text = (f"{head}. Where it can come from: a chunk past a short sequence's end left as 0/0 (content/l4.md "
                f"§3), NaN read from a block no sequence owns or from the unused end of a last block (they hold "
                f"NaN here; L2's masks carry over), or an LSE of -inf minus -inf in the merge (content/l4.md §4)")
    return Mismatch(text + f"\n  {_describe(case, splits)}", pitfalls)


def _mistakes(case, splits):
    """(output [B, H_q, D] float64, pitfall, sentence) for each chunk mistake, each tried
    with every chunk rounding; splits=None tries the counts a CPU default may use."""
    data = case.scores_values()
    bs = case.block_size
    counts = [splits] if splits else list(range(2, 9))
    for count in counts:
        if count < 2:
            continue
        for align in sorted({*_ALIGNS, bs}):
            states = [chunk_states(s, v, chunk_bounds(s.shape[1], count, align)) for s, v in data]
            rounding = "no rounding" if align == 1 else f"chunks rounded to {align} tokens"
            yield (torch.stack([merge_all([(v, lse / LN2, l) for v, lse, l in st])[0] for st in states]),
                   "lse_base2",
                   f"it matches the {count} chunks ({rounding}) merged with their LSEs in base 2 (m·log2 e + "
                   f"log2 l) read as natural logs: an exp2 softmax must store (m + log2 l) · ln 2")
            yield (torch.stack([merge_all([(v * l[:, None], lse, l) for v, lse, l in st])[0] for st in states]),
                   "unnormalised_partial",
                   f"it matches the {count} chunks ({rounding}) merged with each chunk's output left unnormalised "
                   f"(acc, not acc / l) while its LSE already counts l: the sum is divided in twice or not at all")
            yield (torch.stack([merge_all(st[:-1])[0] for st in states]), "last_chunk_dropped",
                   f"it matches the first {count - 1} of {count} chunks ({rounding}) merged, the last left out: "
                   f"the merge loop, or the phase-1 grid, stops one chunk early")


def _explain_wrong(case, out, want, wrong, splits, atol, rtol, b, h):
    """The tolerance rule (tests/_diagnose.py): a mistake reproduces this output within
    tolerance where its output is far from the right one; it is named only when it also
    reproduces every other output, wrong and right alike. A partial match is described."""
    this = torch.zeros_like(wrong)
    this[b, h] = True
    partial = None
    for alt, tag, text in _mistakes(case, splits):
        if not reproduces(out, want, alt, atol, rtol, this):
            continue
        if bool(_close(out, alt, atol, rtol).all()):
            return tag, f"{text}; so do all the other outputs (pitfall:{tag}, {SECTION})"
        partial = partial or text
    if partial:
        return None, f"{partial}; but other outputs do not fit that story, so it may be something else ({SECTION})"
    return None, (f"it matches none of the usual chunk mistakes (LSE in base 2, an unnormalised partial, the last "
                  f"chunk dropped); compare it with L2 on the same input: if L2's kernel is right there, the "
                  f"mistake is in the chunk bounds or the merge (content/l4.md §5)")


def check_merge(case, got):
    """merge_attention_states' (v, s) against the float64 merge."""
    name = "merge_attention_states"
    if not (isinstance(got, tuple) and len(got) == 2):
        raise Mismatch(f"{name} should return a tuple (v, s), got {type(got).__name__}")
    v, s = got
    if v.shape != case.v_a.shape or v.dtype != case.v_a.dtype or v.device != case.v_a.device:
        raise Mismatch(f"v should be {tuple(case.v_a.shape)} {case.v_a.dtype} on {case.v_a.device} (v_a's dtype); got "
                       f"{tuple(v.shape)} {v.dtype} on {v.device} (content/l4.md §1)")
    if s.shape != case.s_a.shape or s.dtype != torch.float32:
        raise Mismatch(f"s should be {tuple(case.s_a.shape)} float32; got {tuple(s.shape)} {s.dtype} "
                       f"(content/l4.md §1)")
    want_v, want_s = case.reference()
    got_v, got_s = v.cpu().double(), s.cpu().double()
    empty_a, empty_b = torch.isinf(case.s_a.cpu()), torch.isinf(case.s_b.cpu())
    both = empty_a & empty_b
    wrong_s = ~(torch.isclose(got_s, want_s, rtol=1e-6, atol=1e-5) | (both & (got_s == float("-inf"))))
    atol, rtol = TOLERANCE.get(v.dtype, TOLERANCE[torch.float32])
    wrong = ~_close(got_v, want_v, atol, rtol) | wrong_s
    bad = ~torch.isfinite(got_v).all(dim=-1)
    if bad.any():
        r, h = (int(i) for i in bad.nonzero()[0])
        raise _merge_non_finite(case, got_v, bad, wrong, r, h, empty_a, empty_b)
    if not wrong.any():
        return
    r, h = (int(i) for i in wrong.nonzero()[0])
    where = (f"row {r}, head {h} (s_a = {float(case.s_a[r, h]):.6g}, s_b = {float(case.s_b[r, h]):.6g}): expected "
             f"v[..., 0] = {float(want_v[r, h, 0]):.6g}, s = {float(want_s[r, h]):.6g}; got {float(got_v[r, h, 0]):.6g}, "
             f"{float(got_s[r, h]):.6g}")
    if both[r, h]:
        error = Mismatch(f"{name}: both sides are empty at {where}: the merge of two empty sets is v = 0, s = -inf "
                         f"(content/l4.md §4)")
        error.pitfalls = []
        raise error
    candidates = [  # (mistake's (v, s), pitfall, sentence, rtol on s: float16 rounds s to 1 part in 2048)
        (_merge_fp16(case), "merge_in_fp16",
         "it matches the merge computed in 16 bits (s and the weighted sum in float16): LSEs near 1000 lose their "
         "fractions there, so merge in fp32 whatever v's dtype", 1e-3),
        (ref_merge(case.v_a, case.s_a, case.v_b, case.s_b, base=2), "lse_base2",
         "it matches a merge that reads the LSEs as base 2 (exp2(s_a - s)): here they are natural logs", 1e-6),
        ((case.v_a.cpu().double().nan_to_num(), case.s_a.cpu().double()), "last_chunk_dropped",
         "it returns side a alone: the merge loop stopped before the last part (v_b, s_b)", 1e-6),
    ]
    for (alt_v, alt_s), tag, text, s_rtol in candidates:
        same = _close(got_v, alt_v, atol, rtol) & torch.isclose(got_s, alt_s.double(), rtol=s_rtol, atol=1e-5)
        far = ~_close(want_v, alt_v, 10 * atol, 10 * rtol) | ~torch.isclose(want_s, alt_s.double(), rtol=1e-4,
                                                                               atol=1e-3)
        if bool(same.all()) and far[r, h]:  # every result, wrong and right alike, as the mistake gives
            raise Mismatch(f"{name}: {where}; {text} (pitfall:{tag}, {SECTION})", [tag])
    error = Mismatch(f"{name}: {where}; {int(wrong.sum())} of {wrong.numel()} (row, head) results wrong. The merge "
                     f"is s = log(e^s_a + e^s_b), v = (e^(s_a - s) v_a + e^(s_b - s) v_b) (content/l4.md §3)")
    error.pitfalls = []
    raise error


def _merge_fp16(case):
    """The merge as a kernel that keeps s and v in float16 would compute it."""
    half = lambda x: x.cpu().half()  # noqa: E731
    s_a, s_b, v_a, v_b = half(case.s_a), half(case.s_b), half(case.v_a), half(case.v_b)
    s_max = torch.maximum(s_a, s_b)
    s_max = torch.where(torch.isinf(s_max), torch.zeros_like(s_max), s_max)
    w_a, w_b = torch.exp(s_a - s_max), torch.exp(s_b - s_max)
    total = w_a + w_b
    part = lambda w, v: torch.where(w[..., None] > 0, w[..., None] * v, 0)  # noqa: E731
    v = (part(w_a, v_a) + part(w_b, v_b)) / torch.where(total > 0, total, 1)[..., None]
    return v.double(), (s_max + torch.log(total)).double()


def _fp16_merge_reproduces(case, got_v):
    """The float16 merge gives inf exactly where got_v does, and got_v's finite results
    elsewhere (a merge that forgets to divide overflows on large values too, but is
    wrong on the small ones)."""
    alt_v, _ = _merge_fp16(case)
    inf = torch.isinf(got_v)
    if not torch.equal(inf, torch.isinf(alt_v)):
        return False
    atol, rtol = TOLERANCE[torch.float16]
    return bool(torch.isclose(got_v[~inf], alt_v[~inf], atol=atol, rtol=rtol).all())


def _merge_non_finite(case, got_v, bad, wrong, r, h, empty_a, empty_b):
    """NaN/inf in v. Named empty_split_nan only when every bad result has an empty side, every
    other result is right, and, if a bad one has a single empty side, some result with both
    sides is right too: a merge that weighs the sides wrongly also gives NaN where one side is
    empty (its garbage v gets a weight), but is wrong where none is."""
    one_empty = empty_a ^ empty_b
    both = empty_a & empty_b
    neither = ~(empty_a | empty_b)
    garbage = torch.isnan(case.v_a.cpu()).any(-1) | torch.isnan(case.v_b.cpu()).any(-1)
    where = f"merge_attention_states: row {r}, head {h} holds NaN or inf ({int(bad.sum())} of {bad.numel()})"
    big = (case.v_a.cpu().double().abs().amax(-1) + case.v_b.cpu().double().abs().amax(-1))
    rest_right = not bool((wrong & ~bad).any())
    shown = not bool((bad & one_empty).any()) or bool(neither.any())
    if bool((bad <= ((one_empty & garbage) | both)).all()) and not (rest_right and shown):
        error = Mismatch(f"{where}: every bad result has an empty side (s = -inf), but "
                         f"{'other results are wrong too' if not rest_right else 'every row has an empty side'}, so "
                         f"the empty side may not be the cause: check the weights e^(s_a - s), e^(s_b - s) on a row "
                         f"with both sides (content/l4.md §3), then the empty sides (§4)")
        error.pitfalls = []
    elif bool((bad <= ((one_empty & garbage) | both)).all()):
        error = Mismatch(f"{where}: every bad result has an empty side (s = -inf); an empty side's v is garbage "
                         f"(NaN here) and must get weight 0 without being multiplied (0 · NaN = NaN), and two empty "
                         f"sides give v = 0, s = -inf, not 0/0 (pitfall:empty_split_nan, {SECTION})")
        error.pitfalls = ["empty_split_nan"]
    elif (torch.isinf(got_v[r, h]).any() and case.v_a.dtype == torch.float16 and bool((big[bad] > 65504).all())
          and _fp16_merge_reproduces(case, got_v)):
        error = Mismatch(f"{where}: inf, where |v_a| + |v_b| passes float16's largest value 65504: the weighted sum "
                         f"was formed in float16; accumulate in fp32 (pitfall:merge_in_fp16, {SECTION})")
        error.pitfalls = ["merge_in_fp16"]
    else:
        error = Mismatch(f"{where}; the inputs there are finite with no empty side: an overflow, or -inf - (-inf) "
                         f"(content/l4.md §4)")
        error.pitfalls = []
    return error
