"""Drill L3, chunked-prefill attention over a paged cache: everything that knows it.

In this order: the page's worked example; the case and its builder; the float64
reference; the hypothesis strategy; the check and its diagnosis; the pitfalls;
the bench workload; the page checks; DRILL.
"""
import math
import re
from dataclasses import dataclass

import torch
from hypothesis import strategies as st

import _env
import _wrong
from _diagnose import Mismatch, far_from, output_of, reproduces
from _drill import ELEMENT_SIZE, BenchCase, Drill, Mistake, Pitfall
from _traffic import Part, check_page_line, measure, report, was_read
from _paged import DTYPES, GUARD, Guarded, allocate_blocks, followed_by, nan_outside, noise, poisoned_out

SECTION = "content/l3.md §8"
TEST_SHAPES = dict(max_seqs=4, max_chunk=64, max_context=96, max_kv_heads=2, gqa_ratios=(1, 4, 8),
                   head_sizes=(3, 16, 24, 80, 96), block_sizes=(4, 16, 32))
# Under the interpreter every program runs in Python: shorter chunks and contexts there.
CPU_LIMITS = dict(max_chunk=24, max_context=48)

# ---------------------------------------------------------------------------
# The worked example (content/l3.md §3)

# One sequence of 6 tokens whose last 3 are this step's chunk, so its prefix is
# 3 tokens; block_size 4, blocks [2, 0]. D = 1, q = k = 1 everywhere: every score
# is the same, so each query's output is the plain mean of the values it sees.
PREFILL_EXAMPLE = dict(block_size=4, block_table=[[2, 0]], num_blocks=3, seq_len=6, q_len=3,
                       values=[1.0, 2.0, 3.0, 4.0, 5.0, 6.0])


def example_outputs(mask):
    """Each query's output in the worked example under `mask` ('bottom_right', the
    right one; 'top_left', no offset; 'chunk_only', prefix ignored)."""
    ex = PREFILL_EXAMPLE
    context = ex["seq_len"] - ex["q_len"]
    outs = []
    for i in range(ex["q_len"]):
        lo, hi = {"bottom_right": (0, context + i), "top_left": (0, i), "chunk_only": (context, context + i)}[mask]
        seen = ex["values"][lo:hi + 1]
        outs.append(sum(seen) / len(seen))
    return outs


# ---------------------------------------------------------------------------
# The case


@dataclass
class PrefillCase:
    """One call of paged_prefill_attention, with what is needed to check and explain it."""

    query: torch.Tensor            # [total_q, H_q, D], possibly a row-strided view
    k_cache: torch.Tensor          # [num_blocks, block_size, H_kv, D]; unowned blocks hold NaN
    v_cache: torch.Tensor
    block_table: torch.Tensor      # [B, max_blocks] int32; garbage columns point at NaN blocks
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor         # [B] int32
    scale: float = None            # None: the function's default 1/sqrt(D)
    tail: str = "noise"            # what the unused end of each last block holds: "noise" or "nan"
    out: Guarded = None            # the poisoned, guarded out= buffer (None: let the function allocate)
    table_guard: bool = True       # the block table is followed in memory by numbers of NaN blocks

    @property
    def block_size(self):
        return self.k_cache.shape[1]

    @property
    def q_lens(self):
        starts = self.query_start_loc.long().cpu()
        return (starts[1:] - starts[:-1]).tolist()

    def args(self):
        return self.query, self.k_cache, self.v_cache, self.block_table, self.query_start_loc, self.seq_lens

    def kwargs(self):
        kwargs = {} if self.scale is None else {"scale": self.scale}
        if self.out is not None:
            kwargs["out"] = self.out.view
        return kwargs

    def rows(self):
        """Per query token t: (sequence b, index i in its chunk, position context_len + i)."""
        out = []
        lens = self.seq_lens.long().tolist()
        for b, q_len in enumerate(self.q_lens):
            out += [(b, i, lens[b] - q_len + i) for i in range(q_len)]
        return out

    def reference(self, **mistake):
        return ref_paged_prefill(*self.args(), scale=self.scale, **mistake)


