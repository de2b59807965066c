"""L7: MLA decode over a paged latent cache (content/l7.md). Runs unchanged against any tree.

The write is compared bit for bit with the plain-PyTorch reference over the whole guarded
cache. The decode is compared with plain attention in float64 (out within a tolerance per
dtype, lse to 1e-3): every block no sequence owns and the unused end of last blocks may hold
NaN, unused block-table entries name NaN blocks or FlashMLA's 2147480000, and `out` is a
poisoned view inside a guarded buffer. Under the interpreter the latents are small (R = 32
or 48, P = 16 or 8); on a GPU DeepSeek's R = 512, P = 64.
"""
import pytest
import torch
import triton
from hypothesis import given

import _env
from _diagnose import Mismatch, expect_value_error
from _paged import DTYPES, caches_past_int32, changed, poisoned_out, snapshot
from drills.l7 import (HUGE, WORKED_EXAMPLE, DecodeCase, check_decode, check_latent_read_once, check_padding_not_read,
                       check_write, decode_case, decode_params, random_write_case, worked_example_decode_case,
                       worked_example_numbers, write_case, write_params)
from drills.l7.checks import WrongValues

ALL_DTYPES = list(DTYPES.values())
LATENT = (32, 16) if _env.INTERPRET else (512, 64)  # (R, P) of the fixed cases
INPUTS = ("q_nope", "q_pe", "kv_cache", "block_table", "seq_lens")


def run(drill, case, use_out=True, seed=0):
    """Call mla_decode_attention and check everything: (out, lse), the poisoned and guarded
    out= (its guards 64 head rows wide: a head tile's spare rows land there), the inputs left
    bit for bit alone. Returns (out, lse)."""
    before = snapshot(*case.args()[:5])
    out = None
    if use_out:
        shape = case.q_nope.shape
        out = poisoned_out(shape, case.q_nope.dtype, case.q_nope.device, torch.Generator().manual_seed(seed),
                           margin=64 * shape[2])
        result = drill.mla_decode_attention(*case.args(), **case.kwargs(), out=out.view)
    else:
        result = drill.mla_decode_attention(*case.args(), **case.kwargs())
    check_decode(case, result, out)
    for i in changed(before):
        raise Mismatch(f"{INPUTS[i]} was modified: mla_decode_attention must only read its inputs")
    return result


def written(drill, case):
    drill.concat_and_cache_mla(*case.args())
    check_write(case)


def _case(device, seq_lens, **kwargs):
    rank, rope = LATENT
    return decode_case(seq_lens, **{**dict(num_heads=16, rank=rank, rope=rope, block_size=16), **kwargs}, device=device)


def _write(device, num_tokens=6, **kwargs):
    rank, rope = LATENT
    return random_write_case(num_tokens, **{**dict(num_blocks=3, block_size=16, rank=rank, rope=rope), **kwargs},
                             device=device)


# --- the worked example ------------------------------------------------------


def test_write_worked_example(drill, device):
    """Three tokens of R = 2, P = 1 into slots 4, 5 and 0 of three blocks of two."""
    ex = WORKED_EXAMPLE
    case = write_case(ex["slots"], num_blocks=ex["num_blocks"], block_size=ex["block_size"], rank=2, rope=1,
                      dtype=torch.float32, device=device)
    case.kv_c.copy_(torch.tensor(ex["kv_c"]))
    case.k_pe.copy_(torch.tensor(ex["k_pe"]))
    case.inputs_initial = case.inputs.clone()
    written(drill, case)


