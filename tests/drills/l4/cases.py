"""L4's cases: TEST_SHAPES, the page's worked examples, the split-decode and merge cases
and their builders, the hypothesis strategies, and the fixture checks of the builders."""
import math
from dataclasses import dataclass

import torch
from hypothesis import strategies as st

from _paged import DTYPES, allocate_blocks, guarded_nan, guarded_table, nan_outside, noise, owned_columns

from .reference import LN2, chunk_bounds, chunk_states, ref_merge, ref_split_decode

TEST_SHAPES = dict(max_seqs=4, max_context=200, max_kv_heads=2, gqa_ratios=(1, 3, 4, 5, 6), head_sizes=(3, 8, 16, 40),
                   block_sizes=(16, 32), max_splits=12)


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


def one_side_empty_case(empty, device="cpu", seed=7):
    """Four rows of two heads: rows 1 to 3 of side `empty` ("a" or "b") are empty (s = -inf,
    v NaN garbage); row 0 has both sides, so a merge that mixes up the two weights is
    wrong there, where no side is empty."""
    case = merge_case(rows=4, heads=2, head_size=8, device=device, seed=seed)
    s, v = (case.s_a, case.v_a) if empty == "a" else (case.s_b, case.v_b)
    s[1:] = float("-inf")
    v[1:] = float("nan")
    return case


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


def check_one_side_empty_case_has_a_row_with_both_sides(device):
    for empty in ("a", "b"):
        case = one_side_empty_case(empty, device)
        gone = torch.isinf(case.s_a if empty == "a" else case.s_b).cpu()
        kept = case.s_b if empty == "a" else case.s_a
        assert gone[1:].all() and not gone[0].any() and bool(torch.isfinite(kept).all())
        assert bool(torch.isnan(case.v_a if empty == "a" else case.v_b)[1:].all())


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


FIXTURE_CHECKS = (check_fused_qkv_query_is_a_strided_view, check_empty_merge_sides_hold_garbage,
                  check_one_side_empty_case_has_a_row_with_both_sides,
                  check_empty_chunk_case_separates_short_from_long_sequences,
                  check_spread_chunks_make_the_chunk_lses_differ, check_last_tokens_score_highest,
                  check_worked_example_case_is_the_pages_row)
