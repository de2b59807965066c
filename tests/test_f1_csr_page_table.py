"""F1: FlashInfer's CSR page table and its append kernel (content/f1.md). Runs
unchanged against any tree.

The CSR arrays are compared with a loop-by-loop reference; every append is
compared bit for bit over guarded caches (the guards included), so a write to the
wrong page, the wrong entry, the wrong layout or outside the cache all fail, and
the failure says which.
"""
import pytest
import torch
from hypothesis import given

from _diagnose import Mismatch, expect_value_error
from _paged import DTYPES, allocate_blocks, caches_past_int32
from drills.f1 import (WORKED_EXAMPLE, append_case, append_params, check_append,
                       check_batch_indices_positions, check_csr, name_pitfalls, worked_example_case)

ALL_DTYPES = list(DTYPES.values())
LAYOUTS = ["NHD", "HND"]


def i32(values, device):
    return torch.tensor(values, dtype=torch.int32, device=device)


def run(drill, case):
    drill.append_paged_kv_cache(*case.args())
    check_append(case)


def csr(drill, table, seq_lens, page_size, device):
    table, seq_lens = i32(table, device), i32(seq_lens, device)
    got = drill.block_table_to_csr(table, seq_lens, page_size)
    check_csr(table, seq_lens, page_size, got)
    return [t.tolist() for t in got]


# --- block_table_to_csr (content/f1.md §2, §4) --------------------------------


def test_csr_worked_example(drill, device):
    ex = WORKED_EXAMPLE
    got = csr(drill, ex["block_table"], ex["seq_lens"], ex["page_size"], device)
    assert got == [ex["kv_indptr"], ex["kv_indices"], ex["kv_last_page_len"]]


@pytest.mark.pitfall("full_last_page_as_zero")
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_csr_full_last_page_is_page_size(drill, device, page_size):
    # Lengths 1·page_size and 2·page_size fill their last page: its length is page_size, not 0.
    got = csr(drill, [[4, 1], [0, 3]], [page_size, 2 * page_size], page_size, device)
    assert got[2] == [page_size, page_size]


@pytest.mark.parametrize("seq_lens", [[0], [0, 0, 0], [5, 0, 3], [0, 9], [4, 0]], ids=str)
def test_csr_length_zero_sequence_owns_no_page(drill, device, seq_lens):
    # As vLLM's FlashInfer backend does: no page, kv_last_page_len 0, indptr repeats.
    table = [[7, 2, 5], [1, 8, 6], [3, 4, 0]][:len(seq_lens)]
    indptr, indices, last = csr(drill, table, seq_lens, 4, device)
    for b, n in enumerate(seq_lens):
        if n == 0:
            assert indptr[b + 1] == indptr[b] and last[b] == 0


def test_csr_of_a_table_with_no_columns(drill, device):
    got = csr(drill, [[], []], [0, 0], 16, device)
    assert got == [[0, 0, 0], [], [0, 0]]


@given(params=append_params())
def test_csr_round_trips_the_block_table(drill, device, params):
    """The CSR of an L1 block pool gives back each row's owned pages and each length."""
    seq_lens = [c + a for c, a in zip(params["context_lens"], params["append_lens"])]
    page_size = params["page_size"]
    gen = torch.Generator().manual_seed(params["seed"])
    table, _ = allocate_blocks(seq_lens, page_size, gen, params["spare_pages"], params["extra_columns"])
    got = drill.block_table_to_csr(table.to(device), i32(seq_lens, device), page_size)
    check_csr(table.to(device), i32(seq_lens, device), page_size, got)
    indptr, indices, last = (t.tolist() for t in got)
    for b, n in enumerate(seq_lens):  # back: rows of the block table and FlashInfer's get_seq_lens
        pages = indices[indptr[b]:indptr[b + 1]]
        assert pages == table[b, :len(pages)].tolist()
        assert ((len(pages) - 1) * page_size + last[b] if pages else 0) == n


# --- batch_indices_positions (§5) --------------------------------------------


def bip(drill, append_indptr, seq_lens, nnz, device):
    append_indptr, seq_lens = i32(append_indptr, device), i32(seq_lens, device)
    got = drill.batch_indices_positions(append_indptr, seq_lens, nnz)
    check_batch_indices_positions(append_indptr, seq_lens, nnz, got)
    return [t.tolist() for t in got]


def test_batch_indices_positions_worked_example(drill, device):
    ex = WORKED_EXAMPLE
    got = bip(drill, ex["append_indptr"], ex["seq_lens"], ex["append_indptr"][-1], device)
    assert got == [ex["batch_indices"], ex["positions"]]


