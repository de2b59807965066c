"""L1: paged KV-cache write (content/l1.md). Runs unchanged against any tree.

Every write is compared bit for bit with the plain-PyTorch reference over the
whole guarded allocation, so a missing write, a write to the wrong slot, a
write of padding and a write outside the cache all fail, and the failure says
which token and which slot.
"""
import pytest
import torch
from hypothesis import given

from _diagnose import Mismatch, expect_value_error
from _paged import DTYPES, caches_past_int32
from drills.l1 import (WORKED_EXAMPLE, check_padding_not_read, check_kv_write, check_slot_mapping, kv_write_case, kv_write_params,
                       random_kv_write_case)

ALL_DTYPES = list(DTYPES.values())


def run(drill, case):
    drill.reshape_and_cache(*case.args())
    check_kv_write(case)


# --- slot_mapping (content/l1.md §4) ----------------------------------------


@pytest.mark.pitfall("position_as_slot")
@pytest.mark.pitfall("logical_as_physical")
def test_slot_mapping_worked_example(drill, device):
    ex = WORKED_EXAMPLE
    table = torch.tensor(ex["block_table"], dtype=torch.int32, device=device)
    seq_idx = torch.tensor(ex["seq_idx"], dtype=torch.int32, device=device)
    positions = torch.tensor(ex["positions"], dtype=torch.int32, device=device)
    got = drill.slot_mapping(table, seq_idx, positions, ex["block_size"])
    check_slot_mapping(table, seq_idx, positions, ex["block_size"], got)
    assert got.tolist() == ex["slots"]


@pytest.mark.pitfall("token_index_as_position")
def test_slot_mapping_uses_position_not_token_index(drill, device):
    # Sequence 1 already holds 9 tokens: its first new token is token 1 of the
    # batch but sits at position 9, in its third block.
    table = torch.tensor([[4, 0, 0], [6, 1, 3]], dtype=torch.int32, device=device)
    seq_idx = torch.tensor([0, 1, 1], dtype=torch.int32, device=device)
    positions = torch.tensor([2, 9, 10], dtype=torch.int32, device=device)
    got = drill.slot_mapping(table, seq_idx, positions, 4)
    check_slot_mapping(table, seq_idx, positions, 4, got)


# --- reshape_and_cache: the worked example and the properties (§4, §5) -------


def test_write_worked_example(drill, device):
    ex = WORKED_EXAMPLE
    case = kv_write_case(ex["block_table"], ex["num_blocks"], ex["seq_idx"], ex["positions"], ex["block_size"],
                         num_heads=2, head_size=4, device=device)
    run(drill, case)


@pytest.mark.pitfall("offset_without_heads")
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_write_is_bit_exact_for_each_dtype(drill, device, dtype):
    case = random_kv_write_case(context_lens=[3, 0], new_lens=[4, 5], block_size=4, num_heads=2, head_size=8,
                                dtype=dtype, device=device, seed=1)
    run(drill, case)


@pytest.mark.launches_nothing  # nothing to do: no kernel need run
def test_zero_tokens_is_a_no_op(drill, device):
    case = random_kv_write_case(context_lens=[5], new_lens=[0], block_size=4, num_heads=2, head_size=8,
                                device=device)
    run(drill, case)


# --- each pitfall on the page (§8) ------------------------------------------


@pytest.mark.pitfall("padding_written")
@pytest.mark.parametrize("padding", [[0], [2], [5], [0, 1, 2, 3, 4, 5]], ids=["first", "middle", "last", "all"])
def test_padding_tokens_write_nothing(drill, device, padding):
    real = 6 - len(padding)
    case = random_kv_write_case(context_lens=[2], new_lens=[real], padding=padding, block_size=4,
                                num_heads=2, head_size=8, device=device)
    run(drill, case)


