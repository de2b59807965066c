"""Drill L7, DeepSeek's multi-head latent attention (MLA) at decode: everything that
knows this drill, in parts:

  cases      TEST_SHAPES, the page's worked example, the write and decode cases, their
             builders and strategies, the fixture checks
  reference  the plain-PyTorch reference (float64, on the CPU) and the tolerances
  checks     the checks, with their diagnosis
  mistakes   the pitfalls and other planted mistakes (PLANTED)
  bench      the bench cases and work
  traffic    the traffic case and report, the latent-read-once and padding-read checks
  picture    picture and draw_case
  page       the page checks

The write is L1's for one latent "head" and is checked bit for bit; the decode is L4's
split decode with every query head against the same latent rows, checked against plain
attention in float64 (the split count never changes the answer).
"""
from _drill import Drill

from .bench import BENCH, bench_work
from .cases import FIXTURE_CHECKS, TEST_SHAPES
from .mistakes import PLANTED
from .page import PAGE_CHECKS
from .picture import draw_case, picture
from .traffic import traffic

# What tests/test_l7_mla_decode.py imports from drills.l7:
from .cases import (HUGE, SCALE, WORKED_EXAMPLE, DecodeCase, decode_case, decode_params, random_write_case,
                    worked_example_decode_case, worked_example_numbers, write_case, write_params)
from .checks import check_decode, check_write, describe_decode
from .traffic import check_latent_read_once, check_padding_not_read

DRILL = Drill(
    **PLANTED.fields(),
    title="MLA decode attention",
    mirrors="vLLM concat_and_cache_mla and Triton MLA decode (triton_mla backend), FlashMLA",
    writes={"concat_and_cache_mla": ("kv_cache",), "mla_decode_attention": ("out",)},
    api=("concat_and_cache_mla_kernel", "mla_decode_kernel", "mla_merge_kernel", "concat_and_cache_mla",
         "default_num_splits", "mla_decode_attention"),
    test_shapes=TEST_SHAPES,
    bench=BENCH,
    bench_work=bench_work,
    traffic=traffic,
    picture=picture,
    draw_case=draw_case,
    page_checks=PAGE_CHECKS,
    fixture_checks=FIXTURE_CHECKS,
)
