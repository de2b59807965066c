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
import time
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
            "MKL_NUM_THREADS", "OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "DRILLS_KERNELS",
            "DRILLS_WORKER_UID", "DRILLS_GPU_LEAVE_ROOT")  # tests/_unroot.py's: whether and as whom root is left
ENV_PREFIXES = ("LC_", "CUDA_", "NVIDIA_", "TRITON_")


def allowed_env():
    return {k: v for k, v in os.environ.items() if k in ENV_KEEP or k.startswith(ENV_PREFIXES)}


def scratch_env(scratch):
    """Where a process that runs the learner's code keeps what it writes: all of it in its
    scratch folder (its home, its temporary files, Triton's and CUDA's caches)."""
    found = {name: os.path.normpath(os.path.join(scratch, sub)) for name, sub in (
        ("HOME", "."), ("TMPDIR", "."), ("TRITON_CACHE_DIR", "triton"), ("TRITON_HOME", "."), ("CUDA_CACHE_PATH", "nv"))}
    # Where it runs as a uid with no name (tests/_sandbox.py's drop from root), getpass.getuser()
    # reads these rather than the user database.
    return {**found, "USER": "drills-worker", "LOGNAME": "drills-worker"}


_SCRATCH = []  # the folder every worker's scratch folder lives in (made on first use)
# The folder a grade makes for one drill's scratch folders (tests/_scratch.py's
# DrillScratch): set, every process of that drill makes its own there, and the grader
# removes it after the drill, whatever became of them (a killed test process runs no
# atexit). Unset (a test run by hand), each process has a root of its own, removed at exit.
SCRATCH_ROOT = "DRILLS_SCRATCH_ROOT"
# A grading run's plan for its test process's worker (tests/_grading.py): the trees it reads
# and the modules it preloads, as JSON.
WORKER_PLAN = "DRILLS_WORKER_PLAN"


def scratch_folder(prefix):
    """A new folder for one confined process to write (a worker, a bench), inside the
    drill's scratch root (SCRATCH_ROOT, which the grader removes) or else this process's
    own, removed at exit. Roots are 0711: a worker that left root (tests/_sandbox.py) may
    pass to its own folder, and list none."""
    root = os.environ.get(SCRATCH_ROOT)
    if not (root and os.path.isdir(root)):
        if not _SCRATCH:
            _SCRATCH.append(tempfile.mkdtemp(prefix="drills-sandbox-"))
            os.chmod(_SCRATCH[0], 0o711)
            atexit.register(remove_tree, _SCRATCH[0])
        root = _SCRATCH[0]
    return tempfile.mkdtemp(prefix=prefix, dir=root)


_FS_IOC_GETFLAGS, _FS_IOC_SETFLAGS = 0x80086601, 0x40086602
_FS_IMMUTABLE_FL, _FS_APPEND_FL = 0x10, 0x20


def remove_tree(path):
    """Remove a folder that a confined process wrote, whatever it left there (FIFOs and
    sockets are unlinked, never opened; a file or folder made immutable or append-only is
    freed first, where we may). None when it is gone, else a sentence saying what is left."""
    if not os.path.lexists(path):
        return None
    try:
        shutil.rmtree(path)
        return None
    except OSError:
        pass
    import fcntl
    import stat
    for folder, dirs, files in os.walk(path):
        for name in (folder, *(os.path.join(folder, n) for n in dirs + files)):
            try:
                fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                if stat.S_ISREG(os.fstat(fd).st_mode) or stat.S_ISDIR(os.fstat(fd).st_mode):
                    flags = bytearray(8)
                    fcntl.ioctl(fd, _FS_IOC_GETFLAGS, flags)
                    value = int.from_bytes(flags[:4], sys.byteorder)
                    if value & (_FS_IMMUTABLE_FL | _FS_APPEND_FL):
                        value &= ~(_FS_IMMUTABLE_FL | _FS_APPEND_FL)
                        fcntl.ioctl(fd, _FS_IOC_SETFLAGS, value.to_bytes(4, sys.byteorder) + bytes(4))
            except OSError:
                pass
            finally:
                os.close(fd)
    try:
        shutil.rmtree(path)
        return None
    except OSError as error:
        left = sum(len(d) + len(f) for _, d, f in os.walk(path)) + 1
        return f"could not remove {path} ({left} entries left): {error.strerror or error}"