@pytest.mark.pitfall("token_index_as_position")
def test_positions_start_after_the_context(drill, device):
    # Sequence 0 holds 10 tokens before it appends 2; sequence 1 is new. Token 2 is the
    # third token of the batch but position 0 of sequence 1.
    got = bip(drill, [0, 2, 5], [12, 3], 5, device)
    assert got == [[0, 0, 1, 1, 1], [10, 11, 0, 1, 2]]


def test_tokens_past_the_last_sequence_are_padding(drill, device):
    got = bip(drill, [0, 1, 1, 3], [4, 0, 2], 6, device)
    assert got == [[0, 2, 2, -1, -1, -1], [3, 0, 1, 0, 0, 0]]


def test_an_empty_batch_padded_for_a_graph_is_all_padding(drill, device):
    got = bip(drill, [0], [], 2, device)
    assert got == [[-1, -1], [0, 0]]


@given(params=append_params())
def test_batch_indices_positions_matches_reference(drill, device, params):
    case = append_case(**params, device=device)
    nnz = case.key.shape[0]
    got = drill.batch_indices_positions(case.append_indptr, case.seq_lens, nnz)
    check_batch_indices_positions(case.append_indptr, case.seq_lens, nnz, got)


# --- append_paged_kv_cache: the worked example and the properties (§5, §6) ---


@pytest.mark.parametrize("cache_form", ["tuple", "5d"])
@pytest.mark.parametrize("kv_layout", LAYOUTS)
def test_append_worked_example(drill, device, kv_layout, cache_form):
    case = worked_example_case(device, kv_layout, cache_form)
    run(drill, case)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_append_is_bit_exact_for_each_dtype(drill, device, dtype):
    case = append_case([3, 0], [4, 5], 4, num_heads=2, head_size=8, dtype=dtype, device=device, seed=1)
    run(drill, case)


@pytest.mark.pitfall("layout_swapped")
@pytest.mark.parametrize("cache_form", ["tuple", "5d"])
@pytest.mark.parametrize("kv_layout", LAYOUTS)
def test_each_layout_puts_entry_and_head_in_their_dims(drill, device, kv_layout, cache_form):
    # H = 3 and page_size = 4 differ, so exchanging their strides lands elsewhere.
    case = append_case([5, 2], [3, 2], 4, num_heads=3, head_size=8, kv_layout=kv_layout, cache_form=cache_form,
                       device=device, seed=2)
    run(drill, case)


@pytest.mark.pitfall("indptr_off_by_one")
def test_each_sequence_starts_at_its_own_indptr(drill, device):
    # key a view of fused QKV (row stride 3*H*D), value rows of its own (H*D): each is read
    # through its own strides.
    case = append_case([6, 1, 9], [2, 3, 1], 4, num_heads=2, head_size=4, rows="mixed", device=device, seed=3)
    run(drill, case)


@pytest.mark.pitfall("last_page_len_as_position")
@pytest.mark.parametrize("kv_layout", LAYOUTS)
def test_several_new_tokens_per_sequence_go_to_their_own_positions(drill, device, kv_layout):
    # A prefill chunk of 6 tokens over a context of 3: only the last one sits at kv_last_page_len - 1.
    case = append_case([3, 0], [6, 5], 4, num_heads=2, head_size=4, kv_layout=kv_layout, device=device, seed=4)
    run(drill, case)


def test_decode_step_one_token_per_sequence(drill, device):
    case = append_case([7, 16, 0, 3], [1, 1, 1, 1], 8, num_heads=2, head_size=8, device=device, seed=5)
    run(drill, case)


@pytest.mark.parametrize("padding", [1, 3])
def test_batch_index_minus_one_reads_and_writes_nothing(drill, device, padding):
    # This drill's choice (content/f1.md §7): batch index -1 marks padding, as slot -1 does in L1.
    case = append_case([2, 5], [3, 1], 4, num_heads=2, head_size=8, padding=padding, device=device, seed=6)
    run(drill, case)


@pytest.mark.parametrize("rows", ["fused_qkv", "mixed"])
def test_fused_qkv_rows_are_read_through_their_strides(drill, device, rows):
    """fused_qkv: key and value both views of one QKV tensor (row stride 3*H*D); mixed: key
    such a view, value contiguous rows (stride H*D), so each needs its own strides."""
    case = append_case([1, 6], [3, 2], 4, num_heads=2, head_size=8, rows=rows, device=device, seed=7)
    run(drill, case)