@pytest.mark.pitfall("padding_written")
def test_padding_tokens_read_nothing(drill, device):
    """A padding token's key/value row must not even be read. Its values decide (the
    padding tokens write nothing); the loads, counted in the worker under the CPU
    interpreter (tests/_traffic.py), explain a failure and are the worker's word: a right
    write that reads the padding rows passes, and the traffic report names it."""
    case = random_kv_write_case(context_lens=[2, 9], new_lens=[3, 2], padding=[0, 3, 6], block_size=4,
                                num_heads=2, head_size=8, device=device)
    if not check_padding_not_read(drill, case):
        pytest.skip("this case runs with its loads counted, under the CPU interpreter only")


@pytest.mark.pitfall("row_stride_ignored")
@pytest.mark.parametrize("layout", ["fused_qkv", "key_in_qkv", "value_in_qkv", "unequal_strides"])
def test_fused_qkv_view_is_read_without_copy(drill, device, layout):
    """key and value as views with their own row strides: each must be read with its own."""
    case = random_kv_write_case(context_lens=[1, 6], new_lens=[3, 2], block_size=4, num_heads=2, head_size=8,
                                layout=layout, device=device)
    run(drill, case)


@pytest.mark.pitfall("unmasked_tail")
@pytest.mark.parametrize("num_heads,head_size", [(3, 40), (1, 3), (5, 24)])
def test_head_size_not_a_power_of_two(drill, device, num_heads, head_size):
    # H*D = 120, 3, 120: the tile is padded to a power of two and its tail must be masked.
    case = random_kv_write_case(context_lens=[2, 0], new_lens=[3, 2], block_size=2, num_heads=num_heads,
                                head_size=head_size, spare_blocks=0, device=device)
    run(drill, case)


@pytest.mark.pitfall("logical_as_physical")
def test_logical_block_is_not_the_physical_block(drill, device):
    # Block table [[2, 0, 1]]: positions 0..11 land in blocks 2, 0, 1 in that order.
    case = kv_write_case([[2, 0, 1]], 3, [0] * 12, list(range(12)), 4, num_heads=1, head_size=8, device=device)
    run(drill, case)


def test_int32_slot_mapping_is_accepted(drill, device):
    # That int32 slots are widened before slot * H * D is shown by the large-cache test at the end.
    case = random_kv_write_case(context_lens=[7], new_lens=[3], block_size=4, num_heads=2, head_size=8,
                                slot_dtype=torch.int32, device=device)
    run(drill, case)


# --- properties over random shapes, layouts, dtypes and padding ------------


@given(params=kv_write_params())
def test_slot_mapping_matches_formula(drill, device, params):
    case = random_kv_write_case(**params, device=device)
    real = case.slot_mapping >= 0
    seq_idx, positions = case.seq_idx[real], case.positions[real]
    got = drill.slot_mapping(case.block_table, seq_idx, positions, case.block_size)
    check_slot_mapping(case.block_table, seq_idx, positions, case.block_size, got)


@given(params=kv_write_params())
def test_write_matches_reference(drill, device, params):
    run(drill, random_kv_write_case(**params, device=device))


# --- bad input is refused (§6) ----------------------------------------------


def _small_case(device, **kwargs):
    return random_kv_write_case(context_lens=[2], new_lens=[3], block_size=4, num_heads=2, head_size=8,
                                device=device, **kwargs)


@pytest.mark.pitfall("noncontiguous_cache_accepted")
def test_rejects_non_contiguous_cache(drill, device):
    case = _small_case(device)
    key, value, k_cache, v_cache, slots = case.args()
    wide = torch.zeros(*k_cache.shape[:3], 16, dtype=k_cache.dtype, device=device)
    with expect_value_error("a non-contiguous k_cache (a [..., :8] slice of a wider tensor)", "content/l1.md §6",
                            pitfall="noncontiguous_cache_accepted"):
        drill.reshape_and_cache(key, value, wide[..., :8], v_cache, slots)


