"""L2's checks and their diagnosis: paged_decode_attention's output against the
reference, and the sentence that says which mistake (content/l2.md §9) reproduces it."""
import math
import os

import torch

import _wrong
from _diagnose import Mismatch, output_of, reproduces

from .mistakes import PLANTED
from .reference import DECODE_TOLERANCE, online_softmax, ref_paged_decode

_TILES = (16, 32, 64, 128, 256)  # tile sizes a kernel may use: mistakes that depend on it are tried with each


def check_paged_decode(case, out, returned=None):
    """paged_decode_attention's output against the reference, (sequence, query head) by
    (sequence, query head). `out` is the Guarded buffer passed as out= (or, for a call
    without out=, the tensor returned). The output contract is checked first, then
    non-finite outputs are reported as such, then wrong values are explained by the
    mistake that reproduces them (content/l2.md §9), naming one only on evidence."""
    query = case.query
    out = output_of(out, returned, query, "paged_decode_attention", "content/l2.md §1")
    got, want = out.float().cpu(), case.reference()
    atol, rtol = DECODE_TOLERANCE[query.dtype]
    wrong = ~_close(got, want, atol, rtol)  # [B, H_q]; NaN counts as wrong
    if not wrong.any():
        return
    _keep_for_picture(case, got)
    b, h = (int(i) for i in wrong.nonzero()[0])
    if torch.isfinite(got[b, h]).all():
        finding, pitfall = _explain_wrong(case, got, want, wrong, b, h, atol, rtol)
    else:
        finding, pitfall = _explain_non_finite(case, got, want, b, h, atol, rtol)
    err = torch.nan_to_num((got[b, h] - want[b, h]).abs(), nan=float("inf"))
    d = int(err.argmax())
    rows = ", ".join(f"({int(i)}, {int(j)})" for i, j in wrong.nonzero()[:6])
    raise Mismatch(
        f"{finding}\n"
        f"  sequence {b}, query head {h}, element {d}: expected {float(want[b, h, d]):.5g}, got {float(got[b, h, d]):.5g} "
        f"(tolerance {atol} + {rtol}·|expected|)\n"
        f"  {int(wrong.sum())} of {wrong.numel()} (sequence, query head) outputs wrong: {rows}"
        f"{', ...' if int(wrong.sum()) > 6 else ''}\n  {_describe_decode(case)}",
        [pitfall] if pitfall else [])  # named only when the evidence singles one out


def _close(a, b, atol, rtol):
    return torch.isclose(a, b, rtol=rtol, atol=atol).all(dim=-1)


def _where(case, b, h):
    """'sequence b (seq_len n: k blocks, the last holding r of block_size), query head h (KV head kv)'."""
    n, bs = int(case.seq_lens[b]), case.block_size
    group = case.query.shape[1] // case.k_cache.shape[2]
    blocks = math.ceil(n / bs)
    return (f"sequence {b} (seq_len {n}: {blocks} block{'s' * (blocks > 1)}, the last holding {n - (blocks - 1) * bs} "
            f"of {bs}), query head {h} (KV head {h // group})")


def _explain_non_finite(case, got, want, b, h, atol, rtol):
    """NaN/inf in the output. Said as exactly that first; the NaN this case planted that
    could reach the bad outputs is offered as a cause, and named only when the planted
    variant of that pitfall, run on the same input, gives NaN in exactly the same outputs
    and the same values elsewhere, while some outputs stay finite (an output that is NaN
    everywhere fits too many stories to name one)."""
    bad = ~torch.isfinite(got).all(dim=-1)  # [B, H_q]
    head = f"{_where(case, b, h)}: the output holds NaN or inf ({int(bad.sum())} of {bad.numel()} outputs)"
    if bool(bad.all()):
        return (f"{head}: every output is NaN or inf, which alone singles out no mistake; look for a division by "
                f"zero (l = 0), exp of +inf (a sign flipped in exp(m_old - m_new)?), or a read outside the inputs "
                f"(content/l2.md §3, §5)"), None
    causes = [name for name in _NAN_CAUSES if _variant_reproduces(case, name, got, bad, atol, rtol)]
    if len(causes) == 1:
        name = causes[0]
        return f"{head}; {_NAN_CAUSES[name]} (pitfall:{name}, content/l2.md §9)", name
    return (f"{head}, in some outputs only; none of the page's NaN mistakes reproduces exactly these: a read outside "
            f"the inputs, an unmasked load, or an overflowing exp (content/l2.md §5, §9)"), None