@pytest.mark.parametrize("kv_layout", LAYOUTS)
@pytest.mark.parametrize("num_heads,head_size", [(3, 40), (1, 3), (5, 24)])
def test_head_size_not_a_power_of_two(drill, device, kv_layout, num_heads, head_size):
    case = append_case([2, 0], [3, 2], 2, num_heads=num_heads, head_size=head_size, kv_layout=kv_layout,
                       spare_pages=1, device=device, seed=8)
    run(drill, case)


def test_empty_sequences_in_the_batch(drill, device):
    case = append_case([0, 4, 0, 0], [0, 2, 3, 0], 4, num_heads=2, head_size=4, device=device, seed=9)
    run(drill, case)


def test_an_empty_batch_of_padding_writes_nothing(drill, device):
    case = append_case([], [], 4, num_heads=2, head_size=8, padding=2, device=device)
    run(drill, case)


@pytest.mark.launches_nothing  # nothing to do: no kernel need run
def test_zero_tokens_is_a_no_op(drill, device):
    case = append_case([5], [0], 4, num_heads=2, head_size=8, device=device)
    run(drill, case)


@given(params=append_params())
def test_append_matches_reference(drill, device, params):
    run(drill, append_case(**params, device=device))


# --- bad input is refused (§7) ------------------------------------------------


def _small(device, **kwargs):
    return append_case([2, 5], [3, 2], 4, num_heads=2, head_size=8, device=device, **kwargs)


def _bad_appends(device):
    case = _small(device)
    key, value, bi, pos, cache, indices, indptr, last, layout = case.args()
    k, v = cache
    bad_indptr = indptr.clone()
    bad_indptr[1] = bad_indptr[2] + 1
    return {
        # value checks (need the tensors' contents: CPU only)
        "kv_indptr not non-decreasing": (key, value, bi, pos, cache, indices, bad_indptr, last, layout),
        "kv_last_page_len 0 for a sequence with pages": (key, value, bi, pos, cache, indices, indptr,
                                                          last * 0, layout),
        "kv_last_page_len above page_size": (key, value, bi, pos, cache, indices, indptr, last + 4, layout),
        "a position beyond the allocated pages": (key, value, bi, pos + 8, cache, indices, indptr, last, layout),
        "a batch index past the last sequence": (key, value, bi + 2, pos, cache, indices, indptr, last, layout),
        # shape, dtype, layout checks (free anywhere)
        "unknown kv_layout 'NDH'": (key, value, bi, pos, cache, indices, indptr, last, "NDH"),
        "int64 batch_indices": (key, value, bi.long(), pos, cache, indices, indptr, last, layout),
        "int64 positions": (key, value, bi, pos.long(), cache, indices, indptr, last, layout),
        "int64 kv_indices": (key, value, bi, pos, cache, indices.long(), indptr, last, layout),
        "int64 kv_indptr": (key, value, bi, pos, cache, indices, indptr.long(), last, layout),
        "int64 kv_last_page_len": (key, value, bi, pos, cache, indices, indptr, last.long(), layout),
        "append_value shape != append_key shape": (key, value[:, :1], bi, pos, cache, indices, indptr, last, layout),
        "cache H, D != append_key's": (key[..., :4].contiguous(), value[..., :4].contiguous(), bi, pos, cache,
                                       indices, indptr, last, layout),
        "k and v caches of different shapes": (key, value, bi, pos, (k, v[:2]), indices, indptr, last, layout),
        "cache dtype != append_key dtype": (key, value, bi, pos, (k.float(), v.float()), indices, indptr, last,
                                            layout),
        "positions shorter than append_key": (key, value, bi, pos[:2], cache, indices, indptr, last, layout),
        "kv_indptr and kv_last_page_len of different batch sizes": (key, value, bi, pos, cache, indices,
                                                                    indptr[:-1], last, layout),
        "a 5-D cache whose dim 1 is not 2": (key, value, bi, pos, torch.stack([k, v, k], dim=1), indices, indptr,
                                             last, layout),
        "a cache whose last dim is strided": (key, value, bi, pos, (k.transpose(2, 3).contiguous().transpose(2, 3),
                                                                    v.transpose(2, 3).contiguous().transpose(2, 3)),
                                              indices, indptr, last, layout),
    }


_VALUE_CHECKS = ("non-decreasing", "kv_last_page_len 0", "above page_size", "beyond", "past the last")


@pytest.mark.parametrize("what", list(_bad_appends("cpu")))
def test_append_rejects_bad_input(drill, device, what):
    if any(word in what for word in _VALUE_CHECKS) and device != "cpu":
        pytest.skip("on a GPU value checks are skipped: they would cost a device sync (content/f1.md §7)")
    args = _bad_appends(device)[what]
    with expect_value_error(what, "content/f1.md §7"):
        drill.append_paged_kv_cache(*args)


