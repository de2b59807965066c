"""Drill L4, split-KV ("flash decoding") decode with a log-sum-exp merge: everything
that knows this drill. In order: the page's worked examples, the case and its
builder, the plain-PyTorch reference (float64, on the CPU), the hypothesis
strategies, the checks (with their diagnosis), the pitfalls, the bench work, the
page checks, and DRILL.

The split count never changes the answer, only how it is summed; so the reference
is plain attention, and the diagnosis rebuilds the chunks a kernel would have made
(several ways of rounding the chunk length) to recognise the mistakes that live
in the split and the merge.
"""
import math
import re
from dataclasses import dataclass

import torch
from hypothesis import strategies as st

from _diagnose import Mismatch, output_of, reproduces
from _drill import BenchCase, Drill, Mistake, Pitfall
from _traffic import Part, check_page_line, measure, report, was_read
from _tree import load_drill
from _paged import DTYPES, allocate_blocks, guarded_nan, guarded_table, nan_outside, noise, owned_columns

SECTION = "content/l4.md §8"
TEST_SHAPES = dict(max_seqs=4, max_context=200, max_kv_heads=2, gqa_ratios=(1, 4), head_sizes=(3, 8, 16, 40),
                   block_sizes=(16, 32), max_splits=12)
LN2 = math.log(2)


# ---------------------------------------------------------------------------
# The page's worked examples (content/l4.md §3)

# L2's worked example (scores 1, 3, 4, 2; values 1, 2, 3, 4; D = 1, scale = 1) cut
# into two chunks of two keys. Each chunk's (v, s) and the merge are on the page.
MERGE_EXAMPLE = dict(scores=[1.0, 3.0, 4.0, 2.0], values=[1.0, 2.0, 3.0, 4.0], cut=2)
# §9's self-test: (v = 2, s = ln 3) merged with (v = 5, s = ln 6).
SELF_TEST_MERGE = dict(v_a=2.0, s_a=math.log(3), v_b=5.0, s_b=math.log(6))


def merge_example_numbers():
    """Every number §3 quotes, from the float64 reference."""
    ex = MERGE_EXAMPLE
    s, v, cut = torch.tensor(ex["scores"], dtype=torch.float64), torch.tensor(ex["values"], dtype=torch.float64), \
        ex["cut"]
    (v_a, s_a), (v_b, s_b) = (_attend(s[:cut], v[:cut]), _attend(s[cut:], v[cut:]))
    v_ab, s_ab = ref_merge(v_a, s_a, v_b, s_b)
    w_a, w_b = math.exp(s_a - s_ab), math.exp(s_b - s_ab)
    # The base-2 trap: the same chunks, their LSEs written in base 2, merged as if natural.
    v_2, _ = ref_merge(v_a, s_a / LN2, v_b, s_b / LN2)
    return dict(s_a=s_a, v_a=v_a, s_b=s_b, v_b=v_b, w_a=w_a, w_b=w_b, s=s_ab, v=v_ab,
                whole=float(torch.softmax(s, 0) @ v), base2_v=v_2)


def _attend(scores, values):
    """(v, lse) of one chunk: softmax-weighted values and the log-sum-exp of the scores."""
    return float(torch.softmax(scores, 0) @ values), float(torch.logsumexp(scores, 0))


# ---------------------------------------------------------------------------
# The case


@dataclass
class SplitCase:
    """One call of paged_decode_attention_split, with what is needed to check and explain it."""

    query: torch.Tensor        # [B, H_q, D], possibly a row-strided view
    k_cache: torch.Tensor      # [num_blocks, block_size, H_kv, D]; unowned blocks hold NaN
    v_cache: torch.Tensor
    block_table: torch.Tensor  # [B, max_blocks] int32; garbage columns point at NaN blocks
    seq_lens: torch.Tensor     # [B] int32
    scale: float = None        # None: the default 1/sqrt(D)
    num_splits: int = None     # None: the function picks
    tail: str = "noise"        # what the unused end of each last block holds: "noise" or "nan"

    @property
    def block_size(self):
        return self.k_cache.shape[1]

    def args(self):
        return self.query, self.k_cache, self.v_cache, self.block_table, self.seq_lens

    def kwargs(self):
        given = dict(scale=self.scale, num_splits=self.num_splits)
        return {k: v for k, v in given.items() if v is not None}

    def scores_values(self):
        """Per sequence, (scores [H_q, n], values [H_q, n, D]) in float64 on the CPU."""
        num_seqs, num_heads, head_size = self.query.shape
        num_kv_heads = self.k_cache.shape[2]
        scale = 1.0 / math.sqrt(head_size) if self.scale is None else self.scale
        kv_head = torch.arange(num_heads) // (num_heads // num_kv_heads)
        owned = owned_columns(self.seq_lens, self.block_size, self.block_table.shape[1])
        result = []
        for b in range(num_seqs):
            n = int(self.seq_lens[b])
            blocks = self.block_table[b].cpu()[owned[b]].long().to(self.k_cache.device)
            k, v = (c[blocks].flatten(0, 1)[:n].cpu().double()[:, kv_head] for c in (self.k_cache, self.v_cache))
            result.append((torch.einsum("hd,nhd->hn", self.query[b].cpu().double(), k) * scale, v.transpose(0, 1)))
        return result

    def reference(self):
        return ref_split_decode(self)


