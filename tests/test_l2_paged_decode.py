"""L2: paged decode attention (content/l2.md). Runs unchanged against any tree.

Every output is compared with the plain-PyTorch reference (fp32, from K/V gathered
through the block table) within a tolerance per dtype. The caches are built so
that mistakes show: blocks no sequence owns and every garbage block-table column
hold NaN, the unused end of each last block holds stale noise (or NaN), and the
output memory is NaN before the call. A failure says which sequence and query
head is off and which mistake reproduces it.
"""

import pytest

import _env
import torch
from hypothesis import given

from _diagnose import Mismatch, expect_value_error
from _paged import DTYPES, caches_past_int32, changed, poisoned_out, snapshot
from drills.l2 import (DECODE_EXAMPLE, check_table_read_only_to_last_block, DecodeCase, check_paged_decode, decode_example_case, far_garbage_case,
                       large_logits_case, new_token_first_case, paged_decode_case, paged_decode_params,
                       rising_scores_case, small_case)

ALL_DTYPES = list(DTYPES.values())


INPUTS = ("query", "k_cache", "v_cache", "block_table", "seq_lens")


def run(drill, case):
    """Call with a NaN-poisoned `out` inside a guarded buffer; check the output, the
    buffer around it, and that every input is bit for bit what it was."""
    out = poisoned_out(case.query.shape, case.query.dtype, case.query.device, torch.Generator().manual_seed(0))
    before = snapshot(*case.args())
    returned = drill.paged_decode_attention(*case.args(), **case.kwargs(), out=out.view)
    check_paged_decode(case, out, returned)
    for i in changed(before):
        raise Mismatch(f"{INPUTS[i]} was modified: paged_decode_attention must only read its inputs")
    return out.view


def _case(device, seq_lens, **kwargs):
    return small_case(device, seq_lens, **kwargs)


# --- the worked example and one case per dtype (content/l2.md §3) ----------


def test_worked_example(drill, device):
    """§3's two blocks of two scores: D = 1, scale = 1, so each key is its own score."""
    out = run(drill, decode_example_case(device))
    weights = torch.tensor(DECODE_EXAMPLE["scores"]).softmax(0)
    assert float(out) == pytest.approx(float(weights @ torch.tensor(DECODE_EXAMPLE["values"])), abs=1e-5)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_matches_reference_for_each_dtype(drill, device, dtype):
    run(drill, _case(device, [1, 16, 17, 90], dtype=dtype, seed=1))


# --- each pitfall on the page (§9) ------------------------------------------


@pytest.mark.pitfall("no_last_block_mask")
def test_last_block_is_masked(drill, device):
    """pitfall:no_last_block_mask: the slots after seq_len in the last block hold stale tokens."""
    run(drill, _case(device, [5, 17, 33, 47], seed=2))


@pytest.mark.pitfall("unmasked_loads")
def test_nan_in_last_block_tail_is_not_loaded(drill, device):
    """pitfall:unmasked_loads: masking the scores is not enough when V there is NaN (0 * NaN = NaN).
    Sequence 2 fills its last block exactly: it has no tail, so it must come out right either way."""
    run(drill, _case(device, [5, 17, 32, 47], tail="nan", seed=3))


@pytest.mark.pitfall("reads_past_seq_len")
def test_block_table_past_seq_len_is_never_read(drill, device):
    """pitfall:reads_past_seq_len: garbage columns point at NaN blocks. Sequence 0 uses every
    column of the table, so it has none to read and must come out right either way."""
    run(drill, _case(device, [128, 32, 1, 20], extra_columns=0, seed=4))


@pytest.mark.pitfall("reads_past_seq_len")
def test_block_table_entries_far_outside_the_cache_are_never_read(drill, device):
    """pitfall:reads_past_seq_len: here the garbage columns name blocks far past the cache's end,
    as a freed table row may; reading one faults on a GPU (and in the interpreter)."""
    run(drill, far_garbage_case(device))


@pytest.mark.pitfall("reads_past_seq_len")
def test_block_table_past_last_block_is_not_even_loaded(drill, device):
    """pitfall:reads_past_seq_len: garbage columns past each sequence's last block. The answer
    decides; the loads, counted in the worker under the CPU interpreter (tests/_traffic.py),
    explain a failure and are the worker's word. Loading the whole table row with the K/V
    loads masked gives the right answer: that passes, and the traffic report names it."""
    if not check_table_read_only_to_last_block(drill, _case(device, [5, 17, 32, 40], extra_columns=3, seed=6)):
        pytest.skip("this case runs with its loads counted, under the CPU interpreter only")


