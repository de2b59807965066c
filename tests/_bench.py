"""The bandwidth bench: each drill's bench cases on a GPU, against this GPU's
measured copy ceiling and the plain-PyTorch baselines. Names no drill.

    python tests/_entry.py bench --drill l1 --tree solutions   # one drill, printed as JSON
    python tests/_entry.py bench --ceiling                     # the copy ceiling alone

grader.py runs each in a process of its own (`Bench`), started before the drill's tests:
its imports, the tree's module, its first case's inputs and compiles overlap the tests,
and it times nothing until the tests are done (`start`, below); from then on each call of
the learner's code in it gets the learner's limit, as in a test (`note_progress`). How it measures
(METHOD.md's rules):
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
import os
import struct
import sys
import tempfile
import threading
import time

import _env
import torch
from triton.testing import do_bench, do_bench_cudagraph

from _process import Child, remove_tree, scratch_folder
from _tree import load_drill, tree_path

TIERS = ((0.90, "at the roofline"), (0.75, "good"), (0.50, "fair"), (0.0, "slow"))
# FLOPs per byte above which a case is bound by arithmetic, not memory: an H200 does about
# 790 TFLOP/s of 16-bit matrix work against 4.3 TB/s, a ridge near 180; prefill sits far above.
COMPUTE_BOUND = 100


def copy_ceiling_gbps(nbytes=1 << 30):
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=50, rep=400, return_mode="median")
    return 2 * nbytes / ms / 1e6  # read + write


# Triton's own defaults, measured against 4x longer runs on an H200 (the same medians within
# 1 %: BENCHMARKS.md, "Machine and method"): 25 ms of warm-up and 100 ms of timed calls with
# events; a graph of about 50 ms of calls replayed 10 times.
EVENTS_WARMUP_MS, EVENTS_MS, GRAPH_MS = 25, 100, 50


def median_ms(fn, graph):
    """Median time of one call of fn; (ms, how it was timed)."""
    if graph:
        return do_bench_cudagraph(fn, rep=GRAPH_MS, return_mode="median"), "graph replay"
    return do_bench(fn, warmup=EVENTS_WARMUP_MS, rep=EVENTS_MS, return_mode="median"), "events"


def tier(fraction):
    return next(name for floor, name in TIERS if fraction >= floor)


def bench_drill(drill, tree, start):
    """The drill's bench cases, timed. `start()` returns the copy ceiling (GB/s); it is
    called when a case's inputs are made and each of its calls has run once (compiled,
    warm), before anything is timed. In the grade its first call returns when the
    drill's tests are done."""
    note_progress(tree)  # before the tree's module is imported: its import is a call of its code too
    module = load_drill(tree, drill.stem)
    if drill.bench_run:  # one long run the drill times itself (a rate, not a copy of memory)
        return drill.bench_run(module, start)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    cases = []
    for case in drill.bench:
        n_sets = max(1, min(32, math.ceil(4 * l2 / case.bytes)))
        ours, baselines = drill.bench_work(module, case.params, "cuda", n_sets)
        calls = {"ours": (ours, case.graph), **{name: (fn, case.graph and graph_safe)
                                                for name, (fn, graph_safe) in baselines.items()}}
        for fn, _ in calls.values():
            fn()  # compile and warm outside the timed region
        torch.cuda.synchronize()
        ceiling = start()

        def row(fn, graph):
            ms, how = median_ms(fn, graph)
            us = ms * 1e3 / n_sets
            gbps = case.bytes / us / 1e3
            return dict(us=round(us, 2), gbps=round(gbps, 1), of_ceiling=round(gbps / ceiling, 4),
                        tflops=round(case.flops / us / 1e6, 1), timing=how)

        result = dict(name=case.name, params=case.params, bytes=case.bytes, flops=case.flops, sets=n_sets,
                      compute_bound=case.flops > COMPUTE_BOUND * case.bytes, ours=row(*calls.pop("ours")))
        # A compute-bound case is judged against the fastest baseline, not the copy ceiling.
        result["tier"] = "compute-bound" if result["compute_bound"] else tier(result["ours"]["of_ceiling"])
        result["baselines"] = {name: row(fn, graph) for name, (fn, graph) in calls.items()}
        cases.append(result)
        del ours, baselines, calls
        torch.cuda.empty_cache()
    return cases


# The learner's limit in the bench, as in a test: a bench process runs the learner's code in
# itself (the timer must be where the kernels run), so a thread of its own notes, twice a
# second, into a file the grade made and handed over, which frame its main thread is in: the
# outermost frame of the learner's code on its stack (one call, its compiles included, however
# many functions it calls in a loop), else its innermost frame (a wait of ours: a kernel of the
# learner's that does not end holds torch's synchronize). The grade ends the bench when that
# frame has not changed for the learner's limit plus SLACK s after its go; a slow bench that
# moves on (compiles, warm-ups, many calls each within the limit) goes on, up to --timeout. A
# process the learner froze (the GIL held, stopped) notes nothing and is ended the same way.
# The note is the bench's word, as its times are: a learner who writes it holds the bench no
# longer than the grade's --timeout, which bounds the whole.
PROGRESS_FD = "DRILLS_BENCH_PROGRESS_FD"
SLACK = 5


