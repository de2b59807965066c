"""Drill L6's checks and their diagnosis: cascade_prefix_len against the rule, and
cascade_attention's output against the reference, a wrong one explained by the mistake
(content/l6.md §8) whose output it is, named only on evidence."""
import torch

import _wrong
from _diagnose import Mismatch, explain_token_rows, output_of, reproduces

from .mistakes import PLANTED, SECTION
from .reference import TOLERANCE, prefix_len_rule


def check_prefix_len(args, got):
    """cascade_prefix_len(*args) returned `got`; args = (block_table, query_start_loc,
    seq_lens, block_size). Names prefix_uncapped when `got` is the uncapped count."""
    want = prefix_len_rule(*args)
    if isinstance(got, bool) or not isinstance(got, int):
        raise Mismatch(f"cascade_prefix_len must return a Python int (tokens), got {type(got).__name__} {got!r} "
                       f"(content/l6.md §3)")
    if got == want:
        return
    table, starts, lens, block_size = args
    uncapped = prefix_len_rule(*args, cap=False)
    cached = [int(n) - int(starts[b + 1] - starts[b]) for b, n in enumerate(lens.tolist())]
    head = (f"cascade_prefix_len returned {got} for block_size {block_size}, cached contexts {cached} and "
            f"{len(lens)} sequences; expected {want}")
    if got == uncapped and uncapped > want:
        raise Mismatch(f"{head}: {got} is the shared columns times block_size, not capped by the fewest cached "
                       f"tokens min(seq_len - q_len) = {min(cached)}; uncapped, pass 1 would show a query prefix "
                       f"keys past its own position (pitfall:prefix_uncapped, {SECTION})", ["prefix_uncapped"])
    hints = []
    if got % block_size:
        hints.append("it is not a multiple of block_size: round down last")
    if len(lens) < 2 and got:
        hints.append("one sequence shares nothing with anyone: 0")
    raise Mismatch(f"{head}{': ' + '; '.join(hints) if hints else ''} (content/l6.md §3)")


def check_cascade(case, out, returned=None):
    """cascade_attention's output against the reference, (token, query head) by (token,
    query head): the out= contract first, then NaN as such, then wrong values explained
    by the mistake that reproduces every output (§8)."""
    out = output_of(out, returned, case.query, "cascade_attention", "content/l6.md §1")
    got, want = out.double().cpu(), case.reference()
    atol, rtol = TOLERANCE[case.query.dtype]
    explain_token_rows(got, want, atol, rtol, lambda got: _explain_non_finite(case, got, atol, rtol),
                       lambda got, want, wrong: _explain_wrong(case, got, want, wrong, atol, rtol),
                       lambda t: _fmt_row(case, t), lambda: _describe(case))


def _fmt_row(case, t):
    b, i, pos = case.rows()[t]
    return f"token {t} (sequence {b}, query {i} of {case.q_lens[b]}, position {pos})"


def _variant(case, name):
    """The reference with `name` planted, run on this case (a fresh output), or None."""
    try:
        return _wrong.variant(PLANTED, name).cascade_attention(*case.args(), scale=case.scale).double().cpu()
    except Exception:
        return None


