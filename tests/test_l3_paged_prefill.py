"""L3: chunked-prefill attention over a paged cache (content/l3.md). Runs unchanged against any tree.

Every output is compared with the float64 reference within a tolerance per dtype.
The caches are built so that mistakes show: blocks no sequence owns and every
garbage block-table column hold NaN, the unused end of each last block holds stale
noise (or NaN), and the output is a NaN-poisoned buffer inside a guarded allocation.
A failure says which token (sequence, query, position) is off and which mistake
reproduces it.
"""
import pytest

import _env
import torch
from hypothesis import Phase, given, settings

from _diagnose import Mismatch, expect_value_error
from _paged import caches_past_int32, changed, snapshot
from drills.l3 import (SECTION, PrefillCase, check_paged_prefill, check_table_read_only_to_last_block, example_case, example_outputs, paged_prefill_case,
                       prefill_params)

ALL_DTYPES = [torch.float16, torch.bfloat16, torch.float32]


INPUTS = ("query", "k_cache", "v_cache", "block_table", "query_start_loc", "seq_lens")


def run(drill, case):
    """Call (with the case's NaN-poisoned, guarded `out` unless it has none); check the
    output, the buffer around it, and that every input is bit for bit what it was."""
    before = snapshot(*case.args())
    returned = drill.paged_prefill_attention(*case.args(), **case.kwargs())
    check_paged_prefill(case, case.out if case.out is not None else returned, returned)
    for i in changed(before):
        raise Mismatch(f"{INPUTS[i]} was modified: paged_prefill_attention must only read its inputs")
    return returned


def _case(device, q_lens, context_lens, **kwargs):
    shape = dict(num_heads=8, num_kv_heads=2, head_size=16, block_size=16)
    return paged_prefill_case(q_lens, context_lens, **{**shape, **kwargs}, device=device)


# --- the worked example and one mixed batch per dtype (content/l3.md §3) ----


def test_worked_example(drill, device):
    """§3: a 3-token chunk over a 3-token prefix; every score equal, so outputs are means."""
    out = run(drill, example_case(device))
    assert out.flatten().tolist() == pytest.approx(example_outputs("bottom_right"), abs=1e-5)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_mixed_batch_for_each_dtype(drill, device, dtype):
    """Decode rows, a pure prefill and chunks over prefixes, in one call. Sequence 4 (32
    tokens) fills its last block: a mistake in the second key tile shows there too."""
    run(drill, _case(device, [1, 20, 7, 1, 12], [30, 0, 17, 4, 20], dtype=dtype, seed=1))


# --- each pitfall on the page (§8) ------------------------------------------


@pytest.mark.pitfall("causal_offset_missing")
def test_chunk_over_a_prefix_sees_the_prefix(drill, device):
    """pitfall:causal_offset_missing: query i sits at seq_len - q_len + i, not at i.
    Sequence 1 is a pure prefill: right with or without the offset."""
    run(drill, _case(device, [9, 11, 1], [20, 0, 13], seed=2))


@pytest.mark.pitfall("prefix_ignored")
def test_prefix_not_a_multiple_of_block_size(drill, device):
    """pitfall:prefix_ignored: the chunk must attend to its cached prefix (here 21 and 37
    tokens: not whole blocks) as well as to itself."""
    run(drill, _case(device, [6, 13], [21, 37], seed=3))


@pytest.mark.pitfall("last_block_unmasked")
def test_nan_past_seq_len_in_the_last_block_is_not_loaded(drill, device):
    """pitfall:last_block_unmasked: the unused end of each last block holds NaN. Sequence 1
    and 3 fill their last blocks exactly: they have no tail and must come out right either way."""
    run(drill, _case(device, [5, 8, 1, 4], [14, 24, 20, 28], tail="nan", extra_columns=0, seed=4))


