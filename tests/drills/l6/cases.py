"""Drill L6's cases: the test shapes, the page's worked example (vLLM's [A, B, C, D, E]
batch, content/l6.md §3), CascadeCase and its builder (block tables whose first
columns are the same physical blocks in every row), vLLM's test_cascade grid scaled
for the interpreter, and the hypothesis strategy."""
import math
from dataclasses import dataclass

import torch
from hypothesis import strategies as st

import _env
from _paged import DTYPES, GUARD, Guarded, followed_by, guarded_nan, nan_outside, noise, poisoned_out

from .reference import prefix_len_rule, ref_cascade

TEST_SHAPES = dict(max_seqs=5, max_chunk=12, max_suffix=24, max_prefix_blocks=4, max_kv_heads=2,
                   gqa_ratios=(1, 3, 4, 6), head_sizes=(16, 24, 80), block_sizes=(4, 8, 16))

# vLLM's tests/kernels/attention/test_cascade_flash_attn.py CASES: (query_len, kv_len)
# per sequence and the common prefix. On the CPU the interpreter runs them scaled down
# by VLLM_SCALE (query lengths floored, kv lengths rounded up, so each sequence's
# cached context still holds the prefix).
VLLM_CASES = {"general": ([(129, 871), (18, 280), (37, 988), (1023, 2304), (1, 257)], 256),
              "flash_decoding": ([(1, 1023), (1, 879), (1, 778), (1, 1777)] * 100, 512)}
VLLM_HEADS = ((4, 4), (8, 2), (16, 2))
VLLM_SCALE = 16


