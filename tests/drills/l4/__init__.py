"""Drill L4, split-KV ("flash decoding") decode with a log-sum-exp merge: everything
that knows this drill, in parts:

  cases      TEST_SHAPES, the page's worked examples, the cases, their builders and
             strategies, the fixture checks
  reference  the plain-PyTorch reference (float64, on the CPU) and the tolerances
  checks     the checks, with their diagnosis
  mistakes   the pitfalls and other planted mistakes (PLANTED)
  bench      the bench cases and work
  traffic    the traffic case and report, the garbage-read check
  picture    picture and draw_case
  page       the page checks

The split count never changes the answer, only how it is summed; so the reference
is plain attention, and the diagnosis rebuilds the chunks a kernel would have made
(several ways of rounding the chunk length) to recognise the mistakes that live
in the split and the merge.
"""
from _drill import Drill

from .bench import BENCH, bench_work
from .cases import FIXTURE_CHECKS, TEST_SHAPES
from .mistakes import PLANTED
from .page import PAGE_CHECKS
from .picture import draw_case, picture
from .traffic import traffic

# What tests/test_l4_split_kv_decode.py imports from drills.l4:
from .cases import (MERGE_EXAMPLE, MergeCase, last_tokens_score_highest, merge_case, merge_example_case,
                    merge_example_numbers, merge_params, one_side_empty_case, split_case, split_params, spread_chunks)
from .checks import check_merge, check_split_decode
from .traffic import check_table_read_only_to_last_block

DRILL = Drill(
    **PLANTED.fields(),
    title="Split-KV decode attention",
    mirrors="vLLM paged attention v2 / unified attention's 3-D path, FlashInfer merge_state",
    writes={"paged_decode_attention_split": ("out",)},
    api=("merge_states_kernel", "merge_attention_states", "split_kv_kernel", "default_num_splits",
         "paged_decode_attention_split"),
    test_shapes=TEST_SHAPES,
    bench=BENCH,
    bench_work=bench_work,
    traffic=traffic,
    picture=picture,
    draw_case=draw_case,
    page_checks=PAGE_CHECKS,
    fixture_checks=FIXTURE_CHECKS,
)
