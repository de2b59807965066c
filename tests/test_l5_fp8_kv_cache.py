"""L5: an FP8 KV cache, the quantising write and the decode that reads it (content/l5.md).
Runs unchanged against any tree.

The write is compared byte for byte with the plain-PyTorch reference (fp32 division,
clamped before the cast) over the whole guarded allocation: the guards and the caches
hold random bytes, NaN encodings among them, so a stray write, a write of padding and
a missing write all show. The decode is compared with float64 attention on the
dequantised cache (the kernel's error); the distance to the unquantised inputs (the
format's error) is reported, never failed on alone. Blocks no sequence owns hold fp8
NaN/inf bytes, which a GPU reads as NaN; the CPU interpreter reads them as finite
numbers, so there the loads are counted instead.
"""
import pytest

import _env
import torch
from hypothesis import Phase, given, settings

from _diagnose import Mismatch, expect_value_error
from _paged import DTYPES, caches_past_int32, changed, poisoned_out, snapshot
from drills.l5 import (FORMAT_TOLERANCE, FP8_DTYPES, WORKED_EXAMPLE, check_fp8_decode, check_fp8_write,
                       check_only_live_tokens_loaded, decode_case, decode_params, fp8_bytes, fp8_errors,
                       worked_example_numbers, write_case, write_params)

ALL_DTYPES = list(DTYPES.values())
FORMATS = list(FP8_DTYPES)


def write(drill, case):
    before = snapshot(case.key, case.value, case.slot_mapping, case.k_scale, case.v_scale)
    drill.reshape_and_cache_fp8(*case.args())
    check_fp8_write(case)
    for i in changed(before):
        raise Mismatch(f"{('key', 'value', 'slot_mapping', 'k_scale', 'v_scale')[i]} was modified: "
                       f"reshape_and_cache_fp8 must only read it")


def decode(drill, case, use_out=True, seed=0):
    before = snapshot(*case.args())
    if use_out:
        out = poisoned_out(case.query.shape, case.query.dtype, case.query.device, torch.Generator().manual_seed(seed))
        returned = drill.paged_decode_attention_fp8(*case.args(), **case.kwargs(), out=out.view)
        check_fp8_decode(case, out, returned)
        result = out.view
    else:
        result = drill.paged_decode_attention_fp8(*case.args(), **case.kwargs())
        check_fp8_decode(case, result)
    for i in changed(before):
        raise Mismatch(f"{('query', 'k_cache', 'v_cache', 'block_table', 'seq_lens', 'k_scale', 'v_scale')[i]} was "
                       f"modified: paged_decode_attention_fp8 must only read its inputs")
    return result


# --- the write (content/l5.md §2-§6) ----------------------------------------


@pytest.mark.pitfall("no_saturation")
@pytest.mark.parametrize("fp8", FORMATS)
def test_write_worked_example(drill, device, fp8):
    """§3: 0.3, 31.5 and 500 with scale 1: 0.3125, 32 and 448 (saturated) in e4m3fn,
    0.3125, 32 and 512 in e5m2. 31.5 is a tie whose rounding carries into the exponent."""
    case = write_case(num_tokens=1, num_heads=1, head_size=3, block_size=4, fp8=fp8, dtype=torch.float32,
                      k_scale=[1.0], v_scale=[1.0], device=device)
    case.key.copy_(torch.tensor(WORKED_EXAMPLE["values"]).view(1, 1, 3))
    case.value.copy_(-case.key)
    write(drill, case)
    slot = int(case.slot_mapping[0])
    got = case.k_cache.view.view(-1, 3)[slot].float().tolist()
    assert got == WORKED_EXAMPLE[fp8] == worked_example_numbers()[fp8]


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("fp8", FORMATS)
def test_write_is_bit_exact(drill, device, fp8, dtype):
    write(drill, write_case(num_tokens=5, num_heads=2, head_size=16, fp8=fp8, dtype=dtype, padding=[2], device=device,
                            seed=1))


@pytest.mark.pitfall("scale_multiplied_on_write")
@pytest.mark.parametrize("per_head", [False, True], ids=["per_tensor", "per_head"])
def test_write_divides_by_the_scale(drill, device, per_head):
    """pitfall:scale_multiplied_on_write: scales amax / 64, far from 1, so x · scale and
    x / scale land on different bytes almost everywhere."""
    write(drill, write_case(num_tokens=4, num_heads=2, head_size=8, per_head=per_head, device=device, seed=2))


