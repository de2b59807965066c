"""Drill L8, sliding-window attention with attention sinks over a paged cache: its entry,
built from its parts.

cases (the shapes, the worked example, WindowCase and its builder, the strategy),
reference (the float64 dense reference, the tolerance), checks (the check and its
diagnosis), mistakes (the pitfalls and other planted mistakes, PLANTED), bench (the bench
workload), traffic (the traffic report and the count of K/V rows read before the window),
picture (picture and draw_case), page (the page checks).
"""
from _drill import Drill

from .bench import BENCH, bench_work
from .cases import TEST_SHAPES, WindowCase, example_case, example_outputs, window_case, window_params
from .checks import check_window
from .mistakes import PLANTED, SECTION
from .page import PAGE_CHECKS
from .picture import draw_case, picture
from .traffic import rows_read_before_window, traffic

__all__ = ["DRILL", "SECTION", "WindowCase", "check_window", "example_case", "example_outputs",
           "rows_read_before_window", "window_case", "window_params"]

DRILL = Drill(
    **PLANTED.fields(),
    title="Sliding-window attention with sinks",
    mirrors="vLLM unified attention's SLIDING_WINDOW / USE_SINKS, FlashInfer window_left",
    writes={"paged_prefill_attention_window": ("out",), "paged_decode_attention_window": ("out",)},
    api=("window_prefill_kernel", "paged_prefill_attention_window", "window_decode_kernel", "merge_kernel",
         "paged_decode_attention_window"),
    test_shapes=TEST_SHAPES,
    bench=BENCH,
    bench_work=bench_work,
    traffic=traffic,
    picture=picture,
    draw_case=draw_case,
    page_checks=PAGE_CHECKS,
)
