"""L6: cascade attention (content/l6.md). Runs unchanged against any tree.

The batches share their first blocks (prefix caching); every output is compared with
the float64 reference, which is L3's answer on the full block tables. Blocks no
sequence owns and every garbage block-table column hold NaN, the unused end of each
last block holds stale noise (or NaN), and the output is a NaN-poisoned buffer inside
a guarded allocation. A failure says which token is off and which mistake reproduces it.
"""
import pytest

import _env
import torch
from hypothesis import Phase, given, settings

from _diagnose import Mismatch, expect_value_error
from _paged import changed, snapshot
from drills.l6 import (EXAMPLE, VLLM_HEADS, VLLM_SCALE, cascade_case, cascade_params, check_cascade,
                       check_prefix_len, check_prefix_read_once, example_case, example_outputs, example_tables,
                       traffic_case, vllm_case_lens)

ALL_DTYPES = [torch.float16, torch.bfloat16, torch.float32]
INPUTS = ("query", "k_cache", "v_cache", "block_table", "query_start_loc", "seq_lens")


def run(drill, case):
    """Call with the case's poisoned, guarded `out` (unless it has none); check the output,
    the buffer around it, and that every input is bit for bit what it was."""
    before = snapshot(*case.args()[:6])
    returned = drill.cascade_attention(*case.args(), **case.kwargs())
    check_cascade(case, case.out if case.out is not None else returned, returned)
    for i in changed(before):
        raise Mismatch(f"{INPUTS[i]} was modified: cascade_attention must only read its inputs")
    return returned


def _case(device, q_lens, context_lens, prefix_blocks, **kwargs):
    shape = dict(num_heads=8, num_kv_heads=2, head_size=16, block_size=4)
    return cascade_case(q_lens, context_lens, prefix_blocks, **{**shape, **kwargs}, device=device)


def prefix_len(drill, case):
    args = (case.block_table, case.query_start_loc, case.seq_lens, case.block_size)
    check_prefix_len(args, drill.cascade_prefix_len(*args))


# --- the worked example (content/l6.md §3) --------------------------------------


@pytest.mark.pitfall("prefix_uncapped")
@pytest.mark.parametrize("block_size", [1, 2])
def test_prefix_len_worked_example(drill, device, block_size):
    """§3, vLLM's comment: requests 1 and 2 share [A, B, C, D, E], but request 1 had only
    3 tokens cached: the prefix is capped at 3, then rounded down to whole blocks."""
    table, _ = example_tables(block_size)
    case = example_case(block_size, device)
    got = drill.cascade_prefix_len(table.to(device), case.query_start_loc, case.seq_lens, block_size)
    check_prefix_len((table, case.query_start_loc.cpu(), case.seq_lens.cpu(), block_size), got)


def test_worked_example(drill, device):
    """§3: q = k = 1, so each output is the mean of the values its query sees."""
    out = run(drill, example_case(1, device))
    assert out.flatten().tolist() == pytest.approx(example_outputs(), abs=1e-5)
    assert len(EXAMPLE["tokens"]) == 2


# --- cascade_prefix_len (the host rule, §3) ---------------------------------------


@pytest.mark.pitfall("prefix_uncapped")
def test_prefix_len_is_capped_by_the_cached_context(drill, device):
    """Three shared blocks of 4, but sequence 2 had only 9 tokens cached: 9 -> 8."""
    prefix_len(drill, _case(device, [3, 1, 4], [14, 20, 9], 3, common_prefix_len=8))


def test_prefix_len_counts_only_columns_every_row_shares(drill, device):
    """Rows 0 and 1 share a third column that row 2 does not: two blocks, not three."""
    prefix_len(drill, _case(device, [1, 1, 1], [15, 14, 13], 2, more_shared=1))


def test_prefix_len_of_one_sequence_is_zero(drill, device):
    prefix_len(drill, _case(device, [2], [12], 2))


def test_prefix_len_with_nothing_shared(drill, device):
    prefix_len(drill, _case(device, [1, 3], [6, 9], 0, common_prefix_len=0))


# --- each pitfall on the page (§8) --------------------------------------------------


@pytest.mark.pitfall("prefix_causal")
def test_prefix_pass_has_no_causal_mask(drill, device):
    """pitfall:prefix_causal: six decode rows over a one-block prefix. Under a causal mask
    over the batch as one sequence the first rows would see fewer prefix keys."""
    run(drill, _case(device, [1] * 6, [5, 7, 4, 9, 6, 8], 1, seed=2))


@pytest.mark.pitfall("suffix_not_offset")
def test_suffix_pass_starts_after_the_prefix(drill, device):
    """pitfall:suffix_not_offset: a prefix of 3 blocks and chunks after it; pass 2 must
    not read the prefix's keys again."""
    run(drill, _case(device, [4, 1, 6], [13, 20, 12], 3, seed=3))