@pytest.mark.pitfall("no_saturation")
@pytest.mark.parametrize("fp8", FORMATS)
def test_write_saturates(drill, device, fp8):
    """pitfall:no_saturation: a few values of ±1e5 pass both formats' largest value once divided
    by the scale; they must be stored as ±448 (e4m3fn) or ±57344 (e5m2), never NaN or inf."""
    write(drill, write_case(num_tokens=4, num_heads=2, head_size=8, fp8=fp8, dtype=torch.float32, outliers=3,
                            device=device, seed=3))


@pytest.mark.pitfall("source_dtype_division")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_write_divides_in_fp32(drill, device, dtype):
    """pitfall:source_dtype_division: x / scale in bf16 (or fp16) rounds twice; over 1536
    values into e5m2 some land on another byte."""
    write(drill, write_case(num_tokens=12, num_heads=2, head_size=64, fp8="e5m2", dtype=dtype, divisor=300.0,
                            device=device, seed=4))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("fp8", FORMATS)
def test_write_every_16_bit_value(drill, device, fp8, dtype):
    """Every finite bf16 (or fp16) value, ±0 included, through four per-head scales: powers
    of two, whose quotients are exact and often land on a tie between two fp8 values, and
    others, whose quotients must be rounded once. Past fp32's range (bf16's largest over
    1e-4) the quotient saturates. A division that is off by one unit in the last place
    somewhere shows here, byte for byte."""
    case = write_case(num_tokens=128, num_heads=4, head_size=128, block_size=16, fp8=fp8, dtype=dtype,
                      k_scale=[0.5, 1.0, 0.0371, 3.3e-3], v_scale=[2.0 ** -7, 0.25, 17.3, 1e-4], device=device,
                      seed=11)
    every = torch.arange(-2 ** 15, 2 ** 15, dtype=torch.int32).to(torch.int16).view(dtype)
    every = every[torch.isfinite(every.float())]
    values = torch.zeros(case.key.numel(), dtype=dtype)
    values[:len(every)] = every[torch.randperm(len(every), generator=torch.Generator().manual_seed(12))]
    case.key.copy_(values.view(case.key.shape))
    case.value.copy_(values.flip(0).view(case.value.shape))
    write(drill, case)


@pytest.mark.skipif(_env.INTERPRET, reason="the interpreter's `/` is numpy's, correctly rounded: only a GPU's "
                                           "approximate division is at stake, and it needs millions of values")
def test_write_quotients_are_correctly_rounded_on_a_gpu(drill, device):
    """64 Mi fp32 values under 64 scales per tensor. An approximate fp32 division (Triton's
    `/` on a GPU) puts a quotient one unit in the last place off now and then, and near the
    midpoint of two fp8 values that flips the byte: on an H200, 2 of 5.2 million values into
    e4m3fn in a probe, and 16 of this test's key bytes. A correctly rounded division never does."""
    write(drill, write_case(num_tokens=65536, num_heads=64, head_size=16, block_size=16, fp8="e4m3fn",
                            dtype=torch.float32, spare_blocks=0, device=device, seed=13))


@pytest.mark.pitfall("padding_written")
@pytest.mark.parametrize("padding", [[0], [3], [0, 1, 2, 3]], ids=["first", "last", "all"])
def test_write_skips_padding(drill, device, padding):
    write(drill, write_case(num_tokens=4, num_heads=2, head_size=8, padding=padding, device=device, seed=5))


def test_write_reads_fused_qkv_rows(drill, device):
    write(drill, write_case(num_tokens=5, num_heads=2, head_size=40, layout="fused_qkv", device=device, seed=6))


@pytest.mark.parametrize("fp8", FORMATS)
def test_write_per_head_scales_with_six_heads(drill, device, fp8):
    """Six KV heads, a scale each: a kernel that reads a token as a tile of heads pads it
    to eight rows, and rows 6 and 7 have no scale (content/l5.md §9, hint 2: the scale
    load is masked like the values). A padding token among them."""
    write(drill, write_case(num_tokens=5, num_heads=6, head_size=24, block_size=4, fp8=fp8, per_head=True,
                            padding=[3], device=device, seed=14))


@pytest.mark.parametrize("head_size,block_size,dtype", [(64, 8, torch.bfloat16), (80, 16, torch.float32),
                                                        (256, 32, torch.bfloat16)], ids=["64-8", "80-16", "256-32"])
