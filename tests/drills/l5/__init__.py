"""Drill L5, an FP8 KV cache (content/l5.md): the quantising write and the split-KV decode
that reads it. Everything that knows this drill, in parts:

  cases      TEST_SHAPES, the page's worked example, the write and decode cases, their
             builders and strategies, the fixture checks
  reference  the plain-PyTorch reference: the write in fp32 with the clamp before the
             cast, the decode in float64 on the dequantised cache and on the unquantised
             inputs, the tolerances
  checks     the checks, with their diagnosis
  mistakes   the pitfalls and other planted mistakes (PLANTED)
  bench      the bench cases and work
  traffic    the traffic case and report, the check that no garbage byte is loaded
  picture    picture: the worked example's write slot by slot, and a small decode
  page       the page checks

The write is graded bit for bit (the contract fixes the rounding); the decode within
L2's tolerances of exact attention on the dequantised cache, with the format's own
error against the unquantised inputs reported beside it, never failed on alone.
"""
from _drill import Drill

from .bench import BENCH, bench_work
from .cases import FIXTURE_CHECKS, TEST_SHAPES
from .mistakes import PLANTED
from .page import PAGE_CHECKS
from .picture import picture
from .traffic import traffic

# What tests/test_l5_fp8_kv_cache.py imports from drills.l5:
from .cases import (NAN_BYTES, WORKED_EXAMPLE, decode_case, decode_params, worked_example_numbers, write_case,
                    write_params)
from .checks import check_fp8_decode, check_fp8_write, check_the_interpreters_hint_needs_its_evidence, \
    fp8_errors
from .reference import FORMAT_TOLERANCE, FP8_DTYPES, fp8_bytes
from .traffic import check_only_live_tokens_loaded

DRILL = Drill(
    **PLANTED.fields(),
    title="FP8 KV cache",
    mirrors="vLLM reshape_and_cache_flash (kv_cache_dtype=\"fp8\") and unified attention's fp8 path, FlashInfer "
            "decode with k_scale / v_scale",
    writes={"reshape_and_cache_fp8": ("k_cache", "v_cache"), "paged_decode_attention_fp8": ("out",)},
    api=("reshape_and_cache_fp8_kernel", "reshape_and_cache_fp8", "merge_states_kernel", "split_kv_fp8_kernel",
         "default_num_splits", "paged_decode_attention_fp8"),
    test_shapes=TEST_SHAPES,
    bench=BENCH,
    bench_work=bench_work,
    traffic=traffic,
    picture=picture,
    page_checks=PAGE_CHECKS,
    fixture_checks=(*FIXTURE_CHECKS, check_the_interpreters_hint_needs_its_evidence),
)
