"""The learner's code runs in a process of its own. Names no drill.

The tests, the checks and the report stay in the test process; a tree's module is
imported only in a worker, and the tests call it through `TreeModule`, a proxy whose
attribute calls are sent to the worker. A learner's crash, abort or endless loop costs
one test, not the drill: the worker is killed or dies, the test fails saying so, and
the next call starts a new one.

The worker is what design.md's boundary asks for:
- **A fresh process.** `python -I` exec'd anew (not a fork of the test process, nor a
  multiprocessing child: no authkey, no resource sharer), with an allow-listed
  environment (tests/_process.py's `allowed_env`: no secrets), in a session of its own, holding no
  descriptor but its channel (a socketpair made before it starts), its output going to
  a file. It dies with the test process (Linux's parent-death signal).
- **Confined before the import.** It imports torch, Triton and the few machinery
  modules it runs, then enters tests/_sandbox.py's Landlock and seccomp confinement
  (reads only the Python install, system libraries, the trees it serves, its scratch
  folder and the device; writes only its scratch folder), then drops tests/ from its
  path; only then is a learner's module imported.
  Where the grade runs as root it leaves root there too (a uid of the drill's own, no
  capability: tests/_sandbox.py's drop_root).
- **Data, never code.** tests/_channel.py: the call goes out as shared copies of its
  tensors' storages; the reply comes back as plain data read by tests/_data.py.
- **The learner's limit is the limit.** One deadline for a whole exchange (the request
  sent, every message read whole: a reply sent a byte at a time ends there); a reply no
  larger than the call may return (`_channel.reply_limit`); what the call prints goes to files
  made here and handed over as descriptors, read back from our own (nothing is opened by
  name in the worker's folder, where a FIFO would block the open).
- **Checks read private memory.** The test's own tensors are never shared; after the
  reply the written storages are copied back once and the read-only ones compared,
  so an input the worker changed fails the test (`InputChanged`).
- **Nothing outlives a test.** After each test the plugin ends every process the
  worker started (`end_strays`); the worker itself serves one drill's test module
  (a fresh interpreter costs 2 s of imports: one per test would double the suite)
  and is replaced after a crash, a time-out or a fatal GPU error.

What the worker counts (Triton launches, tests/_launches.py; the bytes its kernels
move, tests/_counting.py) is counted beside the learner's code: its own word, which
teaches an honest learner and binds nobody.

DRILLS_ISOLATE=0 runs the module in the test process instead (handy with a
debugger); the grade always isolates.
"""
import os
import pickle
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import _channel
import _data
import _sandbox
from _process import kill_descendants, remove_tree, start_worker

ISOLATE = os.environ.get("DRILLS_ISOLATE", "1") != "0"
# Seconds of the learner's code one test (or hypothesis example) may use (DRILLS_TIMEOUT;
# make grade TIMEOUT=...).
TIMEOUT = float(os.environ.get("DRILLS_TIMEOUT", "60"))
SHORT_TIMEOUT = min(5.0, TIMEOUT)  # at least this for a call of a function that hung before
BOOT_TIMEOUT = 600  # seconds a worker may take to import torch and Triton (a cold disk is slow)

SANDBOX = _sandbox.describe()
TESTS = str(Path(__file__).resolve().parent)
# Exceptions whose type means something to the tests come back as that type;
# anything else comes back as LearnerError (so an AssertionError raised by the
# learner's own code cannot pass for a check's verdict).
_KEEP_TYPES = {t.__name__: t for t in (ValueError, TypeError, IndexError, NotImplementedError, RuntimeError,
                                       FileNotFoundError, AttributeError)}


class LearnerError(Exception):
    """An exception of another type raised by the learner's code: `TypeName: message`."""


def _last_cuda_error(err):
    """The last "CUDA error: ..." line a crashed call printed on its stderr (`err`, the call's file)."""
    return ([None] + re.findall(r"CUDA error: [^\n]{1,200}", _channel.tail(err, 8000)))[-1]


def _as_text(text):
    """What the learner's code printed, as text to print: control characters and Unicode format
    characters removed (tests/_render.py's cleaning), so that nothing it printed reaches a
    terminal as an escape sequence, in the tests or in the picture's subprocess."""
    from _render import clean_text
    return clean_text(text)


class LearnerCrash(Exception):
    """The process running the learner's code died, or hit an error it cannot survive
    (a CUDA error: the context is dead after an illegal address)."""


class LearnerTimeout(Exception):
    """The learner's code ran past the time one test may use."""


class InputChanged(AssertionError):
    """The learner's code changed a tensor the function only reads."""


# ---------------------------------------------------------------------------
# The test-process side


