"""Drill L6, cascade attention (a shared prefix read once for the whole batch): its entry,
built from its parts.

cases (the shapes, vLLM's [A, B, C, D, E] example, CascadeCase and its builder, vLLM's
test_cascade grid, the strategy, the fixture check), reference (the float64 reference
split as cascade splits it, the prefix rule, the tolerance), checks (the checks and their
diagnosis), mistakes (the pitfalls and other planted mistakes, PLANTED), bench (the bench
work and the crossover grid), traffic (the traffic report and the read-once check), picture
(the [A, B, C, D, E] example drawn for make show), page (the page checks).
"""
from _drill import Drill

from .bench import BENCH, bench_work
from .cases import FIXTURE_CHECKS, TEST_SHAPES
from .mistakes import PLANTED
from .page import PAGE_CHECKS
from .picture import picture
from .traffic import traffic

# What tests/test_l6_cascade_attention.py imports from drills.l6:
from .cases import (EXAMPLE, VLLM_HEADS, VLLM_SCALE, CascadeCase, cascade_case, cascade_params, example_case,
                    example_outputs, example_tables, vllm_case_lens)
from .checks import check_cascade, check_prefix_len
from .mistakes import SECTION
from .reference import prefix_len_rule
from .traffic import check_prefix_read_once, traffic_case

DRILL = Drill(
    **PLANTED.fields(),
    title="Cascade attention",
    mirrors="vLLM cascade_attention (FlashAttention backend), FlashInfer MultiLevelCascadeAttentionWrapper",
    writes={"cascade_attention": ("out",)},
    api=("cascade_prefix_len", "prefix_kernel", "suffix_kernel", "cascade_attention"),
    test_shapes=TEST_SHAPES,
    bench=BENCH,
    bench_work=bench_work,
    traffic=traffic,
    picture=picture,
    page_checks=PAGE_CHECKS,
    fixture_checks=FIXTURE_CHECKS,
    torch_only=("cascade_prefix_len",),
)
