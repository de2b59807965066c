"""The builders make the cases the drills' tests say they make. These checks of our
own fixtures live here, apart from the learner-facing tests, so a learner never
fails a test because of a fixture."""
import torch

from _paged import changed, never_written, poisoned_out, snapshot
from drills import f1, l1, l2, l4


def test_l1_worked_example_gets_the_pages_slots(device):
    ex = l1.WORKED_EXAMPLE
    case = l1.kv_write_case(ex["block_table"], ex["num_blocks"], ex["seq_idx"], ex["positions"], ex["block_size"],
                            num_heads=2, head_size=4, device=device)
    assert case.slot_mapping.tolist() == ex["slots"]


def test_l1_layouts_give_key_and_value_their_own_row_strides(device):
    for layout in ("fused_qkv", "key_in_qkv", "value_in_qkv", "unequal_strides"):
        case = l1.random_kv_write_case(context_lens=[1, 6], new_lens=[3, 2], block_size=4, num_heads=2, head_size=8,
                                       layout=layout, device=device)
        strides = case.key.stride(0), case.value.stride(0)
        assert strides != (16, 16), layout
        assert (strides[0] != strides[1]) == (layout != "fused_qkv"), layout


def test_l2_large_logits_overflow_exp_only_in_sequence_1(device):
    largest = [float(scores.max()) for scores, _ in l2.large_logits_case(device).scores_values()]
    assert largest[0] < 11 and largest[1] > 120  # exp overflows float16 past 11.1, float32 past 88.7


def test_l2_fused_qkv_query_is_a_strided_view(device):
    assert not l2.small_case(device, [9, 33], layout="fused_qkv", seed=11).query.is_contiguous()


def test_l2_far_garbage_points_past_the_cache_only_where_unowned(device):
    case = l2.far_garbage_case(device)
    owned = l2.owned_columns(case.seq_lens, case.block_size, case.block_table.shape[1]).to(case.block_table.device)
    assert bool((case.block_table[owned] < case.k_cache.shape[0]).all())
    assert bool((case.block_table[~owned] == l2.FAR).all()) and bool(owned[0].all())


def test_l2_new_token_scores_highest(device):
    """...for the first query head of each KV head, whose query the new token's key copies."""
    case = l2.new_token_first_case(device)
    group = case.query.shape[1] // case.k_cache.shape[2]
    for scores, _ in case.scores_values():
        assert bool((scores[::group].argmax(dim=1) == scores.shape[1] - 1).all())


def test_poisoned_out_is_nan_inside_and_noise_around(device):
    out = poisoned_out((3, 4, 5), torch.float16, device, torch.Generator().manual_seed(0))
    assert bool(never_written(out.view).all())
    assert not bool(never_written(out.outside()).any()) and bool(torch.isfinite(out.outside()).all())
    before = snapshot(out.view)
    out.storage[-1] = 0
    assert changed(before) == [0]  # a write past the view shows as a change of its storage


def test_f1_worked_example_puts_each_token_in_the_pages_place(device):
    ex = f1.WORKED_EXAMPLE
    for layout in ("NHD", "HND"):
        case = f1.worked_example_case(device, layout)
        assert case.places() == list(zip(ex["pages"], ex["entries"]))
        assert [case.kv_indptr.tolist(), case.kv_indices.tolist(), case.kv_last_page_len.tolist()] == [
            ex["kv_indptr"], ex["kv_indices"], ex["kv_last_page_len"]]


def test_f1_padding_tokens_get_batch_index_minus_one(device):
    case = f1.append_case([2, 5], [3, 1], 4, num_heads=2, head_size=8, padding=3, device=device)
    assert case.batch_indices.tolist()[-3:] == [-1, -1, -1] and int((case.batch_indices < 0).sum()) == 3


def test_f1_fused_qkv_rows_are_strided_views(device):
    case = f1.append_case([1, 6], [3, 2], 4, num_heads=2, head_size=8, rows="fused_qkv", device=device)
    assert case.key.stride(0) == case.value.stride(0) == 3 * 2 * 8


def test_f1_pages_come_from_a_shuffled_pool_and_kv_indices_is_guarded(device):
    case = f1.append_case([9, 0, 13], [3, 2, 1], 4, num_heads=1, head_size=2, spare_pages=2, device=device)
    pages = case.kv_indices.tolist()
    assert pages != sorted(pages) or len(pages) < 3  # a logical page is not its physical page
    guard = case.kv_indices.new_empty(0).set_(case.kv_indices.untyped_storage()).tolist()[len(pages):]
    assert len(guard) == f1.GUARD and set(guard) <= set(case.spare_pages)


def test_l4_fused_qkv_query_is_a_strided_view(device):
    assert not l4.split_case([9, 70], layout="fused_qkv", num_splits=2, seed=15, device=device).query.is_contiguous()


def test_l4_empty_merge_sides_hold_garbage(device):
    case = l4.merge_case(rows=3, heads=2, head_size=8, empty_a=1.0, device=device, seed=7)
    assert bool(torch.isinf(case.s_a).all()) and bool(torch.isnan(case.v_a).all())
    assert bool(torch.isfinite(case.s_b).all()) and bool(torch.isfinite(case.v_b).all())


def test_l4_empty_chunk_case_separates_short_from_long_sequences():
    """The empty-split test: sequences shorter than 8 tokens leave chunks empty however a
    kernel rounds its chunks; 2048 = 8 · 256 leaves none empty under any rounding tried."""
    for align in (1, 16, 32, 64, 128, 256):
        assert all(end > start for start, end in l4.chunk_bounds(2048, 8, align))
        assert all(any(end <= start for start, end in l4.chunk_bounds(n, 8, align)) for n in (1, 3))


def test_l4_spread_chunks_make_the_chunk_lses_differ(device):
    case = l4.spread_chunks(l4.split_case([200, 150], num_splits=4, seed=7, device=device))
    for scores, values in case.scores_values():
        lse = torch.stack([s for _, s, _ in l4.chunk_states(scores, values, l4.chunk_bounds(scores.shape[1], 4, 64))])
        assert float((lse.max(0).values - lse.min(0).values).min()) > 1.0


def test_l4_last_tokens_score_highest(device):
    case = l4.last_tokens_score_highest(l4.split_case([256, 200], num_splits=4, seed=9, device=device))
    group = case.query.shape[1] // case.k_cache.shape[2]
    for scores, _ in case.scores_values():
        assert bool((scores[::group].argmax(dim=1) >= scores.shape[1] - 8).all())


def test_l4_worked_example_case_is_the_pages_row(device):
    case = l4.merge_example_case(device)
    scores, values = case.scores_values()[0]
    assert scores.flatten().tolist() == l4.MERGE_EXAMPLE["scores"]
    assert values.flatten().tolist() == l4.MERGE_EXAMPLE["values"]

