"""The learner's limit is the limit, and nothing is left behind (issue 47): a worker that
stalls the channel in any way costs its test the learner's limit plus seconds; what it
prints reaches us as text; where the grade is root it is not; and after a drill the grader
removes what its confined processes left, even when they were killed. Each mechanism is
planted in a tree of its own and driven through tests/_worker.py's Worker, as a test's
call is. (tests/test_sandbox.py plants the rest in one wrong L1 graded by grader.py.)"""
import io
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

import _grading
import _sandbox
import _scratch
from _front import here  # noqa: F401  -- a fixture
from _manifest import BY_ID
from _worker import LearnerCrash, LearnerError, LearnerTimeout, Worker

pytestmark = pytest.mark.meta
L1 = BY_ID["l1"]
LIMIT = 3.0  # the learner's limit in these tests: each stall must end within it plus SLACK
SLACK = 10.0

# The learner's module finds the worker's end of the channel (its one socket) and writes on it.
CHANNEL = '''
import os, socket, stat, struct, sys, time

def _channel():
    for fd in range(3, 256):  # the one connected socket (a GPU host's CUDA may hold a listener)
        try:
            if stat.S_ISSOCK(os.fstat(fd).st_mode):
                found = socket.socket(fileno=os.dup(fd))
                found.getpeername()
                return found
        except OSError:
            pass
    raise LookupError("no channel")
'''


@pytest.fixture
def worker():
    w = Worker()
    w.budget = LIMIT
    yield w
    w.stop()


def _tree(tmp_path, body):
    folder = tmp_path / "tree"
    folder.mkdir(exist_ok=True)
    (folder / f"{L1.stem}.py").write_text(body)
    return folder


def _timed(worker, tree, error, match=None):
    """Call slot_mapping once the worker is up (its boot is not the learner's time); the
    seconds the call took, which must raise `error`."""
    worker.prepare(readable=[tree])
    worker._boot()
    started = time.monotonic()
    with pytest.raises(error, match=match):
        worker.call(tree, L1.stem, "slot_mapping", (), {})
    return time.monotonic() - started


def test_a_reply_sent_a_byte_at_a_time_ends_at_the_limit(tmp_path, worker):
    """A worker that announces a reply and sends one byte every 2 s: one deadline for the whole
    message, not a timeout for each read (which never ended)."""
    tree = _tree(tmp_path, CHANNEL + '''
def slot_mapping(*a):
    channel = _channel()
    channel.sendall(struct.pack("<QI", 1000, 0))
    while True:
        channel.send(b"x")
        time.sleep(2)
''')
    assert _timed(worker, tree, LearnerTimeout, "ran past") < LIMIT + SLACK


def test_a_half_sent_header_ends_at_the_limit(tmp_path, worker):
    tree = _tree(tmp_path, CHANNEL + '''
def slot_mapping(*a):
    channel = _channel()
    while True:
        channel.send(b"\\0")
        time.sleep(1.5)
''')
    assert _timed(worker, tree, LearnerTimeout) < LIMIT + SLACK


def test_a_reply_larger_than_the_call_may_return_is_refused_unread(tmp_path, worker):
    """A reply is capped by what the call may return (a few times its arguments, 64 MiB of plain
    data): 1 GiB announced is refused at once, not read (nor waited for)."""
    tree = _tree(tmp_path, CHANNEL + '''
def slot_mapping(*a):
    _channel().sendall(struct.pack("<QI", 1 << 30, 0))
    time.sleep(600)
''')
    assert _timed(worker, tree, LearnerError, "more than slot_mapping") < LIMIT + SLACK


def test_fifos_in_place_of_the_output_files_then_a_crash_cost_no_wait(tmp_path, worker):
    """The worker once kept a call's output in named files of its scratch folder, which the test
    process opened after a crash: a FIFO planted there blocked that open forever. The files are
    now the test process's own, handed over as descriptors: the FIFOs are just files of the
    worker's, and what CUDA said still comes back."""
    tree = _tree(tmp_path, '''
import os, sys
def slot_mapping(*a):
    for name in ("call-stdout", "call-stderr", "call-stderr.log"):
        os.mkfifo(os.path.join(os.environ["TMPDIR"], name))
    print("CUDA error: an illegal memory access was planted", file=sys.stderr, flush=True)
    os._exit(1)
''')
    took = _timed(worker, tree, LearnerCrash, "CUDA said: CUDA error: an illegal memory access was planted")
    assert took < LIMIT + SLACK


def test_what_the_learner_prints_comes_back_as_text(tmp_path, worker, capfd):
    """No escape sequence reaches the terminal from a call's output (in a test it lands in the
    report, in the picture's subprocess on the screen): a painted "passed" row is plain text."""
    tree = _tree(tmp_path, '''
import sys
def slot_mapping(*a):
    print("\\x1b[2J\\x1b[H\\x1b[1;32mL1 Paged KV-cache write passed 35/35\\x1b[0m\\x9b31m")
    print("\\x1b]0;title\\x07 \\u202epassed\\u202c \\u200b", file=sys.stderr)
    return 13
''')
    worker.budget = 60
    assert worker.call(tree, L1.stem, "slot_mapping", (), {}) == 13
    out, err = capfd.readouterr()
    assert "L1 Paged KV-cache write passed 35/35" in out
    assert not {"\x1b", "\x9b", "\x07", "\u202e", "\u202c", "\u200b"} & set(out + err), (out, err)