@pytest.mark.pitfall("wrong_gqa_mapping")
@pytest.mark.parametrize("num_heads,num_kv_heads", [(8, 2), (16, 2), (12, 3), (6, 2), (5, 1), (6, 1)],
                         ids=["ratio4", "ratio8", "ratio4x3", "ratio3", "ratio5", "ratio6"])
def test_gqa_head_mapping(drill, device, num_heads, num_kv_heads):
    """pitfall:wrong_gqa_mapping: query head h reads KV head h // (H_q / H_kv)."""
    run(drill, _case(device, [20, 40], num_heads=num_heads, num_kv_heads=num_kv_heads, seed=5))


def test_one_query_head_per_kv_head(drill, device):
    run(drill, _case(device, [20, 40], num_heads=4, num_kv_heads=4, seed=6))


@pytest.mark.pitfall("missing_scale")
def test_default_scale_is_one_over_sqrt_d(drill, device):
    """pitfall:missing_scale: D = 64, so the default scale is 1/8."""
    run(drill, _case(device, [30, 50], head_size=64, seed=7))


@pytest.mark.pitfall("missing_scale")
@pytest.mark.parametrize("scale", [0.05, 1.0])
def test_explicit_scale_is_honoured(drill, device, scale):
    run(drill, _case(device, [30, 50], scale=scale, seed=8))


@pytest.mark.pitfall("no_running_max")
def test_large_logits_need_the_running_max(drill, device):
    """pitfall:no_running_max: sequence 1's logits reach a few hundred, where exp() overflows
    float16 and float32 alike; sequence 0's stay small, so a softmax without the max gets it right."""
    run(drill, large_logits_case(device))


@pytest.mark.pitfall("no_rescale")
def test_running_max_grows_across_tiles(drill, device):
    """pitfall:no_rescale: long sequences whose scores keep growing, so the max moves on every tile."""
    run(drill, rising_scores_case(device))


@pytest.mark.pitfall("off_by_one")
def test_new_token_attends_to_itself(drill, device):
    """pitfall:off_by_one: seq_len counts the new token, whose K/V is already in the cache; here
    that token scores highest, so leaving it out moves every output."""
    run(drill, new_token_first_case(device))


@pytest.mark.pitfall("query_stride_ignored")
def test_query_may_be_a_view_of_fused_qkv(drill, device):
    """pitfall:query_stride_ignored: query = qkv[:, :H_q*D], rows (H_q + 2 H_kv) * D apart."""
    run(drill, _case(device, [9, 33], layout="fused_qkv", seed=11))


@pytest.mark.pitfall("unmasked_head_size")
@pytest.mark.parametrize("head_size", [3, 80, 128], ids=lambda d: f"D={d}")
def test_head_size_is_padded_and_masked(drill, device, head_size):
    # D = 3, 80: the tile is padded to a power of two and its tail must be masked.
    run(drill, _case(device, [7, 18], head_size=head_size, num_heads=4, num_kv_heads=1, seed=12))


def test_every_sequence_one_token(drill, device):
    run(drill, _case(device, [1, 1, 1], seed=13))


def test_sequences_of_exactly_full_blocks(drill, device):
    run(drill, _case(device, [32, 64, 16], block_size=32, seed=14))


def test_allocates_the_output_when_out_is_none(drill, device):
    case = _case(device, [9, 40], seed=16)
    out = drill.paged_decode_attention(*case.args(), **case.kwargs())
    check_paged_decode(case, out)


@pytest.mark.launches_nothing  # nothing to do: no kernel need run
def test_empty_batch(drill, device):
    case = _case(device, [3])
    out = drill.paged_decode_attention(case.query[:0], case.k_cache, case.v_cache, case.block_table[:0],
                                       case.seq_lens[:0])
    assert out.shape == (0, 8, 16)


# --- hypothesis sweeps ------------------------------------------------------


@given(params=paged_decode_params())
def test_matches_reference(drill, device, params):
    run(drill, paged_decode_case(**params, device=device))


# --- bad input is refused (§7) ----------------------------------------------


