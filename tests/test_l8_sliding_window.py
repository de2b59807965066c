"""L8: sliding-window attention with attention sinks (content/l8.md). Runs unchanged against any tree.

Every output is compared with the float64 dense reference (transformers' gpt-oss
definition: the sink concatenated to the logits, dropped after the softmax) within a
tolerance per dtype. The caches are built so that mistakes show: the block-table
entries of blocks wholly before the window are dead (-1, huge, another sequence's
block, or a block that holds NaN), blocks no sequence owns hold NaN, and the output is
a NaN-poisoned buffer inside a guarded allocation.
"""
import math

import pytest
import torch
from hypothesis import given, settings

import _env
from _diagnose import Mismatch, expect_value_error
from _paged import caches_past_int32, changed, snapshot
from drills.l8 import (SECTION, WindowCase, check_window, example_case, example_outputs, window_case,
                       window_params)

ALL_DTYPES = [torch.float16, torch.bfloat16, torch.float32]
TILE = 16  # the reference's key tile under the interpreter; on a GPU, 16 keys are still a few tiles' edges


def run(drill, case):
    """Call (with the case's NaN-poisoned, guarded `out`); check the output, the buffer
    around it, and that every input is bit for bit what it was."""
    before = snapshot(*case.args()[:-1], case.sinks)
    returned = case.call(drill)
    check_window(case, case.out if case.out is not None else returned, returned)
    if changed(before):
        raise Mismatch(f"an input was modified: {case.function} must only read its inputs")
    return returned


def _prefill(device, q_lens, context_lens, window_left, **kwargs):
    return window_case(q_lens, context_lens, window_left=window_left, device=device, **kwargs)


def _decode(device, context_lens, window_left, **kwargs):
    return window_case([1] * len(context_lens), context_lens, window_left=window_left, decode=True, device=device,
                       **kwargs)


# --- the worked example and one batch per dtype (content/l8.md §4) --------------------


def test_worked_example(drill, device):
    """§4: a chunk of 2 at positions 8 and 9, window_left 3, sink 1, block 0 dead (-1):
    every score is 1, so each output is the mean of what it sees with the sink as a 0."""
    out = run(drill, example_case(device=device))
    assert out.flatten().tolist() == pytest.approx(example_outputs(), abs=1e-5)
    for num_splits in (1, 2):
        case = example_case(decode=True, device=device)
        case.num_splits = num_splits
        assert run(drill, case).flatten().tolist() == pytest.approx(example_outputs()[-1:], abs=1e-5)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_each_dtype(drill, device, dtype):
    """Decode rows, a pure prefill and chunks over prefixes, window 5, a sink per head; then a decode batch."""
    run(drill, _prefill(device, [1, 20, 7, 1, 12], [30, 0, 17, 4, 20], 5, dtype=dtype, seed=1))
    run(drill, _decode(device, [30, 3, 17, 45], 5, dtype=dtype, num_splits=3, seed=2))


# --- the window's edges -------------------------------------------------------------------


@pytest.mark.parametrize("window_left", [0, 1, 3, 4, TILE - 1, TILE, 100],
                         ids=["0", "1", "block-1", "block", "tile-1", "tile", "past_the_context"])
def test_window_sizes(drill, device, window_left):
    """Blocks of 4: windows around a block and a key tile, none at all (0: the query alone),
    and one longer than every context (the whole causal prefix)."""
    run(drill, _prefill(device, [3, 17, 1], [21, 9, 33], window_left, seed=3))
    run(drill, _decode(device, [21, 9, 40, 2], window_left, num_splits=3, seed=4))


@pytest.mark.pitfall("window_off_by_one")
def test_window_holds_window_left_keys_and_the_query(drill, device):
    """pitfall:window_off_by_one: a query at p sees [p - window_left, p]: window_left + 1 keys."""
    run(drill, _prefill(device, [6, 1], [30, 12], 6, num_heads=4, seed=5))
    run(drill, _decode(device, [30, 12], 6, num_splits=2, num_heads=4, seed=6))