@pytest.mark.pitfall("merge_swapped")
def test_merge_pairs_each_part_with_its_own_lse(drill, device):
    """pitfall:merge_swapped: a 4-block prefix and suffixes of very different lengths, so
    the two parts' log-sum-exps differ."""
    run(drill, _case(device, [1, 5, 1], [17, 30, 40], 4, seed=4))


@pytest.mark.pitfall("empty_part_nan")
def test_a_chunk_of_the_prefix_with_no_key_stays_finite(drill, device):
    """pitfall:empty_part_nan: a prefix of 16 tokens (one tile of the interpreter) cut into
    chunks leaves a chunk with no key; it must merge as an empty part, not as NaN. No
    input holds NaN here, so a NaN output came from arithmetic."""
    run(drill, _case(device, [1, 3, 1], [18, 16, 25], 4, nan=False, seed=5))


@pytest.mark.pitfall("empty_part_nan")
@pytest.mark.skipif(_env.INTERPRET, reason="a GPU-sized prefix: the interpreter's chunks are tested above")
def test_long_prefix_cut_into_chunks_on_a_gpu(drill, device):
    """2064 shared tokens (129 blocks of 16) and a mixed batch. At the other tests' sizes a
    GPU gives the whole prefix to one chunk; this one it cuts into many, and with the
    reference's rule (8 chunks of 320 keys) the seventh ends early and the last holds no
    key at all: chunks must meet exactly in the merge, and an empty one must weigh nothing.
    No input holds NaN (as in the test above), so a NaN output came from arithmetic and the
    grade can name the pitfall."""
    run(drill, _case(device, [1, 1, 7, 1, 3, 1], [2150, 2070, 2300, 2100, 2500, 2080], 129, block_size=16,
                     head_size=64, nan=False, seed=21))


@pytest.mark.skipif(_env.INTERPRET, reason="overlap is a GPU's: the interpreter runs the passes in order")
def test_merge_waits_for_the_prefix_pass_on_a_gpu(drill, device):
    """A kernel may run pass 1 beside pass 2 (programmatic dependent launch, or a stream of
    its own: content/l6.md §4); then the merge must wait for it. 8192 shared tokens against
    1-5 own tokens a sequence make pass 1 far longer than pass 2, so a merge that does not
    wait reads parts pass 1 has not written yet; three fresh batches, since such a race
    need not show every time."""
    for seed in range(3):
        run(drill, _case(device, [1] * 48, [8192 + seed + b % 3 for b in range(48)], 512, num_heads=32,
                         num_kv_heads=8, head_size=128, block_size=16, seed=30 + seed))


@pytest.mark.pitfall("prefix_per_sequence")
def test_prefix_is_read_once_for_the_batch(drill, device):
    """pitfall:prefix_per_sequence: pass 1 should load the prefix's K once for all the decode
    rows, not once per row. The answer decides; the loads, counted in the worker under the
    CPU interpreter (tests/_traffic.py), are the worker's word: a right answer that reads the
    prefix once per sequence passes, and the traffic report names the pitfall (advice)."""
    if not check_prefix_read_once(drill, traffic_case(device)):
        pytest.skip("this case runs with its loads counted, under the CPU interpreter only")


# --- the rest of the contract --------------------------------------------------------


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_mixed_batch_for_each_dtype(drill, device, dtype):
    """Decode rows and chunks over a shared 2-block prefix, in one call."""
    run(drill, _case(device, [1, 7, 1, 5], [12, 9, 20, 15], 2, dtype=dtype, seed=6))


@pytest.mark.parametrize("prefix_blocks", [1, 2, 3, 4])
def test_decode_batch_for_each_prefix_length(drill, device, prefix_blocks):
    run(drill, _case(device, [1] * 5, [4 * prefix_blocks + x for x in (0, 3, 9, 1, 6)], prefix_blocks,
                     seed=7 + prefix_blocks))


def test_common_prefix_len_zero_is_l3(drill, device):
    """common_prefix_len = 0 is plain L3, whatever the tables share."""
    run(drill, _case(device, [3, 1, 5], [9, 14, 8], 2, common_prefix_len=0, seed=12))


def test_rows_agree_for_only_some_columns(drill, device):
    """Rows 0..2 share two more blocks than row 3; the prefix is the columns all share,
    and pass 2 reads the rest through each row's own columns."""
    run(drill, _case(device, [1, 2, 1, 3], [19, 18, 21, 9], 1, more_shared=2, seed=13))


@pytest.mark.parametrize("num_heads,num_kv_heads,head_size", [(6, 2, 24), (12, 2, 80), (8, 8, 16)],
                         ids=["group3-D24", "group6-D80", "group1"])