def split_case(seq_lens, *, num_heads=8, num_kv_heads=2, head_size=16, block_size=16, dtype=torch.float16,
               scale=None, num_splits=None, spare_blocks=2, extra_columns=2, tail="noise", layout="contiguous",
               device="cpu", seed=0):
    """A decode step over a paged cache, built as L2's: owned blocks hold noise; blocks
    no sequence owns hold NaN and every garbage block-table column (and the guard after
    the table) names one; the unused end of each last block holds `tail`. A contiguous
    query is followed in memory by NaN; `layout="fused_qkv"` makes it a row-strided view."""
    gen = torch.Generator().manual_seed(seed)
    table, num_blocks = allocate_blocks(seq_lens, block_size, gen, max(spare_blocks, 1), extra_columns)
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    k_cache, v_cache = noise(shape, torch.float32, "cpu", gen), noise(shape, torch.float32, "cpu", gen)
    spare = nan_outside(k_cache, table, seq_lens, block_size, tail)
    nan_outside(v_cache, table, seq_lens, block_size, tail)
    num_seqs, hd = len(seq_lens), num_heads * head_size
    if layout == "fused_qkv":
        qkv = noise((num_seqs, hd + 2 * num_kv_heads * head_size), dtype, device, gen)
        query = qkv[:, :hd].view(num_seqs, num_heads, head_size)
    else:
        query = guarded_nan(noise((num_seqs, num_heads, head_size), dtype, "cpu", gen), device)
    return SplitCase(query=query, k_cache=k_cache.to(dtype=dtype, device=device),
                     v_cache=v_cache.to(dtype=dtype, device=device), block_table=guarded_table(table, spare, gen, device),
                     seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device), scale=scale,
                     num_splits=num_splits, tail=tail)


def spread_chunks(case):
    """Give the keys a ramp along each sequence, so the chunks' LSEs differ by several
    units: a wrong weight or an unnormalised partial then moves the answer far."""
    group = case.query.shape[1] // case.k_cache.shape[2]
    for b, n in enumerate(case.seq_lens.tolist()):
        blocks = case.block_table[b, :math.ceil(n / case.block_size)].long()
        ramp = torch.linspace(-2, 2, blocks.numel() * case.block_size, device=case.query.device)
        k = case.k_cache[blocks].float() + ramp.view(-1, case.block_size, 1, 1) * case.query[b, ::group].float()
        case.k_cache[blocks] = k.to(case.k_cache.dtype)
    return case


