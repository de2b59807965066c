"""Drill F1: FlashInfer's CSR page table and its append kernel. Its parts:
cases (TEST_SHAPES, the worked example, the case builders, the strategy, the fixture
checks), reference (plain PyTorch), checks (compare and explain), mistakes (pitfalls,
mistakes, PLANTED), bench, traffic, picture, page (the page checks). DRILL is built here.
"""
from _drill import Drill

from .bench import BENCH, bench_work
from .cases import FIXTURE_CHECKS, TEST_SHAPES
from .mistakes import PLANTED
from .page import PAGE_CHECKS
from .picture import draw_case, picture
from .traffic import traffic

# What files outside this folder import from drills.f1 (tests/test_f1_csr_page_table.py,
# tests/test_wrong.py), re-exported by name:
from .cases import WORKED_EXAMPLE, append_case, append_params, worked_example_case  # noqa: F401
from .checks import check_append, check_batch_indices_positions, check_csr, name_pitfalls  # noqa: F401

DRILL = Drill(
    **PLANTED.fields(), title="FlashInfer's CSR page table", mirrors="FlashInfer append_paged_kv_cache",
    writes={"append_paged_kv_cache": ("paged_kv_cache",)},
    api=("block_table_to_csr", "batch_indices_positions", "append_paged_kv_cache_kernel", "append_paged_kv_cache"),
    torch_only=("block_table_to_csr", "batch_indices_positions"),
    test_shapes=TEST_SHAPES,
    bench=BENCH,
    bench_work=bench_work,
    picture=picture,
    draw_case=draw_case,
    traffic=traffic,
    page_checks=PAGE_CHECKS,
    fixture_checks=FIXTURE_CHECKS,
)
