"""The bandwidth bench: each drill's bench cases on a GPU, against this GPU's
measured copy ceiling and the plain-PyTorch baselines. Names no drill.

    python tests/_entry.py bench --drill l1 --tree solutions   # one drill, printed as JSON
    python tests/_entry.py bench --ceiling                     # the copy ceiling alone

grader.py runs it in a process of its own (`in_subprocess`, `ceiling_in_subprocess`). How it measures (METHOD.md's rules):
- the ceiling is a 1 GiB device-to-device copy_ timed with events, outside a CUDA
  graph (inside one, torch's copy ran 37 % slower on an H200);
- every time is a median after warm-up; ops under ~100 us are timed as CUDA-graph
  replays (launch gaps would dominate), longer ones with events;
- inputs rotate over enough independent sets that the L2 cache cannot hold them;
- GB/s counts the fewest bytes the op must move (the manifest's `bytes`); a case whose
  FLOPs per byte put it past the ridge (prefill) is shown in TFLOP/s instead.
"""
import json
import math
import sys

import _env
import torch
from triton.testing import do_bench, do_bench_cudagraph

from _process import run_process
from _tree import load_drill

TIERS = ((0.90, "at the roofline"), (0.75, "good"), (0.50, "fair"), (0.0, "slow"))
# FLOPs per byte above which a case is bound by arithmetic, not memory: an H200 does about
# 790 TFLOP/s of 16-bit matrix work against 4.3 TB/s, a ridge near 180; prefill sits far above.
COMPUTE_BOUND = 100


def copy_ceiling_gbps(nbytes=1 << 30):
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=50, rep=400, return_mode="median")
    return 2 * nbytes / ms / 1e6  # read + write


def median_ms(fn, graph):
    """Median time of one call of fn; (ms, how it was timed)."""
    if graph:
        return do_bench_cudagraph(fn, rep=200, return_mode="median"), "graph replay"
    return do_bench(fn, warmup=50, rep=400, return_mode="median"), "events"


def tier(fraction):
    return next(name for floor, name in TIERS if fraction >= floor)


def bench_drill(drill, tree, ceiling):
    module = load_drill(tree, drill.stem)
    if drill.bench_run:  # one long run the drill times itself (a rate, not a copy of memory)
        return drill.bench_run(module, ceiling)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    cases = []
    for case in drill.bench:
        n_sets = max(1, min(32, math.ceil(4 * l2 / case.bytes)))
        ours, baselines = drill.bench_work(module, case.params, "cuda", n_sets)

        def row(fn, graph):
            fn()  # compile and warm outside the timed region
            torch.cuda.synchronize()
            ms, how = median_ms(fn, graph)
            us = ms * 1e3 / n_sets
            gbps = case.bytes / us / 1e3
            return dict(us=round(us, 2), gbps=round(gbps, 1), of_ceiling=round(gbps / ceiling, 4),
                        tflops=round(case.flops / us / 1e6, 1), timing=how)

        result = dict(name=case.name, params=case.params, bytes=case.bytes, flops=case.flops, sets=n_sets,
                      compute_bound=case.flops > COMPUTE_BOUND * case.bytes, ours=row(ours, case.graph))
        # A compute-bound case is judged against the fastest baseline, not the copy ceiling.
        result["tier"] = "compute-bound" if result["compute_bound"] else tier(result["ours"]["of_ceiling"])
        result["baselines"] = {name: row(fn, case.graph and graph_safe) for name, (fn, graph_safe) in baselines.items()}
        cases.append(result)
        del ours, baselines
        torch.cuda.empty_cache()
    return cases


def in_subprocess(drill, tree, ceiling, timeout):
    """The bench of one drill, run in a process of its own: its JSON, or {"error": ...}."""
    code, out, err = run_process([sys.executable, "tests/_entry.py", "bench", "--drill", drill.id, "--tree", str(tree),
                                  "--ceiling-gbps", str(ceiling)], timeout, untrusted=True)
    if code != 0:
        return {"error": "timed out" if code is None else "\n".join(err.strip().splitlines()[-6:])}
    return json.loads(out.strip().splitlines()[-1])


def ceiling_in_subprocess(timeout):
    code, out, err = run_process([sys.executable, "tests/_entry.py", "bench", "--ceiling"], timeout)
    if code != 0:
        raise RuntimeError(f"could not measure the copy ceiling: {err.strip()[-400:]}")
    return json.loads(out.strip().splitlines()[-1])["ceiling_gbps"]
