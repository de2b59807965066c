"""L2's cases: the test shapes, the page's worked example (content/l2.md §3), the case
`DecodeCase` and its builders, the hypothesis strategy, and at the bottom the fixture
checks that the builders make what they say (tests/test_fixtures.py)."""
import math
from dataclasses import dataclass

import torch
from hypothesis import strategies as st

from _paged import DTYPES, allocate_blocks, guarded_nan, guarded_table, nan_outside, noise, owned_columns

from .reference import decode_scores_values, ref_paged_decode

TEST_SHAPES = dict(max_seqs=4, max_context=200, max_kv_heads=2, gqa_ratios=(1, 3, 4, 5, 6, 8), head_sizes=(3, 8, 16, 24, 40),
                   block_sizes=(16, 32))

# The example content/l2.md §3 works by hand (tests/test_content.py checks the page
# against it): one sequence, one head, D = 1, scale = 1, so each token's key *is*
# its score. Block size 2: two blocks of two tokens, in physical blocks 3 and 1.
DECODE_EXAMPLE = dict(block_size=2, block_table=[[3, 1]], num_blocks=4,
                      scores=[1.0, 3.0, 4.0, 2.0], values=[1.0, 2.0, 3.0, 4.0])


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


def _case_for_mutations(device, seed):
    """A case for the diagnosis's own property test: GQA, a partial last block, NaN tails."""
    return paged_decode_case([5, 37, 64], num_heads=8, num_kv_heads=2, head_size=16, block_size=16, tail="nan",
                             device=device, seed=seed)


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


FIXTURE_CHECKS = (check_large_logits_overflow_exp_only_in_sequence_1, check_fused_qkv_query_is_a_strided_view,
                  check_far_garbage_points_past_the_cache_only_where_unowned, check_new_token_scores_highest)