@pytest.mark.parametrize("per_head", [False, True], ids=["per_tensor", "per_head"])
def test_write_vllm_grid(drill, device, head_size, block_size, dtype, per_head):
    """vLLM's test_reshape_and_cache_flash fp8 grid (head sizes 64/80/256, block sizes 8/16/32,
    bf16/fp32 sources, scales amax / 64), at interpreter size."""
    write(drill, write_case(num_tokens=3, num_heads=2, head_size=head_size, block_size=block_size, dtype=dtype,
                            per_head=per_head, device=device, seed=7))


@pytest.mark.launches_nothing  # nothing to do: no kernel need run
def test_write_of_no_tokens(drill, device):
    case = write_case(num_tokens=3, device=device)
    case.key, case.value, case.slot_mapping = case.key[:0], case.value[:0], case.slot_mapping[:0]
    write(drill, case)


@settings(phases=(Phase.explicit, Phase.reuse, Phase.generate))
@given(params=write_params())
def test_write_matches_reference(drill, device, params):
    write(drill, write_case(**params, device=device))


def _bad_writes(device):
    case = write_case(num_tokens=3, num_heads=2, head_size=8, device=device)
    key, value, k_cache, v_cache, slots, k_scale, v_scale = case.args()
    half = lambda c: torch.zeros(c.shape, dtype=torch.float16, device=device)  # noqa: E731
    return {
        "cache in float16": (key, value, half(k_cache), half(v_cache), slots, k_scale, v_scale),
        "cache in uint8": (key, value, k_cache.view(torch.uint8), v_cache.view(torch.uint8), slots, k_scale, v_scale),
        "k_cache e4m3fn, v_cache e5m2": (key, value, k_cache, v_cache.view(torch.float8_e5m2), slots, k_scale,
                                         v_scale),
        "scale of 3 heads for 2": (key, value, k_cache, v_cache, slots, torch.ones(3, device=device),
                                   torch.ones(3, device=device)),
        "scale as a 0-d tensor": (key, value, k_cache, v_cache, slots, k_scale[0], v_scale[0]),
        "scale in float16": (key, value, k_cache, v_cache, slots, k_scale.half(), v_scale.half()),
        "scale as a Python float": (key, value, k_cache, v_cache, slots, 0.5, 0.5),
        "scale on another device": (key, value, k_cache, v_cache, slots, k_scale.to("meta"), v_scale.to("meta")),
        "k_scale per head, v_scale per tensor": (key, value, k_cache, v_cache, slots, k_scale, v_scale[:1]),
        "key in float64": (key.double(), value.double(), k_cache, v_cache, slots, k_scale, v_scale),
        "slot past the cache": (key, value, k_cache, v_cache, slots.clone().fill_(k_cache.shape[0] *
                                                                                   k_cache.shape[1]),
                                k_scale, v_scale),
        "non-contiguous k_cache": (key, value, k_cache.transpose(1, 2).contiguous().transpose(1, 2), v_cache, slots,
                                   k_scale, v_scale),
    }


@pytest.mark.parametrize("what", list(_bad_writes("cpu")))
def test_write_rejects_bad_input(drill, device, what):
    if what == "slot past the cache" and device != "cpu":
        pytest.skip("on a GPU slots are not checked: it would cost a device sync (content/l5.md §8)")
    with expect_value_error(what, "content/l5.md §8"):
        drill.reshape_and_cache_fp8(*_bad_writes(device)[what])


# --- the decode (content/l5.md §6) ------------------------------------------


def _case(device, seq_lens, **kwargs):
    return decode_case(seq_lens, **{**dict(num_heads=6, num_kv_heads=2, head_size=16, block_size=16), **kwargs},
                       device=device)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("fp8", FORMATS)
def test_decode_matches_reference(drill, device, fp8, dtype):
    decode(drill, _case(device, [1, 17, 90], fp8=fp8, dtype=dtype, num_splits=3, seed=1))


@pytest.mark.pitfall("scale_applied_twice")
@pytest.mark.pitfall("v_not_dequantised")
@pytest.mark.parametrize("fp8", FORMATS)
def test_decode_vllm_unified_attention_scales(drill, device, fp8):
    """vLLM's unified-attention fp8 case: k_scale = 0.5, v_scale = 0.25 per tensor, non-1 on
    purpose: a scale applied twice or not at all moves every output."""
    decode(drill, _case(device, [20, 70], fp8=fp8, k_scale=[0.5], v_scale=[0.25], magnitude=0.5, num_splits=2,
                        seed=2))


