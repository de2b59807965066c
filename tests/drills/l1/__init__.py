"""L1, the paged KV-cache write (content/l1.md): its manifest entry `DRILL`, built from
its parts:

  cases.py      the test shapes, the worked example, the case and its builders, the
                hypothesis strategy, the fixture checks
  reference.py  the plain-PyTorch reference
  checks.py     the checks and their diagnosis
  mistakes.py   the pitfalls and mistakes, planted as edits (`PLANTED`)
  bench.py      the bench cases, the bytes a write moves, the bench work
  traffic.py    the traffic case and report, the padding-read check
  picture.py    the picture and the drawing of a failing case
  page.py       the page checks

The names other tests import from `drills.l1` are re-exported here.
"""
from _drill import Drill

from .bench import BENCH, bench_work
from .cases import FIXTURE_CHECKS, TEST_SHAPES, WORKED_EXAMPLE, kv_write_case, kv_write_params, random_kv_write_case
from .checks import _rerun_kv_write, check_kv_write, check_slot_mapping
from .mistakes import PLANTED
from .page import PAGE_CHECKS
from .picture import draw_case, picture
from .traffic import check_padding_not_read, traffic, traffic_case

__all__ = ["DRILL", "WORKED_EXAMPLE", "_rerun_kv_write", "check_kv_write", "check_padding_not_read",
           "check_slot_mapping", "draw_case", "kv_write_case", "kv_write_params", "random_kv_write_case",
           "traffic_case"]

DRILL = Drill(
    **PLANTED.fields(),
    title="Paged KV-cache write",
    mirrors="vLLM reshape_and_cache_flash",
    writes={"reshape_and_cache": ("k_cache", "v_cache")},
    api=("slot_mapping", "reshape_and_cache_kernel", "reshape_and_cache"),
    torch_only=("slot_mapping",),
    test_shapes=TEST_SHAPES,
    bench=BENCH,
    bench_work=bench_work,
    picture=picture,
    draw_case=draw_case,
    traffic=traffic,
    page_checks=PAGE_CHECKS,
    fixture_checks=FIXTURE_CHECKS,
)