def _explain_non_finite(case, got, atol, rtol):
    """NaN or inf: named empty_part_nan only when the planted variant gives NaN in exactly
    the same (token, head) outputs and the same values elsewhere, some outputs finite."""
    bad = ~torch.isfinite(got).all(dim=-1)
    head = f"the output holds NaN or inf for {int(bad.any(dim=1).sum())} of {len(got)} query tokens"
    # Every output NaN is what many bugs give; it is evidence only where the inputs hold
    # no NaN at all (then it came from arithmetic: 0/0), as the case for this pitfall does.
    clean = not any(bool(torch.isnan(t.cpu()).any()) for t in (case.query, case.k_cache, case.v_cache))
    theirs = _variant(case, "empty_part_nan") if clean or not bool(bad.all()) else None
    if theirs is not None:
        their_bad = ~torch.isfinite(theirs).all(dim=-1)
        same = torch.isclose(got, theirs, atol=atol, rtol=rtol).all(dim=-1)
        if torch.equal(their_bad, bad) and bool(same[~bad].all()):
            return (f"{head}; an empty part (a chunk of the prefix with no key: l = 0) stored 0/0 = NaN and the "
                    f"merge multiplied it by its weight 0, and 0 · NaN = NaN: store v = 0, lse = -inf for an empty "
                    f"part, and never multiply an empty part's v (pitfall:empty_part_nan, {SECTION})"), \
                "empty_part_nan"
    return (f"{head}. Where NaN can come from: a part with no key left as 0/0 (§4), a block no sequence owns or the "
            f"unused end of a last block read without a mask (they hold NaN here; L3's masks carry over), or "
            f"exp(-inf - (-inf)) for a row that sees no key in a tile (content/l3.md §4)"), None


# Analytic mistakes: (the reference's `mistake`, the pitfall, what it means).
_MODELS = (
    ("prefix_causal", "prefix_causal",
     "it matches pass 1 under FlashAttention's causal mask over the batch as one sequence (token t sees prefix "
     "keys 0..P - total_q + t): the prefix pass needs no mask at all, every query sits past the prefix"),
    ("prefix_causal_tl", "prefix_causal",
     "it matches pass 1 under a causal mask aligned top-left over the batch (token t sees prefix keys 0..t): the "
     "prefix pass needs no mask at all, every query sits past the prefix"),
    ("prefix_twice", "suffix_not_offset",
     "it matches attention in which every prefix key counts twice: pass 2 also read keys 0..P - 1, which pass 1 "
     "already covered; start pass 2 at key common_prefix_len"),
    ("swapped", "merge_swapped",
     "it matches the two parts merged with their sides swapped (the prefix's v weighted by exp(suffix LSE), the "
     "suffix's by exp(prefix LSE)): pair each part's v with its own LSE"),
)


def _explain_wrong(case, got, want, wrong, atol, rtol):
    """A finite wrong output: a mistake is named when its output reproduces this one on
    every (token, head), wrong and right alike, and is far from the answer where this is wrong."""
    if case.common_prefix_len > 0:
        for mistake, tag, text in _MODELS:
            alt = case.reference(mistake=mistake)
            if _matches(got, want, alt, wrong, atol, rtol):
                return f"{text} (pitfall:{tag}, {SECTION})", tag
        for name, text in (("merge_swapped", "a kernel whose merge weighs each side by the other side's LSE (the "
                                             "sides swapped)"),
                           ("prefix_causal", "a kernel whose pass 1 runs under a causal mask")):
            alt = _variant(case, name)
            if alt is not None and _matches(got, want, alt, wrong, atol, rtol):
                return f"it matches, on every output, {text}, run on this case (pitfall:{name}, {SECTION})", name
    mapping = _head_mapping(case, got, want, atol, rtol)
    if mapping:
        return mapping, None
    if case.common_prefix_len > 0:
        for mistake, text in (("no_prefix", "the suffix's part alone: the prefix's part never reached the output"),
                              ("no_suffix", "the prefix's part alone: the suffix's part never reached the output")):
            alt = case.reference(mistake=mistake)
            if reproduces(got, want, alt, atol, rtol, wrong):
                return f"the output is wrong for {int(wrong.any(dim=1).sum())} query tokens: it matches {text} " \
                       f"(content/l6.md §4)", None
    return _describe_wrong(case, wrong), None


