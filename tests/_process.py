"""Processes the grade starts, and how they end. Names no drill.

Every child runs in a process group of its own, dies with its parent (Linux's
parent-death signal), and is killed whole on a time limit or on the grader's Ctrl-C,
so nothing the grade started outlives it.
"""
import atexit
import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_CHILDREN = set()  # live process groups, killed on Ctrl-C or SIGTERM
# Held while a child is started and recorded, and while a sweep decides what to keep: a
# grading run started from a thread is never taken for a leftover in between.
_STARTING = threading.Lock()
_SUBREAPER = []    # [True] once this process adopts its descendants' orphans


def die_with_parent():
    """Ask Linux to kill this process when its parent dies (Ctrl-C, a grader's kill, the
    out-of-memory killer), so nothing the grade started outlives it."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


# The environment a process that runs the learner's code gets: what Python, the C library,
# CUDA and Triton read, and the drills' own variables; nothing else of the grader's (tokens,
# keys, SSH_AUTH_SOCK).
ENV_KEEP = ("PATH", "LANG", "LANGUAGE", "TZ", "LD_LIBRARY_PATH", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS",
            "MKL_NUM_THREADS", "OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "DRILLS_KERNELS")
ENV_PREFIXES = ("LC_", "CUDA_", "NVIDIA_", "TRITON_")


def allowed_env():
    return {k: v for k, v in os.environ.items() if k in ENV_KEEP or k.startswith(ENV_PREFIXES)}


def scratch_env(scratch):
    """Where a process that runs the learner's code keeps what it writes: all of it in its
    scratch folder (its home, its temporary files, Triton's and CUDA's caches)."""
    return {name: os.path.normpath(os.path.join(scratch, sub)) for name, sub in (
        ("HOME", "."), ("TMPDIR", "."), ("TRITON_CACHE_DIR", "triton"), ("TRITON_HOME", "."), ("CUDA_CACHE_PATH", "nv"))}


_SCRATCH = []  # the folder every worker's scratch folder lives in (made on first use)
# A grading run's plan for its test process's worker (tests/_grading.py): the trees it reads
# and the modules it preloads, as JSON.
WORKER_PLAN = "DRILLS_WORKER_PLAN"


def scratch_folder(prefix):
    """A new folder for one confined process to write (a worker, a bench), inside this
    process's scratch root, which is removed at exit whatever became of the process."""
    if not _SCRATCH:
        _SCRATCH.append(tempfile.mkdtemp(prefix="drills-sandbox-"))
        atexit.register(shutil.rmtree, _SCRATCH[0], ignore_errors=True)
    return tempfile.mkdtemp(prefix=prefix, dir=_SCRATCH[0])


def start_worker(readable, preload):
    """Start a worker (tests/_serve.py; tests/_worker.py drives it) that may read the
    `readable` trees and imports the `preload` modules before it is confined: a fresh
    `python -I`, in a session of its own, with the allow-listed environment pointed at a
    scratch folder of its own, holding only its end of a socketpair. Returns (process,
    our end of the socket, its scratch folder, its log file). Imports no torch, so that a
    test process can start its worker before its own imports (`start_planned_worker`)."""
    scratch = scratch_folder("worker-")
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    env = {**allowed_env(), **scratch_env(scratch)}
    env["HF_HUB_OFFLINE"] = "1"
    # One thread: Landlock below ABI 8 covers only the thread that asks, so no thread pool
    # may start before the worker is confined (OpenBLAS and OpenMP start theirs at import).
    env.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    config = dict(fd=theirs.fileno(), scratch=scratch, readable=sorted(readable), preload=list(preload),
                  parent=os.getpid())
    log = open(scratch.rstrip(os.sep) + ".log", "w+b")
    boot = "import sys; sys.path.insert(0, sys.argv[1]); import _serve; _serve.serve(sys.argv[2])"
    try:
        proc = subprocess.Popen([sys.executable, "-I", "-B", "-c", boot, str(ROOT / "tests"), json.dumps(config)],
                                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                cwd=scratch, env=env, start_new_session=True)
    finally:
        theirs.close()
    return proc, ours, scratch, log


def start_planned_worker():
    """The worker a grading run planned for this test process (WORKER_PLAN in the
    environment, taken out of it), started now: ((readable, preload), start_worker's
    tuple), the form of tests/_worker.py's spare; None without a plan. The plugin calls it
    before it imports torch: the worker's imports (4-6 s on the H200 host, 10 s with
    E1's transformers) then overlap the test process's own."""
    plan = os.environ.pop(WORKER_PLAN, None)
    if not plan or os.environ.get("DRILLS_ISOLATE", "1") == "0":
        return None
    plan = json.loads(plan)
    readable, preload = set(plan["readable"]), tuple(plan["preload"])
    return (readable, preload), start_worker(readable, preload)


