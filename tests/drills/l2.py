"""L2, paged decode attention (content/l2.md): everything the tests, the grader,
the bench and the pictures know about this drill, top to bottom in this order:
the page's worked example, the reference and the online softmax it explains, the
case builder, the hypothesis strategy, the checks and their diagnosis, the
pitfalls, the bench work, the picture, the page checks, and the manifest entry
`DRILL`.
"""
import ast
import math
import os
import re
from dataclasses import dataclass

import pytest
import torch
from hypothesis import strategies as st
from rich.table import Table
from rich.text import Text

import _env
import _wrong
from _diagnose import Mismatch, output_of, reproduces
from _drill import ELEMENT_SIZE, BenchCase, Drill, Mistake, Pitfall
from _paged import (DTYPES, allocate_blocks, guarded_nan, guarded_table, nan_outside, never_written, noise,
                    owned_columns, poisoned_out)
from _pages import section
from _traffic import Part, check_page_line, measure, report, was_read
from _tree import load_drill

TEST_SHAPES = dict(max_seqs=4, max_context=200, max_kv_heads=2, gqa_ratios=(1, 4, 8), head_sizes=(3, 8, 16, 24, 40),
                   block_sizes=(16, 32))

# ---------------------------------------------------------------------------
# L2: paged decode attention

# The example content/l2.md §3 works by hand (tests/test_content.py checks the page
# against it): one sequence, one head, D = 1, scale = 1, so each token's key *is*
# its score. Block size 2: two blocks of two tokens, in physical blocks 3 and 1.
DECODE_EXAMPLE = dict(block_size=2, block_table=[[3, 1]], num_blocks=4,
                      scores=[1.0, 3.0, 4.0, 2.0], values=[1.0, 2.0, 3.0, 4.0])


def decode_scores_values(query, k_cache, v_cache, block_table, seq_lens, scale=None, kv_head=None):
    """Per sequence, (scores [H_q, n] · scale, values [H_q, n, D]) in fp32 on the CPU:
    gather the sequence's blocks through the block table, keep its first n = seq_len
    tokens, give query head h the KV head kv_head[h] (default h // (H_q / H_kv)).
    """
    num_seqs, num_heads, head_size = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    scale = 1.0 / math.sqrt(head_size) if scale is None else scale
    kv_head = (torch.arange(num_heads) // (num_heads // num_kv_heads) if kv_head is None else kv_head).cpu()
    owned = owned_columns(seq_lens, block_size, block_table.shape[1])
    result = []
    for b in range(num_seqs):
        n = int(seq_lens[b])
        blocks = block_table[b].cpu()[owned[b]].long().to(k_cache.device)
        k, v = (cache[blocks].flatten(0, 1)[:n].float().cpu()[:, kv_head] for cache in (k_cache, v_cache))
        scores = torch.einsum("hd,nhd->hn", query[b].float().cpu(), k) * scale
        result.append((scores, v.transpose(0, 1)))
    return result


def ref_paged_decode(query, k_cache, v_cache, block_table, seq_lens, scale=None, kv_head=None):
    """The reference of L2: softmax(q·K^T · scale) · V for each sequence and query head,
    in fp32, from the K/V gathered through the block table. Returns [B, H_q, D] fp32 (CPU).

    `kv_head` replaces the GQA mapping and other `seq_lens` than the true ones
    attend over more or fewer tokens: the diagnosis tries such mistakes.
    """
    out = torch.empty(query.shape)
    for b, (scores, values) in enumerate(decode_scores_values(query, k_cache, v_cache, block_table, seq_lens,
                                                             scale, kv_head)):
        out[b] = torch.einsum("hn,hnd->hd", scores.softmax(dim=-1), values)
    return out


def online_softmax(scores, values, tile, rescale_sum=True, rescale_acc=True, zero_scores=False):
    """content/l2.md §3's online softmax over tiles of `tile` tokens: scores [H, n], values
    [H, n, D] in fp32. Returns the state after each tile, [(m, alpha, p, l, acc)], so the
    page's worked example can be checked step by step; the output is acc / l of the last.

    The flags replay a kernel's mistakes for the diagnosis: no rescaling of the running
    sum and/or accumulator when the max grows, or the positions past n in the last tile
    left at score 0 (value 0) instead of -inf.
    """
    heads, n = scores.shape
    if zero_scores:
        pad = -n % tile
        scores = torch.cat([scores, scores.new_zeros(heads, pad)], dim=1)
        values = torch.cat([values, values.new_zeros(heads, pad, values.shape[2])], dim=1)
    m = torch.full((heads,), float("-inf"))
    l, acc, steps = torch.zeros(heads), torch.zeros(heads, values.shape[2]), []
    for start in range(0, scores.shape[1], tile):
        s, v = scores[:, start:start + tile], values[:, start:start + tile]
        m_new = torch.maximum(m, s.max(dim=1).values)
        alpha = torch.exp(m - m_new)
        p = torch.exp(s - m_new[:, None])
        l = (l * alpha if rescale_sum else l) + p.sum(dim=1)
        acc = (acc * alpha[:, None] if rescale_acc else acc) + torch.einsum("hn,hnd->hd", p, v)
        m = m_new
        steps.append((m, alpha, p, l, acc))
    return steps


@dataclass
class DecodeCase:
    """One call of paged_decode_attention, with what is needed to check and explain it."""

    query: torch.Tensor        # [B, H_q, D], possibly a row-strided view
    k_cache: torch.Tensor      # [num_blocks, block_size, H_kv, D]; unowned blocks hold NaN
    v_cache: torch.Tensor
    block_table: torch.Tensor  # [B, max_blocks] int32; garbage columns and the guard after it point at NaN blocks
    seq_lens: torch.Tensor     # [B] int32
    scale: float = None        # None: the function's default 1/sqrt(D)
    tail: str = "noise"        # what the unused end of each last block holds: "noise" or "nan"
    guarded: bool = False      # the query and the block table are followed in memory by NaN / NaN blocks

    @property
    def block_size(self):
        return self.k_cache.shape[1]

    def args(self):
        return self.query, self.k_cache, self.v_cache, self.block_table, self.seq_lens

    def kwargs(self):
        return {} if self.scale is None else {"scale": self.scale}

    def scores_values(self, seq_lens=None, scale=None, kv_head=None):
        return decode_scores_values(self.query, self.k_cache, self.v_cache, self.block_table,
                                    self.seq_lens if seq_lens is None else seq_lens,
                                    self.scale if scale is None else scale, kv_head)

    def reference(self, seq_lens=None, scale=None, kv_head=None):
        """ref_paged_decode on this case; the arguments replace the case's own."""
        return ref_paged_decode(self.query, self.k_cache, self.v_cache, self.block_table,
                                self.seq_lens if seq_lens is None else seq_lens,
                                self.scale if scale is None else scale, kv_head)



def paged_decode_case(seq_lens, *, num_heads, num_kv_heads, head_size, block_size, dtype=torch.float16,
                      scale=None, spare_blocks=2, extra_columns=2, tail="noise", layout="contiguous",
                      device="cpu", seed=0):
    """A decode step of len(seq_lens) sequences over caches built by `allocate_blocks`.

    Owned blocks hold noise. Blocks no sequence owns hold NaN, and every garbage
    block-table column (and the guard after the table) points at one of them, so
    a kernel that reads past a sequence's last block returns NaN. A contiguous
    query is followed in memory by NaN too (`guarded`). The unused end
    of each last block holds `tail`: "noise" (stale tokens: reading them gives a
    finite, wrong answer) or "nan". `layout="fused_qkv"` makes the query a
    row-strided view of [B, (H_q + 2 H_kv) D], as vLLM's q split from qkv.
    """
    gen = torch.Generator().manual_seed(seed)
    table, num_blocks = allocate_blocks(seq_lens, block_size, gen, max(spare_blocks, 1), extra_columns)
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    k_cache, v_cache = noise(shape, torch.float32, "cpu", gen), noise(shape, torch.float32, "cpu", gen)
    spare = nan_outside(k_cache, table, seq_lens, block_size, tail)
    nan_outside(v_cache, table, seq_lens, block_size, tail)

    num_seqs, hd = len(seq_lens), num_heads * head_size
    if layout == "fused_qkv":  # query = qkv[:, :H_q*D]: row stride (H_q + 2 H_kv) * D
        qkv = noise((num_seqs, hd + 2 * num_kv_heads * head_size), dtype, device, gen)
        query = qkv[:, :hd].view(num_seqs, num_heads, head_size)
    elif layout == "contiguous":
        query = guarded_nan(noise((num_seqs, num_heads, head_size), dtype, "cpu", gen), device)
    else:
        raise ValueError(f"unknown layout {layout!r}")
    return DecodeCase(query=query, k_cache=k_cache.to(dtype=dtype, device=device),
                      v_cache=v_cache.to(dtype=dtype, device=device), block_table=guarded_table(table, spare, gen, device),
                      seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device), scale=scale, tail=tail,
                      guarded=layout == "contiguous")


