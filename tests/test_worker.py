"""The worker that runs the learner's module: what a broken module costs (an endless loop,
an exit, a crash, a rename), what it prints, and that Ctrl-C ends everything the grader
started. Names no drill but L1, whose stem the planted trees use."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _manifest import BY_ID
from _tree import ROOT
from _worker import SHORT_TIMEOUT, LearnerCrash, LearnerTimeout, TreeModule, Worker

pytestmark = pytest.mark.meta
L1 = BY_ID["l1"]


@pytest.fixture
def worker(monkeypatch):
    w = Worker()
    w.budget = 1.5
    yield w
    w.stop()


def learner(tmp_path, body):
    folder = tmp_path / "tree"
    folder.mkdir(exist_ok=True)
    (folder / f"{L1.stem}.py").write_text(body)
    return folder


def test_an_endless_loop_costs_its_test_then_the_next_call_works(tmp_path, worker):
    tree = learner(tmp_path, "def slot_mapping(*a):\n    while True:\n        pass\n\n"
                             "def reshape_and_cache(*a):\n    return 7\n")
    started = time.monotonic()
    with pytest.raises(LearnerTimeout, match="endless loop"):
        worker.call(tree, L1.stem, "slot_mapping", (), {})
    assert time.monotonic() - started < 30
    worker.budget = 30
    assert worker.call(tree, L1.stem, "reshape_and_cache", (), {}) == 7


def test_a_function_that_hung_gets_a_short_limit_then_is_not_run_again(tmp_path, worker):
    """A hung kernel costs one test's limit, then a short one, then nothing: the rest of the
    drill's calls of it fail at once (a hung L1 grade: 23 minutes before, under 2 now)."""
    tree = learner(tmp_path, "def slot_mapping(*a):\n    while True:\n        pass\n\n"
                             "def reshape_and_cache(*a):\n    return 7\n")
    with pytest.raises(LearnerTimeout, match="endless loop"):
        worker.call(tree, L1.stem, "slot_mapping", (), {})
    worker.budget = 60
    started = time.monotonic()
    with pytest.raises(LearnerTimeout, match="already ran past the limit in an earlier test"):
        worker.call(tree, L1.stem, "slot_mapping", (), {})
    assert time.monotonic() - started < SHORT_TIMEOUT + 30  # the short limit, and a spare worker's boot
    worker.budget = 60
    started = time.monotonic()
    with pytest.raises(LearnerTimeout, match="was not run"):
        worker.call(tree, L1.stem, "slot_mapping", (), {})
    assert time.monotonic() - started < 1
    assert worker.call(tree, L1.stem, "reshape_and_cache", (), {}) == 7  # the other function still runs


def test_an_exit_at_import_is_reported_as_such(tmp_path, worker):
    tree = learner(tmp_path, "import os\nos._exit(0)\n")
    worker.budget = 60
    with pytest.raises(LearnerCrash, match="at import of your module"):
        worker.call(tree, L1.stem, "slot_mapping", (), {})


def test_a_crash_in_a_call_says_which_call(tmp_path, worker):
    tree = learner(tmp_path, "import os, signal\ndef slot_mapping(*a):\n    os.kill(os.getpid(), signal.SIGSEGV)\n")
    worker.budget = 60
    with pytest.raises(LearnerCrash, match=r"in slot_mapping\(\) \(killed by SIGSEGV\)"):
        worker.call(tree, L1.stem, "slot_mapping", (), {})


def test_a_crash_says_what_cuda_said(tmp_path, worker):
    """A device error often ends the worker in SIGABRT; the CUDA error it printed says more."""
    tree = learner(tmp_path, "import os, signal, sys\ndef slot_mapping(*a):\n"
                             "    print('CUDA error: misaligned address', file=sys.stderr, flush=True)\n"
                             "    os.kill(os.getpid(), signal.SIGABRT)\n")
    worker.budget = 60
    with pytest.raises(LearnerCrash, match=r"killed by SIGABRT; CUDA said: CUDA error: misaligned address\)"):
        worker.call(tree, L1.stem, "slot_mapping", (), {})


