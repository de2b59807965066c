"""L7's cases: TEST_SHAPES, the page's worked example, the write and decode cases and
their builders, the hypothesis strategies, and the fixture checks of the builders."""
from dataclasses import dataclass

import torch
from hypothesis import strategies as st

import _env
from _paged import (DTYPES, GUARD, Guarded, allocate_blocks, followed_by, guarded, guarded_table, nan_outside, noise,
                    owned_columns)

from .reference import latent_rows, ref_concat_and_cache, ref_mla_decode

# Under the interpreter small latents (R and P not powers of two among them); on a GPU
# DeepSeek's own R = 512, P = 64 as well. Head counts: one, odd ones, DeepSeek-V3 sharded
# over 8 GPUs (16) and whole (128).
TEST_SHAPES = dict(max_seqs=3, max_context=150, heads=(1, 3, 16, 63, 128),
                   latents=((32, 16), (48, 8)) if _env.INTERPRET else ((32, 16), (48, 8), (512, 64)),
                   block_sizes=(16, 64), max_splits=8)
SCALE = 192 ** -0.5  # DeepSeek-V2/V3: qk_head_dim = 128 + 64, before the YaRN factor
HUGE = 2147480000    # what FlashMLA's tests put in unused block-table entries: a block no cache has


# ---------------------------------------------------------------------------
# The worked example (the page works it by hand)

# One sequence of 3 tokens, R = 2, P = 1, two heads, scale 0.5 (not 1/sqrt(R + P) = 0.577);
# blocks of 2 tokens: positions 0, 1 in block 2 (slots 4, 5), position 2 in block 0 (slot 0).
WORKED_EXAMPLE = dict(block_size=2, block_table=[[2, 0]], num_blocks=3, slots=[4, 5, 0], scale=0.5,
                      kv_c=[[1.0, 0.0], [0.0, 2.0], [2.0, 2.0]], k_pe=[[2.0], [0.0], [-2.0]],
                      q_nope=[[1.0, 1.0], [2.0, 0.0]], q_pe=[[1.0], [0.0]])


def worked_example_numbers(scale=None, rope=True):
    """Every number the worked example has, float64: per head the scores, the softmax
    weights, out and lse (with another `scale`, or without the rotary part, what those
    mistakes give)."""
    ex = WORKED_EXAMPLE
    c, k_pe = torch.tensor(ex["kv_c"], dtype=torch.float64), torch.tensor(ex["k_pe"], dtype=torch.float64)
    q_nope, q_pe = torch.tensor(ex["q_nope"], dtype=torch.float64), torch.tensor(ex["q_pe"], dtype=torch.float64)
    scores = (q_nope @ c.T + (q_pe @ k_pe.T if rope else 0)) * (ex["scale"] if scale is None else scale)
    weights = scores.softmax(-1)
    return dict(scores=scores, weights=weights, out=weights @ c, lse=torch.logsumexp(scores, -1))


# ---------------------------------------------------------------------------
# The write


@dataclass
class WriteCase:
    """One call of concat_and_cache_mla, with what is needed to check and explain it."""

    kv_c: torch.Tensor          # [T, R], possibly a view with another row stride
    k_pe: torch.Tensor          # [T, P]
    kv_cache: Guarded           # view: [num_blocks, block_size, R + P]
    slot_mapping: torch.Tensor  # [T], -1 for padding
    inputs: torch.Tensor        # the storage kv_c and k_pe are views of ...
    inputs_initial: torch.Tensor  # ... and its contents before the call

    @property
    def block_size(self):
        return self.kv_cache.view.shape[1]

    def args(self):
        return self.kv_c, self.k_pe, self.kv_cache.view, self.slot_mapping

    def expected(self):
        return self.kv_cache.expected(lambda cache: ref_concat_and_cache(self.kv_c, self.k_pe, cache,
                                                                         self.slot_mapping))


WRITE_LAYOUTS = ("separate", "fused", "strided")


