"""Drill L3's cases: the test shapes, the page's worked example (content/l3.md §3), the
case PrefillCase and its builders, and the hypothesis strategy."""
from dataclasses import dataclass

import torch
from hypothesis import strategies as st

import _env
from _paged import DTYPES, GUARD, Guarded, allocate_blocks, followed_by, nan_outside, noise, poisoned_out

from .reference import ref_paged_prefill

TEST_SHAPES = dict(max_seqs=4, max_chunk=64, max_context=96, max_kv_heads=2, gqa_ratios=(1, 3, 4, 5, 6, 8),
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
