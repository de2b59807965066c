"""E2, automatic prefix caching on the learner's E1 engine (content/e2.md): its manifest
entry `DRILL`, built from its parts:

  cases.py      the engine cases (E1's tiny models, prompts sharing prefixes), PrefixRecorder
                (E1's Recorder plus L6), the worked example, the fixed block-manager traces
                and the state machine of random traces
  reference.py  the plain-Python model of the block manager, L6's rule on lists, the
                fingerprint of Python's hash()
  checks.py     the checks of the replayed traces and of generate, and their diagnosis
  mistakes.py   the pitfalls and mistakes, planted as edits (`PLANTED`)
  bench.py      the shared-system-prompt and multi-turn workloads, caching on and off (GPU)
  picture.py    the worked example's blocks, as the learner's block manager holds them
  page.py       the page checks

There is no traffic part: the engine's bytes are its kernels', which L1, L3 and L6 count.
"""
from _drill import Drill

from .bench import bench_rows
from .cases import PRELOAD, TEST_SHAPES, WORKED_EXAMPLE, WRITES
from .mistakes import PLANTED, SECTION
from .page import PAGE_CHECKS
from .picture import picture

__all__ = ["DRILL", "SECTION", "WORKED_EXAMPLE"]

DRILL = Drill(
    **PLANTED.fields(),
    title="Prefix caching on your engine",
    mirrors="vLLM V1 KVCacheManager / BlockPool (automatic prefix caching), nano-vllm BlockManager",
    writes=WRITES,
    preload=PRELOAD,  # its models and PrefixRecorder are pickled into the worker
    api=("hash_block_tokens", "generate", "replay_prefix_cache"),
    torch_only=("hash_block_tokens", "replay_prefix_cache"),  # plain Python: no kernel need run
    test_shapes=TEST_SHAPES,
    bench=(),
    bench_run=bench_rows,  # `cd tests && python -m drills.e2.bench` (BENCHMARKS.md)
    picture=picture,
    page_checks=PAGE_CHECKS,
)