def _head_mapping(case, got, want, atol, rtol):
    """A GQA head mapping: the pass whose KV heads, taken per query head from some other
    mapping than h // group, reproduce every output (the others' parts right), said as
    which query heads read which KV head in which pass; None when none does."""
    num_heads, num_kv_heads = case.query.shape[1], case.k_cache.shape[2]
    if num_kv_heads < 2:
        return None
    group = num_heads // num_kv_heads
    right = torch.arange(num_heads) // group
    passes = ((0, "pass 1 (the prefix's part)"), (1, "pass 2 (each sequence's own keys)"), (2, "both passes")) \
        if case.common_prefix_len > 0 else ((1, "the attention over each sequence's keys"),)
    close = lambda a, b: torch.isclose(a, b, atol=atol, rtol=rtol).all(dim=-1).all(dim=0)  # noqa: E731  [H_q]
    for which, said in passes:
        fits = []  # per KV head j: which query heads' outputs are those of reading j in this pass
        for j in range(num_kv_heads):
            heads = torch.full((num_heads,), j)
            fits.append(close(got, case.reference(kv_heads=(heads if which != 1 else None,
                                                             heads if which != 0 else None))))
        fits = torch.stack(fits, dim=1)  # [H_q, H_kv]
        if not bool(fits.any(dim=1).all()):
            continue
        found = torch.where(fits[torch.arange(num_heads), right], right, fits.int().argmax(dim=1))
        off = (found != right).nonzero().flatten().tolist()
        if not off or bool(close(got, want)[off].any()):
            continue
        return (f"query heads {off} (of {num_heads}: {group} query heads per KV head) are wrong, the others right: "
                f"their outputs are those of {said} reading KV heads {found[off].tolist()} instead of "
                f"{right[off].tolist()}; query head h reads KV head h // {group} in both passes (GQA: a tile's row r "
                f"is query head kv_head · {group} + r % {group}, as in L3: content/l3.md §1, §8)")
    return None


def _matches(got, want, alt, wrong, atol, rtol):
    """L4's rule: the mistake's output is far from the answer at the worst (token, head)
    and agrees with `got` there, and it agrees with `got` everywhere else too."""
    err = torch.nan_to_num((got - want).abs().amax(dim=-1), nan=float("inf"))  # [total_q, H_q]
    first = torch.zeros_like(wrong)
    first[tuple(int(i) for i in divmod(int(err.argmax()), err.shape[1]))] = True  # the worst (token, head)
    return reproduces(got, want, alt, atol, rtol, first) and bool(torch.isclose(got, alt, atol=atol, rtol=rtol).all())


def _describe_wrong(case, wrong):
    """No known mistake fits: say where the wrong tokens are."""
    rows = wrong.any(dim=1)
    info = case.rows()
    bad = [info[t] for t in rows.nonzero().flatten().tolist()]
    parts = []
    if case.common_prefix_len == 0:
        parts.append("common_prefix_len is 0 here: the answer is plain L3 (pass 2 alone, over keys 0..position)")
    elif len(bad) == len(info):
        heads = wrong.any(dim=0)
        if not bool(heads.all()) and bool(wrong[:, heads].all()):
            parts.append(f"query heads {heads.nonzero().flatten().tolist()} are wrong for every token and the other "
                         f"heads right for every token: look at how query heads meet KV heads and output rows (GQA), "
                         f"in both passes, before any key range")
        else:
            parts.append("every token is wrong: look at what every token shares, pass 1 over the prefix, pass 2's "
                         "key range and the merge")
    if bad and all(case.q_lens[b] == 1 for b, _, _ in bad) and len(bad) < len(info):
        parts.append("only decode rows (q_len = 1) are wrong")
    where = "; ".join(parts) if parts else "it matches none of the usual mistakes (§8)"
    return f"the output is wrong for {len(bad)} query tokens; {where} (content/l6.md §4)"


def _describe(case):
    num_heads, head_size = case.query.shape[1:]
    scale = "default 1/sqrt(D)" if case.scale is None else f"{case.scale:g}"
    return (f"case: H_q={num_heads}, H_kv={case.k_cache.shape[2]}, D={head_size}, block_size={case.block_size}, "
            f"dtype={str(case.query.dtype).replace('torch.', '')}, scale={scale}, common_prefix_len="
            f"{case.common_prefix_len}, q_lens={case.q_lens}, seq_lens={case.seq_lens.tolist()}, unused end of each "
            f"last block holds {case.tail}")
