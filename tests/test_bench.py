"""The bandwidth bench's place in the grade (tests/_bench.py, tests/_entry.py bench): what
can be shown without a GPU. The GPU's own measurements are faked here; BENCHMARKS.md has
the H200's."""
import io
import os
import json
import sys
import time

from _manifest import BY_ID
from _tree import ROOT, load_front
from test_grading import _failing, _graded_in_process


def test_e1s_bench_row_is_the_engines_tokens_per_s_beside_generate(monkeypatch):
    """On a GPU E1's bench is one timed run each (a whole generate), not a kernel the
    harness repeats: the grade's table gets a row of it (it printed a header and no row),
    with tokens/s for the engine and for transformers' generate and how many times faster.
    The GPU's measurement is faked here; `grader.py e1 --tree solutions` on a GPU runs it."""
    from rich.console import Console

    import _bench
    import _render
    from drills.e1 import bench as e1_bench
    measured = dict(engine_tokens_per_s=3819, transformers_tokens_per_s=987, speedup=3.87, engine_s=2.15,
                    transformers_s=8.3, prefill_s=0.175, decode_step_ms=15.51, decode_floor_ms=0.8)
    asked = []
    monkeypatch.setattr(e1_bench, "measure", lambda module, **kw: asked.append(kw) or measured)
    def start():
        return 4200.0
    cases = _bench.bench_drill(BY_ID["e1"], "solutions", start)
    assert asked == [dict(start=start, extras=False)]  # the grade's run: its go and the ceiling it measured, no extras
    out = io.StringIO()
    _render._bench_table(Console(file=out, width=200),
                         dict(ceiling_gbps=4200.0, drills=[dict(id="e1", bench=dict(cases=cases))]))
    rows = [" ".join(line.split()) for line in out.getvalue().splitlines()[2:]]
    assert rows == ["E1 1B llama, 64 x (512 + 128) 2.15 s 3819 tokens/s transformers generate 987 tokens/s "
                    "3.87× faster"], out.getvalue()
    assert json.loads(json.dumps(cases)) == cases  # the bench process hands it back as JSON


def test_on_a_gpu_a_drills_bench_gets_ready_during_its_tests_and_times_after_them(tmp_path, monkeypatch):
    """On a GPU each drill's bench process starts before its tests (its imports and compiles
    overlap them) and times only after them; a drill that does not pass has its bench
    ended untimed; the copy ceiling's process starts with the first bench and measures
    once, when the first passing drill needs it. The processes are faked here."""
    from rich.console import Console

    import _bench
    front = load_front()
    happened = []

    class Bench:
        def __init__(self, drill, tree):
            self.id = drill.id
            happened.append(f"bench {drill.id} started")

        def result(self, ceiling, timeout, limit):
            happened.append(f"bench {self.id} timed, ceiling {ceiling}")
            return dict(cases=[])

        def cancel(self):
            happened.append(f"bench {self.id} ended")

    class Ceiling:
        def __init__(self):
            happened.append("ceiling started")

        def gbps(self, timeout):
            happened.append("ceiling measured")
            return 4200.0

        def cancel(self):
            happened.append("ceiling ended")
    monkeypatch.setattr(_bench, "Bench", Bench)
    monkeypatch.setattr(_bench, "Ceiling", Ceiling)
    monkeypatch.setattr(front._env, "INTERPRET", False)
    monkeypatch.setattr(front._env, "describe", lambda: "a GPU (faked)")
    monkeypatch.setattr(front._grading, "is_untouched_stub", lambda drill, tree: False)
    passed = {d: dict(_failing(BY_ID[d]), status="passed", passed=1, failed=0, first_failure=None)
              for d in ("l1", "f1")}
    summaries = dict(passed, l2=_failing(BY_ID["l2"]))
    code, grade = _graded_in_process(monkeypatch, tmp_path, Console(file=io.StringIO(), width=200), summaries,
                                     ["l1", "l2", "f1"], on_grade=lambda drill: happened.append(f"tests {drill.id}"))
    assert happened == ["bench l1 started", "ceiling started", "tests l1", "ceiling measured",
                        "bench l1 timed, ceiling 4200.0", "bench l2 started", "tests l2", "bench l2 ended",
                        "bench f1 started", "tests f1", "ceiling measured", "bench f1 timed, ceiling 4200.0",
                        "ceiling ended"]
    assert [d.get("bench") for d in grade["drills"]] == [dict(cases=[]), None, dict(cases=[])]