@pytest.mark.pitfall("scale_applied_twice")
@pytest.mark.pitfall("v_not_dequantised")
def test_decode_per_head_scales_far_from_one(drill, device):
    decode(drill, _case(device, [33, 64], num_splits=1, seed=3))


@pytest.mark.pitfall("scale_by_query_head")
@pytest.mark.parametrize("num_heads,num_kv_heads", [(6, 2), (12, 2), (4, 4)], ids=["group3", "group6", "mha"])
def test_decode_per_head_scale_follows_the_kv_head(drill, device, num_heads, num_kv_heads):
    """pitfall:scale_by_query_head: query head h reads scale[h // group]; the memory after
    the scale holds other numbers, so reading scale[h] comes out wrong."""
    decode(drill, _case(device, [20, 45], num_heads=num_heads, num_kv_heads=num_kv_heads, num_splits=2, seed=4))


@pytest.mark.pitfall("empty_split_nan")
def test_decode_chunks_past_a_short_sequence_are_empty(drill, device):
    """pitfall:empty_split_nan: 8 chunks; sequences of 1 and 3 tokens leave most of them empty;
    2048 = 8 × 256 tokens fills every chunk however it is rounded."""
    decode(drill, _case(device, [1, 3, 2048], num_heads=2, num_kv_heads=1, num_splits=8, seed=5))


@pytest.mark.parametrize("fp8", FORMATS)
def test_decode_nan_bytes_in_unowned_blocks_and_tails(drill, device, fp8):
    """NaN (and e5m2's inf) bytes in every unowned block and past seq_len in each last block:
    a GPU reads them as NaN, which a load without the pos < seq_len mask lets through."""
    decode(drill, _case(device, [5, 17, 40], fp8=fp8, tail="nan", extra_columns=3, num_splits=3, seed=6))


def test_decode_loads_only_live_tokens(drill, device):
    """The same case under the CPU interpreter, with its loads counted (tests/_traffic.py).
    The answer decides; the interpreter reads fp8 NaN bytes as finite numbers, so a load of
    them may leave it right: that passes, the traffic report names it, and the counts (the
    worker's word) explain a wrong answer."""
    if not check_only_live_tokens_loaded(drill, _case(device, [5, 17, 40], tail="nan", extra_columns=3,
                                                      num_splits=3, seed=6)):
        pytest.skip("this case runs with its loads counted, under the CPU interpreter only; on a GPU the "
                    "NaN bytes show an unmasked load")


@pytest.mark.parametrize("head_size", [3, 40], ids=lambda d: f"D={d}")
def test_decode_head_size_is_padded_and_masked(drill, device, head_size):
    decode(drill, _case(device, [7, 50], head_size=head_size, num_heads=3, num_kv_heads=1, num_splits=2, seed=7))


def test_decode_query_may_be_a_view_of_fused_qkv(drill, device):
    decode(drill, _case(device, [9, 40], layout="fused_qkv", num_splits=2, seed=8))


def test_decode_default_split_count_and_no_out(drill, device):
    decode(drill, _case(device, [30, 100], seed=9), use_out=False)


def test_decode_reports_the_kernel_error_and_the_format_error(drill, device):
    """Both numbers of content/l5.md §6: the kernel's error against exact attention on the fp8
    cache (graded), and fp8's own against the unquantised inputs (reported only)."""
    case = _case(device, [40, 100], dtype=torch.float32, num_splits=2, seed=10)
    out = decode(drill, case)
    kernel_error, format_error = fp8_errors(case, out)
    print(f"\nyour kernel is within {kernel_error:.3g} of exact on the fp8 cache; fp8 itself costs {format_error:.3g} "
          f"against the unquantised inputs (vLLM allows {FORMAT_TOLERANCE})")
    assert kernel_error < 1e-3 and format_error < FORMAT_TOLERANCE


@pytest.mark.launches_nothing  # nothing to do: no kernel need run
def test_decode_empty_batch(drill, device):
    case = _case(device, [3])
    out = drill.paged_decode_attention_fp8(case.query[:0], case.k_cache, case.v_cache, case.block_table[:0],
                                           case.seq_lens[:0], case.k_scale, case.v_scale, num_splits=2)
    assert out.shape == (0, 6, 16)


