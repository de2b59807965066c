"""The processes the grade runs apart from the tests, each reading the manifest (this is
part of the front, like grader.py and tests/_plugin.py: the shared modules below it are
handed the drill they work on and never read the manifest).

    python tests/_entry.py traffic l2 TREE                      # the drill's traffic report, as JSON
    python tests/_entry.py bench --drill l1 --tree solutions    # the drill's bench on a GPU, as JSON
    python tests/_entry.py bench --ceiling                      # this GPU's copy ceiling alone
"""
import argparse
import atexit
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _process import scratch_env  # noqa: E402  -- imports neither torch nor Triton


def _scratch_before_cuda(argv):
    """A drill's bench runs the learner's code in this process, so what it writes goes to a
    scratch folder (HOME, TMPDIR, Triton's and CUDA's caches), set here, before `_env`
    starts CUDA, as a worker's is at its launch. The driver reads CUDA_CACHE_PATH once, as
    CUDA starts: set later, its JIT cache stayed in ~/.nv, which the confinement refuses,
    and cuDNN's attention (transformers' generate in E1's bench) compiled every new
    context length anew, 0.5 s a call. The grade hands in the folder and removes it
    (--scratch); by hand, one is made here and removed at exit. None for other commands."""
    if argv[:1] != ["bench"] or "--drill" not in argv:
        return None
    given = argv[argv.index("--scratch") + 1] if "--scratch" in argv[:-1] else None
    scratch = given or tempfile.mkdtemp(prefix="drills-bench-")
    if not given:
        atexit.register(shutil.rmtree, scratch, ignore_errors=True)
    os.environ.update(scratch_env(scratch))
    tempfile.tempdir = scratch
    sys.dont_write_bytecode = True  # it imports the tree before it confines itself: no .pyc beside the tree's files
    return scratch


SCRATCH = _scratch_before_cuda(sys.argv[1:])
import _env  # noqa: E402  -- first of what imports torch: the interpreter decision
from _manifest import drill as find_drill  # noqa: E402


# The grade's bench gets its first case ready while the drill's tests run (tests/_bench.py's
# Bench) on a GPU this large; on a smaller one it waits for them before it allocates anything.
SHARED_GPU_BYTES = 64 << 30


def traffic(argv):
    from _worker import WORKER, tree_module
    entry = find_drill(argv[0])
    try:
        result = json.dumps(entry.traffic(tree_module(argv[1], entry.stem, entry.contract, preload=entry.preload)))
    finally:
        WORKER.stop()
    if os.environ.get("DRILLS_TRAFFIC_FD"):  # the grade's (tests/_traffic.py): not the output the prints share
        with os.fdopen(int(os.environ["DRILLS_TRAFFIC_FD"]), "w") as out:
            out.write(result)
    else:
        print(result)


def bench(argv):
    parser = argparse.ArgumentParser(prog="tests/_entry.py bench")
    parser.add_argument("--drill")
    parser.add_argument("--tree", default="solutions")
    parser.add_argument("--ceiling", action="store_true", help="measure the copy ceiling only")
    parser.add_argument("--ceiling-gbps", type=float, help="use this ceiling instead of measuring it")
    parser.add_argument("--scratch", help="the folder the bench may write (default: a temporary one)")
    parser.add_argument("--wait", action="store_true",
                        help="get ready, then time nothing until a line on standard input says go (with the drill: "
                             "the line is the ceiling in GB/s)")
    args = parser.parse_args(argv)
    if _env.INTERPRET:
        sys.exit("the bandwidth bench needs a CUDA GPU; here kernels run in Triton's CPU interpreter")
    import _bench
    found = []

    def start():
        """The copy ceiling; the first call waits for the grade's go (--wait)."""
        if not found:
            line = sys.stdin.readline() if args.wait else ""
            found.append(args.ceiling_gbps or (float(line) if args.drill and line.strip() else None)
                         or _bench.copy_ceiling_gbps())
        return found[0]
    if args.ceiling:
        out = dict(device=_env.describe())  # CUDA's start-up, before the go
        out["ceiling_gbps"] = round(start(), 1)
    else:
        drill = find_drill(args.drill)
        # Confined before CUDA starts its threads: Landlock below ABI 8 covers only the thread that asks.
        _confine_for(drill, args.tree, SCRATCH)
        out = dict(device=_env.describe())
        if args.wait and _bench.torch.cuda.get_device_properties(0).total_memory < SHARED_GPU_BYTES:
            start()  # a smaller GPU: nothing of the bench's may take memory the tests need
        out["cases"] = _bench.bench_drill(drill, args.tree, start)
        out["ceiling_gbps"] = round(start(), 1)
    print(json.dumps(out))


def _confine_for(drill, tree, scratch):
    """The bench runs the learner's module in this process: confine it first, as a worker is
    (tests/_serve.py), to its scratch folder, after loading what the bench needs from
    outside the tree: the other drills' references its baselines call (never this drill's own)."""
    import _sandbox
    from _manifest import DRILLS
    from _tree import load_drill, tree_path
    for other in DRILLS:
        if other.stem != drill.stem:
            load_drill("solutions", other.stem)
    if _sandbox.describe() != "none":
        _sandbox.confine(scratch, readable=[str(tree_path(tree))])


if __name__ == "__main__":
    {"traffic": traffic, "bench": bench}[sys.argv[1]](sys.argv[2:])