def test_a_renamed_function_is_named_by_its_file(tmp_path, worker):
    tree = learner(tmp_path, "def slot_map(*a):\n    return 1\n")
    worker.budget = 60
    with pytest.raises(AttributeError, match=rf"{L1.stem}\.py defines no slot_mapping\(\).*renamed"):
        worker.call(tree, L1.stem, "slot_mapping", (), {})


def test_what_the_learner_prints_comes_back(tmp_path, capfd):
    tree = learner(tmp_path, "def slot_mapping(*a):\n    print('debug: slot 13')\n    return 13\n")
    assert TreeModule(tree, L1.stem).slot_mapping() == 13
    assert "debug: slot 13" in capfd.readouterr().out


def _descendants(pid):
    """Every live process below `pid` (from /proc's parent links)."""
    parents = {}
    for entry in os.listdir("/proc"):
        try:
            parents[int(entry)] = int(open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            pass
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process groups and /proc")
def test_ctrl_c_stops_every_process_the_grader_started(tmp_path):
    # /dev/shm: one of the few places the sandboxed learner's code may write (tests/_sandbox.py)
    started = Path("/dev/shm") / f"drills-started-{tmp_path.name}-{os.getpid()}"
    tree = learner(tmp_path, f"def slot_mapping(*a):\n    open({str(started)!r}, 'w').close()\n    while True:\n"
                             f"        pass\n")
    grader = subprocess.Popen([sys.executable, "grader.py", "l1", f"--tree={tree}", "--test-timeout", "600"],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60
    while not started.exists() and time.monotonic() < deadline:  # the learner's code is running
        time.sleep(0.1)
    assert started.exists(), "the learner's code never ran"
    below = _descendants(grader.pid)  # the test process, its workers (and their fork server)
    assert len(below) >= 2, below
    grader.send_signal(signal.SIGINT)
    out, _ = grader.communicate(timeout=30)
    assert grader.returncode == 128 + signal.SIGINT
    assert "stopped by SIGINT" in out
    deadline = time.monotonic() + 10
    while [p for p in below if _alive(p)] and time.monotonic() < deadline:
        time.sleep(0.1)
    started.unlink(missing_ok=True)
    assert [p for p in below if _alive(p)] == [], "processes of the grade are still running after Ctrl-C"


def _alive(pid):
    """Whether the process runs (a zombie waiting to be reaped does not)."""
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_grading_run_starts_its_worker_before_torch_and_the_fixture_takes_it(tmp_path, monkeypatch):
    """The grade plans each test process's worker (tests/_grading.py): the plugin starts it
    before it imports torch, so that their imports overlap, and the first call takes it
    rather than starting another. A plan for other trees is ended, never left running."""
    import json

    import _process
    import _worker
    tree = learner(tmp_path, "def slot_mapping(*a):\n    return 3\n")
    plan = json.dumps(dict(readable=[str(tree)], preload=[]))
    spy = ("import sys; sys.path.insert(0, 'tests'); import _process\n"
           "start = _process.start_worker\n"
           "def spied(*a):\n"
           "    print('torch imported' if 'torch' in sys.modules else 'before torch', flush=True)\n"
           "    return start(*a)\n"
           "_process.start_worker = spied\n"
           "import _plugin, _worker\n"
           "print('planned' if _worker.WORKER.planned else 'none'); _worker.stop_all()\n")
    done = subprocess.run([sys.executable, "-c", spy], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, _process.WORKER_PLAN: plan})
    assert done.stdout.split() == ["before", "torch", "planned"], done.stderr[-2000:]

    monkeypatch.setenv(_process.WORKER_PLAN, plan)
    other = tmp_path / "other"  # not tmp_path itself: pytest makes it 0700, which a worker that left root cannot read
    other.mkdir()
    for trees, taken in (([tree], True), ([tree, other], False)):
        worker = Worker()
        worker.planned = _process.start_planned_worker()
        assert _process.WORKER_PLAN not in os.environ  # taken out: nothing it starts inherits it
        planned = worker.planned[1][0]
        try:
            worker.prepare(trees)
            assert TreeModule(tree, L1.stem, worker).slot_mapping() == 3
            assert (worker.proc is planned) == taken and worker.planned is None
            assert taken or planned.poll() is not None  # the wrong plan's worker was ended
            assert worker.proc.pid in _worker.live_pids()
        finally:
            worker.stop()
            monkeypatch.setenv(_process.WORKER_PLAN, plan)