def test_no_window_is_l3_and_l4(drill, device):
    """window_left = -1 without sinks, and with sinks of -inf, is L3's and L4's attention,
    checked against their own references (tests/drills/l3, and L2's, which L4 equals)."""
    from drills.l2 import ref_paged_decode
    from drills.l3.reference import ref_paged_prefill

    for sinks in (None, float("-inf")):
        case = _prefill(device, [5, 1, 9], [11, 30, 0], -1, sinks=sinks, seed=7)
        out = run(drill, case)
        l3 = ref_paged_prefill(case.query, case.k_cache, case.v_cache, case.block_table, case.query_start_loc,
                               case.seq_lens)
        assert torch.allclose(out.double().cpu(), l3, atol=2e-3, rtol=2e-3)
        case = _decode(device, [11, 30, 1], -1, sinks=sinks, num_splits=2, seed=8)
        out = run(drill, case)
        l4 = ref_paged_decode(case.query, case.k_cache, case.v_cache, case.block_table, case.seq_lens)
        assert torch.allclose(out.double().cpu(), l4.double(), atol=2e-3, rtol=2e-3)


# --- the sink -----------------------------------------------------------------------------


@pytest.mark.parametrize("sink", [30.0, -30.0, float("-inf"), None], ids=["large", "large_negative", "-inf", "none"])
def test_sink_extremes(drill, device, sink):
    """A sink far above every score (the output shrinks toward 0, finite), far below (no
    effect), -inf (no sink) and none at all."""
    run(drill, _prefill(device, [4, 1], [20, 7], 9, sinks=sink, seed=9))
    run(drill, _decode(device, [20, 7, 50], 9, sinks=sink, num_splits=4, seed=10))


# Sinks near the scores of a short window (4 or 8 keys): a sink counted wrong moves every output far.
_SINKS = [2.5, 3.0, 2.0, 3.5, 1.5, 2.0, 3.0, 2.5]


@pytest.mark.pitfall("sink_scaled")
@pytest.mark.pitfall("sink_base_e")
def test_sink_is_a_natural_log_logit_not_scaled(drill, device):
    """pitfall:sink_scaled, pitfall:sink_base_e: scale 0.3 and sinks near the scores: a sink
    multiplied by the scale, or taken in base 2, weighs visibly less."""
    run(drill, _prefill(device, [5, 1], [14, 9], 3, scale=0.3, sinks=_SINKS, seed=11))
    run(drill, _decode(device, [14, 26], 3, scale=0.3, sinks=_SINKS, num_splits=2, seed=12))


@pytest.mark.pitfall("sink_per_kv_head")
@pytest.mark.parametrize("num_heads,num_kv_heads", [(6, 2), (8, 1)], ids=["group3", "group8"])
def test_sink_belongs_to_the_query_head(drill, device, num_heads, num_kv_heads):
    """pitfall:sink_per_kv_head: each query head has its own sink, sinks[h], far apart here."""
    sinks = [3.0, -3.0, -2.0, 3.0, 1.0, 2.5, -1.0, -2.5][:num_heads]
    run(drill, _prefill(device, [5, 1], [10, 19], 3, num_heads=num_heads, num_kv_heads=num_kv_heads, sinks=sinks,
                        seed=13))
    run(drill, _decode(device, [10, 19], 3, num_heads=num_heads, num_kv_heads=num_kv_heads, sinks=sinks,
                       num_splits=2, seed=14))


@pytest.mark.pitfall("sink_every_split")
@pytest.mark.parametrize("num_splits", [2, 5])
def test_sink_counted_once_whatever_num_splits(drill, device, num_splits):
    """pitfall:sink_every_split: the merge of the splits must count the sink once."""
    run(drill, _decode(device, [40, 70, 9], 7, num_splits=num_splits, sinks=_SINKS, seed=15))


@pytest.mark.pitfall("split_outside_window_nan")
@pytest.mark.parametrize("num_splits", [3])
def test_split_with_no_key_of_the_window_is_empty_not_nan(drill, device, num_splits):
    """pitfall:split_outside_window_nan: splits cut the window; sequence 1's window is its 4
    keys, so all but its first split hold no key and must add nothing, never NaN. Sequence
    0's window (101 keys) fills every split."""
    run(drill, _decode(device, [150, 3], 100, num_splits=num_splits, seed=16))
    run(drill, _decode(device, [150, 3], 100, sinks=None, num_splits=num_splits, seed=17))


# --- GQA, head sizes ------------------------------------------------------------------------


@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (6, 2), (5, 1), (6, 1), (8, 1)],
                         ids=["group1", "group3", "group5", "group6", "group8"])
