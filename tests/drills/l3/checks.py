"""Drill L3's check of paged_prefill_attention's output against the reference, and its
diagnosis: which token is off and which mistake (§8) reproduces it."""
import math

import torch

import _wrong
from _diagnose import explain_token_rows, far_from, output_of, reproduces

from .mistakes import PLANTED, SECTION
from .reference import TOLERANCE, ref_paged_prefill


def check_paged_prefill(case, out, returned=None):
    """paged_prefill_attention's output against the reference, (token, query head) by
    (token, query head). The out= contract first, then non-finite outputs as such,
    then wrong values explained by the mistake that reproduces them (§8); a pitfall
    is named only on evidence no simpler story fits."""
    query = case.query
    out = output_of(out, returned, query, "paged_prefill_attention", "content/l3.md §1")
    got, want = out.double().cpu(), case.reference()
    atol, rtol = TOLERANCE[query.dtype]
    explain_token_rows(got, want, atol, rtol, lambda got: _explain_non_finite(case, got, atol, rtol),
                       lambda got, want, wrong: _explain_wrong(case, got, want, wrong, atol, rtol),
                       lambda t: _fmt_row(case, t), lambda: _describe(case))


def _fmt_row(case, t):
    b, i, pos = case.rows()[t]
    return f"token {t} (sequence {b}, query {i} of {case.q_lens[b]}, position {pos})"


def _explain_non_finite(case, got, atol, rtol):
    """NaN or inf in the output. Said as exactly that first; the NaN sources this case
    planted that could reach the bad tokens are offered as causes, and a pitfall is named
    only when its planted variant, run on the same input, gives NaN in exactly the same
    (token, head) outputs and the same values elsewhere, while some outputs stay finite."""
    rows = case.rows()
    bad = ~torch.isfinite(got).all(dim=-1)  # [total_q, H_q]
    bad_rows = bad.any(dim=1)
    head = f"the output holds NaN or inf for {int(bad_rows.sum())} of {len(rows)} query tokens"
    everywhere = bool(bad.all())  # NaN everywhere fits too many stories: no planted variant is tried
    causes = [] if everywhere else [name for name in _NAN_CAUSES
                                    if _variant_reproduces(case, name, got, bad, atol, rtol)]
    if len(causes) == 1:
        return f"{head}; {_NAN_CAUSES[causes[0]]} (pitfall:{causes[0]}, {SECTION})", causes[0]
    bs, lens = case.block_size, case.seq_lens.long().tolist()
    width = case.block_table.shape[1]

    def reach(test):
        return torch.tensor([test(b, i, pos) for b, i, pos in rows])

    sources = [  # (tokens it could reach, what it is)
        (reach(lambda b, i, pos: case.tail == "nan" and lens[b] % bs != 0),
         "the unused end of the last block holds NaN in this case: were K/V loaded past seq_len without a mask?"),
        (reach(lambda b, i, pos: (pos + 1) % 16 == 0),
         "the bad tokens sit just before tile boundaries, where a tile can hold no key a row may see: is a row whose "
         "scores are all -inf kept from exp(-inf - (-inf)) = NaN?"),
        (reach(lambda b, i, pos: width > math.ceil(lens[b] / bs) or (case.table_guard and b == len(lens) - 1)),
         "NaN fills every block no sequence owns, and the block-table entries past ceil(seq_len / block_size) name "
         "such blocks: were they read?"),
    ]
    fits = [text for r, text in sources if bool(r[bad_rows].all())]
    if everywhere:
        could = "".join(f"; {text}" for text in fits)
        return (f"{head}: every output is NaN or inf, which alone singles out no mistake{could}; or look for a "
                f"division by zero (l = 0), exp of +inf (a sign flipped in exp(m_old - m_new)?), or a read outside "
                f"the inputs (content/l3.md §5)"), None
    if not fits:
        return (f"{head}, and no NaN this case put in its inputs can reach all of them: a division by zero, or a "
                f"read outside the inputs (content/l3.md §5)"), None
    return f"{head}; " + "; or ".join(fits) + f" ({SECTION})", None


