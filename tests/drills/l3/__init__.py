"""Drill L3, chunked-prefill attention over a paged cache: its entry, built from its parts.

cases (the shapes, the worked example, PrefillCase and its builders, the strategy),
reference (the float64 reference, the tolerance), checks (the check and its diagnosis),
mistakes (the pitfalls and other planted mistakes, PLANTED), bench (the bench workload),
traffic (the traffic report and the garbage-table-read check), picture (picture and draw_case),
page (the page checks).
"""
from _drill import Drill

from .bench import BENCH, bench_work
from .cases import TEST_SHAPES, PrefillCase, example_case, example_outputs, paged_prefill_case, prefill_params
from .checks import check_paged_prefill
from .mistakes import PLANTED, SECTION
from .page import PAGE_CHECKS
from .picture import draw_case, picture
from .traffic import check_table_read_only_to_last_block, traffic

__all__ = ["DRILL", "SECTION", "PrefillCase", "check_paged_prefill", "check_table_read_only_to_last_block",
           "example_case", "example_outputs", "paged_prefill_case", "prefill_params"]

DRILL = Drill(
    **PLANTED.fields(),
    title="Chunked-prefill attention",
    mirrors="vLLM unified attention (2-D path)",
    writes={"paged_prefill_attention": ("out",)},
    api=("paged_prefill_kernel", "paged_prefill_attention"),
    test_shapes=TEST_SHAPES,
    bench=BENCH,
    bench_work=bench_work,
    traffic=traffic,
    picture=picture,
    draw_case=draw_case,
    page_checks=PAGE_CHECKS,
)