@pytest.mark.pitfall("masked_row_nan")
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (8, 2)], ids=["group1", "group4"])
def test_row_that_sees_no_key_in_a_tile_stays_finite(drill, device, num_heads, num_kv_heads):
    """pitfall:masked_row_nan: prefixes of 63 and 79 tokens put query blocks right before
    tile boundaries, so a tile past a row's position holds no key it may see; its scores
    are all -inf there, and that must not turn into NaN. The sequences (80, 96 and 16
    tokens) are whole blocks: no tail, no garbage block-table column."""
    run(drill, _case(device, [17, 17, 1], [63, 79, 15], num_heads=num_heads, num_kv_heads=num_kv_heads,
                     extra_columns=0, seed=5))


@pytest.mark.pitfall("wrong_seq_lookup")
def test_query_blocks_never_straddle_two_sequences(drill, device):
    """pitfall:wrong_seq_lookup: chunk lengths that are not multiples of any block of
    queries, so a block cut from the flat token array would straddle two sequences."""
    run(drill, _case(device, [5, 7, 3, 9, 1], [10, 0, 40, 6, 25], seed=6))


@pytest.mark.pitfall("gqa_head_mapping")
@pytest.mark.parametrize("num_heads,num_kv_heads", [(8, 2), (16, 2), (12, 3), (6, 2), (5, 1), (6, 1)],
                         ids=["ratio4", "ratio8", "ratio4x3", "ratio3", "ratio5", "ratio6"])
def test_gqa_head_mapping(drill, device, num_heads, num_kv_heads):
    """pitfall:gqa_head_mapping: query head h reads KV head h // (H_q / H_kv)."""
    run(drill, _case(device, [6, 1], [10, 30], num_heads=num_heads, num_kv_heads=num_kv_heads, seed=7))


# --- the rest of the contract ------------------------------------------------


@pytest.mark.parametrize("group", [1, 4], ids=["group1", "group4"])
def test_every_chunk_length_from_1_to_17(drill, device, group):
    """A kernel may hand chunks to different programs (or launches) by length, as the
    reference hands chunks of up to 16 / group queries to short tiles: whatever the
    threshold, every length on either side of it must be written once, and right."""
    lengths = list(range(1, 18))
    run(drill, _case(device, lengths, [(7 * n) % 23 for n in lengths], num_heads=2 * group, num_kv_heads=2,
                     seed=31))


@pytest.mark.mistake("spare_group_rows_unmasked")
@pytest.mark.skipif(_env.INTERPRET, reason="long chunks; under the interpreter the short ones above catch it")
@pytest.mark.parametrize("num_heads,num_kv_heads", [(6, 2), (10, 2), (12, 2)], ids=["group3", "group5", "group6"])
def test_spare_rows_of_tall_tiles_on_long_chunks(drill, device, num_heads, num_kv_heads):
    """With a group of 3, 5 or 6 a tile has rows past its BLOCK_Q * group live ones. The
    first of them is the next query block's first query: a kernel that stores it writes
    that query a second time, seeing one key too few. On a GPU the two writes race, so one
    wrong block may well lose (measured on an H200: with this case, caught 1 time in 5 at
    a group of 3, 5 in 5 at 5 and 6); chunks of hundreds of queries over long prefixes
    cut into many blocks of about equal work, so some wrong write lands last."""
    run(drill, _case(device, [700, 300, 450], [1200, 900, 2000], num_heads=num_heads, num_kv_heads=num_kv_heads,
                     seed=29))


@pytest.mark.parametrize("group", [1, 4], ids=["group1", "group4"])
def test_causal_boundary_just_past_a_tile_edge(drill, device, group):
    """Prefixes of 14, 30 and 62 tokens put a block's first query one key before a tile
    edge (position + 2 a multiple of 16, 32, 64): the key right after it is the first one
    it must not see, and a mask-free tile that runs one key too far lets it in."""
    run(drill, _case(device, [5, 17, 3, 1], [62, 30, 14, 46], num_heads=2 * group, num_kv_heads=2, seed=17))


