"""Drill L8's check of both functions' outputs against the float64 reference, and its
diagnosis: which token is off and which mistake of content/l8.md §10 reproduces it."""
import math

import torch

import _wrong
from _diagnose import explain_token_rows, far_from, output_of, reproduces

from .mistakes import PLANTED, SECTION
from .reference import TOLERANCE


def check_window(case, out, returned=None):
    """The function's output against the reference, (token, query head) by (token, query
    head): the out= contract first, then non-finite outputs as such, then wrong values
    explained by the mistake that reproduces them (§9), a pitfall named only on evidence
    no simpler story fits."""
    out = output_of(out, returned, case.query, case.function, "content/l8.md §8")
    got, want = out.double().cpu(), case.reference()
    atol, rtol = TOLERANCE[case.query.dtype]
    explain_token_rows(got, want, atol, rtol, lambda got: _explain_non_finite(case, got, atol, rtol),
                       lambda got, want, wrong: _explain_wrong(case, got, want, wrong, atol, rtol),
                       lambda t: _fmt_row(case, t), lambda: _describe(case))


def _fmt_row(case, t):
    b, i, pos = case.rows()[t]
    return (f"token {t} (sequence {b}, position {pos})" if case.decode else
            f"token {t} (sequence {b}, query {i} of {case.q_lens[b]}, position {pos})")


# The NaN sources a case plants, and what each means when its planted variant reproduces the output.
_NAN_CAUSES = {
    "tiles_outside_window_loaded": "K/V of tiles before the window were loaded (their scores masked afterwards): "
                                   "the blocks there are dead here and hold NaN, and 0 · NaN = NaN. Skip those "
                                   "tiles; do not load and mask them",
    "dead_entries_as_block_numbers": "the first live tile is partial, and its keys before the window were "
                                     "gathered through their block-table entries: those entries are dead here "
                                     "(their blocks hold NaN). Mask the loads, block-table entry included, with "
                                     "key >= the window's start",
    "split_outside_window_nan": "a split with no key in the window divided 0 by 0 (or the merge multiplied its "
                                "garbage part by a weight of 0): an empty split must give v = 0 and lse = -inf",
}


def _variant_reproduces(case, name, got, bad, atol, rtol):
    """The planted variant `name`, run on this case (into a fresh output), is NaN in exactly
    the outputs `bad` and agrees with `got` on the others."""
    try:
        theirs = case.call(_wrong.variant(PLANTED, name), out=False).double().cpu()
    except Exception:
        return False
    their_bad = ~torch.isfinite(theirs).all(dim=-1)
    return torch.equal(their_bad, bad) and bool(torch.isclose(got, theirs, atol=atol, rtol=rtol)
                                                .all(dim=-1)[~bad].all())


def _explain_non_finite(case, got, atol, rtol):
    bad = ~torch.isfinite(got).all(dim=-1)
    rows = bad.any(dim=1)
    head = f"the output holds NaN or inf for {int(rows.sum())} of {len(got)} query tokens"
    causes = [] if bool(bad.all()) else [n for n in _NAN_CAUSES if _variant_reproduces(case, n, got, bad, atol, rtol)]
    if len(causes) == 1:
        return f"{head}; {_NAN_CAUSES[causes[0]]} (pitfall:{causes[0]}, {SECTION})", causes[0]
    hints = []
    if case.dead == "nan":
        hints.append("the blocks before each window are dead here and hold NaN: were K/V loaded before the "
                     "window's start?")
    if case.decode:
        hints.append("with several splits, one may hold no key of the window: does it store 0 and lse = -inf?")
    hints.append("a row with no key in a tile needs exp(-inf - (-inf)) kept from NaN (content/l8.md §6)")
    return f"{head}; " + "; or ".join(hints) + f" ({SECTION})", None