# A stand-in for a drill's bench process (the bench needs a GPU): it notes its progress as the bench
# does (tests/_bench.py's note_progress), waits for the grade's go, then calls the tree's slot_mapping
# N times, as the bench calls a kernel it times, and prints its result.
BENCH = '''
import json, sys
sys.path.insert(0, "tests")
import _bench
from _tree import load_drill
_bench.note_progress(sys.argv[1])
sys.stdin.readline()
module = load_drill(sys.argv[1], "l1_paged_kv_write")
for _ in range(int(sys.argv[2])):
    module.slot_mapping()
print(json.dumps(dict(cases=[])))
'''


def test_a_bench_that_stalls_in_the_learners_code_ends_at_the_limit_and_the_grade_says_so(tmp_path):
    """The bench runs the learner's code in its own process: the grade ends it when one call
    (here an endless loop of short calls of its own) has run past the learner's limit,
    not at the drill's --timeout; a bench whose calls each end within the limit goes on,
    however long it takes in all."""
    from rich.console import Console
    from types import SimpleNamespace

    import _bench
    import _render
    from _tree import load_front
    limit = 1.0
    for name in ("stalls", "slow"):
        (tmp_path / name).mkdir()
    stalls = _tree(tmp_path / "stalls", "import time\ndef _step():\n    time.sleep(0.2)\n"
                                        "def slot_mapping():\n    while True:\n        _step()\n")
    slow = _tree(tmp_path / "slow", "import time\ndef slot_mapping():\n    time.sleep(0.8)\n")
    benches = {tree: _bench.Bench(L1, tree, [sys.executable, "-c", BENCH, str(tree), calls])
               for tree, calls in ((stalls, "1"), (slow, "8"))}  # both start now: their imports overlap
    ran = []

    def slow_run():  # at the same time as the stalled one: each is mostly waiting
        started = time.monotonic()
        ran.append((benches[slow].result(1000.0, 600, limit), time.monotonic() - started))
    beside = threading.Thread(target=slow_run)
    beside.start()
    front = load_front()
    grade = dict(ceiling_gbps=1000.0, drills=[dict(id="l1", status="passed")])
    args = SimpleNamespace(timeout=600, test_timeout=limit)
    started = time.monotonic()
    front.time_drill(grade, benches[stalls], SimpleNamespace(gbps=lambda timeout: 1000.0), args,
                     SimpleNamespace(update=lambda text: None))
    assert time.monotonic() - started < limit + SLACK
    said = grade["drills"][0]["bench"]["error"]
    assert said.startswith("stopped at the 1 s limit, in one call of your code"), said
    out = io.StringIO()
    _render._bench_table(Console(file=out, width=200), grade)
    assert "L1 bench failed stopped at the 1 s limit, in one call of your" in " ".join(out.getvalue().split())
    beside.join(60)
    assert ran[0][0] == dict(cases=[]) and ran[0][1] > limit + _bench.SLACK, ran  # 8 calls of 0.8 s: slow, moving


LEAVES_ROOT = _sandbox.worker_user() is not None
STAYS = "the worker leaves root only where the grade is root, and not on a GPU host (tests/_unroot.py)"


@pytest.mark.skipif(not LEAVES_ROOT, reason=STAYS)
def test_as_root_the_learners_code_runs_as_another_uid(tmp_path, worker):
    tree = _tree(tmp_path, '''
import os
def slot_mapping(*a):
    status = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return os.getuid(), os.geteuid(), os.getgid(), os.getgroups(), status["CapEff"].strip(), status["CapBnd"].strip()
''')
    worker.budget = 60
    uid, euid, gid, groups, effective, bounding = worker.call(tree, L1.stem, "slot_mapping", (), {})
    assert uid != 0 and euid != 0 and gid != 0 and groups == [], (uid, euid, gid, groups)
    assert int(effective, 16) == 0 and int(bounding, 16) == 0, (effective, bounding)
    assert (uid, gid)[0] == _sandbox.worker_user()[0]


# A stand-in for a drill's confined process: it makes its scratch folder where the grade says
# (DRILLS_SCRATCH_ROOT), leaves there a FIFO and a file made immutable (as root without seccomp
# could), makes a /dev/shm name as the drill's uid, and then is killed: no atexit runs.
KILLED = '''
import fcntl, os, struct, sys, time
sys.path.insert(0, "tests")
import _process
folder = _process.scratch_folder("worker-")
os.mkfifo(os.path.join(folder, "fifo"))
with open(os.path.join(folder, "locked"), "w") as f:
    f.write("x")
if os.geteuid() == 0:
    fd = os.open(os.path.join(folder, "locked"), os.O_RDONLY)
    try:
        fcntl.ioctl(fd, 0x40086602, struct.pack("l", 0x10))  # FS_IOC_SETFLAGS, FS_IMMUTABLE_FL
    except OSError:
        pass  # a file system without flags
    uid = int(os.environ.get("DRILLS_WORKER_UID", os.getuid()))
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
open("/dev/shm/" + sys.argv[1], "w").write("x")
print(folder, flush=True)
time.sleep(600)
'''