def test_block_table_past_last_block_is_not_even_loaded(drill, device):
    """design.md: the entries past a sequence's last block are garbage, so not even loaded.
    The answer decides; the loads, counted in the worker under the CPU interpreter
    (tests/_traffic.py), explain a failure and are the worker's word: a right answer that
    loaded them passes, and the traffic report names it."""
    # Blocks of 4 tokens: a tile of keys spans several, so one reaching past seq_len meets garbage columns.
    if not check_table_read_only_to_last_block(drill, _case(device, [3, 20, 1], [2, 30, 47], block_size=4,
                                                            extra_columns=3, seed=6)):
        pytest.skip("this case runs with its loads counted, under the CPU interpreter only")


def test_decode_only_batch_is_l2(drill, device):
    """Every q_len = 1: the answer is L2's, one new token attending to its whole sequence,
    checked against L2's own reference (tests/drills/l2/reference.py)."""
    from drills.l2 import DECODE_TOLERANCE, ref_paged_decode

    case = _case(device, [1, 1, 1, 1], [0, 15, 16, 40], seed=8)
    out = run(drill, case)
    l2 = ref_paged_decode(case.query, case.k_cache, case.v_cache, case.block_table, case.seq_lens)
    atol, rtol = DECODE_TOLERANCE[case.query.dtype]
    assert torch.allclose(out.float().cpu(), l2, atol=atol, rtol=rtol)


def test_out_may_be_left_out(drill, device):
    case = _case(device, [4, 1], [3, 9], out=False, seed=9)
    run(drill, case)


def test_query_may_be_a_view_of_fused_qkv(drill, device):
    case = _case(device, [5, 3], [7, 0], layout="fused_qkv", seed=10)
    assert not case.query.is_contiguous()
    run(drill, case)


@pytest.mark.parametrize("head_size", [3, 80, 96, 128], ids=lambda d: f"D={d}")
def test_head_size_is_padded_and_masked(drill, device, head_size):
    run(drill, _case(device, [5, 1], [4, 18], head_size=head_size, num_heads=4, num_kv_heads=1, seed=11))


@pytest.mark.parametrize("scale", [0.05, 1.0])
def test_explicit_scale_is_honoured(drill, device, scale):
    run(drill, _case(device, [6, 2], [9, 30], scale=scale, seed=12))


def test_sequence_with_an_empty_chunk(drill, device):
    """q_len = 0 for sequence 1: it owns no query rows, and nothing is written for it."""
    run(drill, _case(device, [3, 0, 4], [5, 9, 0], seed=13))


def test_block_sizes_smaller_and_larger_than_a_tile(drill, device):
    run(drill, _case(device, [7, 1], [9, 13], block_size=4, seed=14))
    run(drill, _case(device, [7, 1], [40, 70], block_size=32, seed=15))


@pytest.mark.launches_nothing  # nothing to do: no kernel need run
def test_empty_batch(drill, device):
    case = _case(device, [3], [2], out=False)
    empty = case.query[:0]
    out = drill.paged_prefill_attention(empty, case.k_cache, case.v_cache, case.block_table,
                                        torch.tensor([0, 0], dtype=torch.int32, device=device), case.seq_lens)
    assert out.shape == (0, 8, 16)


# --- hypothesis sweep ---------------------------------------------------------


# No shrinking: under the interpreter one example takes a second or more, and the
# failure message already names the token, the head and the mistake.
@settings(phases=(Phase.explicit, Phase.reuse, Phase.generate))
@given(params=prefill_params())
def test_matches_reference(drill, device, params):
    run(drill, paged_prefill_case(**params, device=device))


# --- bad input is refused (§6) -------------------------------------------------