class Worker:
    """One worker process, started on first use (or by `prepare`) and again after it
    dies. `readable`: the folders it may read besides its own (the trees it serves);
    `preload`: modules of ours it imports before it is confined (what a drill's
    arguments are made of, e.g. a class of the drill's cases)."""

    def __init__(self, readable=(), preload=()):
        self.readable, self.preload = {str(p) for p in readable}, tuple(preload)
        self.proc = self.sock = self.scratch = self.log = self.spare = self.planned = None
        self.ready = False
        self.hung = {}         # {function: tests it ran past its limit in}: later calls get a short limit, or none
        self.slowest = {}      # {function: seconds of its slowest call that returned}
        self.budget = TIMEOUT  # seconds left to the current test (reset per test by the plugin)
        self.calls = {}        # this test's calls that returned: {function name: (calls, kernels launched)}
        WORKERS.append(self)

    def prepare(self, readable=(), preload=()):
        """Start the worker now (it boots while the tests go on) for these trees."""
        # A tree an earlier test removed is dropped: no sandbox can grant a path that is gone.
        wanted = frozenset({p for p in self.readable if os.path.exists(p)} | {str(p) for p in readable})
        preload = tuple(dict.fromkeys(self.preload + tuple(preload)))
        if wanted != self.readable or preload != self.preload:
            self.stop()
            self.readable, self.preload = wanted, preload
        if self.proc is None or self.proc.poll() is not None:
            self.stop()
            self.start()

    def start(self):
        """Take the worker the grade planned for this process (tests/_process.py's
        start_planned_worker) or the spare, if it boots for the same trees; else start one."""
        key = (self.readable, self.preload)
        planned, spare, self.planned, self.spare = self.planned, self.spare, None, None
        if planned is not None and planned[0] == key:
            taken, planned = planned, None
        elif spare is not None and spare[0] == key:
            taken, spare = spare, None
            # A worker that crashed once may crash again (a planted bug, a learner's bad offset):
            # the next spare boots while this one serves.
            self.spare = (key, self._launch())
        else:
            taken = (key, self._launch())
        _end(planned), _end(spare)
        self.proc, self.sock, self.scratch, self.log = taken[1]
        self.ready = False

    def _launch(self):
        return start_worker(self.readable, self.preload)

    def stop(self, spare=False):
        """End the worker and everything it started. spare=True (after a crash or a time-out,
        when more calls are likely) boots the next one now, while the tests go on."""
        if self.proc is not None:
            _end((None, (self.proc, self.sock, self.scratch, self.log)))
        self.proc = self.sock = self.scratch = self.log = None
        self.ready = False
        if spare and self.spare is None:
            self.spare = ((self.readable, self.preload), self._launch())

    def _receive(self, deadline, limit=_channel.MAX_MESSAGE):
        """The next message's bytes, whole by `deadline` (time.monotonic()), or None: a worker
        that sends half a message, or a byte now and then, is a time-out at the deadline, not
        a wait forever. A message announced longer than `limit` raises _channel.TooLarge."""
        try:
            payload, _ = _channel.recv(self.sock, deadline=deadline, limit=limit)
        except TimeoutError:
            return None
        return payload

    def _boot(self):
        """Wait (bounded, outside the learner's time) until the worker is confined and ready."""
        deadline = time.monotonic() + BOOT_TIMEOUT
        while not self.ready:
            try:
                payload = self._receive(deadline, limit=1 << 20)
            except (EOFError, OSError):
                payload = None
            message = _data.loads(payload) if payload is not None else None
            if message is None or message[0] != "ready":
                tail = self._log_tail()
                self.stop()
                reason = message[1] if message else f"it ended or did not answer in {BOOT_TIMEOUT} s"
                raise LearnerCrash(f"the worker process could not start: {reason}" + (f"\n{tail}" if tail else ""))
            self.ready = True

    def _log_tail(self):
        self.log.flush()
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-2000:].strip()

    def call(self, tree, stem, name, args, kwargs, traffic=False, contract=None):
        """name(*args, **kwargs) of the tree's module, run in the worker. `contract` is
        {function: (parameter names, names it writes)}; an argument it does not write
        must come back unchanged. With traffic=True, run it with its kernels' loads and
        stores counted (tests/_counting.py) and return (result, Traffic)."""
        if not _covers(self.readable, tree) or self.proc is None or self.proc.poll() is not None:
            self.prepare(readable=[tree])
        self._boot()
        # Without the drill's contract every argument may be written (the machinery's own calls).
        names, writes = (contract or {}).get(name, ((), None))
        sharing = _channel.Sharing(owner=_sandbox.worker_user())
        # What the call prints goes to two files of ours, made here unnamed and handed over as
        # descriptors (the last two of the request's): read back after the reply or a crash,
        # they are never a path in a folder the worker writes.
        printed = [tempfile.TemporaryFile(), tempfile.TemporaryFile()]
        try:
            request = pickle.dumps(("call", str(tree), stem, name, traffic,
                                    sharing.pickle_args(args, kwargs, names, writes)))
            return self._exchange(name, request, sharing, traffic, printed)
        finally:
            sharing.close()
            for f in printed:
                f.close()

    def _exchange(self, name, request, sharing, traffic, printed=(None, None)):
        started, phase = time.monotonic(), "starting"
        # A function that hung once is likely to hang again: its later calls get a few times its
        # slowest finished call (at least SHORT_TIMEOUT s), not the whole limit, so one endless
        # loop costs one test's limit plus seconds for each test after it.
        # After a second time-out it is not run again: each later test fails at once, saying so.
        if len(self.hung.get(name, ())) >= 2:
            raise LearnerTimeout(f"{name}() was not run: it ran past its time limit twice already (the full "
                                 f"{TIMEOUT:.0f} s, then a short limit), so the rest of this drill's calls of it "
                                 f"fail at once; fix the hang and grade again")
        short = max(SHORT_TIMEOUT, 4 * self.slowest.get(name, 0)) if name in self.hung else None
        budget = min(self.budget, short) if short else self.budget
        # One deadline for the whole exchange: the request sent, every message read whole.
        deadline = started + max(budget, 1e-3)
        fds = [*sharing.fds, *(f.fileno() for f in printed if f is not None)]
        try:
            _channel.send(self.sock, request, fds, deadline=deadline)
        except TimeoutError:
            payload = None  # it stopped reading: a time-out, said below
        except OSError:
            self.stop()
            raise LearnerCrash(f"the process running your code died before {name}() was called")
        limit = _channel.reply_limit(sharing)
        while True:
            try:
                payload = self._receive(deadline, limit) if time.monotonic() < deadline else None
                message = None if payload is None else _data.loads(payload, sharing.view)
            except _data.NotData as error:
                self.stop()
                raise LearnerError(f"your code sent back something that is not data ({error}); return tensors, "
                                   f"numbers, strings, None, or tuples, lists and dicts of these") from None
            except _channel.TooLarge as error:
                self.stop(spare=True)
                raise LearnerError(f"your code's process sent back {error.length} bytes, more than {name}() may "
                                   f"return ({error.limit} bytes: a few times its arguments' size)") from None
            except (EOFError, OSError):
                code, cuda = self._exit_code(), _last_cuda_error(printed[1])
                sharing.collect()
                self.stop(spare=True)
                where = "at import of your module" if phase == "importing your module" else f"in {phase}"
                raise LearnerCrash(f"the process running your code ended {where} ({code}"
                                   + (f"; CUDA said: {cuda}" if cuda else "") + "): usually a read or "
                                   f"write far outside a tensor, or os._exit / a fatal error in your file")
            if message is None:
                self.stop(spare=True)
                self.budget = 0
                self.hung.setdefault(name, []).append(phase)
                if short and short < TIMEOUT:
                    raise LearnerTimeout(f"your code ran past the {short:.0f} s this call had, in {phase}: {name}() "
                                         f"already ran past the limit in an earlier test, so its later calls get "
                                         f"a few times its slowest finished call, not the whole {TIMEOUT:.0f} s")
                raise LearnerTimeout(f"your code ran past the {TIMEOUT:.0f} s this test allows it, in {phase} "
                                     f"(an endless loop? a huge grid?); the process was stopped "
                                     f"(DRILLS_TIMEOUT / make grade TIMEOUT=... sets the limit)")
            if not (isinstance(message, tuple) and message and message[0] in ("phase", "ok", "error")):
                self.stop()
                raise LearnerError("your code's process sent back a message out of order")
            if message[0] == "phase":
                phase = str(message[1])
                continue
            break
        took = time.monotonic() - started
        self.budget -= took
        if message[0] == "ok":
            self.slowest[name] = max(self.slowest.get(name, 0), took)
        return self._reply(name, message, sharing, traffic, printed)

    def _reply(self, name, message, sharing, traffic, printed=(None, None)):
        if len(message) != 6 or type(message[4]) is not int:
            self.stop()
            raise LearnerError("your code's process sent back a malformed reply")
        kind, payload, out, err, launched, fatal = message
        changed = sharing.collect()  # the one copy of what the worker wrote, before anything reads it
        if kind == "ok":
            calls, kernels = self.calls.get(name, (0, 0))
            self.calls[name] = (calls + 1, kernels + int(launched))
        # What it printed is read from our own files (the reply's copy is not trusted), and
        # passed on as text: in a test it lands in the record's stdout/stderr, in the
        # picture's subprocess in the picture, never as escape sequences.
        out, err = _channel.tail(printed[0], 4000), _channel.tail(printed[1], 4000)
        if out:
            sys.stdout.write(_as_text(str(out)))
        if err:
            sys.stderr.write(_as_text(str(err)))
        if fatal:
            self.stop()
        if changed:
            raise InputChanged(f"{name}() changed {', '.join(changed)}, which it only reads: the caller's "
                               f"tensors must come back as they were passed")
        if kind == "ok":
            if traffic:
                import _counting
                result, counts = payload
                return result, _counting.Traffic.from_data(counts)
            return payload
        type_name, text, where = payload
        if fatal:
            error = LearnerCrash(f"{type_name}: {text}")
        elif type_name in _KEEP_TYPES:
            error = _KEEP_TYPES[type_name](text)
        else:
            error = LearnerError(f"{type_name}: {text}")
        error.where = where
        raise error

    def _exit_code(self):
        try:
            self.proc.wait(2)
        except subprocess.TimeoutExpired:
            return "still running"
        code = self.proc.returncode
        if code < 0:
            try:
                return f"killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        return f"exit code {code}"