def test_rejects_token_whose_heads_are_not_contiguous(drill, device):
    case = _small_case(device)
    key, value, k_cache, v_cache, slots = case.args()
    permuted = key.transpose(1, 2).contiguous().transpose(1, 2)  # same values, [H, D] strided
    with expect_value_error("a key whose [H, D] rows are not contiguous", "content/l1.md §6"):
        drill.reshape_and_cache(permuted, value, k_cache, v_cache, slots)


def _bad_inputs(device):
    case = _small_case(device)
    key, value, k_cache, v_cache, slots = case.args()
    return {
        "value shape != key shape": (key, value[:, :1], k_cache, v_cache, slots),
        "cache head size != key head size": (key[..., :4].contiguous(), value[..., :4].contiguous(), k_cache, v_cache,
                                             slots),
        "k_cache shape != v_cache shape": (key, value, k_cache, v_cache[:2], slots),
        "slot_mapping length != T": (key, value, k_cache, v_cache, slots[:2]),
        "float slot_mapping": (key, value, k_cache, v_cache, slots.float()),
        "value dtype != key dtype": (key, value.float(), k_cache, v_cache, slots),
        "cache dtype != key dtype": (key, value, k_cache.float(), v_cache.float(), slots),
        "slot past the end of the cache": (key, value, k_cache, v_cache,
                                           slots.clone().fill_(k_cache.shape[0] * k_cache.shape[1])),
        "slot below -1": (key, value, k_cache, v_cache, slots.clone().fill_(-2)),
    }


@pytest.mark.parametrize("what", list(_bad_inputs("cpu")))
def test_rejects_bad_input(drill, device, what):
    args = _bad_inputs(device)[what]
    if "slot" in what and "slot_mapping" not in what and device != "cpu":
        pytest.skip("on a GPU the slot range is not checked: it would cost a device sync (content/l1.md §6)")
    with expect_value_error(what, "content/l1.md §6"):
        drill.reshape_and_cache(*args)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a second device type")
def test_rejects_tensors_on_two_devices(drill):
    case = _small_case("cuda")
    key, value, k_cache, v_cache, slots = case.args()
    with expect_value_error("slot_mapping on the CPU with the rest on the GPU", "content/l1.md §6"):
        drill.reshape_and_cache(key, value, k_cache, v_cache, slots.cpu())


# Last: a kernel that overflows int32 may corrupt memory or crash the process.
@pytest.mark.pitfall("int32_offsets")
def test_large_cache_needs_int64_offsets(drill, device):
    """A cache of more than 2**31 elements: slot * H * D no longer fits in int32.

    The 4 GiB cache is allocated but only a few slots are ever touched, so on
    the CPU it costs no memory.
    """
    num_heads, head_size, block_size = 1, 128, 16
    k_cache, v_cache = caches_past_int32(block_size, num_heads, head_size, device)
    num_slots = k_cache.shape[0] * block_size
    slots = torch.tensor([num_slots - 1, 5, num_slots - block_size - 3], dtype=torch.int32, device=device)
    key = torch.randn(3, num_heads, head_size, device=device).half()
    value = torch.randn(3, num_heads, head_size, device=device).half()
    flat_k, flat_v = k_cache.view(num_slots, -1), v_cache.view(num_slots, -1)
    for cache in (flat_k, flat_v):
        cache[slots.long()] = float("nan")
    drill.reshape_and_cache(key, value, k_cache, v_cache, slots)
    right = [all(torch.equal(cache[s], rows[t].flatten()) for cache, rows in ((flat_k, key), (flat_v, value)))
             for t, s in enumerate(slots.tolist())]
    if not all(right):
        t, s = right.index(False), slots[right.index(False)].item()
        error = Mismatch(f"token {t} belongs in slot {s} (flat offset {s * head_size:,}), but the slot "
                         f"does not hold its values (content/l1.md §8)")
        if right[1]:  # slot 5, near the start, is right: only the offsets past 2**31 went wrong
            error = Mismatch(str(error) + "\n  slot 5, near the start of the cache, is right: offsets computed in "
                             "int32 wrap around past 2**31")
            error.pitfalls = ["int32_offsets"]
        raise error
