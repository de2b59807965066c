"""E1, the capstone: a paged engine over a real `transformers` model (content/e1.md):
its manifest entry `DRILL`, built from its parts:

  cases.py      the tiny models, the real one (SmolLM2-135M-Instruct), the worked example,
                EngineCase, the instrumented kernels (Recorder, AttentionSpy), the
                block-manager strategy, the fixture checks
  reference.py  transformers' generate and logits, the page's scheduling rule (simulate)
  checks.py     the checks of generate and of the block manager, and their diagnosis
  mistakes.py   the pitfalls and mistakes, planted as edits (`PLANTED`)
  bench.py      the 1 B-parameter serving workload against transformers' generate (the
                grade's row: bench_rows), and `make chat` (the learner's engine serving
                SmolLM2, checked against generate)
  picture.py    make show: the worked example's steps against the page's schedule, and each
                request's tokens against generate
  page.py       the page checks

There is no traffic part: the engine's bytes are its kernels', which L1 and L3 count.
"""
from _drill import Drill

from .bench import bench_rows
from .cases import (FIXTURE_CHECKS, PRELOAD, TEST_SHAPES, WORKED_EXAMPLE, WRITES, EngineCase, Recorder, block_ops,
                    engine_case, example_case, kernels_tree, random_prompts, spy_on, tiny_model)
from .checks import check_generate, explain, run_generate, steps_of
from .mistakes import PLANTED, SECTION
from .page import PAGE_CHECKS
from .picture import picture
from .reference import simulate, step_tensors

__all__ = ["DRILL", "SECTION", "WORKED_EXAMPLE", "EngineCase", "Recorder", "block_ops", "check_generate",
           "engine_case", "example_case", "explain", "kernels_tree", "random_prompts", "run_generate", "simulate",
           "spy_on", "step_tensors", "steps_of", "tiny_model"]

DRILL = Drill(
    **PLANTED.fields(),
    title="A paged engine on your kernels",
    mirrors="vLLM V1 engine core / nano-vllm (scheduler, block manager, model runner)",
    writes=WRITES,
    preload=PRELOAD,  # its models, Recorder and AttentionSpy are pickled into the worker
    milestones={"test_serves_smollm2_as_generate_does": "served SmolLM2-135M-Instruct on these L1 and L3 kernels: "
                "2 chat prompts x 4 tokens, equal to transformers' generate"},
    api=("generate", "replay_block_manager"),
    torch_only=("replay_block_manager",),
    test_shapes=TEST_SHAPES,
    bench=(),  # one generate() takes seconds: no cases to repeat; the grade times one run of each (bench_run),
    bench_run=bench_rows,  # `cd tests && python -m drills.e1.bench` everything else (BENCHMARKS.md)
    picture=picture,
    page_checks=PAGE_CHECKS,
    fixture_checks=FIXTURE_CHECKS,
)