def run_process(cmd, timeout, env=None, pass_fds=(), untrusted=False):
    """(returncode or None if killed at the time limit, stdout, stderr). The child runs in
    a process group of its own, killed whole on timeout and on the grader's Ctrl-C. Its
    output goes to files, not pipes: a process it leaves behind holding a pipe end cannot
    make us wait, and every wait here is bounded. untrusted=True (it will run the learner's
    code itself) gives it only `allowed_env()` of ours."""
    return Child(cmd, env, pass_fds, untrusted).wait(timeout)


class Child:
    """A process started now and waited for later (`run_process` is both at once), so that
    its start-up (imports, a tree loaded, kernels compiled) overlaps other work. With
    gated=True its standard input is a pipe that `wait` writes one line to (and closes)
    before it waits: the child reads it as its signal to go on (the grade's bench times
    nothing while the tests still run). `kill` ends it unwaited-for."""

    def __init__(self, cmd, env=None, pass_fds=(), untrusted=False, gated=False):
        # One thread per child: the tensors are tiny, and two graders side by side on a
        # 2-core machine would otherwise oversubscribe it several times over.
        self.out, self.err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
        with _STARTING:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self.out, stderr=self.err,
                                         stdin=subprocess.PIPE if gated else subprocess.DEVNULL,
                                         start_new_session=True, pass_fds=pass_fds, preexec_fn=die_with_parent,
                                         env={"OMP_NUM_THREADS": "1", **(allowed_env() if untrusted else os.environ),
                                              **(env or {})})
            _CHILDREN.add(self.proc.pid)

    def wait(self, timeout, line=None):
        """(returncode or None if killed at the time limit, stdout, stderr), `line` sent
        first to a gated child. What the child left behind in its group goes with it."""
        if self.proc.stdin:
            try:  # one short line: it fits the pipe's buffer, so this never blocks
                self.proc.stdin.write(f"{'' if line is None else line}\n".encode())
                self.proc.stdin.close()
            except OSError:  # the child is gone, or closed its end: its exit code says why
                pass
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            self._end()
        out, err = _read(self.out), _read(self.err)
        self.out.close(), self.err.close()
        return code, out, err

    def kill(self):
        self._end()
        self.out.close(), self.err.close()

    def _end(self):
        kill_group(self.proc.pid)
        _CHILDREN.discard(self.proc.pid)
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            pass
        if self.proc.stdin and not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()
            except OSError:
                pass


def _read(f, limit=1 << 20):
    """The last `limit` bytes a child wrote to `f`, as text."""
    size = f.seek(0, os.SEEK_END)
    f.seek(max(0, size - limit))
    return f.read().decode(errors="replace")


def kill_group(pgid):
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def stop_children_on_signals(say):
    """On Ctrl-C or SIGTERM: kill every child's process group (and so their workers), say so, exit."""
    def handler(signum, frame):
        for pgid in list(_CHILDREN):
            kill_group(pgid)
        say(f"stopped by {signal.Signals(signum).name}: killed {len(_CHILDREN)} test process group(s)")
        sys.exit(128 + signum)
    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)


def become_subreaper():
    """Orphans of our descendants (a learner's detached process: a double fork, setsid)
    are re-parented to this process instead of init, so `kill_leftovers` can find them."""
    try:
        _SUBREAPER.append(ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0)  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        pass


def _parents():
    """{pid: parent pid} of every process we can see in /proc."""
    found = {}
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if entry.name.isdigit():
            try:
                found[int(entry.name)] = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    return found


def _kill_all(pids):
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for pid in pids:  # reap those that are our children; the others are reaped by their parents
        try:
            os.waitpid(pid, os.WNOHANG)
        except (ChildProcessError, OSError):
            pass


def kill_descendants(roots, keep=(), orphans=False, rounds=20):
    """Kill every process below the pids `roots` (not the roots themselves) and, with
    orphans=True in a subreaper (`become_subreaper`), every child of this process not in
    `keep` (an orphan of ours re-parented here) and all below it. One listing of /proc a
    round, again until nothing is left (a process may fork while we kill its parent).
    Returns how many were killed."""
    me, killed = os.getpid(), 0
    roots = {roots} if isinstance(roots, int) else set(roots)
    for _ in range(rounds):
        with _STARTING:  # the machinery's own children (a grading run in a thread) stay
            keep, parents = set(keep) | set(_CHILDREN), _parents()
        below, frontier = set(), set(roots)
        if orphans and any(_SUBREAPER):
            below = {p for p, parent in parents.items() if parent == me and p not in keep | roots}
            frontier |= below
        while frontier:
            frontier = {p for p, parent in parents.items() if parent in frontier and p not in below}
            below |= frontier
        if not below:
            break
        _kill_all(below)
        killed += len(below)
    return killed


def kill_leftovers(keep=()):
    """Kill every process still parented to this one but those in `keep` and the ones
    `run_process` is waiting for (after `become_subreaper`: every process the grade
    started, however it detached), and reap them. Returns how many; nothing is done in a
    process that is not a subreaper."""
    if not any(_SUBREAPER):
        return 0
    return kill_descendants((), keep, orphans=True)


def exit_name(code):
    try:
        return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
    except ValueError:
        return f"signal {-code}"
