"""L7's checks and their diagnosis: the write bit for bit (a planted pitfall named when its
variant writes the very same bytes), and the decode's (out, lse) against the float64
reference, the mistakes that reproduce a wrong answer named only on evidence."""
import os

import torch

from _diagnose import Mismatch, check_out_buffer, describe_mistakes, known_mistakes, output_of, reproduces
from _paged import Guarded, bits, same_bits

from .mistakes import PLANTED, SECTION
from .reference import LSE_TOLERANCE, TOLERANCE

# ---------------------------------------------------------------------------
# The write


def _describe_write(case):
    num_tokens, rank = case.kv_c.shape
    return (f"case: T={num_tokens} tokens ({int((case.slot_mapping < 0).sum())} padding), R={rank}, "
            f"P={case.k_pe.shape[1]}, block_size={case.block_size}, "
            f"dtype={str(case.kv_c.dtype).replace('torch.', '')}, "
            f"kv_c row stride={case.kv_c.stride(0)}, k_pe row stride={case.k_pe.stride(0)}, "
            f"slots={case.slot_mapping.tolist()}")


def check_write(case):
    """The cache, guards included, bit for bit; kv_c and k_pe left untouched. A pitfall is
    named when its planted variant, run on the same input, leaves exactly these bytes."""
    want = case.expected()
    try:
        _explain_write(case, case.kv_cache.storage, want)
        if not same_bits(case.inputs, case.inputs_initial):
            raise Mismatch("kv_c/k_pe were modified: concat_and_cache_mla must only read them\n  "
                           + _describe_write(case))
    except Mismatch as error:
        names, undecided = known_mistakes(PLANTED, lambda module: (rerun_write(module, case),),
                                          (case.kv_cache.storage,))
        raise Mismatch(str(error) + describe_mistakes(PLANTED, names), names, undecided) from None


def rerun_write(module, case):
    """module.concat_and_cache_mla on the case's inputs, into a fresh copy of its cache's storage."""
    cache = case.kv_cache
    storage = cache.initial.clone()
    module.concat_and_cache_mla(case.kv_c, case.k_pe, storage[cache.margin:cache.margin + cache.view.numel()]
                                .view(cache.view.shape), case.slot_mapping)
    return storage


def _explain_write(case, got, want):
    diff = bits(got) != bits(want)
    if not diff.any():
        return
    cache = case.kv_cache
    width = cache.view.shape[-1]
    rank = case.kv_c.shape[1]
    margin, size = cache.margin, cache.view.numel()
    findings = []
    if diff[:margin].any():
        before = margin - int(diff[:margin].nonzero()[0])
        pads = [t for t, s in enumerate(case.slot_mapping.tolist()) if s < 0]
        findings.append(f"{before} elements before the cache were written"
                        + (f" (slot -1 is the row just before it: padding token(s) {pads} must write nothing)"
                           if pads and before <= width else ": an offset went negative"))
    if diff[margin + size:].any():
        findings.append(f"{int(diff[margin + size:].sum())} elements past the end of the cache were written")
    rows = diff[margin:margin + size].view(-1, width)
    owner = {s: t for t, s in enumerate(case.slot_mapping.tolist()) if s >= 0}
    for slot in rows.any(dim=1).nonzero().flatten().tolist()[:2]:
        where = f"slot {slot} (block {slot // case.block_size}, offset {slot % case.block_size})"
        cols = rows[slot].nonzero().flatten()
        part = ("its c (columns 0..R-1)" if int(cols[-1]) < rank else "its k_pe (columns R..R+P-1)"
                if int(cols[0]) >= rank else "both parts")
        if slot in owner:
            findings.append(f"{where} should hold token {owner[slot]}'s row (kv_c then k_pe); {cols.numel()} of its "
                            f"{width} values are wrong, in {part}")
        else:
            findings.append(f"{where} belongs to no token and must keep its contents, but {cols.numel()} of its "
                            f"values changed, in {part}")
    wrong = sum(1 for s in owner if rows[s].any())
    raise Mismatch("; ".join(findings) + f"\n  {wrong} of {len(owner)} real tokens' rows wrong\n  "
                   + _describe_write(case))