def _rows(num_tokens, rank, rope, layout, dtype, device, gen):
    """(storage, kv_c, k_pe): "separate" tensors; "fused": the two column ranges of one
    projection output [T, R + P + 3]; "strided": rows R + 3 and P + 5 apart, so reading
    one with the other's stride goes wrong. The storage runs a row past the last token."""
    width = rank + rope
    if layout == "separate":
        buf = noise((num_tokens * width + width,), dtype, device, gen)
        return buf, buf[:num_tokens * rank].view(num_tokens, rank), \
            buf[num_tokens * rank:num_tokens * width].view(num_tokens, rope)
    if layout == "fused":
        buf = noise((num_tokens * (width + 3) + width,), dtype, device, gen)
        kv = buf[:num_tokens * (width + 3)].view(num_tokens, width + 3)
        return buf, kv[:, :rank], kv[:, rank:width]
    if layout == "strided":
        c_size = num_tokens * (rank + 3)
        buf = noise((c_size + num_tokens * (rope + 5) + width,), dtype, device, gen)
        return buf, buf.as_strided((num_tokens, rank), (rank + 3, 1)), \
            buf.as_strided((num_tokens, rope), (rope + 5, 1), c_size)
    raise ValueError(f"unknown layout {layout!r}")


def write_case(slots, *, num_blocks, block_size, rank, rope, dtype=torch.float16, layout="separate",
               slot_dtype=torch.int64, device="cpu", seed=0):
    """concat_and_cache_mla of len(slots) tokens into a guarded noise cache; slot -1 is
    padding. The guards are two rows each side, so a padding row written to slot -1 lands
    in them."""
    gen = torch.Generator().manual_seed(seed)
    inputs, kv_c, k_pe = _rows(len(slots), rank, rope, layout, dtype, device, gen)
    cache = guarded((num_blocks, block_size, rank + rope), dtype, device, gen, margin=2 * (rank + rope))
    return WriteCase(kv_c, k_pe, cache, torch.tensor(slots, dtype=slot_dtype, device=device), inputs,
                     inputs.clone())


def random_write_case(num_tokens, *, num_blocks, block_size, padding=(), seed=0, **kwargs):
    """Tokens in distinct random slots of the cache, with the tokens `padding` given slot -1."""
    gen = torch.Generator().manual_seed(seed + 1)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens].tolist()
    for t in padding:
        slots[t] = -1
    return write_case(slots, num_blocks=num_blocks, block_size=block_size, seed=seed, **kwargs)


# ---------------------------------------------------------------------------
# The decode


@dataclass
class DecodeCase:
    """One call of mla_decode_attention, with what is needed to check and explain it."""

    q_nope: torch.Tensor       # [B, H, R], possibly a view
    q_pe: torch.Tensor         # [B, H, P]
    kv_cache: torch.Tensor     # [num_blocks, block_size, R + P]; blocks no sequence owns hold NaN
    block_table: torch.Tensor  # [B, max_blocks] int32; the columns past a sequence's last block are garbage
    seq_lens: torch.Tensor     # [B] int32
    scale: float = SCALE
    num_splits: int = None     # None: the function picks
    tail: str = "noise"        # what the unused end of each last block holds: "noise" or "nan"
    garbage: str = "spare"     # unused block-table entries: "spare" (NaN blocks) or "huge" (HUGE)

    @property
    def block_size(self):
        return self.kv_cache.shape[1]

    def args(self):
        return self.q_nope, self.q_pe, self.kv_cache, self.block_table, self.seq_lens, self.scale

    def kwargs(self):
        return {} if self.num_splits is None else dict(num_splits=self.num_splits)

    def rows(self):
        return latent_rows(self.kv_cache, self.block_table.cpu(), self.seq_lens.cpu())

    def reference(self, scale=None, rope=True):
        """(out [B, H, R], lse [B, H]), float64 on the CPU."""
        return ref_mla_decode(self.q_nope, self.q_pe, self.rows(), self.scale if scale is None else scale, rope)


Q_LAYOUTS = ("separate", "concat", "absorbed")


def _nan_after(t, device):
    """t followed by 64 rows of NaN (a head tile's worth): spare head rows read past it read NaN."""
    return followed_by(t, torch.full((max(GUARD, 64 * t.shape[-1]),), float("nan")), device)