def shm_names():
    """{name: (owner uid, inode)} of /dev/shm's entries (POSIX shared memory, torch's)."""
    found = {}
    try:
        with os.scandir("/dev/shm") as entries:
            for entry in entries:
                try:
                    info = entry.stat(follow_symlinks=False)
                    found[entry.name] = (info.st_uid, info.st_ino)
                except OSError:
                    pass
    except OSError:
        pass
    return found


def _shm_in_use():
    """The /dev/shm paths some live process we can see has open or mapped."""
    used = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if target.startswith("/dev/shm/"):
                    used.add(target.removesuffix(" (deleted)"))
            with open(f"/proc/{pid}/maps") as maps:
                used.update(line.split(None, 5)[-1].strip() for line in maps if " /dev/shm/" in line)
        except OSError:
            continue
    return used


def remove_shm(before, uid=None):
    """Remove the /dev/shm names a drill's confined processes made (they cannot list the
    folder, only create and open names in it): with `uid` (the drill's own, where the
    grade is root: tests/_sandbox.py's worker_user) every entry that uid owns; else the
    entries that are new since `before` (shm_names), ours, and held by no live process.
    Returns (how many removed, [sentences for those that could not be])."""
    removed, failed = 0, []
    now = shm_names()
    if uid is not None:
        gone = [name for name, (owner, _) in now.items() if owner == uid]
    else:
        used = _shm_in_use()
        gone = [name for name, (owner, ino) in now.items() if owner == os.geteuid() and before.get(name) != (owner, ino)
                and f"/dev/shm/{name}" not in used]
    for name in gone:
        path = os.path.join("/dev/shm", name)
        problem = remove_tree(path) if os.path.isdir(path) and not os.path.islink(path) else None
        if problem is None and os.path.lexists(path):
            try:
                os.unlink(path)
            except OSError as error:
                problem = f"could not remove {path}: {error.strerror}"
        if problem:
            failed.append(problem)
        else:
            removed += 1
    return removed, failed


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

    def go(self, line=None):
        """Send a gated child its line (once; its standard input is closed after)."""
        if self.proc.stdin and not self.proc.stdin.closed:
            try:  # one short line: it fits the pipe's buffer, so this never blocks
                self.proc.stdin.write(f"{'' if line is None else line}\n".encode())
                self.proc.stdin.close()
            except OSError:  # the child is gone, or closed its end: its exit code says why
                pass

    def wait(self, timeout, line=None):
        """(returncode or None if killed at the time limit, stdout, stderr), `line` sent
        first to a gated child (`go`). What the child left behind in its group goes with it."""
        self.go(line)
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            self._end()
        out, err = _read(self.out), _read(self.err)
        self.out.close(), self.err.close()
        return code, out, err

    def wait_while_moving(self, progress, stall, timeout=None, every=0.5):
        """Wait for the child as long as `progress()` keeps changing: None when it ends,
        "stalled" once its value has not changed for `stall` s (None, nothing to watch yet,
        starts no clock), "timeout" after `timeout` s in all. `wait(0)` then collects it."""
        started = last = time.monotonic()
        seen = None
        while True:
            try:
                self.proc.wait(every)
                return None
            except subprocess.TimeoutExpired:
                pass
            now, value = time.monotonic(), progress()
            if value != seen:
                seen, last = value, now
            elif value is not None and now - last > stall:
                return "stalled"
            if timeout is not None and now - started > timeout:
                return "timeout"

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