# The NaN sources a case plants, and what each means when its planted variant reproduces the output.
_NAN_CAUSES = {
    "last_block_unmasked": "the unused end of the last block holds NaN here, and 0 · NaN = NaN: K/V were loaded past "
                           "seq_len, the whole last block, without a mask (masking the scores alone is not enough)",
    "masked_row_nan": "these rows see no key in a tile (all their scores there are -inf), so the running max stays "
                      "-inf and exp(-inf - (-inf)) is NaN: measure such a row from 0 instead",
}


def _variant_reproduces(case, name, got, bad, atol, rtol):
    """The planted variant `name`, run on this case (into a fresh output), is NaN in exactly
    the outputs `bad` and agrees with `got` on the others."""
    try:
        theirs = _wrong.variant(PLANTED, name).paged_prefill_attention(
            *case.args(), scale=case.scale).double().cpu()
    except Exception:
        return False
    their_bad = ~torch.isfinite(theirs).all(dim=-1)
    if not torch.equal(their_bad, bad):
        return False
    return bool(torch.isclose(got, theirs, atol=atol, rtol=rtol).all(dim=-1)[~bad].all())


def _other_sequence(case, got, want, atol, rtol):
    """Per token, the first other sequence whose cache reproduces its output (or -1)."""
    found = []
    for t, (b, _, _) in enumerate(case.rows()):
        hit = -1
        for other in range(len(case.q_lens)):
            alt = None if other == b else _as_if_in(case, t, other)
            if alt is not None and bool(torch.isclose(got[t], alt, atol=atol, rtol=rtol).all()) \
                    and bool(far_from(want[t], alt, atol, rtol).any()):
                hit = other
                break
        found.append(hit)
    return found


def _as_if_in(case, t, other):
    """Token t's output had it been query t - query_start_loc[other] of sequence `other`
    (a position past that sequence's end sees all of it), or None if it sees nothing."""
    starts = case.query_start_loc.long().cpu().tolist()
    n, q_len = int(case.seq_lens[other]), starts[other + 1] - starts[other]
    pos = min(n - q_len + (t - starts[other]), n - 1)
    if pos < 0:
        return None
    # A one-token chunk at position pos of sequence `other`: seq_len pos + 1, q_len 1.
    return ref_paged_prefill(case.query[t:t + 1], case.k_cache, case.v_cache, case.block_table[other:other + 1],
                             torch.tensor([0, 1]), torch.tensor([pos + 1]), scale=case.scale)[0]