# ---------------------------------------------------------------------------
# The decode


class WrongValues(Mismatch):
    """The decode kept its contract (the output's shape, dtype, buffer) and its values are
    wrong: non-finite, or outside the tolerance. The big-offset test names int32 offsets
    only on this (a contract error is not a wrapped offset)."""


def describe_decode(case):
    num_seqs, num_heads, rank = case.q_nope.shape
    splits = case.num_splits or "None (the function picks)"
    return (f"case: B={num_seqs}, H={num_heads}, R={rank}, P={case.q_pe.shape[2]}, block_size={case.block_size}, "
            f"dtype={str(case.q_nope.dtype).replace('torch.', '')}, scale={case.scale:g}, num_splits={splits}, "
            f"seq_lens={case.seq_lens.tolist()}, unused block-table entries: {case.garbage}, unused end of each last "
            f"block holds {case.tail}")


def check_decode(case, result, out=None):
    """mla_decode_attention's (out, lse). `out` is the Guarded buffer passed as out= (None
    for a call without). The out= contract first (the head tile's spare rows stored past
    the end are named as such), then NaN as NaN, then the tolerance; a wrong answer is
    explained by the mistake that reproduces every output, named only on that evidence."""
    name = "mla_decode_attention"
    if not (isinstance(result, tuple) and len(result) == 2):
        raise Mismatch(f"{name} should return a tuple (out, lse), got {type(result).__name__}")
    returned, lse = result
    if isinstance(out, Guarded):
        _spare_rows_past_the_end(case, out)
        check_out_buffer(out, returned)
        got = out.view
    else:
        got = output_of(returned, None, case.q_nope, name, SECTION)
    num_seqs, num_heads, _ = case.q_nope.shape
    if not isinstance(lse, torch.Tensor) or tuple(lse.shape) != (num_seqs, num_heads) or lse.dtype != torch.float32:
        raise Mismatch(f"lse should be a float32 tensor [B, H] = [{num_seqs}, {num_heads}], got "
                       f"{type(lse).__name__} {tuple(getattr(lse, 'shape', ()))} {getattr(lse, 'dtype', '')}")
    o, s = got.cpu().double(), lse.cpu().double()
    want_o, want_s = case.reference()
    atol, rtol = TOLERANCE[case.q_nope.dtype]
    bad = ~torch.isfinite(o).all(dim=-1) | torch.isnan(s)
    if bad.any():
        _keep_for_picture(case, got, lse)
        raise _non_finite(case, o, s, want_o, want_s, bad, atol, rtol)
    wrong_o = ~torch.isclose(o, want_o, atol=atol, rtol=rtol).all(dim=-1)
    wrong_s = ~torch.isclose(s, want_s, atol=LSE_TOLERANCE[0], rtol=LSE_TOLERANCE[1])
    if not (wrong_o.any() or wrong_s.any()):
        return
    _keep_for_picture(case, got, lse)
    wrong = wrong_o | wrong_s
    b, h = (int(i) for i in wrong.nonzero()[0])
    pitfall, text = _explain(case, o, s, want_o, want_s, wrong, b, h)
    d = int(torch.nan_to_num((o[b, h] - want_o[b, h]).abs(), nan=float("inf")).argmax())
    what = "out is off" if wrong_o[b, h] else "out is right, but lse is off"
    raise WrongValues(f"sequence {b} (seq_len {int(case.seq_lens[b])}), head {h}: {what}: {text}\n"
                      f"  out[{b}, {h}, {d}]: expected {float(want_o[b, h, d]):.5g}, got {float(o[b, h, d]):.5g} "
                      f"(tolerance {atol} + {rtol}·|expected|); lse[{b}, {h}]: expected {float(want_s[b, h]):.6g}, "
                      f"got {float(s[b, h]):.6g}\n"
                      f"  {int(wrong_o.sum())} of {wrong.numel()} (sequence, head) outputs wrong, "
                      f"{int(wrong_s.sum())} lse wrong\n  {describe_decode(case)}", [pitfall] if pitfall else [])