def test_gqa_groups(drill, device, num_heads, num_kv_heads):
    run(drill, _prefill(device, [6, 1], [12, 25], 10, num_heads=num_heads, num_kv_heads=num_kv_heads, seed=18))
    run(drill, _decode(device, [12, 25], 10, num_heads=num_heads, num_kv_heads=num_kv_heads, num_splits=2, seed=19))


@pytest.mark.parametrize("head_size", [64, 128, 80], ids=lambda d: f"D={d}")
def test_head_sizes(drill, device, head_size):
    run(drill, _prefill(device, [4, 1], [10, 20], 6, head_size=head_size, num_heads=4, num_kv_heads=1, seed=20))
    run(drill, _decode(device, [10, 20], 6, head_size=head_size, num_heads=4, num_kv_heads=1, num_splits=2, seed=21))


# --- dead block-table entries before the window ------------------------------------------------


@pytest.mark.pitfall("tiles_outside_window_loaded")
def test_tiles_before_the_window_are_skipped(drill, device):
    """pitfall:tiles_outside_window_loaded: the blocks wholly before the window are dead and
    hold NaN. Sequence 1's window starts at 64, a tile edge, so its first live tile is
    whole: only a kernel that loads tiles before the window meets the NaN there. Sequence 3
    has no dead block."""
    run(drill, _decode(device, [50, 72, 20, 3], 8, num_splits=2, dead="nan", seed=22))


@pytest.mark.pitfall("dead_entries_as_block_numbers")
def test_first_live_tile_reads_no_dead_entry(drill, device):
    """pitfall:dead_entries_as_block_numbers: sequence 0's first query sees keys from 31 on,
    and blocks 0-6 (keys 0-27) are dead and hold NaN. Only its first block of queries has
    a first live tile that reaches back into them; its later query blocks' do not, and
    sequence 1 has no dead block."""
    run(drill, _prefill(device, [40, 1], [40, 5], 9, num_heads=8, num_kv_heads=2, dead="nan", seed=23))


@pytest.mark.parametrize("dead", ["-1", "huge", "other"])
def test_dead_entries_are_never_block_numbers(drill, device, dead):
    """design.md: entries of blocks wholly before the window may be -1, huge or another
    sequence's block: never used as block numbers, and no input check may raise on them.
    (Not marked with pitfall:dead_entries_as_block_numbers: the NaN case above singles it
    out; a crash here is said as a crash, with what it usually means.)"""
    run(drill, _prefill(device, [6, 1, 3], [37, 22, 50], 9, dead=dead, seed=24))
    run(drill, _decode(device, [37, 22, 50], 9, dead=dead, num_splits=3, seed=25))


# --- the rest of the contract ------------------------------------------------------------------


def test_out_may_be_left_out(drill, device):
    run(drill, _prefill(device, [4, 1], [3, 9], 2, out=False, seed=26))
    run(drill, _decode(device, [3, 9], 2, out=False, seed=27))


def test_query_may_be_a_view_of_fused_qkv(drill, device):
    case = _prefill(device, [5, 3], [7, 0], 4, layout="fused_qkv", seed=28)
    assert not case.query.is_contiguous()
    run(drill, case)
    run(drill, _decode(device, [7, 12], 4, layout="fused_qkv", seed=29))


@pytest.mark.launches_nothing  # nothing to do: no kernel need run
def test_empty_batch(drill, device):
    case = _prefill(device, [3], [2], 1, out=False)
    out = drill.paged_prefill_attention_window(case.query[:0], case.k_cache, case.v_cache, case.block_table,
                                               torch.tensor([0, 0], dtype=torch.int32, device=device),
                                               case.seq_lens, 1)
    assert out.shape == (0, 8, 16)