def _end(launched):
    """Kill a launched worker (`(key, (proc, sock, scratch, log))`, or None) and what it started."""
    if launched is None:
        return
    proc, sock, scratch, log = launched[1]
    kill_descendants(proc.pid)
    if proc.poll() is None:
        proc.kill()
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        pass
    sock.close()
    log.close()
    remove_tree(scratch)


WORKERS = []        # every worker of this process, for the plugin's per-test reset and stop
WORKER = Worker()   # runs the learner's module


def reset_all(budget=TIMEOUT, calls=False):
    """A fresh time budget for every worker (each test, each hypothesis example); with
    calls=True also forget the calls counted so far (each test)."""
    for worker in WORKERS:
        worker.budget = budget
        if calls:
            worker.calls = {}


def calls_made():
    """{function name: (calls, kernels launched)} of this test, over every worker."""
    merged = {}
    for worker in WORKERS:
        for name, (calls, kernels) in worker.calls.items():
            c, k = merged.get(name, (0, 0))
            merged[name] = (c + calls, k + kernels)
    return merged


def live_pids():
    """The workers of this process, spares and a planned one included: what a sweep of leftovers must keep."""
    waiting = [s for w in WORKERS for s in (w.spare, w.planned) if s]
    return {w.proc.pid for w in WORKERS if w.proc is not None} | {s[1][0].pid for s in waiting}