def test_decode_worked_example(drill, device):
    """Two heads over the three rows, scale 0.5: the page's scores, weights, out and lse."""
    if torch.device(device).type == "cuda" and tuple(map(int, triton.__version__.split(".")[:2])) < (3, 7):
        pytest.skip("on a GPU, Triton before 3.7 vectorises the loads of a row as wide as R + P = 3 into misaligned "
                    "ones when its address is written as one product (content/l7.md §12): a right kernel could "
                    "crash; the CPU grade runs this example")
    out, lse = run(drill, worked_example_decode_case(device))
    n = worked_example_numbers()
    torch.testing.assert_close(out[0].cpu().double(), n["out"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse[0].cpu().double(), n["lse"], atol=1e-5, rtol=1e-5)


# --- the write (concat_and_cache_mla) ------------------------------------------


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_write_is_bit_exact_for_each_dtype(drill, device, dtype):
    written(drill, _write(device, dtype=dtype, seed=1))


@pytest.mark.parametrize("layout", ["fused", "strided"])
def test_write_reads_views_with_their_own_row_strides(drill, device, layout):
    """kv_c and k_pe as the two column ranges of one projection output, or rows R + 3 and
    P + 5 apart: each read with its own stride, in place."""
    written(drill, _write(device, layout=layout, seed=2))


@pytest.mark.parametrize("latent", [(48, 8), (33, 5)], ids=lambda x: f"R={x[0]},P={x[1]}")
def test_write_widths_not_powers_of_two(drill, device, latent):
    written(drill, _write(device, rank=latent[0], rope=latent[1], block_size=64, seed=3))


@pytest.mark.pitfall("padding_written")
@pytest.mark.parametrize("padding", [[0], [2], [5], [0, 1, 2, 3, 4, 5]], ids=["first", "middle", "last", "all"])
def test_padding_tokens_write_nothing(drill, device, padding):
    written(drill, _write(device, padding=padding, seed=4))


@pytest.mark.pitfall("padding_written")
def test_padding_tokens_read_nothing(drill, device):
    """A padding token's kv_c and k_pe rows are not even read. The values decide; the loads,
    counted in the worker under the CPU interpreter, explain a failure (the worker's word)."""
    if not check_padding_not_read(drill, _write(device, padding=[0, 3], seed=5)):
        pytest.skip("this case runs with its loads counted, under the CPU interpreter only")


@pytest.mark.launches_nothing  # nothing to do: no kernel need run
def test_zero_tokens_is_a_no_op(drill, device):
    written(drill, _write(device, num_tokens=0))


@given(params=write_params())
def test_write_matches_reference(drill, device, params):
    written(drill, random_write_case(**params, device=device))


# --- the decode: agreement with plain attention ----------------------------------


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_matches_reference_for_each_dtype(drill, device, dtype):
    run(drill, _case(device, [1, 16, 17, 90], dtype=dtype, num_splits=3, seed=1))


@pytest.mark.parametrize("num_heads", [1, 3, 16, 63, 128])
def test_every_head_count(drill, device, num_heads):
    """One head, odd counts, DeepSeek-V3 over 8 GPUs (16) and whole (128): one split stores
    straight into out, three go through the merge."""
    for num_splits in (1, 3):
        run(drill, _case(device, [20, 70], num_heads=num_heads, num_splits=num_splits, seed=2))


@pytest.mark.parametrize("latent", [(48, 8), (33, 5)], ids=lambda x: f"R={x[0]},P={x[1]}")
def test_widths_not_powers_of_two(drill, device, latent):
    run(drill, _case(device, [7, 70], num_heads=3, rank=latent[0], rope=latent[1], num_splits=2, seed=3))


def test_deepseek_shape(drill, device):
    """R = 512, P = 64 in bfloat16, blocks of 64, H = 16: the real row, under the interpreter too."""
    run(drill, _case(device, [1, 64, 65, 200], rank=512, rope=64, block_size=64, dtype=torch.bfloat16, seed=4))


@pytest.mark.parametrize("block_size", [16, 64])
def test_lengths_at_block_edges(drill, device, block_size):
    """One token, a whole block, one past, two blocks: where the last block's tail starts."""
    run(drill, _case(device, [1, block_size, block_size + 1, 2 * block_size], block_size=block_size, num_splits=2,
                     tail="nan", seed=5))


def test_unused_table_entries_hold_huge_block_numbers(drill, device):
    """FlashMLA's tests put 2147480000 in every unused block-table entry: a kernel that uses
    one as a block number reads far outside the cache."""
    case = _case(device, [5, 17, 40], garbage="huge", extra_columns=3, tail="nan", num_splits=3, seed=6)
    assert int(case.block_table.max()) == HUGE
    run(drill, case)


@pytest.mark.parametrize("q_layout", ["concat", "absorbed"])
def test_queries_may_be_views(drill, device, q_layout):
    """q_nope and q_pe as the two halves of one q [B, H, R + P], or q_nope as the transposed
    [H, B, R] product W_UK gives (heads R·B apart)."""
    run(drill, _case(device, [9, 70], num_heads=3, q_layout=q_layout, num_splits=2, seed=7))


@pytest.mark.parametrize("num_splits", [1, 2, 3, 7])
def test_every_split_count_gives_the_same_answer(drill, device, num_splits):
    run(drill, _case(device, [5, 64, 65, 150], num_heads=3, num_splits=num_splits, seed=8))


def test_most_chunks_empty(drill, device):
    """Eight chunks: sequences of 1 and 3 tokens leave at least five of them empty."""
    run(drill, _case(device, [1, 3, 150], num_heads=3, num_splits=8, seed=9))


def test_default_split_count(drill, device):
    run(drill, _case(device, [30, 130], seed=10))


@pytest.mark.mistake("out_float32_when_not_given")
def test_output_without_out_is_a_new_tensor(drill, device):
    run(drill, _case(device, [30, 130], num_splits=2, seed=11), use_out=False)


@pytest.mark.mistake("merge_without_max")
def test_large_scores_across_splits(drill, device):
    """Scores in the hundreds (a sharp softmax, as a long context's can be), four splits: every
    chunk's lse is past 88.7, where exp(lse) overflows float32, so the merge must weigh the
    chunks by exp(lse - the largest lse). The other cases' lse stay near 10."""
    case = _case(device, [50, 130], num_heads=3, scale=20.0 if LATENT[0] == 32 else 5.0, num_splits=4, seed=18)
    smallest = float(case.reference()[1].min())
    assert smallest > 100, f"this case exists to put every lse past 88.7, but its smallest is {smallest:.1f}"
    run(drill, case)


def test_decode_reads_what_the_write_wrote(drill, device):
    """L1 then L4 on one cache: each sequence's newest token written by concat_and_cache_mla
    into its slot, then the decode over every row, the new one included."""
    case = _case(device, [6, 33], num_heads=3, num_splits=2, seed=12)
    rank = case.q_nope.shape[2]
    slots = [int(case.block_table[b, (n - 1) // 16]) * 16 + (n - 1) % 16 for b, n in enumerate([6, 33])]
    new = torch.randn(2, case.kv_cache.shape[2], generator=torch.Generator().manual_seed(0)).to(case.kv_cache.dtype)
    drill.concat_and_cache_mla(new[:, :rank].to(device), new[:, rank:].to(device), case.kv_cache,
                               torch.tensor(slots, device=device))
    assert torch.equal(case.kv_cache.view(-1, case.kv_cache.shape[2])[slots].cpu(), new)
    run(drill, case)


@pytest.mark.launches_nothing  # nothing to do: no kernel need run
def test_empty_batch(drill, device):
    case = _case(device, [3])
    out, lse = drill.mla_decode_attention(case.q_nope[:0], case.q_pe[:0], case.kv_cache, case.block_table[:0],
                                          case.seq_lens[:0], case.scale, num_splits=2)
    assert out.shape == (0, 16, LATENT[0]) and lse.shape == (0, 16) and lse.dtype == torch.float32


@given(params=decode_params())
def test_decode_matches_reference(drill, device, params):
    run(drill, decode_case(**params, device=device), seed=params["seed"])


# --- each pitfall on the page ----------------------------------------------------


@pytest.mark.pitfall("scale_from_row_width")
def test_scale_is_the_callers(drill, device):
    """pitfall:scale_from_row_width: the scale given (DeepSeek-V3's 0.1352, 192 ** -0.5 times
    its YaRN factor squared) is far from 1/sqrt(R + P); one split, then four."""
    for num_splits in (1, 4):
        run(drill, _case(device, [40, 90], scale=0.1352 if LATENT[0] == 512 else 0.4, num_splits=num_splits, seed=13))


@pytest.mark.pitfall("rope_part_left_out")
def test_rotary_part_is_in_the_score(drill, device):
    """pitfall:rope_part_left_out: q_pe · k_pe moves every score, so leaving it out moves every output."""
    run(drill, _case(device, [40, 90], scale=0.3, num_splits=2, seed=14))


@pytest.mark.pitfall("head_tile_unmasked")
@pytest.mark.parametrize("num_heads", [1, 3, 63])
def test_head_tile_spare_rows_are_masked(drill, device, num_heads):
    """pitfall:head_tile_unmasked: H not a multiple of any head tile; one split stores straight
    into out, whose guard after it is a head tile wide: a spare row stored lands there."""
    run(drill, _case(device, [20, 45], num_heads=num_heads, num_splits=1, seed=15))


@pytest.mark.pitfall("empty_sequence_nan")
@pytest.mark.parametrize("num_splits", [1, 4])
def test_empty_sequences_give_zero_and_minus_inf(drill, device, num_splits):
    """pitfall:empty_sequence_nan: seq_lens[b] = 0 gives out = 0 and lse = -inf, never NaN,
    beside sequences that have tokens."""
    out, lse = run(drill, _case(device, [0, 5, 0, 70], num_heads=3, num_splits=num_splits, seed=16))
    assert bool((out[[0, 2]] == 0).all()) and bool((lse[[0, 2]] == float("-inf")).all())


@pytest.mark.pitfall("value_loaded_again")
def test_latent_rows_are_read_once(drill, device):
    """pitfall:value_loaded_again: every latent row read once per (sequence, split): the value
    is the key tile's first R columns, never loaded again. The answer decides; the loads,
    counted in the worker under the CPU interpreter, are the worker's word: a right answer
    that loads the value again passes, and the traffic report names the pitfall (advice)."""
    case = _case(device, [70, 33], num_heads=16, num_splits=2, seed=17)
    if not check_latent_read_once(drill, case):
        pytest.skip("this case runs with its loads counted, under the CPU interpreter only")


# --- bad input is refused ----------------------------------------------------------


def _bad_writes(device):
    case = _write(device)
    kv_c, k_pe, cache, slots = case.args()
    return {
        "k_pe with another T": (kv_c, k_pe[:2], cache, slots),
        "kv_c without a row axis": (kv_c[0], k_pe, cache, slots),
        "cache width != R + P": (kv_c, k_pe[:, :-1].contiguous(), cache, slots),
        "4-D cache": (kv_c, k_pe, cache[:, :, None], slots),
        "slot_mapping length != T": (kv_c, k_pe, cache, slots[:2]),
        "float slot_mapping": (kv_c, k_pe, cache, slots.float()),
        "k_pe dtype != kv_c dtype": (kv_c, k_pe.float(), cache, slots),
        "float64 everywhere": (kv_c.double(), k_pe.double(), cache.double(), slots),
        "non-contiguous cache": (kv_c, k_pe, cache.transpose(0, 1).contiguous().transpose(0, 1), slots),
        "kv_c whose rows are not contiguous": (kv_c.t().contiguous().t(), k_pe, cache, slots),
        "slot past the end of the cache": (kv_c, k_pe, cache, slots.clone().fill_(cache.shape[0] * cache.shape[1])),
        "slot below -1": (kv_c, k_pe, cache, slots.clone().fill_(-2)),
    }


@pytest.mark.parametrize("what", list(_bad_writes("cpu")))
def test_write_rejects_bad_input(drill, device, what):
    if what.startswith("slot ") and device != "cpu":
        pytest.skip("on a GPU the slot range is not checked: it would cost a device sync (content/l7.md §8)")
    with expect_value_error(what, "content/l7.md §8"):
        drill.concat_and_cache_mla(*_bad_writes(device)[what])


def _bad_decodes(device):
    case = _case(device, [5, 20])
    q_nope, q_pe, cache, table, lens, scale = case.args()
    ok = (q_nope, q_pe, cache, table, lens)
    return {
        "scale None": (ok, dict(scale=None)),
        "scale 0": (ok, dict(scale=0.0)),
        "num_splits 0": (ok, dict(scale=scale, num_splits=0)),
        "num_splits 2.5": (ok, dict(scale=scale, num_splits=2.5)),
        "out of another shape": (ok, dict(scale=scale, out=torch.empty_like(q_nope[:1]))),
        "out of another dtype": (ok, dict(scale=scale, out=torch.empty(q_nope.shape, dtype=torch.float32,
                                                                       device=device))),
        "out whose heads are not contiguous": (ok, dict(scale=scale, out=torch.empty_like(q_nope).transpose(1, 2)
                                                        .contiguous().transpose(1, 2))),
        "q_pe with other heads": ((q_nope, q_pe[:, :3], cache, table, lens), dict(scale=scale)),
        "q_nope without a head axis": ((q_nope[:, 0], q_pe, cache, table, lens), dict(scale=scale)),
        "cache width != R + P": ((q_nope[..., :8].contiguous(), q_pe, cache, table, lens), dict(scale=scale)),
        "4-D cache": ((q_nope, q_pe, cache[:, :, None], table, lens), dict(scale=scale)),
        "block_table rows != B": ((q_nope, q_pe, cache, table[:1], lens), dict(scale=scale)),
        "seq_lens length != B": ((q_nope, q_pe, cache, table, lens[:1]), dict(scale=scale)),
        "float seq_lens": ((q_nope, q_pe, cache, table, lens.float()), dict(scale=scale)),
        "float block_table": ((q_nope, q_pe, cache, table.float(), lens), dict(scale=scale)),
        "cache dtype != q dtype": ((q_nope, q_pe, cache.float(), table, lens), dict(scale=scale)),
        "float64 everywhere": ((q_nope.double(), q_pe.double(), cache.double(), table, lens), dict(scale=scale)),
        "non-contiguous cache": ((q_nope, q_pe, cache.transpose(0, 1).contiguous().transpose(0, 1), table, lens),
                                 dict(scale=scale)),
        "q_nope with a strided last axis": ((q_nope.transpose(1, 2).contiguous().transpose(1, 2), q_pe, cache, table,
                                             lens), dict(scale=scale)),
        "block_table whose rows are strided": ((q_nope, q_pe, cache, torch.stack([table, table], -1)[..., 0], lens),
                                               dict(scale=scale)),
        "seq_len -1": ((q_nope, q_pe, cache, table, lens.clone().fill_(-1)), dict(scale=scale)),
        "seq_len beyond the block table": ((q_nope, q_pe, cache, table,
                                            lens.clone().fill_(table.shape[1] * cache.shape[1] + 1)),
                                           dict(scale=scale)),
        "block number past the cache": ((q_nope, q_pe, cache, table.clone().fill_(cache.shape[0]), lens),
                                        dict(scale=scale)),
    }


@pytest.mark.parametrize("what", list(_bad_decodes("cpu")))
def test_decode_rejects_bad_input(drill, device, what):
    args, kwargs = _bad_decodes(device)[what]
    if what.startswith(("seq_len ", "block number")) and device != "cpu":
        pytest.skip("on a GPU seq_lens and block numbers are not checked: it would cost a device sync "
                    "(content/l7.md §8)")
    with expect_value_error(what, "content/l7.md §8"):
        drill.mla_decode_attention(*args, **kwargs)


# --- last: a kernel that overflows int32 may read or write far outside the cache --------


def _cache_past_int32(device, block_size):
    """A latent cache [num_blocks, block_size, R + P] of just over 2**31 elements (never filled)."""
    rank, rope = LATENT
    cache, _ = caches_past_int32(block_size, 1, rank + rope, device)
    return cache.view(cache.shape[0], block_size, rank + rope)


@pytest.mark.pitfall("int32_offsets")
def test_write_past_int32_needs_int64_offsets(drill, device):
    """Slots near the end of a cache past 2**31 elements: slot * (R + P) no longer fits in
    int32. Slot 5, near the start, is the control."""
    cache = _cache_past_int32(device, 16)
    width = cache.shape[2]
    num_slots = cache.shape[0] * 16
    slots = torch.tensor([num_slots - 1, 5, num_slots - 19], dtype=torch.int32, device=device)
    rows = torch.randn(3, width, generator=torch.Generator().manual_seed(0)).to(cache.dtype).to(device)
    flat = cache.view(num_slots, width)
    flat[slots.long()] = float("nan")
    drill.concat_and_cache_mla(rows[:, :LATENT[0]], rows[:, LATENT[0]:], cache, slots)
    right = [torch.equal(flat[s], rows[t]) for t, s in enumerate(slots.tolist())]
    if not all(right):
        t = right.index(False)
        error = Mismatch(f"token {t} belongs in slot {int(slots[t])} (flat offset {int(slots[t]) * width:,}), but the "
                         f"slot does not hold its row (content/l7.md §10)")
        if right[1]:  # the slot near the start is right: only the offsets past 2**31 went wrong
            error = Mismatch(f"{error}\n  slot 5, near the start of the cache, is right: offsets computed in int32 "
                             f"wrap around past 2**31 (pitfall:int32_offsets, content/l7.md §10)", ["int32_offsets"])
        raise error


@pytest.mark.pitfall("int32_offsets")
def test_decode_past_int32_needs_int64_offsets(drill, device):
    """The same sequence in a small cache, then in blocks past 2**31 elements of a large one:
    right in the first, wrong in the second means offsets computed in int32."""
    small = _case(device, [40], num_heads=3, extra_columns=0, num_splits=2)
    run(drill, small)
    cache = _cache_past_int32(device, 16)
    num_blocks = cache.shape[0]
    table = torch.tensor([[num_blocks - 1, 5, num_blocks - 3]], dtype=torch.int32, device=device)
    for column, block in enumerate(table[0].tolist()):
        cache[block] = small.kv_cache[small.block_table[0, column]]
    large = DecodeCase(small.q_nope, small.q_pe, cache, table, small.seq_lens, small.scale, num_splits=2)
    # Called as the small case was (a poisoned out=): a mismatch that only one way of calling
    # shows (a wrong dtype when out= is left out) is no wrapped offset. Only wrong values
    # (the contract kept) name int32; any other mismatch is said as it is.
    out = poisoned_out(large.q_nope.shape, large.q_nope.dtype, device, torch.Generator().manual_seed(0),
                       margin=64 * large.q_nope.shape[2])
    try:
        check_decode(large, drill.mla_decode_attention(*large.args(), **large.kwargs(), out=out.view), out)
    except WrongValues as error:
        raise Mismatch(f"right in a small cache, wrong when blocks {num_blocks - 1} and {num_blocks - 3} start past "
                       f"2**31 elements into the cache: offsets computed in int32 wrap around "
                       f"(pitfall:int32_offsets, content/l7.md §10)\n{error}", ["int32_offsets"]) from None