def _bad_csr(device):
    table, seq_lens = i32([[9, 3, 7], [2, 5, 0]], device), i32([9, 8], device)
    return {
        "int64 block_table": (table.long(), seq_lens, 4),
        "int64 seq_lens": (table, seq_lens.long(), 4),
        "page_size 0": (table, seq_lens, 0),
        "seq_lens of another batch size": (table, seq_lens[:1], 4),
        "a seq_len longer than its block-table row": (table, i32([13, 8], device), 4),
        "a negative seq_len": (table, i32([-1, 8], device), 4),
    }


@pytest.mark.parametrize("what", list(_bad_csr("cpu")))
def test_csr_rejects_bad_input(drill, device, what):
    if ("longer" in what or "negative" in what) and device != "cpu":
        pytest.skip("on a GPU value checks are skipped: they would cost a device sync (content/f1.md §7)")
    with expect_value_error(what, "content/f1.md §7"):
        drill.block_table_to_csr(*_bad_csr(device)[what])


def _bad_bip(device):
    return {
        "int64 append_indptr": (torch.tensor([0, 2, 3], device=device), i32([4, 1], device), 3),
        "append_indptr not non-decreasing": (i32([0, 3, 2], device), i32([4, 1], device), 3),
        "append_indptr of the wrong length": (i32([0, 2], device), i32([4, 1], device), 3),
        "nnz smaller than append_indptr[-1]": (i32([0, 2, 3], device), i32([4, 1], device), 2),
        "seq_lens shorter than the tokens appended": (i32([0, 2, 3], device), i32([1, 1], device), 3),
    }


@pytest.mark.parametrize("what", list(_bad_bip("cpu")))
def test_batch_indices_positions_rejects_bad_input(drill, device, what):
    if what not in ("int64 append_indptr", "append_indptr of the wrong length") and device != "cpu":
        pytest.skip("on a GPU value checks are skipped: they would cost a device sync (content/f1.md §7)")
    with expect_value_error(what, "content/f1.md §7"):
        drill.batch_indices_positions(*_bad_bip(device)[what])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a second device type")
def test_rejects_tensors_on_two_devices(drill):
    key, value, bi, pos, cache, indices, indptr, last, layout = _small("cuda").args()
    with expect_value_error("kv_indices on the CPU with the rest on the GPU", "content/f1.md §7"):
        drill.append_paged_kv_cache(key, value, bi, pos, cache, indices.cpu(), indptr, last, layout)


# Last: a kernel that overflows int32 may corrupt memory or crash the process.
@pytest.mark.pitfall("int32_offsets")
def test_large_cache_needs_int64_offsets(drill, device):
    """Caches of more than 2**31 elements: page * stride_page no longer fits in int32.

    One sequence owns the last page, page 5 and the page before the last. The 4 GiB
    caches are allocated but only three entries are touched, so on the CPU they cost
    no memory.
    """
    page_size, num_heads, head_size = 16, 1, 128
    k_cache, v_cache = caches_past_int32(page_size, num_heads, head_size, device)
    last_page = k_cache.shape[0] - 1
    kv_indices = i32([last_page, 5, last_page - 1], device)
    kv_indptr, kv_last_page_len = i32([0, 3], device), i32([page_size], device)
    positions = i32([15, 16, 40], device)  # page 0 entry 15, page 1 entry 0, page 2 entry 8
    batch_indices = i32([0, 0, 0], device)
    places = [(last_page, 15), (5, 0), (last_page - 1, 8)]
    key = torch.randn(3, num_heads, head_size, device=device).half()
    value = torch.randn(3, num_heads, head_size, device=device).half()
    for cache in (k_cache, v_cache):
        for place in places:
            cache[place] = float("nan")
    drill.append_paged_kv_cache(key, value, batch_indices, positions, (k_cache, v_cache), kv_indices, kv_indptr,
                                kv_last_page_len, "NHD")
    right = [torch.equal(k_cache[p], key[t]) and torch.equal(v_cache[p], value[t]) for t, p in enumerate(places)]
    if not all(right):
        t = right.index(False)
        error = Mismatch(f"token {t} belongs in page {places[t][0]:,}, entry {places[t][1]} (flat offset "
                         f"{k_cache[places[t]].storage_offset():,}), but that entry does not hold its values "
                         f"(content/f1.md §9)")
        if right[1]:  # page 5, near the start, is right: only the offsets past 2**31 went wrong
            error = name_pitfalls(Mismatch(str(error) + "\n  page 5, near the start of the cache, is right: "
                                           "offsets computed in int32 wrap around past 2**31"), ["int32_offsets"])
        raise error
