"""L5's cases: TEST_SHAPES, the page's worked example, the write and decode cases and
their builders, the hypothesis strategies, and the fixture checks of the builders."""
import math
from dataclasses import dataclass

import torch
from hypothesis import strategies as st

from _paged import DTYPES, Guarded, allocate_blocks, followed_by, guarded_nan, guarded_table, noise, owned_columns

from .reference import FP8_DTYPES, FP8_MAX, fp8_bytes, quantise, ref_cache_write

TEST_SHAPES = dict(max_seqs=3, max_new_tokens=5, max_context=150, max_kv_heads=2, gqa_ratios=(1, 3, 6),
                   head_sizes=(3, 16, 40), block_sizes=(8, 16), max_splits=6)

# content/l5.md §3: three values through both formats, scale 1 (one saturates in e4m3fn).
WORKED_EXAMPLE = dict(values=[0.3, 31.5, 500.0], e4m3fn=[0.3125, 32.0, 448.0], e5m2=[0.3125, 32.0, 512.0])
# The byte of each: sign, exponent, mantissa (checked by page.py against torch's own).
NAN_BYTES = {torch.float8_e4m3fn: (0x7F, 0xFF), torch.float8_e5m2: (0x7C, 0x7F, 0xFC, 0xFE)}  # e5m2: inf and NaN


def worked_example_numbers():
    """§3's table from torch: each value quantised (clamped, then cast) into both formats,
    and what torch's bare cast gives for 1e5 in e5m2 (inf: nothing clamps it)."""
    x = torch.tensor(WORKED_EXAMPLE["values"])
    one = torch.ones(1)
    return {name: quantise(x[None], one, dtype)[0].float().tolist() for name, dtype in FP8_DTYPES.items()} | \
        dict(bare_e5m2=float(torch.tensor([1e5]).to(torch.float8_e5m2).float()), bytes={
            name: [int(b) for b in fp8_bytes(quantise(x[None], one, dtype)[0])] for name, dtype in FP8_DTYPES.items()})


def random_bytes(numel, dtype, device, gen):
    """fp8 storage holding random bytes, NaN and inf encodings among them."""
    return torch.randint(0, 256, (numel,), generator=gen, dtype=torch.uint8).view(dtype).to(device)


# ---------------------------------------------------------------------------
# The write


@dataclass
class Fp8WriteCase:
    """One call of reshape_and_cache_fp8, with what is needed to check and explain it."""

    key: torch.Tensor           # [T, H, D], possibly a row-strided view
    value: torch.Tensor
    k_cache: Guarded            # fp8 view [num_blocks, block_size, H, D] inside random bytes
    v_cache: Guarded
    slot_mapping: torch.Tensor  # [T], -1 for padding
    k_scale: torch.Tensor       # [1] or [H] float32
    v_scale: torch.Tensor
    block_size: int

    def args(self):
        return (self.key, self.value, self.k_cache.view, self.v_cache.view, self.slot_mapping, self.k_scale,
                self.v_scale)

    def expected(self, how="right"):
        """(expected k storage, expected v storage), guards included; `how` as quantise's."""
        return (self.k_cache.expected(lambda c: ref_cache_write(self.key, c, self.slot_mapping, self.k_scale, how)),
                self.v_cache.expected(lambda c: ref_cache_write(self.value, c, self.slot_mapping, self.v_scale, how)))


def _guarded_fp8(shape, dtype, device, gen, margin):
    storage = random_bytes(margin + math.prod(shape) + margin, dtype, device, gen)
    return Guarded(storage, storage[margin:margin + math.prod(shape)].view(shape), margin, storage.clone())


def scales_for(x, per_head, divisor, gen):
    """vLLM's test grid: amax / divisor, per tensor [1] or per KV head [H], a little jittered."""
    amax = x.float().abs().amax(dim=(0, 2)) if per_head else x.float().abs().amax().view(1)
    jitter = 1 + 0.25 * torch.rand(amax.shape, generator=gen)
    return (amax.clamp(min=1e-3) / divisor * jitter).float()