def ref_paged_prefill(query, k_cache, v_cache, block_table, query_start_loc, seq_lens, scale=None,
                      mask="bottom_right", kv_head=None):
    """float64 on the CPU: every query token's attention over its sequence's cache,
    gathered through the block table, under the bottom-right causal mask.

    The keyword arguments compute mistakes for the diagnosis: mask "top_left" (query i
    sees keys 0..i: no seq_len - q_len offset), "chunk_only" (keys context_len..pos:
    the prefix ignored), "one_more" / "one_less" (the diagonal one key off); kv_head[h],
    the KV head query head h reads.
    """
    total_q, num_heads, head_size = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    scale = 1.0 / math.sqrt(head_size) if scale is None else scale
    kv_head = (torch.arange(num_heads) // (num_heads // num_kv_heads)) if kv_head is None else kv_head
    starts = query_start_loc.long().cpu().tolist()
    lens = seq_lens.long().cpu().tolist()
    table = block_table.long().cpu()
    q = query.double().cpu()
    out = torch.zeros(total_q, num_heads, head_size, dtype=torch.float64)
    kv = {}
    for b, n in enumerate(lens):
        blocks = table[b, :math.ceil(n / block_size)]
        kv[b] = (k_cache[blocks.to(k_cache.device)].double().cpu().reshape(-1, num_kv_heads, head_size)[:n],
                 v_cache[blocks.to(v_cache.device)].double().cpu().reshape(-1, num_kv_heads, head_size)[:n])
    for b in range(len(lens)):
        for t in range(starts[b], starts[b + 1]):
            n, q_len = lens[b], starts[b + 1] - starts[b]
            i = t - starts[b]
            context = n - q_len
            lo, hi = {"bottom_right": (0, context + i), "top_left": (0, i), "chunk_only": (context, context + i),
                      "one_more": (0, context + i + 1), "one_less": (0, context + i - 1)}[mask]
            hi = min(hi, n - 1)
            if hi < lo:
                continue
            k, v = kv[b][0][lo:hi + 1][:, kv_head], kv[b][1][lo:hi + 1][:, kv_head]  # [keys, H_q, D]
            p = (torch.einsum("hd,khd->hk", q[t], k) * scale).softmax(-1)
            out[t] = torch.einsum("hk,khd->hd", p, v)
    return out


def paged_prefill_case(q_lens, context_lens, *, num_heads, num_kv_heads, head_size, block_size, dtype=torch.float16,
                       scale=None, spare_blocks=2, extra_columns=2, tail="noise", layout="contiguous", out=True,
                       device="cpu", seed=0):
    """A serving step: sequence b brings q_lens[b] new tokens after context_lens[b]
    cached ones (both already in the cache, as L1 leaves them).

    Owned blocks hold noise; blocks no sequence owns hold NaN, and every garbage
    block-table column (and a guard after the table) points at one of them. The
    unused end of each last block holds `tail` ("noise": stale tokens; "nan").
    `layout="fused_qkv"` makes the query a row-strided view of [T, (H_q + 2 H_kv) D].
    `out=True` passes a NaN-poisoned out= buffer inside a guarded allocation.
    """
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [q + c for q, c in zip(q_lens, context_lens)]
    table, num_blocks = allocate_blocks(seq_lens, block_size, gen, max(spare_blocks, 1), extra_columns)
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    k_cache, v_cache = noise(shape, torch.float32, "cpu", gen), noise(shape, torch.float32, "cpu", gen)
    spare = nan_outside(k_cache, table, seq_lens, block_size, tail)
    nan_outside(v_cache, table, seq_lens, block_size, tail)
    total, hd = sum(q_lens), num_heads * head_size
    if layout == "fused_qkv":
        qkv = noise((total, hd + 2 * num_kv_heads * head_size), dtype, device, gen)
        query = qkv[:, :hd].view(total, num_heads, head_size)
    elif layout == "contiguous":  # followed in memory by NaN: a padded lane read unmasked shows
        query = followed_by(noise((total, num_heads, head_size), dtype, "cpu", gen),
                            torch.full((GUARD,), float("nan")), device)
    else:
        raise ValueError(f"unknown layout {layout!r}")
    starts = torch.tensor([0] + list(q_lens)).cumsum(0)
    return PrefillCase(
        query=query, k_cache=k_cache.to(dtype=dtype, device=device), v_cache=v_cache.to(dtype=dtype, device=device),
        block_table=followed_by(table, spare[torch.randint(len(spare), (GUARD,), generator=gen)], device),
        query_start_loc=starts.to(dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device), scale=scale, tail=tail,
        out=poisoned_out((total, num_heads, head_size), dtype, device, gen) if out else None)


def example_case(device="cpu"):
    """content/l3.md §3's example as a PrefillCase (query 1, every key 1, D = 1, scale = 1)."""
    ex = PREFILL_EXAMPLE
    table, bs, n = torch.tensor(ex["block_table"], dtype=torch.int32), ex["block_size"], ex["seq_len"]
    k_cache, v_cache = torch.zeros(ex["num_blocks"], bs, 1, 1), torch.zeros(ex["num_blocks"], bs, 1, 1)
    for pos in range(n):
        k_cache[table[0, pos // bs], pos % bs] = 1.0
        v_cache[table[0, pos // bs], pos % bs] = ex["values"][pos]
    nan_outside(k_cache, table, [n], bs, "nan")
    nan_outside(v_cache, table, [n], bs, "nan")
    gen = torch.Generator().manual_seed(0)
    return PrefillCase(query=torch.ones(ex["q_len"], 1, 1, device=device), k_cache=k_cache.to(device),
                       v_cache=v_cache.to(device), block_table=table.to(device),
                       query_start_loc=torch.tensor([0, ex["q_len"]], dtype=torch.int32, device=device),
                       seq_lens=torch.tensor([n], dtype=torch.int32, device=device), scale=1.0, tail="nan",
                       table_guard=False, out=poisoned_out((ex["q_len"], 1, 1), torch.float32, device, gen))


# ---------------------------------------------------------------------------
# The hypothesis strategy


@st.composite
def prefill_params(draw, dtypes=tuple(DTYPES)):
    """Keyword arguments for paged_prefill_case: a mixed batch of decode rows, pure
    prefills and chunks over a prefix (of 0, a whole number of blocks or not)."""
    shapes = {**TEST_SHAPES, **(CPU_LIMITS if _env.INTERPRET else {})}
    block_size = draw(st.sampled_from(shapes["block_sizes"]))
    num_seqs = draw(st.integers(1, shapes["max_seqs"]))
    q_lens, context_lens = [], []
    for _ in range(num_seqs):
        kind = draw(st.sampled_from(["decode", "prefill", "chunk", "chunk"]))
        q_len = 1 if kind == "decode" else draw(st.integers(1, shapes["max_chunk"]))
        prefix = st.sampled_from([block_size - 1, block_size, block_size + 1, 2 * block_size]) | st.integers(
            1, shapes["max_context"])
        context = 0 if kind == "prefill" else draw(prefix)
        q_lens.append(q_len)
        context_lens.append(context)
    num_kv_heads = draw(st.integers(1, shapes["max_kv_heads"]))
    return dict(
        q_lens=q_lens, context_lens=context_lens, block_size=block_size, num_kv_heads=num_kv_heads,
        num_heads=num_kv_heads * draw(st.sampled_from(shapes["gqa_ratios"])),
        head_size=draw(st.sampled_from(shapes["head_sizes"])),
        dtype=DTYPES[draw(st.sampled_from(dtypes))],
        scale=draw(st.none() | st.floats(0.01, 1.0)),
        tail=draw(st.sampled_from(["noise", "nan"])),
        layout=draw(st.sampled_from(["contiguous", "fused_qkv"])),
        extra_columns=draw(st.integers(0, 3)),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


# ---------------------------------------------------------------------------
# The check and its diagnosis

# (atol, rtol) against the float64 reference: 16-bit runs round p to the value
# dtype before p·V and round the output once; fp32 runs use "ieee" dot products.
TOLERANCE = {torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.5e-2, 1.5e-2), torch.float32: (1e-4, 1e-4)}


def check_paged_prefill(case, out, returned=None):
    """paged_prefill_attention's output against the reference, (token, query head) by
    (token, query head). The out= contract first, then non-finite outputs as such,
    then wrong values explained by the mistake that reproduces them (§8); a pitfall
    is named only on evidence no simpler story fits."""
    query = case.query
    out = output_of(out, returned, query, "paged_prefill_attention", "content/l3.md §1")
    got, want = out.double().cpu(), case.reference()
    atol, rtol = TOLERANCE[query.dtype]
    wrong = ~torch.isclose(got, want, atol=atol, rtol=rtol).all(dim=-1)  # [total_q, H_q]; NaN counts as wrong
    if not wrong.any():
        return
    t, h = (int(x) for x in wrong.nonzero()[0])
    bad_rows = wrong.any(dim=1)
    if not torch.isfinite(got[bad_rows]).all():
        finding, pitfall = _explain_non_finite(case, got, atol, rtol)
    else:
        finding, pitfall = _explain_wrong(case, got, want, wrong, atol, rtol)
    err = torch.nan_to_num((got[t, h] - want[t, h]).abs(), nan=float("inf"))
    d = int(err.argmax())
    tokens = bad_rows.nonzero().flatten().tolist()
    listed = ", ".join(_fmt_row(case, x) for x in tokens[:4]) + (", ..." if len(tokens) > 4 else "")
    raise Mismatch(
        f"{finding}\n"
        f"  first: {_fmt_row(case, t)}, query head {h}, element {d}: expected {float(want[t, h, d]):.5g}, got "
        f"{float(got[t, h, d]):.5g} (tolerance {atol} + {rtol}·|expected|)\n"
        f"  {len(tokens)} of {len(got)} query tokens wrong: {listed}\n  {_describe(case)}",
        [pitfall] if pitfall else [])


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
    if bool(bad.all()):
        return (f"{head}: every output is NaN or inf, so no single planted NaN explains it; look for a division by "
                f"zero (l = 0), exp of +inf (a sign flipped in exp(m_old - m_new)?), or a read outside the inputs "
                f"(content/l3.md §5)"), None
    causes = [name for name in _NAN_CAUSES if _variant_reproduces(case, name, got, bad, atol, rtol)]
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
    if not fits:
        return (f"{head}, and no NaN this case planted can reach all of them: a division by zero, or a read outside "
                f"the inputs (content/l3.md §5)"), None
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
        theirs = _wrong.variant(DRILL, name).paged_prefill_attention(
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
        alt = _wrong.variant(DRILL, "wrong_seq_lookup").paged_prefill_attention(*args, scale=case.scale).double().cpu()
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
    finding = _describe_wrong(case, rows)
    if boundary:
        finding += (f"; {boundary} of them see one key more or less than their position allows: look at the "
                    f"diagonal (key <= position) and at where the mask-free tiles stop (§4)")
    return finding, None


def _describe_wrong(case, rows):
    """No known mistake fits: say where the wrong tokens are, in the drill's terms."""
    info = case.rows()
    bs, lens = case.block_size, case.seq_lens.long().tolist()
    bad = [info[t] for t in rows.nonzero().flatten().tolist()]
    good = [info[t] for t in (~rows).nonzero().flatten().tolist()]
    parts = []
    if all(lens[b] - case.q_lens[b] > 0 for b, _, _ in bad) and any(lens[b] == case.q_lens[b] for b, _, _ in good):
        parts.append("only chunks over a cached prefix are wrong; pure prefills are right: look at how the prefix "
                     "enters (the offset seq_len - q_len, the loop's first key)")
    last_start = {b: (n - 1) // bs * bs for b, n in enumerate(lens)}
    if all(pos >= last_start[b] and lens[b] % bs for b, _, pos in bad):
        parts.append("only queries whose keys reach into the last, partly filled block are wrong: look at the last "
                     "block's mask (keys past seq_len) and at whether it is read at all")
    if all(case.q_lens[b] == 1 for b, _, _ in bad) and good:
        parts.append("only decode rows (q_len = 1) are wrong")
    where = "; ".join(parts) if parts else "it matches none of the usual mistakes (§8)"
    return f"the output is wrong for {len(bad)} query tokens; {where} (content/l3.md §5)"


def _describe(case):
    num_heads, head_size = case.query.shape[1:]
    scale = "default 1/sqrt(D)" if case.scale is None else f"{case.scale:g}"
    return (f"case: H_q={num_heads}, H_kv={case.k_cache.shape[2]}, D={head_size}, block_size={case.block_size}, "
            f"dtype={str(case.query.dtype).replace('torch.', '')}, scale={scale}, q_lens={case.q_lens}, "
            f"seq_lens={case.seq_lens.tolist()}, unused end of each last block holds {case.tail}")


# ---------------------------------------------------------------------------
# The pitfalls (content/l3.md §8): each planted in the reference by exact edits

_DIAG_LOOP = ("for start in range(num_full * TILE, end, TILE):\n        key = start + tl.arange(0, TILE)\n"
              "        k, v = _load_kv(k_cache_ptr, v_cache_ptr, block_table_ptr, seq, table_stride, key, key < end,")

PITFALLS = {
    "causal_offset_missing": Pitfall(
        says="the causal mask is aligned top-left (query i sees keys 0..i): the seq_len - q_len offset is missing",
        edits=(("context_len = seq_len - q_len", "context_len = 0"),)),
    "prefix_ignored": Pitfall(
        says="only the chunk's own keys are attended: the cached prefix before the chunk is skipped",
        edits=(("num_full = (context_len + first + 1) // TILE", "num_full = 0"),
               ("for start in range(num_full * TILE, end, TILE):", "for start in range(context_len, end, TILE):"))),
    "last_block_unmasked": Pitfall(
        says="K/V are loaded for the whole last block, past seq_len, and 0 * NaN = NaN",
        edits=((_DIAG_LOOP, _DIAG_LOOP.replace("key, key < end,", "key, key < tl.cdiv(end, BLOCK_SIZE) * BLOCK_SIZE,")),)),
    "masked_row_nan": Pitfall(
        says="a row that sees no key in a tile gets max -inf, and exp(-inf - (-inf)) = NaN poisons it",
        edits=(('base = tl.where(m_new == float("-inf"), 0.0, m_new)', "base = m_new"),)),
    "wrong_seq_lookup": Pitfall(
        says="query blocks are cut from the flat token array, so a block that straddles two chunks attends all of "
             "its rows against the first chunk's sequence",
        edits=(("if tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= q_block:",
                "if tl.load(query_start_loc_ptr + mid) <= q_block * BLOCK_Q:"),
               ("first = (q_block - q_start // BLOCK_Q - seq) * BLOCK_Q", "first = q_block * BLOCK_Q - q_start"),
               ("row_live = (rows < BLOCK_Q * GROUP) & (i < q_len)",
                "row_live = (rows < BLOCK_Q * GROUP) & (q_start + i < tl.load(query_start_loc_ptr + num_seqs))"))),
    "gqa_head_mapping": Pitfall(
        says="query head h is paired with KV head h % H_kv instead of h // (H_q / H_kv)",
        edits=(("heads = kv_head * GROUP + rows % GROUP", "heads = kv_head + (rows % GROUP) * NUM_KV_HEADS"),)),
}


# Other wrong kernels: the grade must fail each one and name no pitfall.
_STORE = "tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=row_live[:, None] & dim_live[None, :])"

MISTAKES = {
    "store_forgotten": Mistake(shows="never written", edits=(
        (_STORE, "pass  # planted: the store is forgotten"),)),
    "stores_padded_rows": Mistake(shows="written past the end of out", edits=(
        (_STORE, _STORE.replace("mask=row_live[:, None] & dim_live[None, :]", "mask=dim_live[None, :]")),)),
    "last_partial_block_dropped": Mistake(shows="last, partly filled block", edits=(
        ("end = tl.minimum(context_len + first + BLOCK_Q, seq_len)",
         "end = tl.minimum(context_len + first + BLOCK_Q, "
         "tl.where(seq_len >= BLOCK_SIZE, seq_len // BLOCK_SIZE * BLOCK_SIZE, seq_len))"),)),
}


# ---------------------------------------------------------------------------
# The bench workload


def prefill_flops(num_seqs, q_len, context, num_heads, head_size, **_):
    """q·k and p·v, a multiply and an add each, per query head and per key each query sees."""
    seen = sum(context + i + 1 for i in range(q_len))
    return 4 * num_seqs * num_heads * head_size * seen


def prefill_bytes(num_seqs, q_len, context, num_heads, num_kv_heads, head_size, block_size, dtype, **_):
    """Each sequence's K/V read once, the query read and the output written once, plus the
    block table and the two length arrays."""
    size = ELEMENT_SIZE[dtype]
    seq_len = context + q_len
    kv = 2 * num_seqs * seq_len * num_kv_heads * head_size * size
    q_and_out = 2 * num_seqs * q_len * num_heads * head_size * size
    return kv + q_and_out + 4 * num_seqs * -(-seq_len // block_size) + 4 * (2 * num_seqs + 1)



# The traffic report (tests/_traffic.py): bytes moved under the CPU interpreter

# The bench's "8x512 on 4096" (a chunk of new tokens over a long cached prefix) shrunk to
# interpreter size: each chunk fits one query block of the interpreter's tile, so each
# KV head's program reads its sequence's K/V once; a partial last block and garbage
# block-table columns past it.
TRAFFIC_CASE = dict(num_seqs=3, q_len=4, context=68, num_heads=8, num_kv_heads=2, head_size=32, block_size=16,
                    dtype="float16")


def traffic_case(device="cpu"):
    p = TRAFFIC_CASE
    return paged_prefill_case([p["q_len"]] * p["num_seqs"], [p["context"]] * p["num_seqs"], num_heads=p["num_heads"],
                              num_kv_heads=p["num_kv_heads"], head_size=p["head_size"], block_size=p["block_size"],
                              dtype=DTYPES[p["dtype"]], extra_columns=2, device=device, seed=5)


def garbage_entries_read(case, traffic, record=3):
    """(sequence, column) of every block-table entry past a sequence's last block that was loaded."""
    width = case.block_table.shape[1]
    owned = torch.arange(width) < (case.seq_lens.cpu()[:, None] + case.block_size - 1) // case.block_size
    return [(b, c) for b, c in (~owned).nonzero().tolist()
            if was_read(traffic.tensors[record], case.block_table[b, c])]


def check_table_read_only_to_last_block(module, case):
    """paged_prefill_attention on `case` with its loads counted: no block-table entry past a
    sequence's last block may be loaded (design.md: they are garbage), whatever the values.
    Returns False where nothing can be counted (a GPU), True when checked."""
    returned, counted = measure(module, "paged_prefill_attention", *case.args(), **case.kwargs())
    if counted is None:
        return False
    garbage = garbage_entries_read(case, counted)
    if garbage:
        b, c = garbage[0]
        raise Mismatch(f"block_table[{b}, {c}] was loaded, but sequence {b} has seq_len {int(case.seq_lens[b])}: "
                       f"the entries past its last block are garbage ({len(garbage)} such entries loaded); mask the "
                       f"block-table load with key < seq_len")
    check_paged_prefill(case, case.out if case.out is not None else returned, returned)
    return True


def traffic_parts(p):
    """prefill_bytes (the bench's count) tensor by tensor. Indices: places in the call."""
    size = ELEMENT_SIZE[p["dtype"]]
    seq_len = p["context"] + p["q_len"]
    kv = 2 * p["num_seqs"] * seq_len * p["num_kv_heads"] * p["head_size"] * size
    rows = p["num_seqs"] * p["q_len"] * p["num_heads"] * p["head_size"] * size
    parts = [Part("K/V", (1, 2), fewest_loaded=kv), Part("query", (0,), fewest_loaded=rows),
             Part("block table", (3,), fewest_loaded=4 * p["num_seqs"] * -(-seq_len // p["block_size"])),
             Part("lengths", (4, 5), fewest_loaded=4 * (2 * p["num_seqs"] + 1)),
             Part("out", (6,), fewest_stored=rows)]
    assert sum(x.fewest_loaded + x.fewest_stored for x in parts) == prefill_bytes(**p)
    return parts


def traffic(module):
    """paged_prefill_attention on TRAFFIC_CASE, its bytes against prefill_bytes, with where
    the extra bytes went in L3's words."""
    case = traffic_case()
    _, counted = measure(module, "paged_prefill_attention", *case.args(), **case.kwargs())
    if counted is None:
        return None
    result = report(DRILL.id, counted, traffic_parts(TRAFFIC_CASE))
    kv, table = result["parts"]["K/V"], result["parts"]["block table"]
    group = case.query.shape[1] // case.k_cache.shape[2]
    where = []
    if kv > 1.5 and group > 1 and abs(kv - group) < 0.25 * group:
        where.append(f"K and V are read {kv:.0f}× — once per query head; read them once per KV head, for its "
                     f"{group} query heads at once (GQA)")
    elif kv > 1.05:
        where.append(f"K and V are read {kv:.2f}× their size: here each sequence's new tokens fit one query block, "
                     f"so each KV head's program can read its sequence's keys once")
    if table > 2 * max(kv, 1) * case.k_cache.shape[2]:
        where.append(f"the block table was read once per token instead of once per block ({table:.0f}×)")
    garbage = garbage_entries_read(case, counted)
    if garbage:
        where.append(f"block-table entries past a sequence's last block were read ({len(garbage)} of them): they "
                     f"are garbage")
    result["where"] = where + result["where"]
    return result


def _bench_case(name, num_seqs, q_len, context):
    params = dict(num_seqs=num_seqs, q_len=q_len, context=context, num_heads=32, num_kv_heads=8, head_size=128,
                  block_size=16, dtype="float16")
    return BenchCase(name, params, prefill_bytes(**params), prefill_flops(**params))


BENCH = (_bench_case("4x2048 causal", 4, 2048, 0), _bench_case("8x512 on 4096", 8, 512, 3584),
         _bench_case("decode B=64 ctx 4096", 64, 1, 4095))


def bench_work(module, params, device, n_sets):
    """`n_sets` serving steps over one block pool, for the report. Baseline: SDPA on the
    same K/V already contiguous, with the same (bottom-right) causal structure."""
    num_seqs, q_len, context = params["num_seqs"], params["q_len"], params["context"]
    num_heads, num_kv_heads, head_size, bs = (params[k] for k in ("num_heads", "num_kv_heads", "head_size",
                                                                  "block_size"))
    dtype = DTYPES[params["dtype"]]
    seq_len = context + q_len
    per_seq = math.ceil(seq_len / bs)
    num_blocks = n_sets * num_seqs * per_seq
    k_cache = torch.randn((num_blocks, bs, num_kv_heads, head_size), dtype=dtype, device=device)
    v_cache = torch.randn_like(k_cache)
    pool = torch.randperm(num_blocks, device=device).to(torch.int32).view(n_sets, num_seqs, per_seq)
    starts = torch.arange(num_seqs + 1, dtype=torch.int32, device=device) * q_len
    seq_lens = torch.full((num_seqs,), seq_len, dtype=torch.int32, device=device)
    sets = [(torch.randn(num_seqs * q_len, num_heads, head_size, dtype=dtype, device=device), pool[i].contiguous())
            for i in range(n_sets)]
    mask = torch.arange(seq_len, device=device)[None, :] <= context + torch.arange(q_len, device=device)[:, None]

    def contiguous(cache, table):  # [B, H_q, seq_len, D]
        kv = cache[table.long()].flatten(1, 2)[:, :seq_len].transpose(1, 2)
        return kv.repeat_interleave(num_heads // num_kv_heads, dim=1).contiguous()

    dense = [(q.view(num_seqs, q_len, num_heads, head_size).transpose(1, 2).contiguous(),
              contiguous(k_cache, t), contiguous(v_cache, t)) for q, t in sets]

    def ours():
        for query, table in sets:
            module.paged_prefill_attention(query, k_cache, v_cache, table, starts, seq_lens)

    def sdpa():
        for q, k, v in dense:
            if context == 0:
                torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    return ours, {"SDPA, contiguous KV": (sdpa, True)}


# ---------------------------------------------------------------------------
# Page checks: every number content/l3.md works out


def _section(text, n):
    start = text.index(f"## {n}. ")
    end = text.find("\n## ", start + 4)
    return text[start:end if end > 0 else len(text)]


def _self_test(text, n):
    start = text.index(f"**自测 {n}**")
    end = text.find("**自测", start + 5)
    return text[start:end if end > 0 else text.index("\n## ", start)]


def check_worked_example(text):
    """§3: the example's layout, the mask table and the three outputs (right, no offset,
    prefix ignored), against PREFILL_EXAMPLE and the reference."""
    ex = PREFILL_EXAMPLE
    sec = _section(text, 3)
    assert eval(re.search(r"`block_table = (\[\[[\d, ]+\]\])`", sec).group(1)) == ex["block_table"]
    assert int(re.search(r"block_size = (\d+)", sec).group(1)) == ex["block_size"]
    assert [int(x) for x in re.search(r"seq_len = (\d+)，q_len = (\d+)", sec).groups()] == [ex["seq_len"], ex["q_len"]]
    rows = re.findall(r"^\| 查询 (\d+) \| 位置 (\d+) \| ([✓· ]+) \|", sec, re.M)
    context = ex["seq_len"] - ex["q_len"]
    assert len(rows) == ex["q_len"]
    for i, pos, marks in rows:
        i, pos = int(i), int(pos)
        assert pos == context + i
        assert marks.split() == ["✓" if k <= pos else "·" for k in range(ex["seq_len"])]
    case = example_case()
    want = case.reference().flatten().tolist()
    for mask, label in (("bottom_right", "正确"), ("top_left", "不加偏移"), ("chunk_only", "忽略前缀")):
        shown = [float(x) for x in re.search(rf"{label}：([\d.、]+)", sec).group(1).split("、")]
        assert shown == example_outputs(mask)
    assert example_outputs("bottom_right") == want


def check_bench_flops_and_bytes(text):
    """§2: the FLOPs and bytes of the 4x2048 prefill and the decode step, and their ratios."""
    sec = _section(text, 2)
    prefill, _, decode = BENCH
    flops = int(re.search(r"预填充的 FLOPs = [^\n]*?= (\d{6,})", sec).group(1))
    nbytes = int(re.search(r"预填充至少搬 [^\n]*?= (\d{6,}) 字节", sec).group(1))
    assert flops == prefill.flops and nbytes == prefill.bytes
    dflops = int(re.search(r"decode 的 FLOPs = [^\n]*?= (\d{6,})", sec).group(1))
    dbytes = int(re.search(r"decode 至少搬 [^\n]*?= (\d{6,}) 字节", sec).group(1))
    assert dflops == decode.flops and dbytes == decode.bytes
    ratios = [float(x) for x in re.findall(r"≈ ([\d.]+) FLOP/字节", sec)]
    assert ratios[0] == round(flops / nbytes) or abs(ratios[0] - flops / nbytes) < 0.5
    assert abs(ratios[1] - dflops / dbytes) < 0.05


def check_self_test_positions(text):
    """Self-test 1: the positions of a chunk's queries and what each sees."""
    q = _self_test(text, 1)
    seq_len, q_len = map(int, re.search(r"seq_len = (\d+)、q_len = (\d+)", q).groups())
    first, last = map(int, re.search(r"第一个查询在位置 (\d+)，最后一个在位置 (\d+)", q).groups())
    assert first == seq_len - q_len and last == seq_len - 1
    seen = int(re.search(r"第一个查询看见 (\d+) 个 key", q).group(1))
    assert seen == first + 1


def check_self_test_grid(text):
    """Self-test 2: the grid's upper bound and which blocks each sequence owns."""
    q = _self_test(text, 2)
    lens = [int(x) for x in re.search(r"q_len 依次是 ([\d、]+)", q).group(1).split("、")]
    block_q = int(re.search(r"BLOCK_Q = (\d+)", q).group(1))
    bound = int(re.search(r"上界 = [^=]*= (\d+)", q).group(1))
    starts = [0] + list(torch.tensor(lens).cumsum(0).tolist())
    assert bound == sum(lens) // block_q + len(lens)
    firsts = [int(x) for x in re.search(r"第一块的编号依次是 ([\d、]+)", q).group(1).split("、")]
    assert firsts == [starts[b] // block_q + b for b in range(len(lens))]
    used = int(re.search(r"真正干活的 program 有 (\d+) 个", q).group(1))
    assert used == sum(-(-n // block_q) for n in lens)


def check_self_test_rows(text):
    """Self-test 3: which query and head tile row r holds."""
    q = _self_test(text, 3)
    group, block_q, row = map(int, re.search(r"group = (\d+)、BLOCK_Q = (\d+).*?第 (\d+) 行", q, re.S).groups())
    i, head_in_group = map(int, re.search(r"查询 first \+ (\d+)、组内第 (\d+) 个 head", q).groups())
    assert (i, head_in_group) == (row // group, row % group)
    block_m = int(re.search(r"BLOCK_M = (\d+)", q).group(1))
    assert block_m == max(16, 1 << (block_q * group - 1).bit_length())


def check_self_test_tiles(text):
    """Self-test 4: the diagonal and mask-free tiles of one query block."""
    q = _self_test(text, 4)
    context, first, block_q, tile, seq_len = map(int, re.search(
        r"context_len = (\d+)、first = (\d+)、BLOCK_Q = (\d+)、TILE = (\d+)、seq_len = (\d+)", q).groups())
    num_full = int(re.search(r"num_full = [^=]*= (\d+)", q).group(1))
    end = int(re.search(r"end = [^=]*= (\d+)", q).group(1))
    assert num_full == (context + first + 1) // tile and end == min(context + first + block_q, seq_len)
    diag = [int(x) for x in re.search(r"对角线 tile 从 key ([\d、]+) 开始", q).group(1).split("、")]
    assert diag == list(range(num_full * tile, end, tile))


# ---------------------------------------------------------------------------

def check_traffic_line(text):
    """The traffic line the page shows is what the reference's traffic case gives (run here,
    in the CPU interpreter; on a GPU there is nothing to count)."""
    from _tree import load_drill
    p = TRAFFIC_CASE
    assert (p["num_seqs"], p["q_len"], p["context"]) == (3, 4, 68) and "3 条序列各 4 个新 token，接在 68 个" in text
    check_page_line(text, "l3", traffic(load_drill("solutions", "l3_paged_prefill")))


DRILL = Drill(
    id="l3",
    stem="l3_paged_prefill",
    title="Chunked-prefill attention",
    mirrors="vLLM unified attention (2-D path)",
    api=("paged_prefill_kernel", "paged_prefill_attention"),
    section=SECTION,
    test_shapes=TEST_SHAPES,
    pitfalls=PITFALLS,
    mistakes=MISTAKES,
    bench=BENCH,
    bench_work=bench_work,
    traffic=traffic,
    page_checks=(check_traffic_line, check_worked_example, check_bench_flops_and_bytes, check_self_test_positions, check_self_test_grid,
                 check_self_test_rows, check_self_test_tiles),
)