# A third of the profile's examples for each function: each example is a fresh batch of kernels.
_FEW = settings(max_examples=max(settings.default.max_examples // 4, 2))


@_FEW
@given(params=window_params())
def test_prefill_matches_reference(drill, device, params):
    run(drill, window_case(**params, device=device))


@_FEW
@given(params=window_params(decode=True))
def test_decode_matches_reference(drill, device, params):
    run(drill, window_case(**params, device=device))


# --- bad input is refused (§5) ----------------------------------------------------------------


def _bad_inputs(device):
    case = _prefill(device, [3, 5], [4, 0], 2, out=False)
    q, k, v, table, starts, lens, w = case.args()
    sinks = case.sinks
    dq = _decode(device, [4, 6], 2, out=False).query
    return {
        "window_left = -2": ("prefill", (q, k, v, table, starts, lens, -2), {}),
        "window_left a float": ("prefill", (q, k, v, table, starts, lens, 2.0), {}),
        "window_left a bool": ("decode", (dq, k, v, table, lens, True), {}),
        "window_left a tensor": ("decode", (dq, k, v, table, lens, torch.tensor(2)), {}),
        "sinks in bfloat16": ("prefill", (q, k, v, table, starts, lens, w), {"sinks": sinks.bfloat16()}),
        "sinks of H_kv heads": ("decode", (dq, k, v, table, lens, w), {"sinks": sinks[:2].clone()}),
        "sinks [1, H_q]": ("prefill", (q, k, v, table, starts, lens, w), {"sinks": sinks[None]}),
        "sinks not contiguous": ("decode", (dq, k, v, table, lens, w),
                                 {"sinks": torch.stack([sinks, sinks], 1)[:, 0]}),
        "num_splits = 0": ("decode", (dq, k, v, table, lens, w), {"num_splits": 0}),
        "H_q not a multiple of H_kv": ("prefill", (q[:, :3], k, v, table, starts, lens, w), {}),
        "cache dtype != query dtype": ("decode", (dq, k.float(), v.float(), table, lens, w), {}),
        "non-contiguous k_cache": ("prefill", (q, k.transpose(1, 2).contiguous().transpose(1, 2), v, table, starts,
                                               lens, w), {}),
        "float seq_lens": ("decode", (dq, k, v, table, lens.float(), w), {}),
        "q_len > seq_len": ("prefill", (q, k, v, table, starts, torch.tensor([7, 4], dtype=torch.int32,
                                                                              device=device), w), {}),
        "block number past the cache inside the window": ("decode", (dq, k, v, table.clone().fill_(k.shape[0]), lens,
                                                                     w), {}),
    }


_VALUE_CHECKS = ("q_len > seq_len", "block number")


@pytest.mark.parametrize("what", list(_bad_inputs("cpu")))
def test_rejects_bad_input(drill, device, what):
    if what.startswith(_VALUE_CHECKS) and device != "cpu":
        pytest.skip("on a GPU the values of seq_lens and the block table are not checked: it would cost a device "
                    "sync (content/l8.md §8)")
    kind, args, kwargs = _bad_inputs(device)[what]
    function = drill.paged_decode_attention_window if kind == "decode" else drill.paged_prefill_attention_window
    with expect_value_error(what, "content/l8.md §8"):
        function(*args, **kwargs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a second device type")
def test_rejects_sinks_on_another_device(drill):
    case = _decode("cuda", [4, 6], 2, out=False)
    with expect_value_error("sinks on the CPU with the rest on the GPU", "content/l8.md §8"):
        drill.paged_decode_attention_window(*case.args(), sinks=case.sinks.cpu())


# Last: a kernel that overflows int32 may read far outside the cache and crash the process.
@pytest.mark.pitfall("int32_offsets")
def test_large_cache_needs_int64_offsets(drill, device):
    """pitfall:int32_offsets: a cache of more than 2**31 elements. The same tokens in a small
    cache come first: if they are wrong too, it is not about int32."""
    small = _decode(device, [40, 27], 10, num_heads=4, num_kv_heads=1, head_size=128, block_size=16,
                    extra_columns=0, num_splits=2, seed=30)
    run(drill, small)
    k_cache, v_cache = caches_past_int32(16, 1, 128, device)
    num_blocks = k_cache.shape[0]
    table = small.block_table.clone()
    width = table.shape[1]
    for b in range(2):
        for column in range(width):
            block = int(small.block_table[b, column])
            if block < 0 or block >= small.k_cache.shape[0]:
                continue  # a dead entry stays as it is
            table[b, column] = num_blocks - 1 - column - width * b
            k_cache[table[b, column]] = small.k_cache[block]
            v_cache[table[b, column]] = small.v_cache[block]
    large = WindowCase(query=small.query, k_cache=k_cache, v_cache=v_cache, block_table=table,
                       query_start_loc=small.query_start_loc, seq_lens=small.seq_lens, window_left=10,
                       sinks=small.sinks, decode=True, num_splits=2)
    try:
        check_window(large, large.call(drill))
    except Mismatch as error:
        raise Mismatch(f"right in a small cache, wrong when the blocks start past 2**31 elements into the cache: "
                       f"offsets computed in int32 wrap around (pitfall:int32_offsets, {SECTION})\n{error}",
                       ["int32_offsets"]) from None