def _queries(num_seqs, num_heads, rank, rope, layout, dtype, device, gen):
    """q_nope and q_pe: "separate" tensors, each followed by NaN; "concat": the two column
    ranges of one q [B, H, R + P]; "absorbed": q_nope as the product W_UK gives it, a
    transposed [H, B, R] (heads R·B apart), q_pe separate."""
    if layout == "concat":
        q = _nan_after(noise((num_seqs, num_heads, rank + rope), dtype, "cpu", gen), device)
        return q[..., :rank], q[..., rank:]
    q_pe = _nan_after(noise((num_seqs, num_heads, rope), dtype, "cpu", gen), device)
    if layout == "absorbed":
        return _nan_after(noise((num_heads, num_seqs, rank), dtype, "cpu", gen), device).transpose(0, 1), q_pe
    return _nan_after(noise((num_seqs, num_heads, rank), dtype, "cpu", gen), device), q_pe


def decode_case(seq_lens, *, num_heads=16, rank=32, rope=16, block_size=16, dtype=torch.float16, scale=SCALE,
                num_splits=None, spare_blocks=2, extra_columns=2, tail="noise", garbage="spare",
                q_layout="separate", device="cpu", seed=0):
    """A decode step over a paged latent cache, built as L4's: owned blocks hold noise;
    blocks no sequence owns hold NaN, and every garbage block-table column (and the guard
    after the table) names one, or holds HUGE; the unused end of each last block holds
    `tail`. A sequence of length 0 owns no block."""
    gen = torch.Generator().manual_seed(seed)
    table, num_blocks = allocate_blocks(seq_lens, block_size, gen, max(spare_blocks, 1), extra_columns)
    cache = noise((num_blocks, block_size, rank + rope), torch.float32, "cpu", gen)
    spare = nan_outside(cache, table, seq_lens, block_size, tail)
    if garbage == "huge":
        table[~owned_columns(seq_lens, block_size, table.shape[1])] = HUGE
        table = followed_by(table, torch.full((GUARD,), HUGE), device)
    else:
        table = guarded_table(table, spare, gen, device)
    q_nope, q_pe = _queries(len(seq_lens), num_heads, rank, rope, q_layout, dtype, device, gen)
    return DecodeCase(q_nope, q_pe, cache.to(dtype=dtype, device=device), table,
                      torch.tensor(seq_lens, dtype=torch.int32, device=device), scale=scale, num_splits=num_splits,
                      tail=tail, garbage=garbage)


def worked_example_decode_case(device="cpu"):
    """The worked example as a decode: its cache filled as the page's write leaves it,
    float32, one split (a chunk is the whole sequence)."""
    ex = WORKED_EXAMPLE
    rows = torch.cat([torch.tensor(ex["kv_c"]), torch.tensor(ex["k_pe"])], dim=1)
    cache = torch.full((ex["num_blocks"], ex["block_size"], rows.shape[1]), float("nan"))
    cache.view(-1, rows.shape[1])[ex["slots"]] = rows
    table = torch.tensor(ex["block_table"], dtype=torch.int32)
    return DecodeCase(_nan_after(torch.tensor([ex["q_nope"]]), device), _nan_after(torch.tensor([ex["q_pe"]]), device),
                      cache.to(device), followed_by(table, torch.full((GUARD,), HUGE), device),
                      torch.tensor([len(rows)], dtype=torch.int32, device=device), scale=ex["scale"], num_splits=1)


# ---------------------------------------------------------------------------
# Hypothesis strategies (bounded by TEST_SHAPES)