def _spare_rows_past_the_end(case, out):
    """pitfall:head_tile_unmasked, on its one piece of evidence: values written right after
    out's end, in whole head rows, as many as a head tile whose size is a power of two
    has spare rows past H (r rows with H + r a multiple of a power of two above r), and
    nothing written before out."""
    num_seqs, num_heads, rank = case.q_nope.shape
    end = out.margin + out.view.numel()
    after = bits(out.storage[end:]) != bits(out.initial[end:])
    if not after.any() or (bits(out.storage[:out.margin]) != bits(out.initial[:out.margin])).any():
        return
    spare = -(-(int(after.nonzero().max()) + 1) // rank)  # rows from out's end to the last value written
    tile = (num_heads + spare) & -(num_heads + spare)       # the largest power of two dividing H + spare
    if bool(after[:spare * rank].all()) and tile > spare:
        # What is known: the tiles are a power of two that divides H + spare (64 for H = 63 and
        # one spare row: tiles of 2, 4, ..., 64 heads all leave it), not which one.
        raise Mismatch(f"{spare} head row(s) of {rank} values were written right after the end of out: H = "
                       f"{num_heads} heads stored in whole head tiles fill {num_heads + spare} rows, {spare} spare "
                       f"row(s) in the last tile, and their stores were not masked by head < H (in every sequence "
                       f"but the last they land in the next one's rows) (pitfall:head_tile_unmasked, {SECTION})\n  "
                       f"{describe_decode(case)}", ["head_tile_unmasked"])


def _non_finite(case, o, s, want_o, want_s, bad, atol, rtol):
    """NaN or inf in out, or NaN in lse. Named empty_sequence_nan only when the bad
    (sequence, head) pairs are exactly those of the empty sequences, and every other output
    is right."""
    b, h = (int(i) for i in bad.nonzero()[0])
    empty = (case.seq_lens.cpu() == 0)[:, None].expand_as(bad)
    head = (f"sequence {b} (seq_len {int(case.seq_lens[b])}), head {h}: out or lse holds NaN or inf ({int(bad.sum())} "
            f"of {bad.numel()} (sequence, head) pairs)")
    rest = ~bad
    rest_right = bool((torch.isclose(o, want_o, atol=atol, rtol=rtol).all(dim=-1)[rest]).all()) and bool(
        torch.isclose(s, want_s, atol=LSE_TOLERANCE[0], rtol=LSE_TOLERANCE[1])[rest].all())
    if empty.any() and torch.equal(bad, empty) and rest_right:
        return WrongValues(f"{head}: exactly the sequences of length 0 are NaN: with no token, acc = 0 and l = 0, "
                           f"and 0/0 is NaN; an empty sequence's answer is out = 0, lse = -inf "
                           f"(pitfall:empty_sequence_nan, {SECTION})\n  {describe_decode(case)}",
                           ["empty_sequence_nan"])
    # exp of an lse past log(float32's largest) = 88.72 is inf: a merge that weighs the
    # splits by exp(lse) without subtracting the largest first gets inf / inf.
    largest = float(want_s[torch.isfinite(want_s)].max()) if bool(torch.isfinite(want_s).any()) else 0.0
    overflow = (f", or exp(lse) overflowing float32 in the merge: the largest lse here is {largest:.0f}, past 88.7, "
                f"so the merge must subtract the largest lse before exp" if largest > 88.7 else "")
    return WrongValues(f"{head}. Where it can come from: NaN read from a block no sequence owns, from the unused end "
                       f"of a last block or through a block-table entry past the sequence's last block (here "
                       f"{'2147480000' if case.garbage == 'huge' else 'the numbers of NaN blocks'}), a chunk or "
                       f"sequence with no token left as 0/0, or -inf - (-inf) in the merge{overflow}\n  "
                       f"{describe_decode(case)}")


def _explain(case, o, s, want_o, want_s, wrong, b, h):
    """(pitfall or None, sentence): a mistake is named when its float64 replay reproduces
    every output and lse within tolerance and is far from the right answer at (b, h)."""
    atol, rtol = TOLERANCE[case.q_nope.dtype]
    rank, rope = case.q_nope.shape[2], case.q_pe.shape[2]
    this = torch.zeros_like(wrong)
    this[b, h] = True
    for tag, (alt_o, alt_s), text in (
            ("scale_from_row_width", case.reference(scale=(rank + rope) ** -0.5),
             f"it matches the scores scaled by 1/sqrt(R + P) = 1/sqrt({rank + rope}), not by the scale given "
             f"({case.scale:g})"),
            ("rope_part_left_out", case.reference(rope=False),
             "it matches scores without q_pe · k_pe: the rotary part was left out")):
        far = ~torch.isclose(alt_o, want_o, atol=10 * atol, rtol=10 * rtol).all(-1) | \
            ~torch.isclose(alt_s, want_s, atol=10 * LSE_TOLERANCE[0], rtol=10 * LSE_TOLERANCE[1])
        same = torch.isclose(o, alt_o, atol=atol, rtol=rtol).all(-1) & \
            torch.isclose(s, alt_s, atol=LSE_TOLERANCE[0], rtol=LSE_TOLERANCE[1])
        if bool(far[b, h]) and bool(same.all()):
            return tag, f"{text}; so does every other output (pitfall:{tag}, {SECTION})"
        if bool(far[b, h]) and bool(same[b, h]) and reproduces(o, want_o, alt_o, atol, rtol, this):
            return None, f"{text}, but other outputs do not fit that story, so it may be something else ({SECTION})"
    out_right = not bool((~torch.isclose(o, want_o, atol=atol, rtol=rtol).all(-1)).any())
    lse_wrong = ~torch.isclose(s, want_s, atol=LSE_TOLERANCE[0], rtol=LSE_TOLERANCE[1])
    if out_right and bool(torch.isinf(want_s)[lse_wrong].all()):
        return None, (f"every output is right; the lse of the empty sequences is not: a sequence of length 0 has "
                      f"lse = -inf, the log of an empty sum (got {float(s[lse_wrong][0]):g}), so that a merge with it "
                      f"returns the other side unchanged")
    finite = torch.isfinite(want_s) & (want_s.abs() > 0.1)
    if out_right and bool(finite.any()):
        ratio = (s[finite] / want_s[finite]).median().item()
        base2 = abs(ratio - 1.4426950408889634) < 0.01
        return None, (f"every output is right, only lse differs (got/expected ≈ {ratio:.4f}"
                      + (", log2 e: a base-2 log-sum-exp; lse is the natural log, (m + log2 l) · ln 2 when the "
                         "softmax runs in base 2" if base2 else "") + "): lse is log Σ exp(score), natural log, "
                      "with the scale applied")
    log2e = 1.4426950408889634
    for other, what in ((1.0, "no scale at all"), (rank ** -0.5, f"1/sqrt(R) = 1/sqrt({rank})"),
                        (case.scale * log2e, "the scale times log2 e twice (or exp of base-2 scores)"),
                        (case.scale / log2e, "the scale without its log2 e (exp2 of natural-log scores)")):
        alt_o, alt_s = case.reference(scale=other)
        if bool(torch.isclose(o, alt_o, atol=atol, rtol=rtol).all()) and \
                bool(torch.isclose(s, alt_s, atol=LSE_TOLERANCE[0], rtol=LSE_TOLERANCE[1]).all()):
            return None, f"every output matches scores scaled by {other:g}, {what}, instead of the scale given"
    return None, ("it matches neither the usual scale nor a score without its rotary part; check the two products "
                  "(q_nope against the first R columns, q_pe against the last P), the chunk bounds and the merge")


def _keep_for_picture(case, got, lse):
    """Save the first failing case small enough to draw where the grader asked (DRILLS_CASE_DUMP)."""
    path = os.environ.get("DRILLS_CASE_DUMP")
    if path and not os.path.exists(path) and case.q_nope.shape[0] <= 4 and case.q_nope.shape[1] <= 16:
        torch.save((case, got.cpu(), lse.cpu()), path)