def _explain_wrong(case, got, want, wrong, atol, rtol):
    """A finite wrong output: which plausible mistake reproduces it."""
    num_heads, num_kv_heads = case.query.shape[1], case.k_cache.shape[2]
    rows = wrong.any(dim=1)
    mistakes = [  # (alternative output, pitfall, what it means)
        (lambda: case.reference(mask="top_left"), "causal_offset_missing",
         "wrong at the causal boundary: it matches a causal mask aligned top-left, query i seeing keys 0..i; "
         "query i of a chunk sits at position seq_len - q_len + i, so a chunk over a prefix sees the prefix too "
         "(sequences without a prefix come out right either way)"),
        (lambda: case.reference(mask="chunk_only"), "prefix_ignored",
         "wrong only in the prefix: it matches attention over the chunk's own keys alone, context_len..position: "
         "the seq_len - q_len cached tokens before the chunk were skipped"),
        (lambda: case.reference(kv_head=torch.arange(num_heads) % num_kv_heads), "gqa_head_mapping",
         "it matches attention with KV head h % H_kv instead of h // (H_q / H_kv): the query heads of KV head kv "
         "are kv·group .. kv·group + group - 1"),
        (lambda: case.reference(kv_head=torch.zeros(num_heads, dtype=torch.long)), "gqa_head_mapping",
         "it matches attention with every query head reading KV head 0: the KV head's offset in the slot is missing"),
    ]
    for compute, tag, text in mistakes:
        alt = compute()
        if reproduces(got, want, alt, atol, rtol, wrong):
            return f"{text} (pitfall:{tag}, {SECTION})", tag
    # Each wrong token against every other sequence's cache, then the planted lookup
    # mistake itself (its padded rows also count zero keys, which no formula models).
    others = _other_sequence(case, got, want, atol, rtol)
    bad_tokens = rows.nonzero().flatten().tolist()
    if bad_tokens and all(others[t] >= 0 for t in bad_tokens):
        t = bad_tokens[0]
        return (f"wrong sequence for the query: {_fmt_row(case, t)} matches attention over sequence {others[t]}'s "
                f"cache, and so does every other wrong token over some other sequence: the program found the "
                f"wrong sequence for its query block (pitfall:wrong_seq_lookup, {SECTION})"), "wrong_seq_lookup"
    try:
        args = (*case.args()[:5], case.seq_lens)
        alt = _wrong.variant(PLANTED, "wrong_seq_lookup").paged_prefill_attention(*args, scale=case.scale).double().cpu()
    except Exception:  # the variant cannot run on this input: no evidence
        alt = None
    if alt is not None and reproduces(got, want, alt, atol, rtol, wrong):
        seqs = sorted({case.rows()[t][0] for t in bad_tokens})
        return (f"wrong sequence for the query: the wrong tokens are the first queries of sequence(s) {seqs}, and "
                f"they match a kernel that cuts query blocks from the flat token array, so a block that straddles "
                f"two chunks attends all its rows against the first chunk's cache (pitfall:wrong_seq_lookup, "
                f"{SECTION})"), "wrong_seq_lookup"
    # Off by one key at the diagonal, for some rows (a mask-free tile that runs one key
    # too far, `<` for `<=`): described, not named; it is none of the page's pitfalls.
    shifted = torch.zeros_like(rows)
    for mask in ("one_more", "one_less"):
        alt = case.reference(mask=mask)
        close = torch.isclose(got, alt, atol=atol, rtol=rtol).all(dim=-1).all(dim=-1)
        shifted |= close & far_from(want, alt, atol, rtol).any(dim=-1).any(dim=-1)
    boundary = int(shifted[rows].sum())
    if boundary == int(rows.sum()):
        return (f"wrong only at the causal boundary: each wrong query matches attention that sees one key more or "
                f"one key less than its own position allows; look at the diagonal tiles' mask (key <= position) "
                f"and at where the mask-free tiles stop (content/l3.md §4)"), None
    finding = _describe_wrong(case, got, want, wrong, atol, rtol)
    if boundary:
        finding += (f"; {boundary} of them see one key more or less than their position allows: look at the "
                    f"diagonal (key <= position) and at where the mask-free tiles stop (§4)")
    return finding, None