def note_progress(tree):
    """Start the noting thread where the grade handed over its file (PROGRESS_FD): (how many
    times the frame changed, whether it is the learner's), at the file's start."""
    if not os.environ.get(PROGRESS_FD):
        return
    fd, main, tree = int(os.environ[PROGRESS_FD]), threading.main_thread().ident, f"{tree_path(tree)}{os.sep}"

    def note():
        held, moves = None, 0
        while True:
            frame = innermost = sys._current_frames().get(main)
            learner = None
            while frame is not None:
                learner = frame if frame.f_code.co_filename.startswith(tree) else learner
                frame = frame.f_back
            now = learner or innermost
            if now is not held:  # a frame held here is not freed, so a new one is never the same object
                held, moves = now, moves + 1
            os.pwrite(fd, struct.pack("<Q?", moves, learner is not None), 0)
            del innermost, learner, now
            time.sleep(0.5)
    threading.Thread(target=note, name="bench progress", daemon=True).start()


class Bench:
    """One drill's bench in a process of its own (it runs the learner's code: confined, as a
    worker is), started now so that it gets ready while the drill's tests run; `result`
    lets it time and returns its JSON, or {"error": ...}; `cancel` ends it (a drill that
    did not pass). `command`: a stand-in for the bench process (the tests: it needs a GPU)."""

    def __init__(self, drill, tree, command=None):
        # Its scratch folder is made here and handed in, so that it is removed however the
        # process ends (a cancelled bench is killed).
        self.scratch, self.progress = scratch_folder("bench-"), tempfile.TemporaryFile()
        fd = self.progress.fileno()
        self.child = Child(command or [sys.executable, "tests/_entry.py", "bench", "--drill", drill.id, "--tree",
                                       str(tree), "--wait", "--scratch", self.scratch],
                           {PROGRESS_FD: str(fd)}, (fd,), untrusted=True, gated=True)

    def result(self, ceiling, timeout, limit):
        """Its JSON once it has timed (`ceiling` is its go), or {"error": ...}: after
        `timeout` s in all, or when its noted frame stood still `limit` + SLACK s."""
        try:
            self.child.go(ceiling)
            stalled = _stalled(self.child, self.progress.fileno(), timeout, limit)
            code, out, err = self.child.wait(0)
            return {"error": stalled} if stalled else read_result(code, out, err)
        finally:
            self.progress.close()
            remove_tree(self.scratch)

    def cancel(self):
        self.child.kill()
        self.progress.close()
        remove_tree(self.scratch)


def _stalled(child, fd, timeout, limit):
    """Wait for the bench process: None when it ends or `timeout` s have passed, else a
    sentence once the frame it notes (note_progress) has stood still past the limit (nothing
    noted yet, our imports before the learner's, counts no time)."""
    if child.wait_while_moving(lambda: os.pread(fd, 9, 0) or None, limit + SLACK, timeout) != "stalled":
        return None
    where = "in one call of your code" if os.pread(fd, 9, 0)[8:] == b"\x01" else "in one wait outside your code"
    return (f"stopped at the {limit:.0f} s limit, {where} (DRILLS_TIMEOUT / make grade TIMEOUT=... sets "
            f"the limit; a kernel that never ends holds a wait)")


def read_result(code, out, err):
    """A bench process's last line, parsed, or {"error": ...}. It ran the learner's code: what
    it wrote is data, which tests/_render.py checks before it draws a row of it."""
    if code != 0:
        return {"error": "timed out" if code is None else "\n".join(err.strip().splitlines()[-6:])}
    try:
        return json.loads(out.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return {"error": "the bench process's last line is not its result (did the code print after it?)"}


class Ceiling:
    """This GPU's copy ceiling, measured once in a process of its own started now (its
    imports overlap the tests) the first time `gbps` is asked for."""

    def __init__(self):
        self.child, self.found = Child([sys.executable, "tests/_entry.py", "bench", "--ceiling", "--wait"],
                                       gated=True), None

    def gbps(self, timeout):
        if self.found is None:
            code, out, err = self.child.wait(timeout)
            if code != 0:
                raise RuntimeError(f"could not measure the copy ceiling: {err.strip()[-400:]}")
            self.found = json.loads(out.strip().splitlines()[-1])["ceiling_gbps"]
        return self.found

    def cancel(self):
        if self.found is None:
            self.child.kill()