def vllm_case_lens(name, scale):
    """(q_lens, context_lens, common_prefix_len) of one of vLLM's cases, scaled by 1/scale
    (the decode case also keeps only 8 of its 400 rows when scaled)."""
    pairs, prefix = VLLM_CASES[name]
    if scale > 1 and name == "flash_decoding":
        pairs = pairs[:8]
    q_lens = [max(1, q // scale) for q, _ in pairs]
    kv = [-(-n // scale) for _, n in pairs]
    return q_lens, [n - q for n, q in zip(kv, q_lens)], prefix // scale


# ---------------------------------------------------------------------------
# The worked example (content/l6.md §3): vLLM's comment in _compute_cascade_attn_prefix_len

# Request 1's cache [A, B, C, D, E, X], 3 of them computed (its query [D, E, X]);
# request 2's cache [A, B, C, D, E, Y], 4 computed (its query [E, Y]). One token per
# letter; V holds the numbers below, q = k = 1, D = 1, scale = 1: every score is 1, so
# each output is the mean of the values its query sees.
EXAMPLE = dict(tokens=[["A", "B", "C", "D", "E", "X"], ["A", "B", "C", "D", "E", "Y"]], computed=[3, 4],
               values=dict(A=1.0, B=2.0, C=3.0, D=4.0, E=5.0, X=6.0, Y=7.0))


def example_tables(block_size):
    """The two requests' block tables when blocks of `block_size` letters that hold the
    same letters are one shared physical block (prefix caching): (table, {block: letters})."""
    blocks, table = {}, []
    for tokens in EXAMPLE["tokens"]:
        row = []
        for i in range(0, len(tokens), block_size):
            row.append(blocks.setdefault(tuple(tokens[i:i + block_size]), len(blocks)))
        table.append(row)
    return torch.tensor(table, dtype=torch.int32), {v: k for k, v in blocks.items()}


def example_case(block_size=1, device="cpu", common_prefix_len=None):
    """The example as a CascadeCase; common_prefix_len None: the rule's value."""
    table, letters = example_tables(block_size)
    k_cache = torch.full((len(letters) + 1, block_size, 1, 1), float("nan"))
    v_cache = k_cache.clone()
    for block, held in letters.items():
        for slot, letter in enumerate(held):
            k_cache[block, slot] = 1.0
            v_cache[block, slot] = EXAMPLE["values"][letter]
    lens = [len(t) for t in EXAMPLE["tokens"]]
    q_lens = [n - c for n, c in zip(lens, EXAMPLE["computed"])]
    starts = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    if common_prefix_len is None:
        common_prefix_len = prefix_len_rule(table, starts, seq_lens, block_size)
    gen = torch.Generator().manual_seed(0)
    return CascadeCase(query=torch.ones(sum(q_lens), 1, 1, device=device), k_cache=k_cache.to(device),
                       v_cache=v_cache.to(device), block_table=table.to(device), query_start_loc=starts.to(device),
                       seq_lens=seq_lens.to(device), common_prefix_len=common_prefix_len, scale=1.0, tail="nan",
                       table_guard=False, out=poisoned_out((sum(q_lens), 1, 1), torch.float32, device, gen))


def example_outputs():
    """Each query's output: the mean of the values of the letters 0..its position."""
    outs = []
    for tokens, computed in zip(EXAMPLE["tokens"], EXAMPLE["computed"]):
        for pos in range(computed, len(tokens)):
            seen = [EXAMPLE["values"][x] for x in tokens[:pos + 1]]
            outs.append(sum(seen) / len(seen))
    return outs


# ---------------------------------------------------------------------------
# The case


@dataclass
class CascadeCase:
    """One call of cascade_attention, with what is needed to check and explain it."""

    query: torch.Tensor            # [total_q, H_q, D]
    k_cache: torch.Tensor          # [num_blocks, block_size, H_kv, D]; unowned blocks hold NaN
    v_cache: torch.Tensor
    block_table: torch.Tensor      # [B, max_blocks] int32; its first columns the same in every row
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor         # [B] int32
    common_prefix_len: int
    scale: float = None
    tail: str = "noise"            # what the unused end of each last block holds
    out: Guarded = None
    table_guard: bool = True

    @property
    def block_size(self):
        return self.k_cache.shape[1]

    @property
    def q_lens(self):
        starts = self.query_start_loc.long().cpu()
        return (starts[1:] - starts[:-1]).tolist()

    def args(self):
        return (self.query, self.k_cache, self.v_cache, self.block_table, self.query_start_loc, self.seq_lens,
                self.common_prefix_len)

    def kwargs(self):
        kwargs = {} if self.scale is None else {"scale": self.scale}
        if self.out is not None:
            kwargs["out"] = self.out.view
        return kwargs

    def rows(self):
        """Per query token t: (sequence b, index i in its chunk, position)."""
        out = []
        for b, (n, q_len) in enumerate(zip(self.seq_lens.long().tolist(), self.q_lens)):
            out += [(b, i, n - q_len + i) for i in range(q_len)]
        return out

    def reference(self, mistake=None, kv_heads=(None, None)):
        return ref_cascade(*self.args(), scale=self.scale, mistake=mistake, kv_heads=kv_heads)


def cascade_case(q_lens, context_lens, prefix_blocks, *, num_heads, num_kv_heads, head_size, block_size,
                 dtype=torch.float16, scale=None, more_shared=0, common_prefix_len=None, spare_blocks=2,
                 extra_columns=2, tail="noise", layout="contiguous", out=True, nan=True, device="cpu", seed=0):
    """A serving step whose sequences share their first `prefix_blocks` physical blocks
    (prefix caching); sequence b brings q_lens[b] new tokens after context_lens[b] cached
    ones. `more_shared` more columns are shared by every row but the last (a table that
    agrees with the others for only some columns). common_prefix_len None: the rule's value.

    Owned blocks hold noise; blocks no sequence owns hold NaN, and so does every garbage
    column past a sequence's last block (and the guard after the table). `tail`: what
    the unused end of each last block holds. `out=True`: a poisoned, guarded out=.
    `nan=False`: no NaN in any input (unowned blocks hold noise), for the one test where
    a NaN output must have come from arithmetic.
    """
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [q + c for q, c in zip(q_lens, context_lens)]
    owned = [math.ceil(n / block_size) for n in seq_lens]
    num_seqs = len(seq_lens)
    # Columns shared by all but the last row stay within those rows' cached context: a
    # shared block is full (prefix caching shares only full blocks, never written again).
    together = max(prefix_blocks, min(prefix_blocks + more_shared, min(context_lens[:-1], default=0) // block_size))
    unique = [o - (together if b < num_seqs - 1 else prefix_blocks) for b, o in enumerate(owned)]
    num_blocks = together + sum(max(u, 0) for u in unique) + max(spare_blocks, 1)
    pool = torch.randperm(num_blocks, generator=gen)
    shared, at = pool[:together], together
    spare = pool[together + sum(max(u, 0) for u in unique):]
    table = spare[torch.randint(len(spare), (num_seqs, max(owned, default=0) + extra_columns), generator=gen)]
    for b, o in enumerate(owned):
        first = together if b < num_seqs - 1 else prefix_blocks
        table[b, :first] = shared[:first]
        table[b, first:o] = pool[at:at + o - first]
        at += o - first
    table = table.to(torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    k_cache, v_cache = noise(shape, torch.float32, "cpu", gen), noise(shape, torch.float32, "cpu", gen)
    if nan:
        nan_outside(k_cache, table, seq_lens, block_size, tail)
        nan_outside(v_cache, table, seq_lens, block_size, tail)
    total, hd = sum(q_lens), num_heads * head_size
    if layout == "fused_qkv":
        qkv = noise((total, hd + 2 * num_kv_heads * head_size), dtype, device, gen)
        query = qkv[:, :hd].view(total, num_heads, head_size)
    elif not nan:
        query = noise((total, num_heads, head_size), dtype, device, gen)
    else:  # followed in memory by NaN: a padded lane read unmasked shows
        query = guarded_nan(noise((total, num_heads, head_size), dtype, "cpu", gen), device)
    starts = torch.tensor([0] + list(q_lens)).cumsum(0).to(torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    if common_prefix_len is None:
        common_prefix_len = prefix_blocks * block_size
    return CascadeCase(
        query=query, k_cache=k_cache.to(dtype=dtype, device=device), v_cache=v_cache.to(dtype=dtype, device=device),
        block_table=followed_by(table, spare[torch.randint(len(spare), (GUARD,), generator=gen)], device),
        query_start_loc=starts.to(device), seq_lens=lens.to(device), common_prefix_len=common_prefix_len,
        scale=scale, tail=tail, out=poisoned_out((total, num_heads, head_size), dtype, device, gen) if out else None)


# ---------------------------------------------------------------------------
# The hypothesis strategy


@st.composite
def cascade_params(draw, dtypes=tuple(DTYPES)):
    """Keyword arguments for cascade_case: a batch sharing 0..4 prefix blocks, of decode
    rows and chunks, each with a suffix of its own after the prefix."""
    s = TEST_SHAPES
    block_size = draw(st.sampled_from(s["block_sizes"]))
    num_seqs = draw(st.integers(2, s["max_seqs"]))
    prefix_blocks = draw(st.integers(0, s["max_prefix_blocks"] if _env.INTERPRET else 16))
    q_lens, context_lens = [], []
    for _ in range(num_seqs):
        q_len = draw(st.sampled_from([1, 1, draw(st.integers(1, s["max_chunk"]))]))
        q_lens.append(q_len)
        context_lens.append(prefix_blocks * block_size + draw(st.integers(0, s["max_suffix"])))
    num_kv_heads = draw(st.integers(1, s["max_kv_heads"]))
    return dict(q_lens=q_lens, context_lens=context_lens, prefix_blocks=prefix_blocks, block_size=block_size,
                num_kv_heads=num_kv_heads, num_heads=num_kv_heads * draw(st.sampled_from(s["gqa_ratios"])),
                head_size=draw(st.sampled_from(s["head_sizes"])), dtype=DTYPES[draw(st.sampled_from(dtypes))],
                scale=draw(st.none() | st.floats(0.05, 1.0)), more_shared=draw(st.integers(0, 2)),
                tail=draw(st.sampled_from(["noise", "nan"])), layout=draw(st.sampled_from(["contiguous", "fused_qkv"])),
                extra_columns=draw(st.integers(0, 2)), seed=draw(st.integers(0, 2**31 - 1)))


def check_cases_share_their_prefix(device):
    """A fixture check: the builder's tables share exactly the columns asked for, and the
    rule gives the prefix back."""
    case = cascade_case([3, 1, 2], [12, 13, 8], 2, num_heads=2, num_kv_heads=1, head_size=16, block_size=4,
                        more_shared=1, device=device)
    table = case.block_table.cpu()
    assert bool((table[:, :2] == table[:1, :2]).all())
    assert bool((table[:2, 2] == table[0, 2]).all()) and int(table[2, 2]) != int(table[0, 2])
    assert prefix_len_rule(case.block_table, case.query_start_loc, case.seq_lens, 4) == 8
    assert example_outputs() == case_example_means()


def case_example_means():
    return example_case(1).reference().flatten().tolist()


FIXTURE_CHECKS = (check_cases_share_their_prefix,)