# The NaN sources a case plants, and what each means when its planted variant reproduces the output.
_NAN_CAUSES = {
    "unmasked_loads": "the unused end of the last block holds NaN here, and 0 · NaN = NaN: K/V were loaded there "
                      "without a mask (masking the scores alone is not enough)",
    "no_running_max": "exp() of the raw scores overflows where the logits are large: the running max was not "
                      "subtracted first",
    "unmasked_head_size": "NaN follows the query in memory, within a padded tile's reach: the lanes past D were "
                          "loaded without a mask",
    "reads_past_seq_len": "NaN fills every block no sequence owns, and the block-table entries past "
                          "ceil(seq_len / block_size) name such blocks: they were read",
}


def _variant_reproduces(case, name, got, bad, atol, rtol):
    """The planted variant `name`, run on this case, is NaN in exactly the outputs `bad`
    and agrees with `got` on the others."""
    try:
        theirs = _wrong.variant(PLANTED, name).paged_decode_attention(*case.args(), **case.kwargs()).float().cpu()
    except Exception:
        return False
    their_bad = ~torch.isfinite(theirs).all(dim=-1)
    if not torch.equal(their_bad, bad):
        return False
    return bool(_close(got, theirs, atol, rtol)[~bad].all())


def _tiled(case, **mistake):
    """The output of an online softmax over tiles (of a size given later) with `mistake` switched on."""
    def compute(tile):
        last = [online_softmax(s, v, tile, **mistake)[-1] for s, v in case.scores_values()]
        return torch.stack([acc / l[:, None] for _, _, _, l, acc in last])
    return compute


def _with_query(case, query):
    return ref_paged_decode(query, case.k_cache, case.v_cache, case.block_table, case.seq_lens, case.scale)