def end_strays():
    """End every process the workers started, and every orphan of theirs that was
    re-parented to this process (a double fork), keeping the workers themselves and the
    children the machinery started (tests/_process.py)."""
    keep = live_pids()
    kill_descendants(keep, keep, orphans=True)


def _covers(folders, tree):
    tree = os.path.realpath(tree)
    return any(tree == f or tree.startswith(f.rstrip(os.sep) + os.sep) for f in map(os.path.realpath, folders))


def stop_all():
    for worker in WORKERS:
        worker.stop()
        _end(worker.spare), _end(worker.planned)
        worker.spare = worker.planned = None


class TreeModule:
    """What the `drill` fixture hands a test: the drill module of one tree, every
    attribute a function that runs in a worker (by default the learner's)."""

    def __init__(self, tree, stem, worker=None, contract=None):
        self._tree, self._stem, self._worker = str(tree), stem, worker or WORKER
        self._contract = contract or {}

    def __getattr__(self, name):
        if name.startswith("_"):  # a drill's API is public; hypothesis asks for _repr_pretty_
            raise AttributeError(name)

        def call(*args, **kwargs):
            return self._worker.call(self._tree, self._stem, name, args, kwargs, contract=self._contract)
        call.__name__ = name
        return call

    def __repr__(self):
        return f"<{self._stem} of {self._tree}, run in a worker process>"


def tree_module(tree, stem, contract=None, readable=(), preload=()):
    """The drill module of `tree`: in a worker (the default; started now, so that it boots
    while the tests go on), or imported here."""
    from _tree import load_drill, tree_path
    tree = tree_path(str(tree))
    if ISOLATE:
        WORKER.prepare(readable=[tree, *readable], preload=preload)
        return TreeModule(tree, stem, contract=contract)
    return load_drill(str(tree), stem)


def flatten_tensors(obj):
    """Every tensor in a nest of tuples, lists and dicts, in order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for x in obj for t in flatten_tensors(x)]
    if isinstance(obj, dict):
        return [t for x in obj.values() for t in flatten_tensors(x)]
    return []