def write_case(num_tokens=6, num_heads=2, head_size=16, block_size=8, *, fp8="e4m3fn", dtype=torch.bfloat16,
               per_head=True, divisor=64.0, magnitude=3.0, k_scale=None, v_scale=None, padding=(),
               layout="contiguous", outliers=0, spare_blocks=2, device="cpu", seed=0):
    """A write of num_tokens tokens (those at the indices `padding` get slot -1) into fresh
    slots of a shuffled pool. Values are noise · magnitude; `outliers` values per tensor are
    ±1e5 (past both formats' largest, once divided by the scale). Scales default to amax /
    divisor (vLLM's grid); pass k_scale / v_scale (lists) to fix them."""
    gen = torch.Generator().manual_seed(seed)
    cache_dtype = FP8_DTYPES[fp8]
    num_blocks = -(-num_tokens // block_size) + spare_blocks
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[list(padding)] = -1
    hd = num_heads * head_size
    if layout == "fused_qkv":
        qkv = noise((num_tokens, 3, num_heads, head_size), torch.float32, "cpu", gen) * magnitude
        key, value = qkv[:, 1], qkv[:, 2]
    else:
        key, value = (noise((num_tokens, num_heads, head_size), torch.float32, "cpu", gen) * magnitude for _ in "kv")
    # The scales come from the values before the outliers go in, so the outliers saturate.
    given = lambda s, x: torch.tensor(s, dtype=torch.float32) if s is not None else scales_for(x, per_head, divisor, gen)  # noqa: E731
    k_s, v_s = given(k_scale, key), given(v_scale, value)
    for t in (key, value):
        for i in range(outliers):
            index = int(torch.randint(num_tokens * hd, (1,), generator=gen))
            t[index // hd, (index % hd) // head_size, index % head_size] = (-1) ** i * 1e5
    if layout == "fused_qkv":
        qkv = qkv.to(dtype=dtype, device=device)
        key, value = qkv[:, 1], qkv[:, 2]
    else:
        key, value = key.to(dtype=dtype, device=device), value.to(dtype=dtype, device=device)
    shape = (num_blocks, block_size, num_heads, head_size)
    return Fp8WriteCase(key=key, value=value, k_cache=_guarded_fp8(shape, cache_dtype, device, gen, hd * block_size),
                        v_cache=_guarded_fp8(shape, cache_dtype, device, gen, hd * block_size),
                        slot_mapping=slots.to(device), k_scale=k_s.to(device), v_scale=v_s.to(device),
                        block_size=block_size)


@st.composite
def write_params(draw):
    """Keyword arguments for write_case, within TEST_SHAPES."""
    num_tokens = draw(st.integers(1, 8))
    padding = draw(st.lists(st.integers(0, num_tokens - 1), max_size=2, unique=True))
    return dict(num_tokens=num_tokens, padding=padding, num_heads=draw(st.integers(1, 3)),
                head_size=draw(st.sampled_from(TEST_SHAPES["head_sizes"])),
                block_size=draw(st.sampled_from(TEST_SHAPES["block_sizes"])),
                fp8=draw(st.sampled_from(list(FP8_DTYPES))), dtype=DTYPES[draw(st.sampled_from(list(DTYPES)))],
                per_head=draw(st.booleans()), divisor=draw(st.sampled_from([1.0, 64.0, 300.0])),
                layout=draw(st.sampled_from(["contiguous", "fused_qkv"])), outliers=draw(st.integers(0, 2)),
                seed=draw(st.integers(0, 2**31 - 1)))


# ---------------------------------------------------------------------------
# The decode


@dataclass
class Fp8DecodeCase:
    """One call of paged_decode_attention_fp8, with the unquantised inputs beside it."""

    query: torch.Tensor
    k_cache: torch.Tensor        # fp8 [num_blocks, block_size, H_kv, D]; unowned blocks hold NaN/inf bytes
    v_cache: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    k_scale: torch.Tensor        # [1] or [H_kv], the front of k_scale_memory
    v_scale: torch.Tensor
    k_scale_memory: torch.Tensor  # the scale and what follows it in memory (other scales), on the CPU
    v_scale_memory: torch.Tensor
    key_full: torch.Tensor       # the cache before quantisation, float32 on the CPU
    value_full: torch.Tensor
    scale: float = None
    num_splits: int = None
    tail: str = "noise"

    @property
    def block_size(self):
        return self.k_cache.shape[1]

    def args(self):
        return self.query, self.k_cache, self.v_cache, self.block_table, self.seq_lens, self.k_scale, self.v_scale

    def kwargs(self):
        given = dict(scale=self.scale, num_splits=self.num_splits)
        return {k: v for k, v in given.items() if v is not None}


def poison_outside(cache, table, seq_lens, block_size, tail, gen):
    """fp8 NaN (and, in e5m2, inf) bytes in every unowned block and, with tail == "nan", in
    each last block's unused slots. Returns the unowned blocks' numbers."""
    owned = owned_columns(seq_lens, block_size, table.shape[1])
    unowned = torch.ones(cache.shape[0], dtype=torch.bool)
    unowned[table[owned].long()] = False
    bad = torch.tensor(NAN_BYTES[cache.dtype], dtype=torch.uint8)
    raw = fp8_bytes(cache)
    raw[unowned] = bad[torch.randint(len(bad), raw[unowned].shape, generator=gen)]
    if tail == "nan":
        for b, n in enumerate(seq_lens):
            if n % block_size:
                rest = raw[table[b, n // block_size].long(), n % block_size:]
                rest.copy_(bad[torch.randint(len(bad), rest.shape, generator=gen)])
    return unowned.nonzero().flatten()


def decode_case(seq_lens, *, num_heads=6, num_kv_heads=2, head_size=16, block_size=16, dtype=torch.float16,
                fp8="e4m3fn", per_head=True, divisor=64.0, k_scale=None, v_scale=None, magnitude=1.0, scale=None,
                num_splits=None, spare_blocks=2, extra_columns=2, tail="noise", layout="contiguous", device="cpu",
                seed=0):
    """A decode step over an fp8 cache: K/V noise · magnitude quantised with scales (amax /
    divisor per KV head or per tensor, or the given lists); blocks no sequence owns hold
    fp8 NaN/inf bytes, as does each last block's unused end with tail == "nan"; garbage
    block-table columns name them. Each scale is followed in memory by other scales."""
    gen = torch.Generator().manual_seed(seed)
    cache_dtype = FP8_DTYPES[fp8]
    table, num_blocks = allocate_blocks(seq_lens, block_size, gen, max(spare_blocks, 1), extra_columns)
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    key_full, value_full = (noise(shape, torch.float32, "cpu", gen) * magnitude for _ in "kv")

    def scales(given, full):
        s = torch.tensor(given, dtype=torch.float32) if given is not None else \
            scales_for(full.flatten(0, 1), per_head, divisor, gen)
        memory = torch.cat([s, 0.5 + torch.rand(256, generator=gen)])  # what a wrong index would read
        return s, memory

    (k_s, k_memory), (v_s, v_memory) = scales(k_scale, key_full), scales(v_scale, value_full)
    flat = lambda full, s: quantise(full.flatten(0, 1), s, cache_dtype).view(shape)  # noqa: E731
    k_cache, v_cache = flat(key_full, k_s), flat(value_full, v_s)
    spare = poison_outside(k_cache, table, seq_lens, block_size, tail, gen)
    poison_outside(v_cache, table, seq_lens, block_size, tail, gen)
    num_seqs, hd = len(seq_lens), num_heads * head_size
    if layout == "fused_qkv":
        qkv = noise((num_seqs, hd + 2 * num_kv_heads * head_size), dtype, device, gen)
        query = qkv[:, :hd].view(num_seqs, num_heads, head_size)
    else:
        query = guarded_nan(noise((num_seqs, num_heads, head_size), dtype, "cpu", gen), device)
    return Fp8DecodeCase(
        query=query, k_cache=k_cache.to(device), v_cache=v_cache.to(device),
        block_table=guarded_table(table, spare, gen, device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        k_scale=followed_by(k_s, k_memory[len(k_s):], device), v_scale=followed_by(v_s, v_memory[len(v_s):], device),
        k_scale_memory=k_memory, v_scale_memory=v_memory, key_full=key_full, value_full=value_full, scale=scale,
        num_splits=num_splits, tail=tail)


@st.composite
def decode_params(draw):
    """Keyword arguments for decode_case, within TEST_SHAPES."""
    shapes = TEST_SHAPES
    block_size = draw(st.sampled_from(shapes["block_sizes"]))
    num_seqs = draw(st.integers(1, shapes["max_seqs"]))
    special = st.sampled_from([1, 2, block_size, block_size + 1, shapes["max_context"]])
    num_kv_heads = draw(st.integers(1, shapes["max_kv_heads"]))
    return dict(
        seq_lens=draw(st.lists(special | st.integers(1, shapes["max_context"]), min_size=num_seqs,
                               max_size=num_seqs)),
        block_size=block_size, num_kv_heads=num_kv_heads,
        num_heads=num_kv_heads * draw(st.sampled_from(shapes["gqa_ratios"])),
        head_size=draw(st.sampled_from(shapes["head_sizes"])), dtype=DTYPES[draw(st.sampled_from(list(DTYPES)))],
        fp8=draw(st.sampled_from(list(FP8_DTYPES))), per_head=draw(st.booleans()),
        num_splits=draw(st.none() | st.integers(1, shapes["max_splits"])),
        tail=draw(st.sampled_from(["noise", "nan"])), layout=draw(st.sampled_from(["contiguous", "fused_qkv"])),
        seed=draw(st.integers(0, 2**31 - 1)))


# ---------------------------------------------------------------------------
# Fixture checks: the builders make the cases the tests say they make (tests/test_fixtures.py)


def check_decode_cache_poison_is_nan_or_inf_outside_the_owned_blocks(device):
    for fp8 in FP8_DTYPES:
        case = decode_case([5, 20], fp8=fp8, tail="nan", device=device, seed=1)
        owned = owned_columns(case.seq_lens, case.block_size, case.block_table.shape[1])
        used = set(case.block_table.cpu()[owned].tolist())
        spare = [b for b in range(case.k_cache.shape[0]) if b not in used]
        assert spare and bool((~torch.isfinite(case.k_cache[spare].float())).all())
        assert bool(torch.isfinite(case.k_cache[case.block_table[1, 0].long()].float()).all())  # a full block


def check_outliers_pass_the_largest_value(device):
    case = write_case(outliers=2, device=device, seed=3)
    quotient = case.key.float().cpu() / case.k_scale.cpu().view(-1, 1)
    assert bool((quotient.abs() > FP8_MAX[torch.float8_e4m3fn]).any())


def check_scale_memory_continues_past_the_scale(device):
    case = decode_case([5], device=device, seed=2)
    assert torch.equal(case.k_scale.cpu(), case.k_scale_memory[:2])
    assert case.k_scale.is_contiguous() and case.k_scale.shape == (2,)


FIXTURE_CHECKS = (check_decode_cache_poison_is_nan_or_inf_outside_the_owned_blocks,
                  check_outliers_pass_the_largest_value, check_scale_memory_continues_past_the_scale)