def test_a_gated_child_starts_now_and_goes_on_when_told():
    """tests/_process.py's Child: the bench's process runs up to its gate at once, goes on
    only when `wait` writes its line, and is killed at the time limit or by `kill`,
    its whole group with it."""
    import _process
    code = ("import sys, time; print('ready', flush=True); line = sys.stdin.readline(); "
            "print('go', line.strip(), flush=True); time.sleep(float(line))")
    child = _process.Child([sys.executable, "-c", code], gated=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and child.out.tell() == 0:  # it started without being waited for
        time.sleep(0.05)
    assert child.out.tell() > 0 and child.proc.poll() is None  # ready, and waiting at its gate
    assert child.wait(30, line=0) == (0, "ready\ngo 0\n", "")
    slow = _process.Child([sys.executable, "-c", code], gated=True)
    assert slow.wait(1, line=60)[0] is None and slow.proc.poll() is not None  # the limit holds after the go
    ended = _process.Child([sys.executable, "-c", code], gated=True)
    ended.kill()
    assert ended.proc.poll() is not None and ended.proc.pid not in _process._CHILDREN


def test_a_bench_process_that_writes_something_else_gets_a_failed_row_not_a_crash():
    """The bench process runs the learner's code, which may print after the bench's JSON or
    print JSON of its own: that drill's row says "bench failed" and the grade goes on (a row
    the table cannot draw, a zero time, a string for a number, would have ended it)."""
    from rich.console import Console

    import _bench
    import _render
    case = dict(name="T=1", tier="good", ours=dict(us=2.0, gbps=10.0, of_ceiling=0.5),
                baselines={"torch": dict(us=4.0, gbps=5.0)})
    bad = ["", "not json", json.dumps([1]), json.dumps(dict(cases=5)), json.dumps(dict(cases=[dict(case, name=3)])),
           json.dumps(dict(cases=[dict(case, ours=dict(us=0, gbps=1.0))])),
           json.dumps(dict(cases=[dict(case, baselines={"torch": dict(us="4", gbps=5.0)})])),
           json.dumps(dict(cases=[dict(case, unit="tokens/s")]))]  # a self-timed row has `rate`, not `gbps`

    def drawn(bench):
        out = io.StringIO()
        _render._bench_table(Console(file=out, width=200), dict(ceiling_gbps=1.0, drills=[dict(id="l1", bench=bench)]))
        return " ".join(out.getvalue().split())
    for out in bad:
        assert "L1 bench failed" in drawn(_bench.read_result(0, out, "")), out
    good = _bench.read_result(0, "printed by the learner\n" + json.dumps(dict(cases=[case])), "")
    assert _render.drawable(good) and "L1 T=1 2.0 µs 10 GB/s 50.0 % good torch 5 GB/s 2.00× faster" in drawn(good)
    assert _bench.read_result(None, "", "")["error"] == "timed out"


def test_a_drills_bench_has_its_scratch_folder_before_cuda_starts(tmp_path):
    """A drill's bench process runs the learner's code, confined to a scratch folder. Its
    HOME, TMPDIR and caches point there before `_env` starts CUDA: the driver reads
    CUDA_CACHE_PATH once, at its start, and set later, its JIT cache stayed in ~/.nv, which
    the confinement refuses (cuDNN then compiled every new shape anew: E1's bench spent
    42 s so on the H200). The grade's folder is handed in and removed however the process
    ends; one made by hand is removed at exit."""
    import subprocess

    import _bench
    spy = ("import json, os, runpy, sys\n"
           "seen = []\n"
           "class Spy:\n"
           "    def find_spec(self, name, path=None, target=None):\n"
           "        if name == '_env' and not seen:\n"
           "            seen.append({k: os.environ.get(k) for k in ('HOME', 'TMPDIR', 'CUDA_CACHE_PATH', 'TRITON_CACHE_DIR')})\n"
           "sys.meta_path.insert(0, Spy())\n"
           "sys.argv = ['tests/_entry.py'] + sys.argv[1:]\n"
           "runpy.run_path('tests/_entry.py', run_name='spied')\n"
           "print(json.dumps(seen[0]))\n")

    def env_at_cuda_start(*args):
        done = subprocess.run([sys.executable, "-c", spy, *args], capture_output=True, text=True, timeout=120,
                              cwd=ROOT)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout.splitlines()[-1])
    given = env_at_cuda_start("bench", "--drill", "l1", "--scratch", str(tmp_path))
    assert given == dict(HOME=str(tmp_path), TMPDIR=str(tmp_path), CUDA_CACHE_PATH=str(tmp_path / "nv"),
                         TRITON_CACHE_DIR=str(tmp_path / "triton"))
    made = env_at_cuda_start("bench", "--drill", "l1")
    assert os.path.basename(made["HOME"]).startswith("drills-bench-") and made["CUDA_CACHE_PATH"] == made["HOME"] + "/nv"
    assert not os.path.exists(made["HOME"])  # removed at exit
    ceiling = env_at_cuda_start("bench", "--ceiling")  # ours alone: no scratch folder
    assert ceiling["CUDA_CACHE_PATH"] == os.environ.get("CUDA_CACHE_PATH")
    for ends in ("cancel", "result"):
        bench = _bench.Bench(BY_ID["l1"], "solutions")
        assert os.path.isdir(bench.scratch)
        bench.cancel() if ends == "cancel" else bench.result(4200.0, 120, 60)
        assert not os.path.exists(bench.scratch), ends