def test_the_grader_removes_a_drills_scratch_and_shm_names_even_after_a_kill(tmp_path):
    env = {}
    scratch = _grading.DrillScratch("t47", env)
    name = f"drills-t47-{os.getpid()}"
    child = subprocess.Popen([sys.executable, "-c", KILLED, name], cwd=_grading.ROOT, stdout=subprocess.PIPE,
                             text=True, env={**os.environ, **env})
    try:
        folder = child.stdout.readline().strip()
        assert folder.startswith(scratch.root) and os.path.exists(f"/dev/shm/{name}"), folder
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(10)
        child.stdout.close()
    assert scratch.close() == []
    assert not os.path.lexists(scratch.root) and not os.path.lexists(f"/dev/shm/{name}")
    assert _grading.SCRATCH_ROOT not in env and _sandbox.WORKER_UID not in env


def test_a_removal_that_fails_is_a_line_of_the_grade(monkeypatch):
    env = {}
    scratch = _grading.DrillScratch("t47", env)
    monkeypatch.setattr(_scratch, "remove_tree", lambda path: f"could not remove {path} (1 entries left): Busy")
    try:
        assert scratch.close() == [f"could not remove {scratch.root} (1 entries left): Busy"]
    finally:
        os.rmdir(scratch.root)


# The grader itself, killed: a stand-in holds a drill's scratch root as grader.py does, and its worker
# stand-in (KILLED, in the same process) leaves there a FIFO, an immutable file and a /dev/shm name.
ORPHAN = 'import sys; sys.path.insert(0, "tests"); import _scratch; _scratch.DrillScratch("t47k")\n' + KILLED


def test_the_next_grade_removes_what_a_killed_grader_left(tmp_path, here):
    name = f"drills-t47k-{os.getpid()}"
    child = subprocess.Popen([sys.executable, "-c", ORPHAN, name], cwd=_grading.ROOT, stdout=subprocess.PIPE,
                             text=True)
    try:
        root = os.path.dirname(child.stdout.readline().strip())
        assert os.path.basename(root).startswith("drills-root-t47k-") and os.path.exists(f"/dev/shm/{name}"), root
        held = _scratch.orphaned_roots()  # what a grade starting now would take: not the live one's root
        for _, lock in held:
            os.close(lock)
        assert root not in [path for path, _ in held]
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(10)
        child.stdout.close()
    assert os.path.isdir(root)  # no clean-up ran
    tree = tmp_path / "mine"
    tree.mkdir()
    (tree / f"{L1.stem}.py").write_bytes((_grading.ROOT / "mine" / f"{L1.stem}.py").read_bytes())
    try:
        _, out = here("l1", "--tree", str(tree))  # the untouched stub: graded without a test process
        assert f"removed {root}, left by a grade that was killed" in " ".join(out.split()), out
        assert not os.path.lexists(root)
        if os.geteuid() == 0:  # the root's name says the drill's uid, whose /dev/shm names go with it
            assert not os.path.lexists(f"/dev/shm/{name}")
    finally:
        if os.path.lexists(f"/dev/shm/{name}"):
            os.unlink(f"/dev/shm/{name}")


@pytest.mark.skipif(not LEAVES_ROOT, reason=STAYS)
def test_as_root_a_tree_others_cannot_read_is_said_in_plain_words(tmp_path, worker):
    tree = _tree(tmp_path, "def slot_mapping(*a):\n    return 1\n")
    tree.chmod(0o700)
    worker.budget = 60
    with pytest.raises(LearnerCrash, match="not readable by others.*chmod o\\+rx"):
        worker.call(tree, L1.stem, "slot_mapping", (), {})


def test_on_a_gpu_host_root_is_kept_unless_asked(monkeypatch):
    """Measured on an H100: a worker of another uid cannot open the test process's CUDA IPC
    handles, so a GPU host keeps uid 0 (the seccomp refusals hold all the same);
    DRILLS_GPU_LEAVE_ROOT=1 leaves root there too, for a trial."""
    import _unroot
    monkeypatch.setattr(_unroot, "gpu_host", lambda: True)
    monkeypatch.setattr(_unroot.os, "geteuid", lambda: 0)
    monkeypatch.delenv(_unroot.GPU_LEAVE_ROOT, raising=False)
    assert _unroot.worker_user() is None
    monkeypatch.setenv(_unroot.GPU_LEAVE_ROOT, "1")
    assert _unroot.worker_user()[0] == int(os.environ.get(_unroot.WORKER_UID) or _unroot.NOBODY)