def last_tokens_score_highest(case, count=8):
    """Each sequence's last `count` keys copy twice the query of their KV head's first
    query head: dropping the last chunk (which holds them) moves every output."""
    group = case.query.shape[1] // case.k_cache.shape[2]
    for b, n in enumerate(case.seq_lens.tolist()):
        for pos in range(n - count, n):
            block, offset = case.block_table[b, pos // case.block_size].long(), pos % case.block_size
            case.k_cache[block, offset] = 2 * case.query[b, ::group]
    return case


def merge_example_case(device="cpu"):
    """§3's example as a decode: one sequence, one head, D = 1, scale = 1, so each
    key is its score; block size 2 and num_splits = 2."""
    ex = MERGE_EXAMPLE
    n = len(ex["scores"])
    table = torch.tensor([[3, 1]], dtype=torch.int32)
    k_cache, v_cache = torch.zeros(4, 2, 1, 1), torch.zeros(4, 2, 1, 1)
    for pos in range(n):
        k_cache[table[0, pos // 2], pos % 2] = ex["scores"][pos]
        v_cache[table[0, pos // 2], pos % 2] = ex["values"][pos]
    spare = nan_outside(k_cache, table, [n], 2, "noise")
    nan_outside(v_cache, table, [n], 2, "noise")
    return SplitCase(query=guarded_nan(torch.ones(1, 1, 1), device), k_cache=k_cache.to(device),
                     v_cache=v_cache.to(device), block_table=guarded_table(table, spare, torch.Generator(), device),
                     seq_lens=torch.tensor([n], dtype=torch.int32, device=device), scale=1.0, num_splits=2)


@dataclass
class MergeCase:
    """One call of merge_attention_states."""

    v_a: torch.Tensor
    s_a: torch.Tensor
    v_b: torch.Tensor
    s_b: torch.Tensor

    def args(self):
        return self.v_a, self.s_a, self.v_b, self.s_b

    def reference(self):
        return ref_merge(self.v_a, self.s_a, self.v_b, self.s_b)


def merge_case(rows=3, heads=2, head_size=5, dtype_a=torch.float32, dtype_b=None, empty_a=0.0, empty_b=0.0,
               spread=4.0, device="cpu", seed=0):
    """Random parts; each (row, head) of a side is empty with probability empty_*: then
    its s is -inf and its v holds NaN (garbage that must not leak into the result)."""
    gen = torch.Generator().manual_seed(seed)
    shape = (rows, heads, head_size)
    v_a, v_b = noise(shape, torch.float32, "cpu", gen), noise(shape, torch.float32, "cpu", gen)
    s_a, s_b = (torch.randn(rows, heads, generator=gen) * spread for _ in range(2))
    for v, s, p in ((v_a, s_a, empty_a), (v_b, s_b, empty_b)):
        gone = torch.rand(rows, heads, generator=gen) < p
        s[gone] = float("-inf")
        v[gone] = float("nan")
    return MergeCase(v_a.to(dtype_a).to(device), s_a.to(device), v_b.to(dtype_b or dtype_a).to(device),
                     s_b.to(device))


# ---------------------------------------------------------------------------
# The reference (float64, CPU)


def ref_merge(v_a, s_a, v_b, s_b, base=math.e):
    """(v, s) of the union of two disjoint key sets, in float64. Works on floats or on
    tensors [n, H, D] / [n, H]. `base` is the base the LSEs are *read* in (the diagnosis
    replays a merge that reads them in the wrong base)."""
    scalar = not isinstance(v_a, torch.Tensor)
    t = (lambda x: torch.tensor(x, dtype=torch.float64)) if scalar else (lambda x: x.cpu().double())
    v_a, s_a, v_b, s_b = t(v_a), t(s_a), t(v_b), t(s_b)
    s_a, s_b = s_a * math.log(base), s_b * math.log(base)
    s = torch.logaddexp(s_a, s_b)  # -inf when both are empty
    shift = torch.where(torch.isinf(s), torch.zeros_like(s), s)
    w_a, w_b = torch.exp(s_a - shift), torch.exp(s_b - shift)
    part = (lambda w, v: torch.where(w[..., None] > 0, w[..., None] * v.nan_to_num(), 0.0)) if not scalar else \
        (lambda w, v: w * v if w > 0 else torch.zeros(()))
    total = w_a + w_b
    denominator = torch.where(total > 0, total, torch.ones_like(total))
    v = (part(w_a, v_a) + part(w_b, v_b)) / (denominator if scalar else denominator[..., None])
    s = s / math.log(base)
    return (float(v), float(s)) if scalar else (v, s)


def ref_split_decode(case):
    """Plain attention, softmax(q·K^T · scale) · V per sequence and query head, float64:
    the split count does not change the answer. Returns [B, H_q, D]."""
    return torch.stack([torch.einsum("hn,hnd->hd", s.softmax(-1), v) for s, v in case.scores_values()]) \
        if case.query.shape[0] else torch.zeros(case.query.shape, dtype=torch.float64)


def chunk_bounds(n, num_splits, align):
    """The [start, end) of each of num_splits chunks of n tokens, each ceil(n / num_splits)
    rounded up to a multiple of `align` long (the reference aligns to its tile)."""
    per_split = -(-n // num_splits)            # ceil(n / num_splits)
    chunk = -(-per_split // align) * align      # rounded up to a multiple of align
    return [(min(i * chunk, n), min((i + 1) * chunk, n)) for i in range(num_splits)]


def chunk_states(scores, values, bounds):
    """Per chunk, (v [H, D], lse [H], l [H]) as phase 1 writes them (l: the chunk's sum
    of exp(score - its own max)); an empty chunk gives v = 0, lse = -inf, l = 0."""
    heads, head_size = values.shape[0], values.shape[2]
    states = []
    for start, end in bounds:
        if end <= start:
            states.append((torch.zeros(heads, head_size, dtype=torch.float64),
                           torch.full((heads,), float("-inf"), dtype=torch.float64), torch.zeros(heads)))
            continue
        s = scores[:, start:end]
        m = s.max(dim=1).values
        p = torch.exp(s - m[:, None])
        l = p.sum(dim=1)
        states.append((torch.einsum("hn,hnd->hd", p, values[:, start:end]) / l[:, None], m + torch.log(l), l))
    return states


def merge_all(states):
    """Phase 2: fold the chunks' (v, lse, l) with ref_merge; returns (v [H, D], lse [H])."""
    v, s = states[0][0], states[0][1]
    for v_i, s_i, _ in states[1:]:
        v, s = ref_merge(v[None], s[None], v_i[None], s_i[None])
        v, s = v[0], s[0]
    return v, s


# ---------------------------------------------------------------------------
# Hypothesis strategies (bounded by TEST_SHAPES)


@st.composite
def split_params(draw, dtypes=tuple(DTYPES)):
    """Keyword arguments for split_case: batch, lengths and split counts, with the
    lengths where split kernels go wrong (one token, fewer tokens than splits, whole
    blocks, one past) and split counts from 1 to more chunks than the context has tiles."""
    shapes = TEST_SHAPES
    block_size = draw(st.sampled_from(shapes["block_sizes"]))
    num_seqs = draw(st.integers(1, shapes["max_seqs"]))
    special = st.sampled_from([1, 2, block_size, block_size + 1, 2 * block_size, shapes["max_context"]])
    seq_lens = draw(st.lists(special | st.integers(1, shapes["max_context"]), min_size=num_seqs, max_size=num_seqs))
    num_kv_heads = draw(st.integers(1, shapes["max_kv_heads"]))
    return dict(
        seq_lens=seq_lens, block_size=block_size, num_kv_heads=num_kv_heads,
        num_heads=num_kv_heads * draw(st.sampled_from(shapes["gqa_ratios"])),
        head_size=draw(st.sampled_from(shapes["head_sizes"])),
        dtype=DTYPES[draw(st.sampled_from(dtypes))],
        scale=draw(st.none() | st.floats(0.05, 1.0)),
        num_splits=draw(st.none() | st.integers(1, shapes["max_splits"])),
        tail=draw(st.sampled_from(["noise", "nan"])),
        layout=draw(st.sampled_from(["contiguous", "fused_qkv"])),
        extra_columns=draw(st.integers(0, 3)),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


@st.composite
def merge_params(draw):
    """Keyword arguments for merge_case."""
    return dict(rows=draw(st.integers(1, 4)), heads=draw(st.integers(1, 3)),
                head_size=draw(st.sampled_from([1, 3, 16, 24])),
                dtype_a=DTYPES[draw(st.sampled_from(list(DTYPES)))],
                empty_a=draw(st.sampled_from([0.0, 0.3, 1.0])), empty_b=draw(st.sampled_from([0.0, 0.3, 1.0])),
                spread=draw(st.sampled_from([0.5, 4.0, 30.0])), seed=draw(st.integers(0, 2**31 - 1)))


# ---------------------------------------------------------------------------
# Checks and diagnosis

# (atol, rtol) against the float64 reference; the partials are fp32 whatever the input.
TOLERANCE = {torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.5e-2, 1.5e-2), torch.float32: (1e-4, 1e-4)}
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
    bad = ~torch.isfinite(got_v).all(dim=-1)
    if bad.any():
        r, h = (int(i) for i in bad.nonzero()[0])
        raise _merge_non_finite(case, got_v, bad, r, h, empty_a, empty_b)
    both = empty_a & empty_b
    wrong_s = ~(torch.isclose(got_s, want_s, rtol=1e-6, atol=1e-5) | (both & (got_s == float("-inf"))))
    atol, rtol = TOLERANCE.get(v.dtype, TOLERANCE[torch.float32])
    wrong = ~_close(got_v, want_v, atol, rtol) | wrong_s
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


def _merge_non_finite(case, got_v, bad, r, h, empty_a, empty_b):
    one_empty = empty_a ^ empty_b
    both = empty_a & empty_b
    garbage = torch.isnan(case.v_a.cpu()).any(-1) | torch.isnan(case.v_b.cpu()).any(-1)
    where = f"merge_attention_states: row {r}, head {h} holds NaN or inf ({int(bad.sum())} of {bad.numel()})"
    big = (case.v_a.cpu().double().abs().amax(-1) + case.v_b.cpu().double().abs().amax(-1))
    if bool((bad <= ((one_empty & garbage) | both)).all()):
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


# ---------------------------------------------------------------------------
# The pitfalls (content/l4.md §8): what each mistake is, and the edits that plant
# it in solutions/l4_split_kv_decode.py.

PITFALLS = {
    "lse_base2": Pitfall(
        says="phase 1 runs its softmax in base 2 (exp2) and stores the LSE as m + log2(l), which the merge reads "
             "as a natural log",
        edits=(("lse = (m + tl.log2(l)) * 0.6931471805599453", "lse = m + tl.log2(l)"),)),
    "empty_split_nan": Pitfall(
        says="an empty chunk (past a short sequence's end) or an empty merge side produces NaN: 0/0 in phase 1, "
             "0 · garbage in the merge, or 0/0 when both sides are empty",
        edits=(("part = acc / tl.where(l > 0, l, 1.0)[:, None]", "part = acc / l[:, None]"),
               ("    v = tl.where(w[:, None] > 0, v, 0.0)\n", ""),
               ("/ tl.where(total > 0, total, 1.0)", "/ total"))),
    "merge_in_fp16": Pitfall(
        says="the merge works in float16: the LSEs lose their fractions and the weighted sum can overflow",
        edits=(('s = tl.load(lse_ptr + first + parts, mask=parts < NUM_PARTS, other=float("-inf"))',
                's = tl.load(lse_ptr + first + parts, mask=parts < NUM_PARTS, other=float("-inf")).to(tl.float16)'),
               ("dims[None, :], mask=v_mask, other=0.0)", "dims[None, :], mask=v_mask, other=0.0).to(tl.float16)"))),
    "unnormalised_partial": Pitfall(
        says="phase 1 stores its chunk's accumulator acc instead of acc / l, while the LSE it stores already "
             "counts l (so the sum is divided in twice, or never)",
        edits=(("part = acc / tl.where(l > 0, l, 1.0)[:, None]", "part = acc"),)),
    "num_splits_ignored": Pitfall(
        says="num_splits is ignored: the function always uses its own default split count",
        edits=(("num_splits = default_num_splits(num_seqs, num_kv_heads, query.device) if num_splits is None "
                "else num_splits", "num_splits = default_num_splits(num_seqs, num_kv_heads, query.device)"),)),
    "last_chunk_dropped": Pitfall(
        says="the merge stops one chunk early: the last chunk (or merge side b) is left out",
        edits=(('mask=parts < NUM_PARTS, other=float("-inf"))', 'mask=parts < NUM_PARTS - 1, other=float("-inf"))'),)),
}

_DIRECT_STORE = "tl.store(out_ptr + out_offs, part.to(out_ptr.dtype.element_ty), mask=q_mask)"

# Wrong kernels that are none of the page's pitfalls: the grade must fail each and
# name nothing, saying what is wrong instead.
MISTAKES = {
    "direct_store_forgotten": Mistake(shows="never written", edits=(
        (_DIRECT_STORE, "pass  # planted: with one split, the answer is never stored"),
    )),
    "chunks_overlap": Mistake(shows="is off", edits=(
        ("end = tl.minimum(start + chunk, seq_len)", "end = tl.minimum(start + chunk + TILE, seq_len)"),
    )),
}


# ---------------------------------------------------------------------------
# The bench work


def split_bytes(num_seqs, num_heads, num_kv_heads, head_size, context, dtype, **_):
    """Every cached K and V read once, the query read and the output written once
    (BENCHMARKS.md counts the same; the block table and seq_lens are left out)."""
    size = DTYPES[dtype].itemsize
    return 2 * num_seqs * context * num_kv_heads * head_size * size + 2 * num_seqs * num_heads * head_size * size


def split_flops(num_seqs, num_heads, context, head_size, **_):
    return 4 * num_seqs * num_heads * context * head_size


def bench_work(module, params, device, n_sets):
    """`n_sets` decode steps over one block pool, no two sharing a block, so the L2
    cache holds none of them. Returns (ours, {name: (baseline, graph_safe)}): L2's
    reference (loaded from solutions/, whatever tree is graded) and SDPA on the same
    K/V already contiguous per sequence."""

    num_seqs, context, block_size = params["num_seqs"], params["context"], params["block_size"]
    num_heads, num_kv_heads, head_size = params["num_heads"], params["num_kv_heads"], params["head_size"]
    dtype = DTYPES[params["dtype"]]
    blocks_per_seq = -(-context // block_size)
    num_blocks = n_sets * num_seqs * blocks_per_seq
    k_cache = torch.randn((num_blocks, block_size, num_kv_heads, head_size), dtype=dtype, device=device)
    v_cache = torch.randn_like(k_cache)
    pool = torch.randperm(num_blocks, device=device).to(torch.int32).view(n_sets, num_seqs, blocks_per_seq)
    seq_lens = torch.full((num_seqs,), context, dtype=torch.int32, device=device)
    sets = [(torch.randn(num_seqs, num_heads, head_size, dtype=dtype, device=device), pool[i].contiguous(),
             torch.empty(num_seqs, num_heads, head_size, dtype=dtype, device=device)) for i in range(n_sets)]
    l2 = load_drill("solutions", "l2_paged_decode")

    def ours():
        for query, table, out in sets:
            module.paged_decode_attention_split(query, k_cache, v_cache, table, seq_lens, out=out)

    def l2_reference():
        for query, table, _ in sets:
            l2.paged_decode_attention(query, k_cache, v_cache, table, seq_lens)

    def gathered(cache, table):
        return cache[table.long()].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()

    contiguous = [(q.unsqueeze(2), gathered(k_cache, t), gathered(v_cache, t)) for q, t, _ in sets]

    def sdpa_contiguous():
        for query, k, v in contiguous:
            torch.nn.functional.scaled_dot_product_attention(query, k, v, enable_gqa=True)

    return ours, {"L2 (solutions)": (l2_reference, True), "SDPA, contiguous KV": (sdpa_contiguous, True)}


# The traffic report (tests/_traffic.py): bytes moved under the CPU interpreter

# The bench's small-batch shape (B=8, 32 query heads over 8 KV heads, D = 128, blocks
# of 16) shrunk to interpreter size: few sequences, a long context, four splits, a
# partial last block and garbage block-table columns past it.
TRAFFIC_CASE = dict(num_seqs=2, num_heads=8, num_kv_heads=2, head_size=32, context=200, block_size=16,
                    dtype="float16", num_splits=4)


def traffic_case(device="cpu"):
    p = TRAFFIC_CASE
    return split_case([p["context"]] * p["num_seqs"], num_heads=p["num_heads"], num_kv_heads=p["num_kv_heads"],
                      head_size=p["head_size"], block_size=p["block_size"], dtype=DTYPES[p["dtype"]],
                      num_splits=p["num_splits"], extra_columns=2, device=device, seed=5)


def garbage_entries_read(case, traffic, record=3):
    """(sequence, column) of every block-table entry past a sequence's last block that was loaded."""
    owned = owned_columns(case.seq_lens, case.block_size, case.block_table.shape[1])
    return [(b, c) for b, c in (~owned).nonzero().tolist()
            if was_read(traffic.tensors[record], case.block_table[b, c])]


def check_table_read_only_to_last_block(module, case):
    """paged_decode_attention_split on `case` with its loads counted: no block-table entry
    past a sequence's last block may be loaded (design.md: they are garbage). Returns
    False where nothing can be counted (a GPU), True when checked."""
    out = torch.full_like(case.query, float("nan"))
    returned, counted = measure(module, "paged_decode_attention_split", *case.args(), **case.kwargs(), out=out)
    if counted is None:
        return False
    garbage = garbage_entries_read(case, counted)
    if garbage:
        b, c = garbage[0]
        raise Mismatch(f"block_table[{b}, {c}] was loaded, but sequence {b} has seq_len {int(case.seq_lens[b])}: "
                       f"the entries past its last block are garbage ({len(garbage)} such entries loaded); mask the "
                       f"block-table load with pos < seq_len (content/l2.md §7)")
    check_split_decode(case, out, returned, case.num_splits)
    return True


def traffic_parts(p):
    """split_bytes (the bandwidth report's count: K/V, query, out) tensor by tensor, plus what
    it leaves out: the block table and seq_lens, and the fp32 partial outputs and lse that
    each split writes once and the merge reads once (the price of splitting)."""
    size = DTYPES[p["dtype"]].itemsize
    kv = 2 * p["num_seqs"] * p["context"] * p["num_kv_heads"] * p["head_size"] * size
    rows = p["num_seqs"] * p["num_heads"] * p["head_size"] * size
    partials = p["num_seqs"] * p["num_heads"] * p["num_splits"] * (p["head_size"] + 1) * 4
    parts = [Part("K/V", (1, 2), fewest_loaded=kv), Part("query", (0,), fewest_loaded=rows),
             Part("block table", (3,), fewest_loaded=4 * p["num_seqs"] * -(-p["context"] // p["block_size"])),
             Part("seq_lens", (4,), fewest_loaded=4 * p["num_seqs"]),
             Part("out", (5,), fewest_stored=rows),
             Part("partials", ("scratch",), fewest_loaded=partials, fewest_stored=partials)]
    assert kv + 2 * rows == split_bytes(**p)
    return parts


def traffic(module):
    """paged_decode_attention_split on TRAFFIC_CASE, its bytes against the fewest, with where
    the extra bytes went in L4's words."""
    case = traffic_case()
    out = torch.empty_like(case.query)
    _, counted = measure(module, "paged_decode_attention_split", *case.args(), **case.kwargs(), out=out)
    if counted is None:
        return None
    result = report(DRILL.id, counted, traffic_parts(TRAFFIC_CASE))
    kv, table = result["parts"]["K/V"], result["parts"]["block table"]
    where = []
    group = case.query.shape[1] // case.k_cache.shape[2]
    if kv > 1.5 and group > 1 and abs(kv - group) < 0.25 * group:
        where.append(f"K and V are read {kv:.0f}× — once per query head; read them once per KV head, for its "
                     f"{group} query heads at once (GQA, content/l2.md §5)")
    elif kv > 1.05:
        where.append(f"K and V are read {kv:.2f}× their size: the splits should share each sequence's tokens, "
                     f"each token in exactly one chunk")
    if table > 2 * max(kv, 1) * case.k_cache.shape[2]:
        where.append(f"the block table was read once per token instead of once per block ({table:.0f}×)")
    if result["parts"]["partials"] > 1.05:
        where.append(f"the partial outputs moved {result['parts']['partials']:.2f}× what num_splits of them need "
                     f"(each split writes its part once, the merge reads it once)")
    garbage = garbage_entries_read(case, counted)
    if garbage:
        where.append(f"block-table entries past a sequence's last block were read ({len(garbage)} of them): they "
                     f"are garbage; mask the table load with pos < seq_len")
    result["where"] = where + result["where"]
    return result


def _bench_case(num_seqs, context, graph):
    params = dict(num_seqs=num_seqs, num_heads=32, num_kv_heads=8, head_size=128, context=context, block_size=16,
                  dtype="float16")
    return BenchCase(f"B={num_seqs} ctx={context}", params, split_bytes(**params), split_flops(**params), graph=graph)


# ---------------------------------------------------------------------------
# Page checks: every number the page states that code can compute


def _on_page(text, value, digits, what):
    shown = f"{value:.{digits}f}"
    assert shown in text, f"content/l4.md should show {what} = {shown}"


def check_worked_example(text):
    """§3: the two chunks' (v, s), the weights, the merged (v, s), L2's whole-row answer
    (the same), and what the base-2 mistake gives instead."""
    n = merge_example_numbers()
    for key, what in (("s_a", "chunk A's LSE"), ("v_a", "chunk A's output"), ("s_b", "chunk B's LSE"),
                      ("v_b", "chunk B's output"), ("w_a", "chunk A's weight"), ("w_b", "chunk B's weight"),
                      ("s", "the merged LSE"), ("v", "the merged output"), ("base2_v", "the base-2 mistake")):
        _on_page(text, n[key], 4, what)
    assert abs(n["v"] - n["whole"]) < 1e-12


def check_occupancy(text):
    """§2: the program counts, for the bench shapes on an H200 (132 SMs), and the split
    counts default_num_splits gives (4 · SMs // (B · H_kv), at most 32, at least 1)."""
    sms = 132
    for num_seqs, splits in ((8, 8), (64, 1), (16, 4), (1, 32)):
        assert max(1, min(32, 4 * sms // (num_seqs * 8))) == splits
    for line in ("8 × 8 = 64", "64 × 8 = 512", "4 × 132 ÷ 64", "4 × 132 ÷ 512"):
        assert line in text, f"content/l4.md §2 should show {line}"


def check_numbers_in_prose(text):
    """§2, §3, §5.1 and §8: the bytes per program and of the partials, the chunks of the
    §5.1 example, the weights of the base-2 mistake and of the float16 merge."""
    assert 4096 * 128 * 2 * 2 == 2 * 2**20 and "共 2 MiB" in text  # K and V of one KV head of one sequence
    partials = 8 * 32 * 8 * (128 + 1) * 4
    assert abs(partials / 2**20 - 1) < 0.01 and "约 1 MiB" in text
    assert chunk_bounds(200, 4, 64) == [(0, 64), (64, 128), (128, 192), (192, 200)]
    assert "⌈200 / 4⌉ = 50" in text and "[0, 64)、[64, 128)、[128, 192)、[192, 200)" in text
    assert [end > start for start, end in chunk_bounds(5, 4, 64)] == [True, False, False, False]
    _on_page(text, 1 / LN2, 4, "1 / ln 2")
    w_a = 1 / (1 + math.exp(1 / LN2))  # the chunks' LSEs differ by 1; read in base 2 the gap is 1 / ln 2
    _on_page(text, w_a, 4, "chunk A's weight under the base-2 mistake")
    _on_page(text, 1 - w_a, 4, "chunk B's weight under the base-2 mistake")
    w_b = 1 / (1 + math.exp(-0.25))  # s = 1000 and 1000.25
    _on_page(text, w_b, 4, "the float16 test's right weight of side b")
    _on_page(text, 1 - w_b, 4, "the float16 test's right weight of side a")
    assert torch.tensor(1000.25, dtype=torch.float16).item() == 1000.0  # float16 spacing near 1000 is 0.5
    assert math.isinf(torch.tensor(60000.0, dtype=torch.float16) + torch.tensor(60000.0, dtype=torch.float16))


def check_self_tests(text):
    """§9's answers."""
    t = SELF_TEST_MERGE
    v, s = ref_merge(t["v_a"], t["s_a"], t["v_b"], t["s_b"])
    assert abs(v - 4.0) < 1e-12 and abs(s - math.log(9)) < 1e-12
    _on_page(text, s, 4, "self-test 1's merged LSE (ln 9)")
    _on_page(text, 3 * LN2, 4, "self-test 2's FlashInfer LSE 3 in natural log")
    assert max(1, min(32, 4 * 132 // (16 * 8))) == 4 and "4 × 132 ÷ 128" in text
    assert re.search(r"v = 0.*s = −?-?inf", text)


# ---------------------------------------------------------------------------

def check_traffic_line(text):
    """§1's traffic line is what the reference's traffic case gives (run here, in the
    CPU interpreter; on a GPU there is nothing to count), and the case is the one described."""
    p = TRAFFIC_CASE
    assert (p["num_seqs"], p["context"], p["num_splits"]) == (2, 200, 4) and "两条序列、上下文 200、分 4 段" in text
    check_page_line(text, "l4", traffic(load_drill("solutions", "l4_split_kv_decode")))


# ---------------------------------------------------------------------------
# Fixture checks: the builders make the cases the tests say they make (tests/test_fixtures.py)


def check_fused_qkv_query_is_a_strided_view(device):
    assert not split_case([9, 70], layout="fused_qkv", num_splits=2, seed=15, device=device).query.is_contiguous()


def check_empty_merge_sides_hold_garbage(device):
    case = merge_case(rows=3, heads=2, head_size=8, empty_a=1.0, device=device, seed=7)
    assert bool(torch.isinf(case.s_a).all()) and bool(torch.isnan(case.v_a).all())
    assert bool(torch.isfinite(case.s_b).all()) and bool(torch.isfinite(case.v_b).all())


def check_empty_chunk_case_separates_short_from_long_sequences(device):
    """The empty-split test: sequences shorter than 8 tokens leave chunks empty however a
    kernel rounds its chunks; 2048 = 8 · 256 leaves none empty under any rounding tried."""
    for align in (1, 16, 32, 64, 128, 256):
        assert all(end > start for start, end in chunk_bounds(2048, 8, align))
        assert all(any(end <= start for start, end in chunk_bounds(n, 8, align)) for n in (1, 3))


def check_spread_chunks_make_the_chunk_lses_differ(device):
    case = spread_chunks(split_case([200, 150], num_splits=4, seed=7, device=device))
    for scores, values in case.scores_values():
        lse = torch.stack([s for _, s, _ in chunk_states(scores, values, chunk_bounds(scores.shape[1], 4, 64))])
        assert float((lse.max(0).values - lse.min(0).values).min()) > 1.0


def check_last_tokens_score_highest(device):
    case = last_tokens_score_highest(split_case([256, 200], num_splits=4, seed=9, device=device))
    group = case.query.shape[1] // case.k_cache.shape[2]
    for scores, _ in case.scores_values():
        assert bool((scores[::group].argmax(dim=1) >= scores.shape[1] - 8).all())


def check_worked_example_case_is_the_pages_row(device):
    case = merge_example_case(device)
    scores, values = case.scores_values()[0]
    assert scores.flatten().tolist() == MERGE_EXAMPLE["scores"]
    assert values.flatten().tolist() == MERGE_EXAMPLE["values"]


DRILL = Drill(
    id="l4",
    stem="l4_split_kv_decode",
    title="Split-KV decode attention",
    mirrors="vLLM paged attention v2 / unified attention's 3-D path, FlashInfer merge_state",
    api=("merge_states_kernel", "merge_attention_states", "split_kv_kernel", "default_num_splits",
         "paged_decode_attention_split"),
    section=SECTION,
    test_shapes=TEST_SHAPES,
    pitfalls=PITFALLS,
    mistakes=MISTAKES,
    # B=8 at 4096 moves 128 MiB (about 31 us at 4.3 TB/s): short, so graph replays. The other two move 1 GiB.
    bench=(_bench_case(8, 4096, graph=True), _bench_case(8, 32768, graph=False), _bench_case(64, 4096, graph=False)),
    bench_work=bench_work,
    traffic=traffic,
    page_checks=(check_traffic_line, check_worked_example, check_occupancy, check_numbers_in_prose, check_self_tests),
    fixture_checks=(check_fused_qkv_query_is_a_strided_view, check_empty_merge_sides_hold_garbage,
                    check_empty_chunk_case_separates_short_from_long_sequences,
                    check_spread_chunks_make_the_chunk_lses_differ, check_last_tokens_score_highest,
                    check_worked_example_case_is_the_pages_row),
)
