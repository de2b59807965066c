"""Processes the grade starts, and how they end. Names no drill.

Every child runs in a process group of its own, dies with its parent (Linux's
parent-death signal), and is killed whole on a time limit or on the grader's Ctrl-C,
so nothing the grade started outlives it.
"""
import ctypes
import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_CHILDREN = set()  # live process groups, killed on Ctrl-C or SIGTERM
_SUBREAPER = []    # [True] once this process adopts its descendants' orphans


def die_with_parent():
    """Ask Linux to kill this process when its parent dies (Ctrl-C, a grader's kill, the
    out-of-memory killer), so nothing the grade started outlives it."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def run_process(cmd, timeout, env=None, pass_fds=()):
    """(returncode or None if killed at the time limit, stdout, stderr). The child runs in
    a process group of its own, killed whole on timeout and on the grader's Ctrl-C."""
    # One thread per child: the tensors are tiny, and two graders side by side on a
    # 2-core machine would otherwise oversubscribe it several times over.
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                            text=True, start_new_session=True, pass_fds=pass_fds, preexec_fn=die_with_parent,
                            env={"OMP_NUM_THREADS": "1", **os.environ, **(env or {})})
    _CHILDREN.add(proc.pid)
    try:
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, out, err
    except subprocess.TimeoutExpired:
        kill_group(proc.pid)
        out, err = proc.communicate()
        return None, out, err
    finally:
        kill_group(proc.pid)  # what the child left behind in its group goes with it
        _CHILDREN.discard(proc.pid)


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


def kill_leftovers():
    """Kill every process still parented to this one (after `become_subreaper`: every
    process the grade started, however it detached), and reap them. Returns how many;
    nothing is done in a process that is not a subreaper (grader.main run by the tests)."""
    if not any(_SUBREAPER):
        return 0
    me, found = os.getpid(), []
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        try:
            stat = (entry / "stat").read_text()
            if entry.name.isdigit() and int(stat.rpartition(")")[2].split()[1]) == me:
                found.append(int(entry.name))
        except (OSError, ValueError, IndexError):
            continue
    for pid in found:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError, PermissionError):
            pass
    return len(found)


def exit_name(code):
    try:
        return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
    except ValueError:
        return f"signal {-code}"
