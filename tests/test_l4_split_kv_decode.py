"""L4: split-KV decode and the log-sum-exp merge (content/l4.md). Runs unchanged against any tree.

Every output is compared with plain attention in float64 (the split count does not
change the answer) within a tolerance per dtype. As in L2, blocks no sequence owns
and every garbage block-table column hold NaN, and `out` is a poisoned view inside a
guarded buffer. The partial results are poisoned where the merge gets them as input:
an empty side's `v` is NaN garbage. A failure says which sequence, query head and
chunk is off, and which mistake reproduces it.
"""

import pytest

import _env
import torch
from hypothesis import Phase, given, settings

from _diagnose import Mismatch, expect_value_error
from _paged import DTYPES, bits, caches_past_int32, changed, poisoned_out, snapshot
from drills.l4 import (MERGE_EXAMPLE, MergeCase, check_merge, check_table_read_only_to_last_block, check_split_decode,
                       last_tokens_score_highest, merge_case, merge_example_case, merge_example_numbers, merge_params,
                       one_side_empty_case, split_case, split_params, spread_chunks)

ALL_DTYPES = list(DTYPES.values())


INPUTS = ("query", "k_cache", "v_cache", "block_table", "seq_lens")


def run(drill, case, use_out=True, seed=0):
    """Call paged_decode_attention_split on the case and check everything: the output
    (or the poisoned, guarded out=), the guards, the inputs left bit for bit alone."""
    before = snapshot(*case.args())
    if use_out:
        out = poisoned_out(case.query.shape, case.query.dtype, case.query.device, torch.Generator().manual_seed(seed))
        returned = drill.paged_decode_attention_split(*case.args(), **case.kwargs(), out=out.view)
        check_split_decode(case, out, returned)
        result = out.view
    else:
        result = drill.paged_decode_attention_split(*case.args(), **case.kwargs())
        check_split_decode(case, result)
    for i in changed(before):
        raise Mismatch(f"{INPUTS[i]} was modified: paged_decode_attention_split must only read its inputs")
    return result


def merged(drill, case):
    """Call merge_attention_states and check (v, s) and that the inputs were left alone."""
    before = snapshot(*case.args())
    got = drill.merge_attention_states(*case.args())
    check_merge(case, got)
    for i in changed(before):
        raise Mismatch(f"{('v_a', 's_a', 'v_b', 's_b')[i]} was modified: merge_attention_states must only read "
                       f"its inputs")
    return got


def _case(device, seq_lens, **kwargs):
    shape = dict(num_heads=8, num_kv_heads=2, head_size=16, block_size=16)
    return split_case(seq_lens, **{**shape, **kwargs}, device=device)


def _merge_of(device, v_a, s_a, v_b, s_b, dtype=torch.float32):
    """A MergeCase of one head from numbers: v_* a list of D values per row, or one row;
    s_* a number per row, or one number."""
    rows = lambda x: x if isinstance(x[0], list) else [x]  # noqa: E731
    v = lambda x: torch.tensor(rows(x), dtype=torch.float32)[:, None].to(dtype).to(device)  # noqa: E731
    s = lambda x: torch.tensor(x if isinstance(x, list) else [x], dtype=torch.float32, device=device)[:, None]  # noqa: E731
    return MergeCase(v(v_a), s(s_a), v(v_b), s(s_b))


# --- the worked example (content/l4.md §3) ----------------------------------


def test_merge_worked_example(drill, device):
    """§3: chunks (1, 3) and (4, 2) of L2's example, merged by their LSEs, give L2's answer."""
    n = merge_example_numbers()
    case = _merge_of(device, [n["v_a"]], n["s_a"], [n["v_b"]], n["s_b"])
    v, s = merged(drill, case)
    assert float(v) == pytest.approx(n["whole"], abs=1e-5) and float(s) == pytest.approx(n["s"], abs=1e-5)


def test_split_worked_example(drill, device):
    """§3's row through the whole function, num_splits = 2."""
    out = run(drill, merge_example_case(device))
    weights = torch.tensor(MERGE_EXAMPLE["scores"]).softmax(0)
    assert float(out) == pytest.approx(float(weights @ torch.tensor(MERGE_EXAMPLE["values"])), abs=1e-5)


# --- the merge (§3, §4) -----------------------------------------------------


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_merge_matches_reference_for_each_dtype(drill, device, dtype):
    merged(drill, merge_case(rows=4, heads=3, head_size=24, dtype_a=dtype, device=device, seed=1))