def _bad_inputs(device):
    case = _case(device, [5, 20])
    query, k_cache, v_cache, table, lens = case.args()
    return {
        "H_q not a multiple of H_kv": (query[:, :3], k_cache, v_cache, table, lens),
        "query without a head axis": (query[:, 0], k_cache, v_cache, table, lens),
        "cache head size != query head size": (query[..., :8].contiguous(), k_cache, v_cache, table, lens),
        "k_cache shape != v_cache shape": (query, k_cache, v_cache[:2], table, lens),
        "block_table rows != B": (query, k_cache, v_cache, table[:1], lens),
        "seq_lens length != B": (query, k_cache, v_cache, table, lens[:1]),
        "float seq_lens": (query, k_cache, v_cache, table, lens.float()),
        "float block_table": (query, k_cache, v_cache, table.float(), lens),
        "cache dtype != query dtype": (query, k_cache.float(), v_cache.float(), table, lens),
        "float64 everywhere": (query.double(), k_cache.double(), v_cache.double(), table, lens),
        "non-contiguous k_cache": (query, k_cache.transpose(1, 2).contiguous().transpose(1, 2), v_cache, table, lens),
        "query whose heads are not contiguous": (query.transpose(1, 2).contiguous().transpose(1, 2), k_cache, v_cache,
                                                 table, lens),
        "block_table whose rows are strided": (query, k_cache, v_cache, torch.stack([table, table], dim=-1)[..., 0], lens),
        "seq_len 0": (query, k_cache, v_cache, table, lens.clone().fill_(0)),
        "seq_len beyond the block table": (query, k_cache, v_cache, table,
                                           lens.clone().fill_(table.shape[1] * k_cache.shape[1] + 1)),
        "block number past the cache": (query, k_cache, v_cache, table.clone().fill_(k_cache.shape[0]), lens),
    }


@pytest.mark.parametrize("what", list(_bad_inputs("cpu")))
def test_rejects_bad_input(drill, device, what):
    args = _bad_inputs(device)[what]
    if what.startswith(("seq_len ", "block number")) and device != "cpu":
        pytest.skip("on a GPU seq_lens and block numbers are not checked: it would cost a device sync "
                    "(content/l2.md §7)")
    with expect_value_error(what, "content/l2.md §7"):
        drill.paged_decode_attention(*args)


@pytest.mark.parametrize("what", ["shape", "dtype"])
def test_rejects_an_out_that_does_not_fit(drill, device, what):
    case = _case(device, [5, 20])
    shape, dtype = case.query.shape, case.query.dtype
    out = torch.empty((shape[0], shape[1] - 1, shape[2]) if what == "shape" else shape,
                      dtype=torch.float32 if what == "dtype" else dtype, device=device)
    with expect_value_error(f"an out of another {what} than the query", "content/l2.md §7"):
        drill.paged_decode_attention(*case.args(), out=out)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a second device type")
def test_rejects_tensors_on_two_devices(drill):
    case = _case("cuda", [5, 20])
    query, k_cache, v_cache, table, lens = case.args()
    with expect_value_error("seq_lens on the CPU with the rest on the GPU", "content/l2.md §7"):
        drill.paged_decode_attention(query, k_cache, v_cache, table, lens.cpu())


# Last: a kernel that overflows int32 may read far outside the cache and crash the process.
@pytest.mark.pitfall("int32_offsets")
def test_large_cache_needs_int64_offsets(drill, device):
    """A cache of more than 2**31 elements: slot * H_kv * D no longer fits in int32.

    The 4 GiB caches are allocated but only three blocks are ever touched, so on
    the CPU they cost no memory. The same tokens in a small cache come first: if
    they are wrong too, the mistake is not about int32.
    """
    num_kv_heads, head_size, block_size = 1, 128, 16
    small = paged_decode_case([40], num_heads=4, num_kv_heads=num_kv_heads, head_size=head_size,
                              block_size=block_size, extra_columns=0, device=device)
    run(drill, small)
    k_cache, v_cache = caches_past_int32(block_size, num_kv_heads, head_size, device)
    num_blocks = k_cache.shape[0]
    table = torch.tensor([[num_blocks - 1, 5, num_blocks - 3]], dtype=torch.int32, device=device)
    for column, block in enumerate(table[0].tolist()):
        k_cache[block] = small.k_cache[small.block_table[0, column]]
        v_cache[block] = small.v_cache[small.block_table[0, column]]
    large = DecodeCase(query=small.query, k_cache=k_cache, v_cache=v_cache, block_table=table,
                       seq_lens=small.seq_lens)
    try:
        check_paged_decode(large, drill.paged_decode_attention(*large.args()))
    except Mismatch as error:
        wrapped = Mismatch(f"right in a small cache, wrong when blocks {num_blocks - 1} and {num_blocks - 3} start "
                           f"past 2**31 elements into the cache: offsets computed in int32 wrap around "
                           f"(content/l2.md §9)\n{error}")
        wrapped.pitfalls = ["int32_offsets"]
        raise wrapped from None