@st.composite
def decode_params(draw, dtypes=tuple(DTYPES)):
    """Keyword arguments for decode_case: lengths where decode kernels go wrong (0, 1, a
    whole block, one past), every head count of TEST_SHAPES, split counts from 1 to more
    chunks than tokens."""
    shapes = TEST_SHAPES
    block_size = draw(st.sampled_from(shapes["block_sizes"]))
    num_seqs = draw(st.integers(1, shapes["max_seqs"]))
    special = st.sampled_from([0, 1, block_size, block_size + 1, shapes["max_context"]])
    seq_lens = draw(st.lists(special | st.integers(0, shapes["max_context"]), min_size=num_seqs, max_size=num_seqs))
    rank, rope = draw(st.sampled_from(shapes["latents"]))
    return dict(
        seq_lens=seq_lens, block_size=block_size, rank=rank, rope=rope,
        num_heads=draw(st.sampled_from(shapes["heads"])),
        dtype=DTYPES[draw(st.sampled_from(dtypes))],
        scale=draw(st.floats(0.02, 0.5)),
        num_splits=draw(st.none() | st.integers(1, shapes["max_splits"])),
        tail=draw(st.sampled_from(["noise", "nan"])),
        garbage=draw(st.sampled_from(["spare", "huge"])),
        q_layout=draw(st.sampled_from(Q_LAYOUTS)),
        extra_columns=draw(st.integers(0, 3)),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


@st.composite
def write_params(draw):
    """Keyword arguments for random_write_case."""
    rank, rope = draw(st.sampled_from(TEST_SHAPES["latents"]))
    num_tokens = draw(st.integers(1, 8))
    block_size = draw(st.sampled_from(TEST_SHAPES["block_sizes"]))
    return dict(num_tokens=num_tokens, num_blocks=draw(st.integers(1, 3)), block_size=block_size, rank=rank,
                rope=rope, padding=draw(st.lists(st.integers(0, num_tokens - 1), max_size=2, unique=True)),
                dtype=DTYPES[draw(st.sampled_from(list(DTYPES)))], layout=draw(st.sampled_from(WRITE_LAYOUTS)),
                slot_dtype=draw(st.sampled_from([torch.int32, torch.int64])), seed=draw(st.integers(0, 2**31 - 1)))


# ---------------------------------------------------------------------------
# Fixture checks: the builders make the cases the tests say they make (tests/test_fixtures.py)


def check_worked_example_numbers(device):
    """The worked example's cache is the page's, and its numbers are attention's."""
    case = worked_example_decode_case(device)
    out, lse = case.reference()
    n = worked_example_numbers()
    assert torch.allclose(out[0], n["out"]) and torch.allclose(lse[0], n["lse"])
    assert n["scores"].tolist() == [[1.5, 1.0, 1.0], [1.0, 0.0, 2.0]]
    assert WORKED_EXAMPLE["scale"] != (2 + 1) ** -0.5


def check_decode_case_poisons_what_no_sequence_owns(device):
    for garbage in ("spare", "huge"):
        case = decode_case([0, 5, 17], block_size=16, tail="nan", garbage=garbage, device=device, seed=3)
        table = case.block_table.cpu()
        owned = owned_columns(case.seq_lens.cpu(), 16, table.shape[1])
        assert bool((table[~owned] == HUGE).all()) if garbage == "huge" else \
            bool(torch.isnan(case.kv_cache[table[~owned].long()]).all())
        assert bool(torch.isnan(case.kv_cache[int(table[1, 0]), 5:]).all())  # the tail of sequence 1's block
        assert sum(len(r) for r in case.rows()) == 22 and bool(torch.isfinite(torch.cat(case.rows())).all())


def check_query_layouts(device):
    for layout in Q_LAYOUTS:
        case = decode_case([3, 4], num_heads=3, rank=32, rope=16, q_layout=layout, device=device)
        assert case.q_nope.shape == (2, 3, 32) and case.q_pe.shape == (2, 3, 16)
        assert case.q_nope.stride(2) == 1 and case.q_pe.stride(2) == 1
        assert case.q_nope.is_contiguous() == (layout == "separate")


def check_write_layouts(device):
    for layout in WRITE_LAYOUTS:
        case = random_write_case(4, num_blocks=2, block_size=16, rank=48, rope=8, layout=layout, padding=[1],
                                 device=device)
        assert case.kv_c.stride(1) == 1 and case.k_pe.stride(1) == 1 and int((case.slot_mapping < 0).sum()) == 1
        assert (case.kv_c.stride(0) == case.k_pe.stride(0)) == (layout == "fused")


FIXTURE_CHECKS = (check_worked_example_numbers, check_decode_case_poisons_what_no_sequence_owns, check_query_layouts,
                  check_write_layouts)
