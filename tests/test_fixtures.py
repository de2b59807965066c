"""The builders make the cases the drills' tests say they make. These checks of our
own fixtures live here, apart from the learner-facing tests, so a learner never
fails a test because of a fixture."""
import torch

from _paged import changed, never_written, poisoned_out, snapshot
from drills import f1, l1, l2


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