def test_gqa_groups_and_head_sizes(drill, device, num_heads, num_kv_heads, head_size):
    run(drill, _case(device, [1, 4, 1], [10, 9, 13], 2, num_heads=num_heads, num_kv_heads=num_kv_heads,
                     head_size=head_size, seed=14))


def test_nan_past_seq_len_and_in_unowned_blocks_is_not_read(drill, device):
    """Each last block's unused end holds NaN, as do blocks no one owns and the garbage columns."""
    run(drill, _case(device, [2, 1, 3], [11, 14, 9], 2, tail="nan", extra_columns=3, seed=15))


@pytest.mark.parametrize("heads", VLLM_HEADS, ids=lambda h: f"{h[0]}x{h[1]}")
def test_vllm_general_case(drill, device, heads):
    """vLLM's test_cascade case 1, ([(129, 871), (18, 280), (37, 988), (1023, 2304), (1, 257)], 256),
    scaled down by 16 on the CPU (tests/drills/l6/cases.py); block_size 16 on a GPU."""
    scale = VLLM_SCALE if device == "cpu" else 1
    q_lens, context_lens, prefix = vllm_case_lens("general", scale)
    bs = 4 if scale > 1 else 16
    run(drill, cascade_case(q_lens, context_lens, prefix // bs, num_heads=heads[0], num_kv_heads=heads[1],
                            head_size=128, block_size=bs, device=device, seed=16))


def test_vllm_flash_decoding_case(drill, device):
    """vLLM's test_cascade case 2: 400 decode rows sharing 512 tokens, D = 256 (8 rows and
    a prefix of 32 on the CPU)."""
    scale = VLLM_SCALE if device == "cpu" else 1
    q_lens, context_lens, prefix = vllm_case_lens("flash_decoding", scale)
    bs = 4 if scale > 1 else 16
    run(drill, cascade_case(q_lens, context_lens, prefix // bs, num_heads=8, num_kv_heads=2, head_size=256,
                            block_size=bs, device=device, seed=17))


def test_out_may_be_left_out_and_query_may_be_fused_qkv(drill, device):
    run(drill, _case(device, [3, 1], [8, 11], 2, out=False, layout="fused_qkv", seed=18))


@pytest.mark.launches_nothing  # nothing to do: no kernel need run
def test_empty_batch(drill, device):
    case = _case(device, [3, 1], [8, 9], 2, out=False)
    out = drill.cascade_attention(case.query[:0], case.k_cache, case.v_cache, case.block_table,
                                  torch.tensor([0, 0, 0], dtype=torch.int32, device=device), case.seq_lens - 3 * 0, 0)
    assert out.shape == (0, 8, 16)


@settings(phases=(Phase.explicit, Phase.reuse, Phase.generate), max_examples=8)
@given(params=cascade_params())
def test_matches_reference(drill, device, params):
    run(drill, cascade_case(**params, device=device))


# --- bad input is refused (§6) -----------------------------------------------------


def _bad_inputs(device):
    case = _case(device, [3, 1], [9, 12], 2, out=False)
    query, k_cache, v_cache, table, starts, lens, prefix = case.args()
    other = table.clone()
    other[1, 1] = table[1, 2]
    return {
        "common_prefix_len not a multiple of block_size": (query, k_cache, v_cache, table, starts, lens, 6),
        "common_prefix_len longer than a cached context": (query, k_cache, v_cache, table, starts, lens, 12),
        "common_prefix_len over columns not shared": (query, k_cache, v_cache, other, starts, lens, 8),
        "negative common_prefix_len": (query, k_cache, v_cache, table, starts, lens, -4),
        "common_prefix_len not an int": (query, k_cache, v_cache, table, starts, lens, 8.0),
        "H_q not a multiple of H_kv": (query[:, :3], k_cache, v_cache, table, starts, lens, prefix),
        "cache dtype != query dtype": (query, k_cache.float(), v_cache.float(), table, starts, lens, prefix),
        "q_len > seq_len": (query, k_cache, v_cache, table, starts, torch.tensor([2, 12], dtype=torch.int32,
                                                                                 device=device), 0),
        "out of the wrong shape": (query, k_cache, v_cache, table, starts, lens, prefix, None, query[:1].clone()),
    }


_VALUE_CHECKS = ("common_prefix_len longer", "common_prefix_len over", "q_len > seq_len")


@pytest.mark.parametrize("what", list(_bad_inputs("cpu")))
def test_rejects_bad_input(drill, device, what):
    if what.startswith(_VALUE_CHECKS) and device != "cpu":
        pytest.skip("on a GPU the values of the lengths and the block table are not checked: it would cost a "
                    "device sync (content/l6.md §6)")
    with expect_value_error(what, "content/l6.md §6"):
        drill.cascade_attention(*_bad_inputs(device)[what])
