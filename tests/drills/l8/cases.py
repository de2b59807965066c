"""Drill L8's cases: the test shapes, the page's worked example (content/l8.md §4), the case
WindowCase and its builder (dead block-table entries before the window included), and the
hypothesis strategy."""
import math
from dataclasses import dataclass

import torch
from hypothesis import strategies as st

import _env
from _paged import DTYPES, GUARD, Guarded, followed_by, noise, poisoned_out

from .reference import ref_window_attention

TEST_SHAPES = dict(max_seqs=3, max_chunk=40, max_context=80, max_kv_heads=2, gqa_ratios=(1, 3, 4, 5, 8),
                   head_sizes=(3, 16, 24, 80), block_sizes=(4, 16), windows=(0, 1, 3, 15, 16, 17, 40, -1))
CPU_LIMITS = dict(max_chunk=20, max_context=48)
CPU_TILE = 16  # the reference's key tile under the interpreter: the window sizes around it are the edge cases
DEAD = {"-1": -1, "huge": (1 << 31) - 1}  # dead entries that no cache has; "nan": a NaN block; "other": another
                                          # sequence's block; "live": no dead entry (every block is the sequence's)

# ---------------------------------------------------------------------------
# The worked example (content/l8.md §4)

# One sequence of 10 tokens whose last 2 are this step's chunk; block_size 4, window_left 3:
# the query at position 8 sees keys 5..8, the one at 9 keys 6..9. Block 0 (positions 0-3)
# lies before both windows: its entry is dead (-1). D = 1, q = k = 1 and scale 1: every
# score is 1, and the sink is 1 too, so the sink counts as one more key of value 0.
WINDOW_EXAMPLE = dict(block_size=4, block_table=[[-1, 4, 1]], num_blocks=6, seq_len=10, q_len=2, window_left=3,
                      sink=1.0, values=[float(p + 1) for p in range(10)])


def example_outputs(window_left=None, sink=True):
    """Each query's output in the worked example, by hand: the mean of the values it sees,
    with the sink as one more key of value 0."""
    ex = WINDOW_EXAMPLE
    w = ex["window_left"] if window_left is None else window_left
    outs = []
    for i in range(ex["q_len"]):
        p = ex["seq_len"] - ex["q_len"] + i
        seen = ex["values"][max(p - w, 0):p + 1]
        outs.append(sum(seen) / (len(seen) + (1 if sink else 0)))
    return outs


# ---------------------------------------------------------------------------
# The case


@dataclass
class WindowCase:
    """One call of paged_prefill_attention_window (decode=False) or
    paged_decode_attention_window (decode=True), with what is needed to check and explain it."""

    query: torch.Tensor            # [total_q or B, H_q, D], possibly a row-strided view
    k_cache: torch.Tensor          # [num_blocks, block_size, H_kv, D]; unowned blocks hold NaN
    v_cache: torch.Tensor
    block_table: torch.Tensor      # [B, max_blocks] int32; dead and garbage columns
    query_start_loc: torch.Tensor  # [B + 1] int32 (decode: 0..B, for the reference only)
    seq_lens: torch.Tensor         # [B] int32
    window_left: int
    sinks: torch.Tensor = None     # [H_q] float32 or None
    scale: float = None
    decode: bool = False
    num_splits: int = None
    dead: str = "nan"              # what the entries before the window hold (DEAD, above)
    out: Guarded = None
    table_guard: bool = True

    @property
    def function(self):
        return "paged_decode_attention_window" if self.decode else "paged_prefill_attention_window"

    @property
    def block_size(self):
        return self.k_cache.shape[1]

    @property
    def q_lens(self):
        starts = self.query_start_loc.long().cpu()
        return (starts[1:] - starts[:-1]).tolist()

    def args(self):
        if self.decode:
            return self.query, self.k_cache, self.v_cache, self.block_table, self.seq_lens, self.window_left
        return (self.query, self.k_cache, self.v_cache, self.block_table, self.query_start_loc, self.seq_lens,
                self.window_left)

    def kwargs(self, out=True):
        kwargs = {"sinks": self.sinks}
        if self.scale is not None:
            kwargs["scale"] = self.scale
        if self.decode and self.num_splits is not None:
            kwargs["num_splits"] = self.num_splits
        if out and self.out is not None:
            kwargs["out"] = self.out.view
        return kwargs

    def call(self, module, out=True):
        return getattr(module, self.function)(*self.args(), **self.kwargs(out))

    def rows(self):
        """Per query token t: (sequence b, index i in its chunk, position)."""
        lens = self.seq_lens.long().tolist()
        return [(b, i, lens[b] - q_len + i) for b, q_len in enumerate(self.q_lens) for i in range(q_len)]

    def reference(self, window_left=None, **mistake):
        return ref_window_attention(self.query, self.k_cache, self.v_cache, self.block_table, self.query_start_loc,
                                    self.seq_lens, self.window_left if window_left is None else window_left,
                                    self.sinks, self.scale, **mistake)