def test_merge_keeps_v_a_dtype_when_sides_differ(drill, device):
    merged(drill, merge_case(dtype_a=torch.float16, dtype_b=torch.float32, device=device, seed=2))


@pytest.mark.pitfall("last_chunk_dropped")
def test_merge_uses_both_sides(drill, device):
    """pitfall:last_chunk_dropped: side b (the last part) weighs as much as side a here."""
    merged(drill, merge_case(rows=2, heads=2, head_size=8, spread=0.5, device=device, seed=3))


def test_merge_is_associative(drill, device):
    """Three parts: (a ∪ b) ∪ c, a ∪ (b ∪ c) and plain attention over all three agree."""
    a, b, c = (merge_case(rows=3, heads=2, head_size=8, spread=3.0, device=device, seed=s) for s in (4, 5, 6))
    ab = merged(drill, MergeCase(a.v_a, a.s_a, b.v_a, b.s_a))
    bc = merged(drill, MergeCase(b.v_a, b.s_a, c.v_a, c.s_a))
    left = merged(drill, MergeCase(*ab, c.v_a, c.s_a))
    right = merged(drill, MergeCase(a.v_a, a.s_a, *bc))
    # On a GPU tl.exp and tl.log are the fast hardware approximations (a few ulp), so
    # the two orders agree to about 1e-5 there; a wrong merge is off by far more.
    torch.testing.assert_close(left[0], right[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(left[1], right[1], atol=1e-4, rtol=1e-5)


@pytest.mark.pitfall("empty_split_nan")
@pytest.mark.parametrize("empty", ["a", "b"])
def test_merge_with_an_empty_side_returns_the_other(drill, device, empty):
    """pitfall:empty_split_nan: where one side's s is -inf and its v is garbage (NaN), the
    other side comes back unchanged, bit for bit. Row 0 has both sides, so a merge that
    is wrong without any empty side is seen for what it is there."""
    case = one_side_empty_case(empty, device)
    v, s = merged(drill, case)
    keep_v, keep_s = (case.v_b, case.s_b) if empty == "a" else (case.v_a, case.s_a)
    if not (torch.equal(bits(v[1:]), bits(keep_v[1:])) and torch.equal(bits(s[1:]), bits(keep_s[1:]))):
        raise Mismatch(f"merging with an empty side {empty} must return the other side unchanged, bit for bit "
                       f"(its weight is exactly 1) (content/l4.md §4)")


@pytest.mark.pitfall("empty_split_nan")
def test_merge_of_two_empty_sides_is_zero_and_minus_inf(drill, device):
    """pitfall:empty_split_nan: v = 0 and s = -inf, never NaN, even with garbage v on both sides."""
    merged(drill, merge_case(rows=2, heads=2, head_size=8, empty_a=1.0, empty_b=1.0, device=device, seed=8))


@pytest.mark.pitfall("merge_in_fp16")
def test_merge_keeps_the_lse_in_fp32(drill, device):
    """pitfall:merge_in_fp16: s = 1000 and 1000.25; float16 holds both as 1000, which
    would weigh the sides equally. The right v is 1 / (1 + e^-0.25) = 0.5622."""
    merged(drill, _merge_of(device, [0.0] * 4, 1000.0, [1.0] * 4, 1000.25, dtype=torch.float16))


@pytest.mark.pitfall("merge_in_fp16")
def test_merge_of_large_values_does_not_overflow(drill, device):
    """pitfall:merge_in_fp16: row 0, two halves of weight 1/2 each with v = 60000 (float16
    holds up to 65504): summed before the division in float16, 60000 + 60000 overflows
    to inf. Row 1 (v = 1000) comes out right in float16 too, and tells that mistake apart
    from a merge that forgets to divide by the total weight."""
    merged(drill, _merge_of(device, [[60000.0] * 4, [1000.0] * 4], [2.0, 2.0], [[60000.0] * 4, [1000.0] * 4],
                            [2.0, 2.0], dtype=torch.float16))


# Under the interpreter one example is a few kernel launches; shrinking reruns hundreds.
@settings(phases=(Phase.explicit, Phase.reuse, Phase.generate))
@given(params=merge_params())
def test_merge_matches_reference(drill, device, params):
    merged(drill, merge_case(**params, device=device))


def _bad_merges(device):
    case = merge_case(rows=2, heads=2, head_size=4, device=device)
    v_a, s_a, v_b, s_b = case.args()
    return {
        "v_b of another shape": (v_a, s_a, v_b[:1], s_b),
        "s_a of another shape": (v_a, s_a[:1], v_b, s_b),
        "v_a without a head axis": (v_a[:, 0], s_a, v_b[:, 0], s_b),
        "s in float16": (v_a, s_a.half(), v_b, s_b.half()),
        "integer v": (v_a.long(), s_a, v_b.long(), s_b),
    }


@pytest.mark.parametrize("what", list(_bad_merges("cpu")))
def test_merge_rejects_bad_input(drill, device, what):
    with expect_value_error(what, "content/l4.md §6"):
        drill.merge_attention_states(*_bad_merges(device)[what])


# --- the split decode: agreement with plain attention (§5) ------------------


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_matches_reference_for_each_dtype(drill, device, dtype):
    run(drill, _case(device, [1, 16, 17, 90], dtype=dtype, num_splits=3, seed=1))


def test_agrees_with_l2_on_the_same_input(drill, device):
    """L2's reference (tests/drills/l2/reference.py, fp32) on the very case L4 gets: the split changes
    how the answer is summed, never what it is."""
    from drills.l2 import ref_paged_decode

    case = _case(device, [1, 16, 17, 90, 200], num_splits=5, dtype=torch.float32, seed=18)
    out = run(drill, case).cpu()
    l2 = ref_paged_decode(*case.args(), scale=case.scale)
    torch.testing.assert_close(out, l2, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("num_splits", [1, 2, 3, 7, 12])
def test_every_split_count_gives_the_same_answer(drill, device, num_splits):
    run(drill, _case(device, [5, 64, 65, 200], num_splits=num_splits, seed=2))


def test_block_table_past_last_block_is_not_even_loaded(drill, device):
    """design.md: the entries past a sequence's last block are garbage, so not even loaded
    (L2's reads_past_seq_len). The answer decides; the loads, counted in the worker under
    the CPU interpreter (tests/_traffic.py), explain a failure and are the worker's word: a
    right answer that loaded them passes, and the traffic report names it."""
    if not check_table_read_only_to_last_block(drill, _case(device, [5, 17, 40, 70], num_splits=3, extra_columns=3,
                                                            seed=6)):
        pytest.skip("this case runs with its loads counted, under the CPU interpreter only")


def test_default_split_count(drill, device):
    run(drill, _case(device, [30, 130], seed=3))


def test_output_without_out_is_a_new_tensor(drill, device):
    run(drill, _case(device, [30, 130], num_splits=2, seed=4), use_out=False)


@pytest.mark.pitfall("empty_split_nan")
def test_chunks_past_a_short_sequence_are_empty(drill, device):
    """pitfall:empty_split_nan: 8 chunks; sequences of 1 and 3 tokens leave most of them
    empty; 2048 = 8 × 256 tokens fills every chunk however it is rounded."""
    run(drill, _case(device, [1, 3, 2048], num_heads=4, num_kv_heads=1, num_splits=8, seed=5))


def test_more_splits_than_tokens(drill, device):
    run(drill, _case(device, [1, 2, 40], num_splits=12, seed=6))


@pytest.mark.pitfall("lse_base2")
@pytest.mark.pitfall("unnormalised_partial")
def test_chunks_with_different_lse_merge_correctly(drill, device):
    """pitfall:lse_base2, pitfall:unnormalised_partial: four chunks whose LSEs differ by
    several units, so a wrong weight or an unnormalised partial moves the answer far."""
    run(drill, spread_chunks(_case(device, [200, 150], num_splits=4, seed=7)))


@pytest.mark.pitfall("lse_base2")
@pytest.mark.pitfall("unnormalised_partial")
def test_two_chunks_in_fp32(drill, device):
    run(drill, spread_chunks(_case(device, [128, 100], num_splits=2, dtype=torch.float32, seed=8)))


@pytest.mark.pitfall("last_chunk_dropped")
def test_last_chunk_is_merged(drill, device):
    """pitfall:last_chunk_dropped: 4 chunks of 64 tokens; the last tokens score highest."""
    run(drill, last_tokens_score_highest(_case(device, [256, 200], num_splits=4, seed=9)))


@pytest.mark.pitfall("num_splits_ignored")
def test_num_splits_is_honoured(drill, device):
    """pitfall:num_splits_ignored: one split and five sum a 1000-token float32 row in a
    different order, so their last bits differ; identical bits mean num_splits did nothing.
    Three query heads share the KV head: a group that is not a power of two, whose padded
    slot a kernel must mask (with one split, its store would land past the end of out)."""
    case = _case(device, [1000], num_heads=3, num_kv_heads=1, dtype=torch.float32, seed=10)
    outs = []
    for splits in (1, 5):
        case.num_splits = splits
        outs.append(run(drill, case).clone())
    if torch.equal(bits(outs[0]), bits(outs[1])):
        error = Mismatch("num_splits = 1 and num_splits = 5 gave bit-identical float32 outputs for a 1000-token "
                         "sequence: five chunks merged by their LSEs round differently from one pass, so the "
                         "split count was not used (pitfall:num_splits_ignored, content/l4.md §8)")
        error.pitfalls = ["num_splits_ignored"]
        raise error


@pytest.mark.pitfall("num_splits_ignored")
def test_num_splits_zero_is_refused(drill, device):
    """pitfall:num_splits_ignored: num_splits = 0 is refused; a correct answer instead means
    the argument never reached the kernel."""
    case = _case(device, [40], num_splits=0, seed=11)
    try:
        out = drill.paged_decode_attention_split(*case.args(), num_splits=0)
    except ValueError:
        return
    error = Mismatch("num_splits = 0 was accepted; it must be refused with a ValueError (content/l4.md §6)")
    case.num_splits = None
    try:
        check_split_decode(case, out)
        error = Mismatch("num_splits = 0 was accepted and the answer is right: the argument never reached the "
                         "kernel (pitfall:num_splits_ignored, content/l4.md §8)")
        error.pitfalls = ["num_splits_ignored"]
    except Mismatch:
        error.pitfalls = []
    raise error


# --- L2's contract carries over (§6) ----------------------------------------


def test_nan_in_the_last_block_tail_and_garbage_columns(drill, device):
    run(drill, _case(device, [5, 17, 32, 47], tail="nan", extra_columns=5, num_splits=3, seed=12))


@pytest.mark.parametrize("num_heads,num_kv_heads", [(8, 2), (12, 3), (6, 2), (5, 1), (12, 2), (4, 4)],
                         ids=["group4", "group4_kv3", "group3", "group5", "group6", "mha"])
def test_gqa_head_mapping(drill, device, num_heads, num_kv_heads):
    """Any H_q = group * H_kv, groups that are not powers of two included: a kernel that pads
    the group to a power of two must mask the spare slots. One split stores straight into
    out (a stray row lands in its guard), two go through the partials and the merge."""
    for num_splits in (1, 2):
        run(drill, _case(device, [20, 70], num_heads=num_heads, num_kv_heads=num_kv_heads, num_splits=num_splits,
                         seed=13))


@pytest.mark.parametrize("head_size", [3, 80], ids=lambda d: f"D={d}")
def test_head_size_is_padded_and_masked(drill, device, head_size):
    run(drill, _case(device, [7, 70], head_size=head_size, num_heads=4, num_kv_heads=1, num_splits=2, seed=14))


def test_query_may_be_a_view_of_fused_qkv(drill, device):
    run(drill, _case(device, [9, 70], layout="fused_qkv", num_splits=2, seed=15))


@pytest.mark.parametrize("scale", [0.05, 1.0])
def test_explicit_scale_is_honoured(drill, device, scale):
    run(drill, _case(device, [30, 70], scale=scale, num_splits=2, seed=16))


def test_block_size_32(drill, device):
    run(drill, _case(device, [32, 100], block_size=32, num_splits=3, seed=17))


@pytest.mark.launches_nothing  # nothing to do: no kernel need run
def test_empty_batch(drill, device):
    case = _case(device, [3])
    out = drill.paged_decode_attention_split(case.query[:0], case.k_cache, case.v_cache, case.block_table[:0],
                                             case.seq_lens[:0], num_splits=2)
    assert out.shape == (0, 8, 16)


@settings(phases=(Phase.explicit, Phase.reuse, Phase.generate))
@given(params=split_params())
def test_matches_reference(drill, device, params):
    run(drill, split_case(**params, device=device), seed=params["seed"])


# --- bad input is refused (§6) ----------------------------------------------


def _bad_inputs(device):
    case = _case(device, [5, 20])
    query, k_cache, v_cache, table, lens = case.args()
    ok = (query, k_cache, v_cache, table, lens)
    return {
        "num_splits 0": (ok, dict(num_splits=0)),
        "num_splits -1": (ok, dict(num_splits=-1)),
        "num_splits 2.5": (ok, dict(num_splits=2.5)),
        "out of another shape": (ok, dict(out=torch.empty_like(query[:1]))),
        "out of another dtype": (ok, dict(out=torch.empty(query.shape, dtype=torch.float32, device=device))),
        "out whose heads are not contiguous": (ok, dict(out=torch.empty_like(query).transpose(1, 2).contiguous()
                                                        .transpose(1, 2))),
        "H_q not a multiple of H_kv": ((query[:, :3], k_cache, v_cache, table, lens), {}),
        "query without a head axis": ((query[:, 0], k_cache, v_cache, table, lens), {}),
        "cache head size != query head size": ((query[..., :8].contiguous(), k_cache, v_cache, table, lens), {}),
        "k_cache shape != v_cache shape": ((query, k_cache, v_cache[:2], table, lens), {}),
        "block_table rows != B": ((query, k_cache, v_cache, table[:1], lens), {}),
        "seq_lens length != B": ((query, k_cache, v_cache, table, lens[:1]), {}),
        "float seq_lens": ((query, k_cache, v_cache, table, lens.float()), {}),
        "float block_table": ((query, k_cache, v_cache, table.float(), lens), {}),
        "cache dtype != query dtype": ((query, k_cache.float(), v_cache.float(), table, lens), {}),
        "float64 everywhere": ((query.double(), k_cache.double(), v_cache.double(), table, lens), {}),
        "non-contiguous k_cache": ((query, k_cache.transpose(1, 2).contiguous().transpose(1, 2), v_cache, table,
                                    lens), {}),
        "query whose heads are not contiguous": ((query.transpose(1, 2).contiguous().transpose(1, 2), k_cache,
                                                  v_cache, table, lens), {}),
        "block_table whose rows are strided": ((query, k_cache, v_cache, torch.stack([table, table], dim=-1)[..., 0],
                                                lens), {}),
        "seq_len 0": ((query, k_cache, v_cache, table, lens.clone().fill_(0)), {}),
        "seq_len beyond the block table": ((query, k_cache, v_cache, table,
                                            lens.clone().fill_(table.shape[1] * k_cache.shape[1] + 1)), {}),
        "block number past the cache": ((query, k_cache, v_cache, table.clone().fill_(k_cache.shape[0]), lens), {}),
    }


@pytest.mark.parametrize("what", list(_bad_inputs("cpu")))
def test_rejects_bad_input(drill, device, what):
    args, kwargs = _bad_inputs(device)[what]
    if what.startswith(("seq_len ", "block number")) and device != "cpu":
        pytest.skip("on a GPU seq_lens and block numbers are not checked: it would cost a device sync "
                    "(content/l4.md §6)")
    with expect_value_error(what, "content/l4.md §6"):
        drill.paged_decode_attention_split(*args, **kwargs)


# Last: a kernel that overflows int32 may read far outside the cache and crash the process.
def test_large_cache_needs_int64_offsets(drill, device):
    """A cache of more than 2**31 elements: slot * H_kv * D no longer fits in int32. The
    same tokens in a small cache come first, so a failure here is about int32."""
    small = split_case([40], num_heads=4, num_kv_heads=1, head_size=128, block_size=16, extra_columns=0,
                       num_splits=2, device=device)
    run(drill, small)
    k_cache, v_cache = caches_past_int32(16, 1, 128, device)
    num_blocks = k_cache.shape[0]
    table = torch.tensor([[num_blocks - 1, 5, num_blocks - 3]], dtype=torch.int32, device=device)
    for column, block in enumerate(table[0].tolist()):
        k_cache[block] = small.k_cache[small.block_table[0, column]]
        v_cache[block] = small.v_cache[small.block_table[0, column]]
    large = type(small)(query=small.query, k_cache=k_cache, v_cache=v_cache, block_table=table,
                        seq_lens=small.seq_lens, num_splits=2)
    try:
        check_split_decode(large, drill.paged_decode_attention_split(*large.args(), num_splits=2))
    except Mismatch as error:
        raise Mismatch(f"right in a small cache, wrong when blocks {num_blocks - 1} and {num_blocks - 3} start past "
                       f"2**31 elements into the cache: offsets computed in int32 wrap around (content/l4.md §5)"
                       f"\n{error}") from None
