"""L2, paged decode attention (content/l2.md): its manifest entry `DRILL`, built from
the parts of this folder:

- cases.py      the test shapes, the page's worked example, DecodeCase and its builders,
                the hypothesis strategy, the fixture checks
- reference.py  the fp32 reference, the online softmax of §3, the tolerances
- checks.py     the checks and their diagnosis
- mistakes.py   the pitfalls of §9 and the other planted mistakes (PLANTED)
- bench.py      the bench cases, bytes and FLOPs, bench_work
- traffic.py    the traffic case and report, the block-table read check
- picture.py    picture and draw_case
- page.py       the page checks

It also re-exports the names other test files import from drills.l2.
"""
from _drill import Drill

from .bench import BENCH, bench_work
from .cases import (DECODE_EXAMPLE, FIXTURE_CHECKS, TEST_SHAPES, DecodeCase, _case_for_mutations, decode_example_case,
                    far_garbage_case, large_logits_case, new_token_first_case, paged_decode_case, paged_decode_params,
                    rising_scores_case, small_case)
from .checks import check_paged_decode
from .mistakes import PLANTED
from .page import PAGE_CHECKS
from .picture import draw_case, picture
from .reference import DECODE_TOLERANCE, ref_paged_decode
from .traffic import check_a_host_read_of_the_whole_table_fails_no_test, check_table_read_only_to_last_block, traffic, \
    traffic_case

DRILL = Drill(
    **PLANTED.fields(),
    title="Paged decode attention",
    mirrors="vLLM paged attention v1 / Triton decode",
    writes={"paged_decode_attention": ("out",)},
    api=("paged_decode_kernel", "paged_decode_attention"),
    test_shapes=TEST_SHAPES,
    bench=BENCH,
    bench_work=bench_work,
    traffic=traffic,
    picture=picture,
    draw_case=draw_case,
    page_checks=PAGE_CHECKS,
    fixture_checks=(*FIXTURE_CHECKS, check_a_host_read_of_the_whole_table_fails_no_test),
)

__all__ = ["DRILL", "DECODE_EXAMPLE", "DECODE_TOLERANCE", "DecodeCase", "_case_for_mutations",
           "check_paged_decode", "check_table_read_only_to_last_block", "decode_example_case", "draw_case",
           "far_garbage_case", "large_logits_case", "new_token_first_case", "paged_decode_case", "paged_decode_params",
           "ref_paged_decode", "rising_scores_case", "small_case", "traffic_case"]