@settings(phases=(Phase.explicit, Phase.reuse, Phase.generate))
@given(params=decode_params())
def test_decode_matches_reference_on_random_cases(drill, device, params):
    decode(drill, decode_case(**params, device=device), seed=params["seed"])


def _bad_decodes(device):
    case = _case(device, [5, 20])
    query, k_cache, v_cache, table, lens, k_scale, v_scale = case.args()
    half = lambda c: c.float().half()  # noqa: E731
    return {
        "cache in float16": (query, half(k_cache), half(v_cache), table, lens, k_scale, v_scale),
        "scale of 3 heads for 2": (query, k_cache, v_cache, table, lens, torch.ones(3, device=device),
                                   torch.ones(3, device=device)),
        "scale in float64": (query, k_cache, v_cache, table, lens, k_scale.double(), v_scale.double()),
        "scale on another device": (query, k_cache, v_cache, table, lens, k_scale.to("meta"), v_scale.to("meta")),
        "query in float64": (query.double(), k_cache, v_cache, table, lens, k_scale, v_scale),
        "H_q not a multiple of H_kv": (query[:, :5], k_cache, v_cache, table, lens, k_scale, v_scale),
        "seq_len 0": (query, k_cache, v_cache, table, lens.clone().fill_(0), k_scale, v_scale),
    }


@pytest.mark.parametrize("what", list(_bad_decodes("cpu")))
def test_decode_rejects_bad_input(drill, device, what):
    if what == "seq_len 0" and device != "cpu":
        pytest.skip("on a GPU seq_lens are not checked: it would cost a device sync (content/l5.md §8)")
    with expect_value_error(what, "content/l5.md §8"):
        drill.paged_decode_attention_fp8(*_bad_decodes(device)[what], num_splits=2)


# Last: a kernel that overflows int32 may write or read far outside the cache and crash.
def test_caches_past_int32_need_int64_offsets(drill, device):
    """Caches of more than 2**31 fp8 elements: the write puts two tokens in the last slots and
    the decode reads them back, through blocks past 2**31 elements into the cache."""
    small = write_case(num_tokens=2, num_heads=1, head_size=128, block_size=16, device=device, seed=11)
    k_cache, v_cache = caches_past_int32(16, 1, 128, device, dtype=torch.float8_e4m3fn)
    num_blocks = k_cache.shape[0]
    slots = torch.tensor([num_blocks * 16 - 1, (num_blocks - 3) * 16], device=device)
    drill.reshape_and_cache_fp8(small.key, small.value, k_cache, v_cache, slots, small.k_scale, small.v_scale)
    for t, slot in enumerate(slots.tolist()):
        want = (small.key[t].float().cpu() / small.k_scale.cpu().view(-1, 1)).clamp(-448, 448).to(k_cache.dtype)
        got = k_cache.view(-1, 1, 128)[slot].cpu()
        if not torch.equal(fp8_bytes(got), fp8_bytes(want)):
            raise Mismatch(f"slot {slot} starts past 2**31 elements into the cache, and its bytes are wrong: offsets "
                           f"computed in int32 wrap around (content/l5.md §5)")
    table = torch.tensor([[num_blocks - 3, num_blocks - 1]], dtype=torch.int32, device=device)
    query = torch.randn(1, 2, 128, dtype=torch.float16, device=device)
    k_cache[num_blocks - 3, 1:] = 0.0  # the rest of the first block: zeros, a known value
    v_cache[num_blocks - 3, 1:] = 0.0
    k_cache[num_blocks - 1, :15] = 0.0
    v_cache[num_blocks - 1, :15] = 0.0
    out = drill.paged_decode_attention_fp8(query, k_cache, v_cache, table, torch.tensor([32], dtype=torch.int32,
                                           device=device), small.k_scale, small.v_scale, num_splits=2)
    dense_k = torch.cat([k_cache[num_blocks - 3], k_cache[num_blocks - 1]]).cpu().double()[:, 0] * \
        float(small.k_scale[0])
    dense_v = torch.cat([v_cache[num_blocks - 3], v_cache[num_blocks - 1]]).cpu().double()[:, 0] * \
        float(small.v_scale[0])
    want = ((query[0].cpu().double() @ dense_k.T) / 128 ** 0.5).softmax(-1) @ dense_v
    if not torch.allclose(out[0].cpu().double(), want, atol=2e-3, rtol=2e-3):
        raise Mismatch("the decode reads blocks past 2**31 elements into the cache wrongly: offsets computed in int32 "
                       "wrap around (content/l5.md §6)")