def _describe_wrong(case, got, want, wrong, atol, rtol):
    """No known mistake fits: say where the wrong tokens are, in the drill's terms, each
    sentence only where it holds and sets the wrong tokens apart from the right ones."""
    rows = wrong.any(dim=1)
    info = case.rows()
    bs, lens = case.block_size, case.seq_lens.long().tolist()
    bad = [info[t] for t in rows.nonzero().flatten().tolist()]
    good = [info[t] for t in (~rows).nonzero().flatten().tolist()]
    head = f"the output is wrong for {len(bad)} query tokens"
    strided = _contiguous_read(case)
    if strided is not None and reproduces(got, want, strided, atol, rtol, rows):
        total_q, num_heads, head_size = case.query.shape
        return (f"{head}; they match attention whose query rows are read H_q·D = {num_heads * head_size} elements "
                f"apart, but the query here is a row-strided view (of a fused QKV) whose rows are "
                f"query.stride(0) = {case.query.stride(0)} apart: step from token to token by the row stride "
                f"(content/l3.md §5)")
    parts = []
    if all(lens[b] - case.q_lens[b] > 0 for b, _, _ in bad) and any(lens[b] == case.q_lens[b] for b, _, _ in good):
        parts.append("only chunks over a cached prefix are wrong; pure prefills are right: look at how the prefix "
                     "enters (the offset seq_len - q_len, the loop's first key)")
    last_start = {b: (n - 1) // bs * bs for b, n in enumerate(lens)}

    def in_partial_last(b, pos):
        return pos >= last_start[b] and lens[b] % bs != 0
    # Said only where it sets the wrong tokens apart: some right token's keys stop short of such a block.
    last_block = all(in_partial_last(b, pos) for b, _, pos in bad) and not all(in_partial_last(b, pos)
                                                                               for b, _, pos in good)
    # The first wrong position, when every query before it is right and it is a possible tile edge.
    lo = min(pos for _, _, pos in bad)
    first_keys = lo > 0 and lo % 16 == 0 and any(pos < lo for _, _, pos in good)
    tiles = " or ".join(str(t) for t in (16, 32, 64, 128) if lo % t == 0)
    also = f" (and a cache block of {bs} tokens)" if lo % bs == 0 else ""
    keys = (f"every query that sees at most {lo} keys is right, and every wrong one sees more: the first {lo} keys "
            f"come out right, and a key tile of {tiles} keys{also} ends there, so look at what happens from the "
            f"next key tile on: the rescale of the running sum and accumulator by exp(m_old - m_new), that tile's "
            f"mask")
    blocks = ("only queries whose keys reach into the last, partly filled block are wrong: look at the last "
              "block's mask (keys past seq_len) and at whether it is read at all")
    if last_block and first_keys:
        parts.append(f"either {keys}; or {blocks} (this case cannot tell the two apart)")
    elif last_block:
        parts.append(blocks)
    elif first_keys:
        parts.append(keys)
    if all(case.q_lens[b] == 1 for b, _, _ in bad) and good:
        parts.append("only decode rows (q_len = 1) are wrong")
    parts += _wrong_heads(case, wrong)
    where = "; ".join(parts) if parts else "it matches none of the usual mistakes (§8)"
    return f"{head}; {where} (content/l3.md §5)"


def _contiguous_read(case):
    """The output had each token's query been read H_q·D elements after the previous
    one's (None when the query's rows are H_q·D apart anyway)."""
    total_q, num_heads, head_size = case.query.shape
    if total_q < 2 or case.query.stride(0) == num_heads * head_size or not case.query[0].is_contiguous():
        return None
    query = torch.as_strided(case.query, case.query.shape, (num_heads * head_size, head_size, 1))
    return ref_paged_prefill(query, *case.args()[1:], scale=case.scale)


def _wrong_heads(case, wrong):
    """When some query heads are right in every token: which heads are wrong."""
    if bool(wrong.any(dim=0).all()):  # every head is wrong somewhere
        return []
    num_heads, num_kv_heads = case.query.shape[1], case.k_cache.shape[2]
    group = num_heads // num_kv_heads
    heads = wrong.any(dim=0).nonzero().flatten().tolist()
    slots = sorted({h % group for h in heads})
    said = (f"only some query heads of them are wrong, heads {heads} of {num_heads} (member(s) {slots} of each KV "
            f"head's group of {group}); the other heads are right")
    if slots == list(range(len(slots))) and len(slots) < group:
        said += (": the first members of a group are what a tile row past its BLOCK_Q · group live rows would "
                 "hold (row r: query r // group, head r % group); is every such spare row masked?")
    return [said]


def _describe(case):
    num_heads, head_size = case.query.shape[1:]
    scale = "default 1/sqrt(D)" if case.scale is None else f"{case.scale:g}"
    return (f"case: H_q={num_heads}, H_kv={case.k_cache.shape[2]}, D={head_size}, block_size={case.block_size}, "
            f"dtype={str(case.query.dtype).replace('torch.', '')}, scale={scale}, q_lens={case.q_lens}, "
            f"seq_lens={case.seq_lens.tolist()}, unused end of each last block holds {case.tail}")