def make_sinks(spec, num_heads, gen, device="cpu"):
    """None; "random": one per head, all different; a float for every head; or a list."""
    if spec is None:
        return None
    if spec == "random":
        values = torch.randn(num_heads, generator=gen) * 2 + torch.linspace(-1, 1, num_heads)
    elif isinstance(spec, (list, tuple)):
        values = torch.tensor(spec)
    else:
        values = torch.full((num_heads,), float(spec))
    return values.to(dtype=torch.float32, device=device).contiguous()


def window_case(q_lens, context_lens, *, window_left, sinks="random", num_heads=8, num_kv_heads=2, head_size=16,
                block_size=4, dtype=torch.float16, scale=None, decode=False, num_splits=None, dead="nan",
                extra_columns=2, layout="contiguous", out=True, device="cpu", seed=0):
    """A serving step: sequence b brings q_lens[b] new tokens after context_lens[b] cached ones
    (decode: one each, and the query is [B, H_q, D]).

    Only blocks the window reaches are the sequence's (noise); the entries of blocks wholly
    before the first query's window start hold `dead` (DEAD), and so does nothing else.
    Blocks no sequence owns hold NaN; garbage columns past the last block and a guard after
    the table name them. A NaN-poisoned out= buffer inside a guarded allocation."""
    gen = torch.Generator().manual_seed(seed)
    if decode:
        q_lens = [1] * len(q_lens)
    seq_lens = [q + c for q, c in zip(q_lens, context_lens)]
    window = 1 << 30 if window_left < 0 else window_left
    last = [math.ceil(n / block_size) for n in seq_lens]
    first = [0 if dead == "live" else max(c - window, 0) // block_size for c in context_lens]
    owned = sum(l - f for f, l in zip(first, last))
    num_blocks = owned + 3
    pool = torch.randperm(num_blocks, generator=gen)
    spare = pool[owned:]
    width = max(last) + extra_columns
    table = spare[torch.randint(len(spare), (len(seq_lens), width), generator=gen)]
    at = 0
    for b in range(len(seq_lens)):
        table[b, first[b]:last[b]] = pool[at:at + last[b] - first[b]]
        at += last[b] - first[b]
    for b in range(len(seq_lens)):  # the dead entries, once every live one is known
        if dead in DEAD:
            table[b, :first[b]] = DEAD[dead]
        elif dead == "other":
            theirs = [table[o, first[o]:last[o]] for o in range(len(seq_lens)) if o != b] or [table[b, first[b]:last[b]]]
            pick = torch.cat(theirs)
            table[b, :first[b]] = pick[torch.randint(len(pick), (first[b],), generator=gen)]
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    k_cache, v_cache = noise(shape, torch.float32, "cpu", gen), noise(shape, torch.float32, "cpu", gen)
    k_cache[spare], v_cache[spare] = float("nan"), float("nan")
    total, hd = sum(q_lens), num_heads * head_size
    if layout == "fused_qkv":
        qkv = noise((total, hd + 2 * num_kv_heads * head_size), dtype, device, gen)
        query = qkv[:, :hd].view(total, num_heads, head_size)
    else:
        query = followed_by(noise((total, num_heads, head_size), dtype, "cpu", gen), torch.full((GUARD,), float("nan")),
                            device)
    starts = torch.tensor([0] + list(q_lens)).cumsum(0)
    return WindowCase(
        query=query, k_cache=k_cache.to(dtype=dtype, device=device), v_cache=v_cache.to(dtype=dtype, device=device),
        block_table=followed_by(table.to(torch.int32), spare[torch.randint(len(spare), (GUARD,), generator=gen)],
                                device),
        query_start_loc=starts.to(dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device), window_left=window_left,
        sinks=make_sinks(sinks, num_heads, gen, device), scale=scale, decode=decode, num_splits=num_splits, dead=dead,
        out=poisoned_out((total, num_heads, head_size), dtype, device, gen) if out else None)


def example_case(decode=False, device="cpu"):
    """content/l8.md §4's example (query 1, every key 1, D = 1, scale 1, sink 1); decode: its last query alone."""
    ex = WINDOW_EXAMPLE
    bs, n, q_len = ex["block_size"], ex["seq_len"], 1 if decode else ex["q_len"]
    table = torch.tensor(ex["block_table"], dtype=torch.int32)
    k_cache = torch.full((ex["num_blocks"], bs, 1, 1), float("nan"))
    v_cache = k_cache.clone()
    for pos in range(n):
        block = int(table[0, pos // bs])
        if block >= 0:
            k_cache[block, pos % bs], v_cache[block, pos % bs] = 1.0, ex["values"][pos]
    gen = torch.Generator().manual_seed(0)
    return WindowCase(query=torch.ones(q_len, 1, 1, device=device), k_cache=k_cache.to(device),
                      v_cache=v_cache.to(device), block_table=table.to(device),
                      query_start_loc=torch.tensor([0, q_len], dtype=torch.int32, device=device),
                      seq_lens=torch.tensor([n], dtype=torch.int32, device=device), window_left=ex["window_left"],
                      sinks=torch.tensor([ex["sink"]], dtype=torch.float32, device=device), scale=1.0, decode=decode,
                      num_splits=2 if decode else None, dead="-1", table_guard=False,
                      out=poisoned_out((q_len, 1, 1), torch.float32, device, gen))


# ---------------------------------------------------------------------------
# The hypothesis strategy


@st.composite
def window_params(draw, decode=False, dtypes=tuple(DTYPES)):
    """Keyword arguments for window_case: a mixed batch (or a decode batch), a window from
    the edge sizes around blocks and tiles, sinks or none, dead entries of every kind."""
    shapes = {**TEST_SHAPES, **(CPU_LIMITS if _env.INTERPRET else {})}
    block_size = draw(st.sampled_from(shapes["block_sizes"]))
    num_seqs = draw(st.integers(1, shapes["max_seqs"]))
    q_lens, context_lens = [], []
    for _ in range(num_seqs):
        kind = "decode" if decode else draw(st.sampled_from(["decode", "prefill", "chunk"]))
        q_lens.append(1 if kind == "decode" else draw(st.integers(1, shapes["max_chunk"])))
        context_lens.append(0 if kind == "prefill" else draw(st.integers(1 if decode else 0, shapes["max_context"])))
    num_kv_heads = draw(st.integers(1, shapes["max_kv_heads"]))
    return dict(
        q_lens=q_lens, context_lens=context_lens, block_size=block_size, num_kv_heads=num_kv_heads,
        num_heads=num_kv_heads * draw(st.sampled_from(shapes["gqa_ratios"])),
        head_size=draw(st.sampled_from(shapes["head_sizes"])),
        window_left=draw(st.sampled_from(shapes["windows"] + (block_size - 1, block_size))),
        sinks=draw(st.sampled_from([None, "random", "random", float("-inf")])),
        dtype=DTYPES[draw(st.sampled_from(dtypes))], scale=draw(st.none() | st.floats(0.05, 1.0)),
        dead=draw(st.sampled_from(["nan", "-1", "huge", "other"])),
        layout=draw(st.sampled_from(["contiguous", "fused_qkv"])), decode=decode,
        num_splits=draw(st.none() | st.integers(1, 6)) if decode else None,
        extra_columns=draw(st.integers(0, 2)), seed=draw(st.integers(0, 2**31 - 1)),
    )