def _explain_wrong(case, got, want, wrong, atol, rtol):
    """A finite wrong output: which plausible mistake reproduces it."""
    num_heads, num_kv_heads = case.query.shape[1], case.k_cache.shape[2]
    group = num_heads // num_kv_heads
    scale = 1 / math.sqrt(case.query.shape[2]) if case.scale is None else case.scale
    w = case.window_left
    sinks = case.sinks.double().cpu() if case.sinks is not None else None
    named = []  # (alternative output, pitfall or None, what it means)
    if w >= 2:
        named += [(lambda d=d: case.reference(window_left=w + d), "window_off_by_one",
                   f"it matches a window of {w + d} keys before the query instead of {w}: each query at p sees "
                   f"[p - window_left, p], window_left keys and itself") for d in (-1, 1)]
    if sinks is not None:
        named += [(lambda: case.reference(sink_of_head=sinks * scale), "sink_scaled",
                   "it matches sinks multiplied by the softmax scale: the sink is a logit as it stands, not a q·k "
                   "to be scaled"),
                  (lambda: case.reference(sink_of_head=sinks * math.log(2)), "sink_base_e",
                   "it matches sinks taken as base-2 logits: in a kernel whose scores are in base 2 (exp2), the "
                   "sink must be multiplied by log2(e) too"),
                  (lambda: case.reference(sink_of_head=sinks[torch.arange(num_heads) // group]), "sink_per_kv_head",
                   "it matches each query head using its KV head's sink, sinks[h // group]: there is one sink per "
                   "query head")]
        if case.decode:
            named += [(lambda k=k: case.reference(sink_of_head=sinks + math.log(k)), "sink_every_split",
                       f"it matches the sink counted {k} times: each split added it to its own denominator, and "
                       f"the merge summed them; only one split may hold it") for k in range(2, 9)]
        named.append((lambda: case.reference(sink_of_head=torch.full((num_heads,), float("-inf"))), None,
                      "it matches attention without the sinks: e^sink must join each softmax's denominator"))
    if w >= 0:
        named.append((lambda: case.reference(window_left=-1), None,
                      "it matches attention over every key up to the query's position: the window is ignored"))
    named.append((lambda: case.reference(kv_head=torch.arange(num_heads) % num_kv_heads), None,
                  "it matches query head h reading KV head h % H_kv instead of h // group"))
    for compute, tag, text in named:
        if reproduces(got, want, compute(), atol, rtol, wrong):
            return text + (f" (pitfall:{tag}, {SECTION})" if tag else " (content/l8.md §8)"), tag
    return _describe_wrong(case, got, want, wrong, atol, rtol), None


def _describe_wrong(case, got, want, wrong, atol, rtol):
    rows = wrong.any(dim=1)
    info = case.rows()
    head = f"the output is wrong for {int(rows.sum())} of {len(info)} query tokens"
    near = torch.zeros_like(rows)
    if case.window_left >= 1:  # wrong only near the window's start: a key more or less there
        for d in (-1, 1):
            alt = case.reference(window_left=case.window_left + d)
            near |= torch.isclose(got, alt, atol=atol, rtol=rtol).all(dim=-1).all(dim=-1) & \
                far_from(want, alt, atol, rtol).any(dim=-1).any(dim=-1)
    if bool(near[rows].all()):
        return (f"{head}; each wrong query matches a window one key longer or shorter, on some queries only: "
                f"look at where the window starts in each tile and split (content/l8.md §8)")
    heads = wrong.any(dim=0)
    if not bool(heads.all()):
        return f"{head}; only query heads {heads.nonzero().flatten().tolist()} are wrong (content/l8.md §8)"
    return f"{head}; it matches none of the usual mistakes (content/l8.md §10)"


def _describe(case):
    num_heads, head_size = case.query.shape[1:]
    sinks = "none" if case.sinks is None else [round(float(s), 3) for s in case.sinks.cpu()[:8]]
    return (f"case: {case.function}, window_left={case.window_left}, sinks={sinks}, H_q={num_heads}, "
            f"H_kv={case.k_cache.shape[2]}, D={head_size}, block_size={case.block_size}, "
            f"dtype={str(case.query.dtype).replace('torch.', '')}, scale={case.scale}, "
            f"num_splits={case.num_splits}, q_lens={case.q_lens}, seq_lens={case.seq_lens.tolist()}, "
            f"dead entries before the window: {case.dead}")