def _explain_wrong(case, got, want, wrong, b, h, atol, rtol):
    """A finite wrong output: which plausible mistake reproduces it."""
    num_heads, head_size = case.query.shape[1:]
    num_kv_heads, bs = case.k_cache.shape[2], case.block_size
    lens = case.seq_lens.long().cpu()
    dropped = lens // bs * bs
    # (how to compute the wrong answer, tried once or once per tile size; the pitfall; what it means)
    mistakes = [
        (lambda: case.reference(seq_lens=(lens + bs - 1) // bs * bs), "no_last_block_mask",
         "it matches attention over the whole last block, unused slots included: the tokens past seq_len in the "
         "last block were not masked out of the softmax"),
        (lambda: case.reference(seq_lens=torch.where(dropped > 0, dropped, lens)), None,
         "it matches attention without the last, partly filled block: only full blocks were read (the tokens of "
         "the last block must be read up to seq_len, and masked after it)"),
        (_tiled(case, zero_scores=True), "no_last_block_mask",
         "it matches a softmax in which the positions past seq_len in the last tile of {tile} tokens kept score 0 "
         "(their K/V loads were masked to 0, their scores were not set to -inf), so they still count in the sum"),
        (lambda: case.reference(seq_lens=torch.clamp(lens - 1, min=1)), "off_by_one",
         "it matches attention over seq_len - 1 tokens: seq_len already counts the new token, whose K/V is in the "
         "cache"),
        (lambda: case.reference(kv_head=torch.arange(num_heads) % num_kv_heads), "wrong_gqa_mapping",
         "it matches attention with KV head h % H_kv instead of h // (H_q / H_kv): the query heads of KV head kv "
         "are kv·group .. kv·group + group - 1"),
        (lambda: case.reference(kv_head=torch.zeros(num_heads, dtype=torch.long)), "wrong_gqa_mapping",
         "it matches attention with every query head reading KV head 0: the KV head's offset inside each slot "
         "(kv_head · D) is missing"),
        (lambda: case.reference(scale=1.0 / math.sqrt(case.query.shape[2])), "missing_scale",
         f"it matches attention with the default scale 1/sqrt(D): the scale={case.scale} passed in was ignored"),
        (lambda: case.reference(scale=1.0), "missing_scale",
         "it matches attention with scale = 1: the scores were not multiplied by scale"),
        (lambda: _with_query(case, case.query.as_strided(case.query.shape, (num_heads * head_size, head_size, 1))),
         "query_stride_ignored",
         "it matches attention with query rows read H_q·D apart: the query's row stride (query.stride(0)) was "
         "ignored, so a view of a fused QKV tensor reads the wrong rows"),
        (_tiled(case, rescale_sum=False, rescale_acc=False), "no_rescale",
         "it matches an online softmax over tiles of {tile} tokens that moves to the new max but never rescales the "
         "running sum and accumulator by exp(m_old - m_new)"),
        (_tiled(case, rescale_acc=False), "no_rescale",
         "it matches an online softmax over tiles of {tile} tokens that rescales the running sum but not the "
         "accumulator by exp(m_old - m_new)"),
        (_tiled(case, rescale_sum=False), "no_rescale",
         "it matches an online softmax over tiles of {tile} tokens that rescales the accumulator but not the "
         "running sum by exp(m_old - m_new)"),
    ]
    # Each mistake that reproduces this output, within tolerance, where its output is far
    # from the right one. It is named only when it reproduces every output, wrong and
    # right alike; a partial match is only described.
    this = torch.zeros_like(wrong)
    this[b, h] = True
    matches = []
    for compute, tag, text in mistakes:
        for tile in (_TILES if "{tile}" in text else (None,)):
            alt = compute(tile) if tile else compute()
            if not reproduces(got, want, alt, atol, rtol, this):
                continue
            whole = bool(_close(got, alt, atol, rtol).all())  # every output, wrong or right, as the mistake gives
            matches.append((not whole, text.format(tile=tile), tag))
    if matches:
        partial, text, tag = min(matches, key=lambda match: match[0])  # stable: the list order breaks ties
        if partial:
            return (f"{_where(case, b, h)} is off: {text}; but other outputs do not fit that story, so it may be "
                    f"something else (content/l2.md §9)"), None
        named = f" (pitfall:{tag}, content/l2.md §9)" if tag else " (content/l2.md §5)"
        return f"{_where(case, b, h)} is off: {text}; so do all the other wrong outputs{named}", tag
    scope = "every output is wrong" if bool(wrong.all()) else "some outputs are right"
    return (f"{_where(case, b, h)} is off ({scope}); it matches none of the usual mistakes (last block unmasked or "
            f"dropped, another GQA head mapping, a missing scale, an online softmax that does not rescale) "
            f"(content/l2.md §5)"), None


def _describe_decode(case):
    num_seqs, num_heads, head_size = case.query.shape
    scale = "default 1/sqrt(D)" if case.scale is None else f"{case.scale:g}"
    return (f"case: B={num_seqs}, H_q={num_heads}, H_kv={case.k_cache.shape[2]}, D={head_size}, "
            f"block_size={case.block_size}, dtype={str(case.query.dtype).replace('torch.', '')}, scale={scale}, "
            f"seq_lens={case.seq_lens.tolist()}, block_table={case.block_table.tolist()}, "
            f"unused end of each last block holds {case.tail}")


def _keep_for_picture(case, got):
    """Save the first failing case small enough to draw where the grader asked (DRILLS_CASE_DUMP)."""
    path = os.environ.get("DRILLS_CASE_DUMP")
    if path and not os.path.exists(path) and case.query.shape[0] <= 8 and case.query.shape[1] <= 32:
        torch.save((case, got), path)