def decode_example_case(device="cpu"):
    """content/l2.md §3's example as a DecodeCase: keys are the scores (q = 1, D = 1, scale = 1)."""
    ex = DECODE_EXAMPLE
    table, block_size, n = torch.tensor(ex["block_table"], dtype=torch.int32), ex["block_size"], len(ex["scores"])
    k_cache, v_cache = torch.zeros(ex["num_blocks"], block_size, 1, 1), torch.zeros(ex["num_blocks"], block_size, 1, 1)
    for pos in range(n):
        k_cache[table[0, pos // block_size], pos % block_size] = ex["scores"][pos]
        v_cache[table[0, pos // block_size], pos % block_size] = ex["values"][pos]
    spare = nan_outside(k_cache, table, [n], block_size, "noise")
    nan_outside(v_cache, table, [n], block_size, "noise")
    return DecodeCase(query=guarded_nan(torch.ones(1, 1, 1), device), k_cache=k_cache.to(device),
                      v_cache=v_cache.to(device),
                      block_table=guarded_table(table, spare, torch.Generator().manual_seed(0), device),
                      seq_lens=torch.tensor([n], dtype=torch.int32, device=device), scale=1.0, guarded=True)


def small_case(device, seq_lens, **kwargs):
    """The tests' usual shape: 8 query heads over 2 KV heads, D = 16, blocks of 16."""
    shape = dict(num_heads=8, num_kv_heads=2, head_size=16, block_size=16)
    return paged_decode_case(seq_lens, **{**shape, **kwargs}, device=device)


def large_logits_case(device):
    """Sequence 1's logits reach a few hundred, where exp() overflows float16 and float32
    alike; sequence 0's stay small (tests/test_fixtures.py checks both)."""
    case = small_case(device, [40, 70], seed=9)
    case.query[1] *= 60
    return case


def rising_scores_case(device):
    """Long sequences whose scores keep growing, so the running max moves on every tile."""
    case = small_case(device, [200, 150], seed=10)
    group = case.query.shape[1] // case.k_cache.shape[2]
    for b, n in enumerate(case.seq_lens.tolist()):
        blocks = case.block_table[b, :math.ceil(n / case.block_size)].long()
        ramp = torch.linspace(0, 3, blocks.numel() * case.block_size, device=device).view(-1, case.block_size, 1, 1)
        # Token t's key gains ramp[t] times the query of its KV head's first query head.
        k = case.k_cache[blocks].float() + ramp * case.query[b, ::group].float()
        case.k_cache[blocks] = k.to(case.k_cache.dtype)
    return case


def new_token_first_case(device):
    """The new (last) token of each sequence scores highest, so leaving it out moves every output."""
    case = small_case(device, [3, 17, 32], seed=15)
    group = case.query.shape[1] // case.k_cache.shape[2]
    for b, n in enumerate(case.seq_lens.tolist()):
        block, offset = case.block_table[b, (n - 1) // case.block_size].long(), (n - 1) % case.block_size
        case.k_cache[block, offset] = 3 * case.query[b, ::group]  # the last token's key, per KV head
    return case


FAR = 1 << 28  # a block number far past any test cache: block * block_size * H_kv * D passes 2**36


def far_garbage_case(device):
    """Every block-table entry past a sequence's last block names a block far past the
    cache's end (sequence 0 uses its whole row, so it has none)."""
    case = small_case(device, [64, 16, 1, 20], extra_columns=0, seed=17)
    table = case.block_table.clone()
    table[~owned_columns(case.seq_lens, case.block_size, table.shape[1]).to(table.device)] = FAR
    return DecodeCase(query=case.query, k_cache=case.k_cache, v_cache=case.v_cache, block_table=table,
                      seq_lens=case.seq_lens, guarded=False)


@st.composite
def paged_decode_params(draw, dtypes=tuple(DTYPES)):
    """Keyword arguments for paged_decode_case, within L2's test shapes."""
    shapes = TEST_SHAPES
    block_size = draw(st.sampled_from(shapes["block_sizes"]))
    num_seqs = draw(st.integers(1, shapes["max_seqs"]))
    # The lengths where kernels go wrong: one token, exactly full blocks, one token
    # into a new block, and long enough for several iterations of any tile size.
    special = st.sampled_from([1, block_size, 2 * block_size, block_size + 1, shapes["max_context"]])
    seq_lens = draw(st.lists(special | st.integers(1, shapes["max_context"]), min_size=num_seqs, max_size=num_seqs))
    num_kv_heads = draw(st.integers(1, shapes["max_kv_heads"]))
    return dict(
        seq_lens=seq_lens, block_size=block_size, num_kv_heads=num_kv_heads,
        num_heads=num_kv_heads * draw(st.sampled_from(shapes["gqa_ratios"])),
        head_size=draw(st.sampled_from(shapes["head_sizes"])),
        dtype=DTYPES[draw(st.sampled_from(dtypes))],
        scale=draw(st.none() | st.floats(0.01, 1.0)),
        tail=draw(st.sampled_from(["noise", "nan"])),
        layout=draw(st.sampled_from(["contiguous", "fused_qkv"])),
        spare_blocks=draw(st.integers(1, 3)),
        extra_columns=draw(st.integers(0, 3)),
        seed=draw(st.integers(0, 2**31 - 1)),
    )



# ---------------------------------------------------------------------------
# Checks and their diagnosis


# (atol, rtol) against the fp32 reference. 16-bit runs round p to the value
# dtype before p·V (as the tensor cores want) and round the output once; fp32
# runs compute in fp32 throughout ("ieee" dot products, no TF32).
DECODE_TOLERANCE = {torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.5e-2, 1.5e-2), torch.float32: (1e-4, 1e-4)}
_TILES = (16, 32, 64, 128, 256)  # tile sizes a kernel may use: mistakes that depend on it are tried with each


def check_paged_decode(case, out, returned=None):
    """paged_decode_attention's output against the reference, (sequence, query head) by
    (sequence, query head). `out` is the Guarded buffer passed as out= (or, for a call
    without out=, the tensor returned). The output contract is checked first, then
    non-finite outputs are reported as such, then wrong values are explained by the
    mistake that reproduces them (content/l2.md §7), naming one only on evidence."""
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
        return (f"{head}: every output is NaN or inf, so no single planted NaN explains it; look for a division by "
                f"zero (l = 0), exp of +inf (a sign flipped in exp(m_old - m_new)?), or a read outside the inputs "
                f"(content/l2.md §3, §5)"), None
    causes = [name for name in _NAN_CAUSES if _variant_reproduces(case, name, got, bad, atol, rtol)]
    if len(causes) == 1:
        name = causes[0]
        return f"{head}; {_NAN_CAUSES[name]} (pitfall:{name}, content/l2.md §7)", name
    return (f"{head}, in some outputs only; none of the page's NaN mistakes reproduces exactly these: a read outside "
            f"the inputs, an unmasked load, or an overflowing exp (content/l2.md §5, §7)"), None


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
        theirs = _wrong.variant(DRILL, name).paged_decode_attention(*case.args(), **case.kwargs()).float().cpu()
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
                    f"something else (content/l2.md §7)"), None
        named = f" (pitfall:{tag}, content/l2.md §7)" if tag else " (content/l2.md §5)"
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


# ---------------------------------------------------------------------------
# The pitfalls of content/l2.md §7, as edits that plant each in the reference

_WHOLE_LAST_BLOCK = "pos < tl.cdiv(seq_len, BLOCK_SIZE) * BLOCK_SIZE"
_WHOLE_ROW = "pos < table_stride * BLOCK_SIZE"

PITFALLS = {
    "no_last_block_mask": Pitfall(says="the tokens past seq_len in the last block are not masked out of the softmax", edits=[
        ("live = pos < seq_len", f"live = {_WHOLE_LAST_BLOCK}"),
    ]),
    "unmasked_loads": Pitfall(says="K/V are loaded for the whole last block; only the scores are masked, and 0 * NaN = NaN", edits=[
        ("pos // BLOCK_SIZE, mask=live, other=0)", f"pos // BLOCK_SIZE, mask={_WHOLE_LAST_BLOCK}, other=0)"),
        ("kv_mask = live[:, None] & (dims < HEAD_SIZE)[None, :]",
         f"kv_mask = ({_WHOLE_LAST_BLOCK})[:, None] & (dims < HEAD_SIZE)[None, :]"),
    ]),
    "reads_past_seq_len": Pitfall(says="the whole block-table row is read, garbage columns past ceil(seq_len / block_size) included", edits=[
        ("pos // BLOCK_SIZE, mask=live, other=0)", f"pos // BLOCK_SIZE, mask={_WHOLE_ROW}, other=0)"),
        ("kv_mask = live[:, None] & (dims < HEAD_SIZE)[None, :]",
         f"kv_mask = ({_WHOLE_ROW})[:, None] & (dims < HEAD_SIZE)[None, :]"),
    ], crashes=True),
    "off_by_one": Pitfall(says="only seq_len - 1 tokens are attended: seq_len already counts the new token", edits=[
        ("live = pos < seq_len", "live = pos < seq_len - 1"),
    ]),
    "wrong_gqa_mapping": Pitfall(says="query head h is paired with KV head h % H_kv instead of h // (H_q / H_kv)", edits=[
        ("heads = kv_head * GROUP + rows", "heads = kv_head + rows * NUM_KV_HEADS"),
    ]),
    "missing_scale": Pitfall(says="the scores are not multiplied by scale", edits=[
        ('s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale', 's = tl.dot(q, tl.trans(k), input_precision="ieee")'),
    ]),
    "no_running_max": Pitfall(says="the softmax takes exp of the raw scores, without subtracting the running max", edits=[
        ("m_new = tl.maximum(m, tl.max(s, axis=1))", "m_new = tl.zeros([GROUP_PAD], tl.float32)"),
    ]),
    "no_rescale": Pitfall(says="the running sum and accumulator are not rescaled by exp(m_old - m_new) when the max grows", edits=[
        ("alpha = tl.exp(m - m_new)", "alpha = tl.full([GROUP_PAD], 1.0, tl.float32)"),
    ]),
    "unmasked_head_size": Pitfall(says="the query's padded lanes past D are loaded without a mask", edits=[
        ("                mask=q_mask, other=0.0)", "                mask=(rows < GROUP)[:, None] & (dims < D_PAD)[None, :], other=0.0)"),
    ]),
    "query_stride_ignored": Pitfall(says="query rows are read H_q*D apart instead of query.stride(0) apart, so fused-QKV views read the wrong rows", edits=[
        ("query_ptr + seq * query_stride + heads", "query_ptr + seq * NUM_HEADS * HEAD_SIZE + heads"),
    ]),
    "int32_offsets": Pitfall(says="cache offsets are computed in int32 and wrap around once slot * H_kv * D passes 2**31", edits=[
        ("seq = tl.program_id(0).to(tl.int64)", "seq = tl.program_id(0)"),
        ("kv_head = tl.program_id(1).to(tl.int64)", "kv_head = tl.program_id(1)"),
        ("slot = block.to(tl.int64) * BLOCK_SIZE", "slot = block.to(tl.int32) * BLOCK_SIZE"),
    ], crashes=True),
}

_STORE = "tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=q_mask)"

# Wrong kernels that are none of the page's pitfalls: the grade must fail each and
# name nothing, saying what is wrong instead.
MISTAKES = {
    "rescale_sign_flipped": Mistake(shows="every output is NaN or inf", edits=(
        ("alpha = tl.exp(m - m_new)", "alpha = tl.exp(m_new - m)"),
    )),
    "store_forgotten": Mistake(shows="never written", edits=(
        (_STORE, "pass  # planted: the store is forgotten"),
    )),
    "last_partial_block_dropped": Mistake(shows="only full blocks were read", edits=(
        ("live = pos < seq_len",
         "live = pos < tl.where(seq_len >= BLOCK_SIZE, seq_len // BLOCK_SIZE * BLOCK_SIZE, seq_len)"),
    )),
    "never_writes_last_head": Mistake(shows="never written", edits=(
        (_STORE, _STORE.replace("mask=q_mask", "mask=q_mask & (heads < NUM_HEADS - 1)[:, None]")),
    )),
    "writes_past_out": Mistake(shows="written past the end of out", edits=(
        (_STORE, _STORE.replace("mask=q_mask", "mask=(dims < HEAD_SIZE)[None, :]")),
    )),
}


# ---------------------------------------------------------------------------
# The bench


def decode_bytes(num_seqs, num_heads, num_kv_heads, head_size, context, block_size, dtype, **_):
    """The K and V of every cached token read once, the query read and the output
    written once, plus each sequence's block-table row and length."""
    size = ELEMENT_SIZE[dtype]
    kv = 2 * num_seqs * context * num_kv_heads * head_size * size
    q_and_out = 2 * num_seqs * num_heads * head_size * size
    return kv + q_and_out + 4 * num_seqs * -(-context // block_size) + 4 * num_seqs


def decode_flops(num_seqs, num_heads, context, head_size, **_):
    """q·k and p·v, a multiply and an add each, per query head and cached token."""
    return 4 * num_seqs * num_heads * context * head_size


def _bench_case(num_seqs, graph):
    params = dict(num_seqs=num_seqs, num_heads=32, num_kv_heads=8, head_size=128, context=4096, block_size=16,
                  dtype="float16")
    return BenchCase(f"B={num_seqs}", params, decode_bytes(**params), decode_flops(**params), graph=graph)


def bench_work(module, params, device, n_sets):
    """`n_sets` independent decode steps over one block pool, for the bandwidth report.

    Every sequence holds `context` tokens in blocks scattered at random over a
    pool no smaller than n_sets * B * context tokens, so no two sets share a block
    and the L2 cache holds none of them. Returns (ours, {name: (baseline, graph_safe)}).
    """
    num_seqs, context, block_size = params["num_seqs"], params["context"], params["block_size"]
    num_heads, num_kv_heads, head_size = params["num_heads"], params["num_kv_heads"], params["head_size"]
    dtype = DTYPES[params["dtype"]]
    blocks_per_seq = math.ceil(context / block_size)
    num_blocks = n_sets * num_seqs * blocks_per_seq
    k_cache = torch.randn((num_blocks, block_size, num_kv_heads, head_size), dtype=dtype, device=device)
    v_cache = torch.randn_like(k_cache)
    pool = torch.randperm(num_blocks, device=device).to(torch.int32).view(n_sets, num_seqs, blocks_per_seq)
    seq_lens = torch.full((num_seqs,), context, dtype=torch.int32, device=device)
    sets = [(torch.randn(num_seqs, num_heads, head_size, dtype=dtype, device=device), pool[i].contiguous())
            for i in range(n_sets)]

    def gathered(cache, table):
        # [B, max_blocks, block_size, H_kv, D] -> [B, H_kv, context, D], as SDPA wants it
        return cache[table.long()].flatten(1, 2)[:, :context].transpose(1, 2)

    def sdpa(query, k, v):
        out = torch.nn.functional.scaled_dot_product_attention(query.unsqueeze(2), k, v, enable_gqa=True)
        return out.squeeze(2)

    # What paging should cost: nothing. The same K/V already contiguous per sequence.
    contiguous = [(q, gathered(k_cache, t).contiguous(), gathered(v_cache, t).contiguous()) for q, t in sets]

    def ours():
        for query, table in sets:
            module.paged_decode_attention(query, k_cache, v_cache, table, seq_lens)

    def gather_sdpa():
        # The naive paged baseline: copy each sequence's pages out, then attend.
        for query, table in sets:
            sdpa(query, gathered(k_cache, table), gathered(v_cache, table))

    def sdpa_contiguous():
        for query, k, v in contiguous:
            sdpa(query, k, v)

    return ours, {"gather + SDPA": (gather_sdpa, True), "SDPA, contiguous KV": (sdpa_contiguous, True)}


# ---------------------------------------------------------------------------
# The picture: which (sequence, query head) outputs are right, and the blocks each sequence owns


def _keep_for_picture(case, got):
    """Save the first failing case small enough to draw where the grader asked (DRILLS_CASE_DUMP)."""
    path = os.environ.get("DRILLS_CASE_DUMP")
    if path and not os.path.exists(path) and case.query.shape[0] <= 8 and case.query.shape[1] <= 32:
        torch.save((case, got), path)


def draw_case(saved, console):
    """A case that already ran: one row per sequence, one cell per query head."""
    case, got = saved
    want = case.reference()
    atol, rtol = DECODE_TOLERANCE[case.query.dtype]
    right = _close(got.float().cpu(), want, atol, rtol)
    unwritten = never_written(got.cpu()).all(dim=-1) if got.is_floating_point() else torch.zeros_like(right)
    num_heads, group = case.query.shape[1], case.query.shape[1] // case.k_cache.shape[2]
    table = Table(header_style="bold", box=None, padding=(0, 1))
    table.add_column("seq")
    table.add_column("seq_len")
    table.add_column("blocks it reads (block_table row, owned columns)")
    for h in range(num_heads):
        table.add_column(f"h{h}" + ("|" if (h + 1) % group == 0 and h + 1 < num_heads else ""), justify="center")
    owned = owned_columns(case.seq_lens, case.block_size, case.block_table.shape[1])
    for b in range(case.query.shape[0]):
        cells = []
        for h in range(num_heads):
            if unwritten[b, h]:
                cells.append(Text("·", style="bold white on red"))
            elif not torch.isfinite(got[b, h].float()).all():
                cells.append(Text("NaN", style="bold red"))
            else:
                cells.append(Text("✓", style="green") if right[b, h] else Text("✗", style="bold red"))
        blocks = case.block_table[b].cpu()[owned[b]].tolist()
        table.add_row(str(b), str(int(case.seq_lens[b])), str(blocks), *cells)
    console.print(f"[dim]H_q={num_heads}, H_kv={case.k_cache.shape[2]} (| separates the query heads of one KV "
                  f"head), D={case.query.shape[2]}, block_size={case.block_size}[/]")
    console.print(table)
    console.print("[dim]✓ right   ✗ wrong   NaN non-finite   ·: never written (still the NaN out= held)[/]")


def picture(module, console):
    """Your kernel on a small GQA batch: sequences of 5, 17 and 33 tokens (a partial
    last block, one token into a new block, several blocks), NaN past each end."""
    case = small_case(_env.DEVICE, [5, 17, 33], tail="nan", seed=3)
    out = poisoned_out(case.query.shape, case.query.dtype, case.query.device, torch.Generator().manual_seed(0))
    try:
        module.paged_decode_attention(*case.args(), **case.kwargs(), out=out.view)
    except Exception as error:  # the picture must draw whatever the learner's code does
        console.print(f"[red]paged_decode_attention raised {type(error).__name__}: {error}[/]")
    draw_case((case, out.view), console)


# ---------------------------------------------------------------------------
# The traffic report (tests/_traffic.py): bytes moved under the CPU interpreter

# The bench's shape (32 query heads over 8 KV heads, D = 128, blocks of 16, one
# context for every sequence) shrunk to interpreter size: the same GQA group of 4, a
# partial last block, and garbage block-table columns past it.
TRAFFIC_CASE = dict(num_seqs=4, num_heads=8, num_kv_heads=2, head_size=32, context=72, block_size=16,
                    dtype="float16")


def traffic_case(device="cpu"):
    p = TRAFFIC_CASE
    return paged_decode_case([p["context"]] * p["num_seqs"], num_heads=p["num_heads"], num_kv_heads=p["num_kv_heads"],
                             head_size=p["head_size"], block_size=p["block_size"], dtype=DTYPES[p["dtype"]],
                             extra_columns=2, device=device, seed=5)


def garbage_entries_read(case, traffic, record=3):
    """(sequence, column) of every block-table entry past a sequence's last block that was
    loaded: those entries are garbage (design.md), and reading one is reads_past_seq_len."""
    owned = owned_columns(case.seq_lens, case.block_size, case.block_table.shape[1])
    return [(b, c) for b, c in (~owned).nonzero().tolist()
            if was_read(traffic.tensors[record], case.block_table[b, c])]


def check_table_read_only_to_last_block(module, case):
    """Run paged_decode_attention on `case` with its loads counted: no block-table entry past
    a sequence's last block may be loaded, even when the K/V loads are masked so that the
    answer comes out right (design.md: those entries are garbage). Returns False where
    nothing can be counted (a GPU), True when checked."""
    out = poisoned_out(case.query.shape, case.query.dtype, case.query.device, torch.Generator().manual_seed(0))
    returned, counted = measure(module, "paged_decode_attention", *case.args(), **case.kwargs(), out=out.view)
    if counted is None:
        return False
    garbage = garbage_entries_read(case, counted)
    if garbage:
        b, c = garbage[0]
        raise Mismatch(f"block_table[{b}, {c}] was loaded, but sequence {b} has seq_len {int(case.seq_lens[b])}: its "
                       f"last block is column {-(-int(case.seq_lens[b]) // case.block_size) - 1}, and the entries "
                       f"past it are garbage ({len(garbage)} such entries loaded); mask the block-table load with "
                       f"pos < seq_len (content/l2.md §7)", ["reads_past_seq_len"])
    check_paged_decode(case, out, returned)
    return True


def traffic_parts(p):
    """The fewest bytes of a decode step, tensor by tensor; they sum to decode_bytes (the
    bandwidth report's count). The indices are the tensors' places in the call."""
    size = ELEMENT_SIZE[p["dtype"]]
    kv = 2 * p["num_seqs"] * p["context"] * p["num_kv_heads"] * p["head_size"] * size
    rows = p["num_seqs"] * p["num_heads"] * p["head_size"] * size
    parts = [Part("K/V", (1, 2), fewest_loaded=kv), Part("query", (0,), fewest_loaded=rows),
             Part("block table", (3,), fewest_loaded=4 * p["num_seqs"] * -(-p["context"] // p["block_size"])),
             Part("seq_lens", (4,), fewest_loaded=4 * p["num_seqs"]),
             Part("out", (5,), fewest_stored=rows)]
    assert sum(x.fewest_loaded + x.fewest_stored for x in parts) == decode_bytes(**p)
    return parts


def traffic_where(result, case, counted, section):
    """Where a decode kernel's extra bytes went, in the words of content/l2.md."""
    group = case.query.shape[1] // case.k_cache.shape[2]
    kv, table = result["parts"]["K/V"], result["parts"]["block table"]
    where = []
    if kv > 1.5 and group > 1 and abs(kv - group) < 0.25 * group:
        where.append(f"K and V are read {kv:.0f}× — once per query head; content/l2.md §5 reads them once per "
                     f"KV head, for its {group} query heads at once (GQA)")
    elif kv > 1.05:
        where.append(f"K and V are read {kv:.2f}× their size: each cached token's K/V once per KV head is enough")
    # Each KV head's program reads its sequence's owned entries once: H_kv× a tiny table.
    if table > 2 * max(kv, 1) * case.k_cache.shape[2]:
        where.append(f"the block table was read once per token instead of once per block ({table:.0f}× its owned "
                     f"entries): load a tile's entries in one tl.load, lanes of one block share an entry")
    garbage = garbage_entries_read(case, counted)
    if garbage:
        where.append(f"block-table entries past a sequence's last block were read ({len(garbage)} of them, first: "
                     f"sequence {garbage[0][0]}, column {garbage[0][1]}): they are garbage; mask the table load "
                     f"with pos < seq_len ({section}, pitfall:reads_past_seq_len)")
    if result["parts"]["query"] > 1.05:
        where.append(f"the query was read {result['parts']['query']:.2f}×: each program reads its heads' rows once")
    return where


def traffic(module):
    """paged_decode_attention on TRAFFIC_CASE, its bytes against decode_bytes (the bandwidth
    report's count), with where the extra bytes went in L2's words."""
    case = traffic_case()
    out = torch.empty_like(case.query)
    _, counted = measure(module, "paged_decode_attention", *case.args(), out=out)
    if counted is None:
        return None
    result = report(DRILL.id, counted, traffic_parts(TRAFFIC_CASE))
    result["where"] = traffic_where(result, case, counted, DRILL.section) + result["where"]
    return result


# ---------------------------------------------------------------------------
# Page checks: every number content/l2.md works out



def check_worked_example(text):
    """§3: the token table, every number of the step table, and the output, against the
    example the tests run (DECODE_EXAMPLE), the reference and the solution's kernel."""
    ex = DECODE_EXAMPLE
    assert ast.literal_eval(re.search(r"`block_table = (\[\[[\d, ]+\]\])`", text).group(1)) == ex["block_table"]
    assert int(re.search(r"block_size = (\d+)。为了", text).group(1)) == ex["block_size"]
    row = {name: [int(n) for n in re.findall(r"\d+", cells)]
           for name, cells in re.findall(r"^\| (物理块|分数 s|值 v) \|(.*)\|$", text, re.M)}
    table, bs = ex["block_table"][0], ex["block_size"]
    assert row["物理块"] == [table[pos // bs] for pos in range(len(ex["scores"]))]
    assert row["分数 s"] == ex["scores"] and row["值 v"] == ex["values"]

    steps = re.findall(r"^\| 物理块 (\d+) \| ([\d, ]+) \| (\d+) \| ([\d.]+) \| ([\d., ]+) \| ([\d.]+) \| ([\d.]+) \|$",
                       text, re.M)
    want = online_softmax(torch.tensor([ex["scores"]]), torch.tensor([ex["values"]])[..., None], tile=bs)
    assert len(steps) == len(want) == len(table)
    for i, ((block, shown, m_new, alpha, p, l, acc), (m2, alpha2, p2, l2, acc2)) in enumerate(zip(steps, want)):
        assert int(block) == table[i] and [float(s) for s in shown.split(",")] == ex["scores"][i * bs:(i + 1) * bs]
        assert float(m_new) == float(m2)
        assert float(alpha) == pytest.approx(float(alpha2), abs=1e-4)
        assert [float(x) for x in p.split(",")] == pytest.approx(p2[0].tolist(), abs=1e-4)
        assert (float(l), float(acc)) == pytest.approx((float(l2), float(acc2)), abs=1e-4)

    # The log-sum-exp L4 needs: m + log l, which is log of the sum of exp(score).
    m, l, lse = re.search(r"lse = m \+ log l = (\d+) \+ ln ([\d.]+) ≈ ([\d.]+)", text).groups()
    assert (float(m), float(l)) == (float(want[-1][0]), pytest.approx(float(want[-1][3]), abs=1e-4))
    assert float(lse) == pytest.approx(math.log(sum(math.exp(s) for s in ex["scores"])), abs=1e-4)

    shown_out = float(re.search(r"≈ \*\*([\d.]+)\*\*", text).group(1))
    case = decode_example_case(device=_env.DEVICE)  # the solution's kernel runs where kernels run here
    assert shown_out == pytest.approx(float(case.reference()), abs=1e-4)
    assert shown_out == pytest.approx(float(want[-1][4] / want[-1][3]), abs=1e-4)
    out = load_drill("solutions", "l2_paged_decode").paged_decode_attention(*case.args(), **case.kwargs())
    check_paged_decode(case, out)


def check_bench_bytes_and_flops(text):
    """§2's totals are the manifest's, for the B=64 bench case."""
    section = text[text.index("## 2."):text.index("## 3.")]
    total = int(re.search(r"合计 (\d+) 字节", section).group(1))
    flops = int(re.search(r"FLOPs = [^\n]*?= (\d{5,})", section).group(1))
    params = next(c.params for c in DRILL.bench if c.params["num_seqs"] == 64)
    assert total == decode_bytes(**params) and flops == decode_flops(**params)
    intensity = float(re.search(r"÷ \d+ ≈ ([\d.]+) FLOP/字节", section).group(1))
    assert intensity == pytest.approx(flops / total, abs=0.05)


def _self_test(text, n):
    start = text.index(f"**自测 {n}**")
    end = text.find("**自测", start + 5)
    return text[start:end if end > 0 else text.index("## 11.")]


def check_self_test_online_update(text):
    q = _self_test(text, 1)
    m, l, acc = map(int, re.search(r"m = (\d+)、l = (\d+)、acc = (\d+)", q).groups())
    base, value = map(int, re.search(r"分数是 (\d+) \+ ln 2，值是 (\d+)", q).groups())
    l_new, acc_new = map(int, re.search(r"l = [^=]*= (\d+)，acc = [^=]*= (\d+)", q).groups())
    out = float(re.search(r"输出 = [^≈]*≈ ([\d.]+)", q).group(1))
    # A state (m, l, acc) is what a first tile of l tokens scoring m, whose values sum to acc, leaves behind.
    scores = torch.tensor([[float(m)] * l + [base + math.log(2)]], dtype=torch.float64)
    values = torch.tensor([[acc / l] * l + [float(value)]], dtype=torch.float64)[..., None]
    (_, _, _, l0, acc0), (_, _, _, l2, acc2) = online_softmax(scores, values, tile=l)
    assert (float(l0), float(acc0)) == pytest.approx((l, acc))
    assert (l_new, acc_new) == (pytest.approx(float(l2)), pytest.approx(float(acc2)))
    assert out == pytest.approx(float(acc2 / l2), abs=1e-4)


def check_self_test_small_batch_bytes(text):
    q = _self_test(text, 2)
    kv = int(re.search(r"K/V：[^=]*= (\d+) 字节", q).group(1))
    total = int(re.search(r"合计 (\d+) 字节", q).group(1))
    flops = int(re.search(r"FLOPs = [^=]*= (\d+)", q).group(1))
    params = next(c.params for c in DRILL.bench if c.params["num_seqs"] == 8)
    assert total == decode_bytes(**params) and flops == decode_flops(**params)
    assert kv == 2 * params["num_seqs"] * params["context"] * params["num_kv_heads"] * params["head_size"] * 2


def check_self_test_block_table_columns(text):
    q = _self_test(text, 3)
    block_size, seq_len, width = map(int, re.search(r"block_size = (\d+)，某条序列 seq_len = (\d+)，.*?一行有 (\d+) 列",
                                                    q).groups())
    columns = [int(c) for c in re.search(r"只读第 ([\d、]+) 列", q).group(1).split("、")]
    live, masked = map(int, re.search(r"= (\d+) 个有效 token，其余 (\d+) 个 slot", q).groups())
    owned = -(-seq_len // block_size)
    assert columns == list(range(owned)) and owned <= width
    assert live == seq_len - (owned - 1) * block_size and masked == block_size - live


def check_self_test_gqa_mapping(text):
    q = _self_test(text, 4)
    num_heads, num_kv_heads = map(int, re.search(r"H_q = (\d+)、H_kv = (\d+)", q).groups())
    head, its_kv = map(int, re.search(r"query head (\d+) 读 KV head \d+ // \d+ = (\d+)", q).group(1, 2))
    kv, heads = re.search(r"KV head (\d+) 的 program 负责 query head ([\d、]+)", q).groups()
    group = num_heads // num_kv_heads
    assert its_kv == head // group
    assert [int(h) for h in heads.split("、")] == [h for h in range(num_heads) if h // group == int(kv)]
    # The reference agrees: query head `head` attends with KV head `its_kv`'s keys.
    case = paged_decode_case([5], num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=4, block_size=4,
                             dtype=torch.float32)
    mapping = torch.full((num_heads,), its_kv)
    assert torch.allclose(case.reference()[0, head], case.reference(kv_head=mapping)[0, head])


def check_self_test_small_batch_grid(text):
    q = _self_test(text, 6)
    programs, idle = map(int, re.search(r"= (\d+) 个 program，至少 \d+ − \d+ = (\d+) 个 SM", q).groups())
    params = next(c.params for c in DRILL.bench if c.params["num_seqs"] == 8)
    assert programs == params["num_seqs"] * params["num_kv_heads"] and idle == 132 - programs


def check_self_test_split_lse(text):
    """Self-test 7: the lse of each half of §3's example, and their merge, which is the whole row's."""
    ex = DECODE_EXAMPLE
    q = _self_test(text, 7)
    halves = re.findall(r"m = (\d+)、l = ([\d.]+)，lse = \d+ \+ ln [\d.]+ ≈ ([\d.]+)", q)
    merged = float(re.search(r"合并：ln\(e\^[\d.]+ \+ e\^[\d.]+\) ≈ ([\d.]+)", q).group(1))
    bs = ex["block_size"]
    parts = [ex["scores"][i:i + bs] for i in range(0, len(ex["scores"]), bs)]
    assert len(halves) == len(parts)
    for (m, l, lse), scores in zip(halves, parts):
        assert float(m) == max(scores)
        assert float(l) == pytest.approx(sum(math.exp(s - max(scores)) for s in scores), abs=1e-4)
        assert float(lse) == pytest.approx(math.log(sum(math.exp(s) for s in scores)), abs=1e-4)
    assert merged == pytest.approx(math.log(sum(math.exp(s) for s in ex["scores"])), abs=1e-4)
    assert "lse = m + log l" in section(text, 3)


def check_int32_boundary(text):
    """§4: the 2 GiB fp16 cache's block count (int32 offsets still fit there)."""
    blocks = int(re.search(r"2 GiB 的 fp16 cache 有 (\d+) 个物理块", section(text, 4)).group(1))
    assert blocks * 16 * 8 * 128 * 2 == 2 * 2**30


def check_traffic_line(text):
    """§1's traffic line is what the reference's traffic case gives (run here, in the
    CPU interpreter; on a GPU there is nothing to count), and the case is the one described."""
    p = TRAFFIC_CASE
    assert p["num_heads"] // p["num_kv_heads"] == 4 and "H_q = 8、H_kv = 2" in text and "D = 32" in text
    assert (p["num_heads"], p["num_kv_heads"], p["head_size"], p["block_size"]) == (8, 2, 32, 16)
    check_page_line(text, "l2", traffic(load_drill("solutions", "l2_paged_decode")))


# ---------------------------------------------------------------------------
# Fixture checks: the builders make the cases the tests say they make (tests/test_fixtures.py)


def check_large_logits_overflow_exp_only_in_sequence_1(device):
    largest = [float(scores.max()) for scores, _ in large_logits_case(device).scores_values()]
    assert largest[0] < 11 and largest[1] > 120  # exp overflows float16 past 11.1, float32 past 88.7


def check_fused_qkv_query_is_a_strided_view(device):
    assert not small_case(device, [9, 33], layout="fused_qkv", seed=11).query.is_contiguous()


def check_far_garbage_points_past_the_cache_only_where_unowned(device):
    case = far_garbage_case(device)
    owned = owned_columns(case.seq_lens, case.block_size, case.block_table.shape[1]).to(case.block_table.device)
    assert bool((case.block_table[owned] < case.k_cache.shape[0]).all())
    assert bool((case.block_table[~owned] == FAR).all()) and bool(owned[0].all())


def check_new_token_scores_highest(device):
    """...for the first query head of each KV head, whose query the new token's key copies."""
    case = new_token_first_case(device)
    group = case.query.shape[1] // case.k_cache.shape[2]
    for scores, _ in case.scores_values():
        assert bool((scores[::group].argmax(dim=1) == scores.shape[1] - 1).all())


# ---------------------------------------------------------------------------

DRILL = Drill(
    id="l2",
    stem="l2_paged_decode",
    title="Paged decode attention",
    mirrors="vLLM paged attention v1 / Triton decode",
    api=("paged_decode_kernel", "paged_decode_attention"),
    section="content/l2.md §7",
    test_shapes=TEST_SHAPES,
    pitfalls=PITFALLS,
    mistakes=MISTAKES,
    # B=64 moves 1 GiB (about 250 us at 4.3 TB/s); B=8 moves 128 MiB, short enough that launch gaps count.
    bench=(_bench_case(64, graph=False), _bench_case(8, graph=True)),
    bench_work=bench_work,
    traffic=traffic,
    picture=picture,
    draw_case=draw_case,
    page_checks=(check_traffic_line, check_worked_example, check_bench_bytes_and_flops, check_self_test_online_update,
                 check_self_test_small_batch_bytes, check_self_test_block_table_columns, check_self_test_gqa_mapping,
                 check_self_test_small_batch_grid, check_self_test_split_lse, check_int32_boundary),
    fixture_checks=(check_large_logits_overflow_exp_only_in_sequence_1, check_fused_qkv_query_is_a_strided_view,
                    check_far_garbage_points_past_the_cache_only_where_unowned, check_new_token_scores_highest),
)


def _case_for_mutations(device, seed):
    """A case for the diagnosis's own property test: GQA, a partial last block, NaN tails."""
    return paged_decode_case([5, 37, 64], num_heads=8, num_kv_heads=2, head_size=16, block_size=16, tail="nan",
                             device=device, seed=seed)