def _bad_inputs(device):
    case = _case(device, [3, 5], [4, 0], out=False)
    query, k_cache, v_cache, table, starts, lens = case.args()

    def loc(*values):
        return torch.tensor(values, dtype=torch.int32, device=device)

    return {
        "query_start_loc not non-decreasing": (query, k_cache, v_cache, table, loc(0, 6, 8)[[0, 2, 1]], lens),
        "query_start_loc not starting at 0": (query, k_cache, v_cache, table, loc(1, 4, 8), lens),
        "query_start_loc not ending at total_q": (query, k_cache, v_cache, table, loc(0, 3, 7), lens),
        "q_len > seq_len": (query, k_cache, v_cache, table, starts, loc(7, 4)),
        "query_start_loc of the wrong length": (query, k_cache, v_cache, table, starts[:2], lens),
        "block_table rows != B": (query, k_cache, v_cache, table[:1], starts, lens),
        "H_q not a multiple of H_kv": (query[:, :3], k_cache, v_cache, table, starts, lens),
        "query without a head axis": (query[:, 0], k_cache, v_cache, table, starts, lens),
        "cache head size != query head size": (query[..., :8].contiguous(), k_cache, v_cache, table, starts, lens),
        "k_cache shape != v_cache shape": (query, k_cache, v_cache[:2], table, starts, lens),
        "float query_start_loc": (query, k_cache, v_cache, table, starts.float(), lens),
        "cache dtype != query dtype": (query, k_cache.float(), v_cache.float(), table, starts, lens),
        "float64 everywhere": (query.double(), k_cache.double(), v_cache.double(), table, starts, lens),
        "non-contiguous k_cache": (query, k_cache.transpose(1, 2).contiguous().transpose(1, 2), v_cache, table,
                                   starts, lens),
        "non-contiguous v_cache": (query, k_cache, v_cache.transpose(1, 2).contiguous().transpose(1, 2), table,
                                   starts, lens),
        "seq_len beyond the block table": (query, k_cache, v_cache, table, starts,
                                           lens.clone().fill_(table.shape[1] * k_cache.shape[1] + 1)),
        "block number past the cache": (query, k_cache, v_cache, table.clone().fill_(k_cache.shape[0]), starts, lens),
        "out of the wrong shape": (query, k_cache, v_cache, table, starts, lens, None, query[:1].clone()),
    }


_VALUE_CHECKS = ("query_start_loc not", "q_len > seq_len", "seq_len beyond", "block number")


@pytest.mark.parametrize("what", list(_bad_inputs("cpu")))
def test_rejects_bad_input(drill, device, what):
    if what.startswith(_VALUE_CHECKS) and device != "cpu":
        pytest.skip("on a GPU the values of query_start_loc, seq_lens and the block table are not checked: it would "
                    "cost a device sync (content/l3.md §6)")
    with expect_value_error(what, "content/l3.md §6"):
        drill.paged_prefill_attention(*_bad_inputs(device)[what])



@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a second device type")
def test_rejects_tensors_on_two_devices(drill):
    case = _case("cuda", [3, 5], [4, 0], out=False)
    query, k_cache, v_cache, table, starts, lens = case.args()
    with expect_value_error("seq_lens on the CPU with the rest on the GPU", "content/l3.md §6"):
        drill.paged_prefill_attention(query, k_cache, v_cache, table, starts, lens.cpu())

# Last: a kernel that overflows int32 may read far outside the cache and crash the process.
def test_large_cache_needs_int64_offsets(drill, device):
    """A cache of more than 2**31 elements: slot * H_kv * D no longer fits in int32. The
    same tokens in a small cache come first: if they are wrong too, it is not about int32."""
    small = _case(device, [5, 1], [11, 30], num_heads=4, num_kv_heads=1, head_size=128, extra_columns=0, seed=16)
    run(drill, small)
    k_cache, v_cache = caches_past_int32(16, 1, 128, device)
    num_blocks = k_cache.shape[0]
    table = small.block_table.clone()
    for b in range(2):
        for column in range(table.shape[1]):
            block = num_blocks - 1 - 2 * column - 5 * b
            k_cache[block] = small.k_cache[small.block_table[b, column]]
            v_cache[block] = small.v_cache[small.block_table[b, column]]
            table[b, column] = block
    large = PrefillCase(query=small.query, k_cache=k_cache, v_cache=v_cache, block_table=table,
                        query_start_loc=small.query_start_loc, seq_lens=small.seq_lens)
    try:
        check_paged_prefill(large, drill.paged_prefill_attention(*large.args()))
    except Mismatch as error:
        raise Mismatch(f"right in a small cache, wrong when the blocks start past 2**31 elements into the cache: "
                       f"offsets computed in int32 wrap around ({SECTION})\n{error}") from None

