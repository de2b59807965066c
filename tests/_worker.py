"""The learner's code runs in a process of its own. Names no drill.

The tests, the checks and the report stay in the test process; a tree's module is
imported only in a worker process, and the tests call it through `TreeModule`, a
proxy whose attribute calls are sent to the worker. So the learner's file cannot
reach what grades it (rebind the checks, hook pytest, write the report), and a
learner's crash, abort or endless loop costs one test, not the drill: the worker
is killed or dies, the test fails saying so, and the next call starts a new one.

Tensors travel as shared memory (torch.multiprocessing: a CPU storage moves into
shared memory in place, a CUDA one goes by IPC handle), with each view's offset
and strides, so the learner's writes land in the test's own buffers, guard regions
included. A returned tensor that is one of the arguments (an `out=`) comes back as
that very argument.

The worker confines itself with Linux Landlock (tests/_sandbox.py) before it imports
the learner's module: from then on it may write only its scratch folder, and it cannot
reach (ptrace, read the memory of, signal) any process outside its sandbox. Under the
interpreter the fork server it is forked from is confined the same way first, so a
worker cannot ask it for an unconfined process either. What it sends back is read as
data (tests/_data.py), and each reply says how many Triton kernels the call launched
(tests/_launches.py). Where Landlock is missing, `SANDBOX` says so and the grade warns.

DRILLS_ISOLATE=0 runs the module in the test process instead (handy with a
debugger); the grade always isolates.
"""
import atexit
import io
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.multiprocessing as mp

import _data
import _sandbox
from _paged import fence, fences_of, unfence
from _process import die_with_parent

ISOLATE = os.environ.get("DRILLS_ISOLATE", "1") != "0"
# Seconds of the learner's code one test (or hypothesis example) may use (DRILLS_TIMEOUT;
# make grade TIMEOUT=...).
TIMEOUT = float(os.environ.get("DRILLS_TIMEOUT", "60"))

# Under the CPU interpreter a worker is forked from a fork server that has already
# imported torch (a few ms a worker instead of 2 s for a fresh interpreter). The
# server is itself a fresh interpreter, started once, so a worker inherits nothing of
# the test process (no report key, no checks). On a GPU each worker is spawned: a
# process that forks after CUDA is initialised cannot use it, and there are few.
_START_METHOD = "forkserver" if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0") else "spawn"
if _START_METHOD == "forkserver":
    # Python 3.11's fork server ignores our sys.path, and skips silently what it cannot
    # import: torch and Triton by name from site-packages, and _forkserver (which confines
    # the server) through the PYTHONPATH the first Worker.start sets.
    mp.set_forkserver_preload(["torch", "triton", "torch.multiprocessing", "_forkserver"])

# Landlock's ABI on this kernel (0: none, and the grade is not tamper-proof here).
LANDLOCK_ABI = _sandbox.abi()
SANDBOX = f"landlock ABI {LANDLOCK_ABI}" if LANDLOCK_ABI else "none"
_SCRATCH = []  # the folder every worker's scratch folder lives in (made on first use)


def _scratch_root():
    if not _SCRATCH:
        _SCRATCH.append(tempfile.mkdtemp(prefix="drills-sandbox-"))
        atexit.register(shutil.rmtree, _SCRATCH[0], ignore_errors=True)
        os.environ["DRILLS_SANDBOX_ROOT"] = _SCRATCH[0]
        tests = str(Path(__file__).resolve().parent)
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (tests, os.environ.get("PYTHONPATH")) if p)
    return _SCRATCH[0]

# Exceptions whose type means something to the tests come back as that type;
# anything else comes back as LearnerError (so an AssertionError raised by the
# learner's own code cannot pass for a check's verdict).
_KEEP_TYPES = {t.__name__: t for t in (ValueError, TypeError, IndexError, NotImplementedError, RuntimeError,
                                       FileNotFoundError, AttributeError)}


class LearnerError(Exception):
    """An exception of another type raised by the learner's code: `TypeName: message`."""


class LearnerCrash(Exception):
    """The process running the learner's code died, or hit an error it cannot survive
    (a CUDA error: the context is dead after an illegal address)."""


class LearnerTimeout(Exception):
    """The learner's code ran past the time one test may use."""


# ---------------------------------------------------------------------------
# The test-process side


class Worker:
    """One worker process, started on first use and again after it dies."""

    def __init__(self):
        self.proc = None
        self.conn = None
        self.scratch = None
        self.budget = TIMEOUT  # seconds left to the current test (reset per test by the plugin)
        self.calls = {}        # this test's calls that returned: {function name: (calls, kernels launched)}
        WORKERS.append(self)

    def start(self):
        self.scratch = tempfile.mkdtemp(prefix="worker-", dir=_scratch_root())
        ctx = mp.get_context(_START_METHOD)
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, sys.path, self.scratch), daemon=True,
                                name="drills-worker")
        self.proc.start()
        child.close()

    def stop(self):
        if self.proc is not None:
            if self.proc.is_alive():
                self.proc.kill()
            self.proc.join(5)
            self.conn.close()
        if self.scratch:
            shutil.rmtree(self.scratch, ignore_errors=True)
        self.proc = self.conn = self.scratch = None

    def _receive(self):
        """The next message, read as data: a reply that names anything else is refused."""
        payload = self.conn.recv_bytes()
        try:
            return _data.loads(payload)
        except _data.NotData as error:
            self.stop()  # what it sent may hold file descriptors or handles we did not take
            raise LearnerError(f"your code sent back something that is not data ({error}); return tensors, "
                               f"numbers, strings, None, or tuples, lists and dicts of these") from None

    def call(self, tree, stem, name, args, kwargs, traffic=False):
        """name(*args, **kwargs) of the tree's module, run in the worker. With traffic=True,
        run it with its kernels' loads and stores counted (tests/_counting.py) and return
        (result, Traffic): the counting happens in the worker, where the kernels run."""
        if self.proc is None or not self.proc.is_alive():
            self.stop()
            self.start()
        flat = flatten_tensors((args, kwargs))
        started = time.monotonic()
        try:
            self.conn.send(("call", str(tree), stem, name, args, kwargs, traffic, fences_of(flat)))
        except (BrokenPipeError, ConnectionResetError, EOFError):
            self.stop()
            raise LearnerCrash(f"the process running your code died before {name}() was called")
        phase = "starting"
        while True:
            left = self.budget - (time.monotonic() - started)
            if left <= 0 or not self.conn.poll(left):
                self.stop()
                self.budget = 0
                raise LearnerTimeout(f"your code ran past the {TIMEOUT:.0f} s this test allows it, in {phase} "
                                     f"(an endless loop? a huge grid?); the process was stopped "
                                     f"(DRILLS_TIMEOUT / make grade TIMEOUT=... sets the limit)")
            try:
                message = self._receive()
            except (EOFError, ConnectionResetError, OSError):
                code = self._exit_code()
                self.stop()
                where = ("at import of your module" if phase == "importing your module"
                         else f"in {phase}")
                raise LearnerCrash(f"the process running your code ended {where} ({code}): usually a read or "
                                   f"write far outside a tensor, or os._exit / a fatal error in your file")
            if message[0] == "phase":
                phase = message[1]
                continue
            break
        self.budget -= time.monotonic() - started
        kind, payload, out, err, launched = message
        if kind == "ok":
            calls, kernels = self.calls.get(name, (0, 0))
            self.calls[name] = (calls + 1, kernels + int(launched))
        if out:
            sys.stdout.write(out)
        if err:
            sys.stderr.write(err)
        if kind == "ok":
            if traffic:
                import _counting
                result, counts = payload
                return _by_value(result, flat), _counting.Traffic.from_data(counts)
            return _by_value(payload, flat)
        type_name, text, where, fatal = payload
        if fatal:
            self.stop()
            error = LearnerCrash(f"{type_name}: {text}")
        elif type_name in _KEEP_TYPES:
            error = _KEEP_TYPES[type_name](text)
        else:
            error = LearnerError(f"{type_name}: {text}")
        error.where = where
        raise error

    def _exit_code(self):
        self.proc.join(2)
        code = self.proc.exitcode
        if code is None:
            return "still running"
        if code < 0:
            try:
                return f"killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        return f"exit code {code}"


WORKERS = []        # every worker of this process, for the plugin's per-test reset and stop
WORKER = Worker()   # runs the learner's module


def reset_all(budget=TIMEOUT, calls=False):
    """A fresh time budget for every worker (each test, each hypothesis example); with
    calls=True also forget the calls counted so far (each test)."""
    for worker in WORKERS:
        worker.budget = budget
        if calls:
            worker.calls = {}


def stop_all():
    for worker in WORKERS:
        worker.stop()


class TreeModule:
    """What the `drill` fixture hands a test: the drill module of one tree, every
    attribute a function that runs in a worker (by default the learner's)."""

    def __init__(self, tree, stem, worker=None):
        self._tree, self._stem, self._worker = str(tree), stem, worker or WORKER

    def __getattr__(self, name):
        if name.startswith("_"):  # a drill's API is public; hypothesis asks for _repr_pretty_
            raise AttributeError(name)

        def call(*args, **kwargs):
            return self._worker.call(self._tree, self._stem, name, args, kwargs)
        call.__name__ = name
        return call

    def __repr__(self):
        return f"<{self._stem} of {self._tree}, run in a worker process>"


def tree_module(tree, stem):
    """The drill module of `tree`: in a worker (the default), or imported here."""
    if ISOLATE:
        return TreeModule(tree, stem)
    from _tree import load_drill
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


class _Arg:
    """Stands, in a reply, for the i-th tensor argument (a returned `out`)."""

    def __init__(self, index):
        self.index = index


def _by_value(obj, flat):
    if isinstance(obj, _Arg):
        return flat[obj.index]
    if isinstance(obj, torch.Tensor) and obj.is_cuda:
        # A new CUDA tensor arrives by IPC and stays the worker's memory: torch will not send
        # it on (a test that hands one result back to the learner's next call), and it dies
        # with the worker. A copy of our own is neither.
        return obj.clone()
    if isinstance(obj, tuple):
        return tuple(_by_value(x, flat) for x in obj)
    if isinstance(obj, list):
        return [_by_value(x, flat) for x in obj]
    return obj


def _by_reference(obj, flat):
    if isinstance(obj, torch.Tensor):
        for i, t in enumerate(flat):
            if (t.data_ptr() == obj.data_ptr() and t.shape == obj.shape and t.stride() == obj.stride()
                    and t.dtype == obj.dtype and t.device == obj.device):
                return _Arg(i)
        return obj
    if isinstance(obj, tuple):
        return tuple(_by_reference(x, flat) for x in obj)
    if isinstance(obj, list):
        return [_by_reference(x, flat) for x in obj]
    return obj


# ---------------------------------------------------------------------------
# The worker side


def _enter_sandbox(scratch):
    """Everything this process writes goes to `scratch` from now on; then Landlock holds
    it there (where the kernel has Landlock)."""
    for name, sub in (("TRITON_CACHE_DIR", "triton"), ("TRITON_HOME", "."), ("CUDA_CACHE_PATH", "nv"),
                      ("TMPDIR", "."), ("HOME", ".")):
        os.environ[name] = os.path.normpath(os.path.join(scratch, sub))
    tempfile.tempdir = scratch
    multiprocessing.current_process()._config.pop("tempdir", None)  # the fork server's, outside scratch
    if LANDLOCK_ABI:
        _sandbox.confine(scratch)


def _serve(conn, path, scratch):
    die_with_parent()
    sys.path[:] = path
    _enter_sandbox(scratch)
    import _env  # noqa: F401  -- the same CPU-interpreter-or-GPU decision as the test process
    import _launches
    from _tree import load_drill

    launched = _launches.install()

    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):
            return
        _, tree, stem, name, args, kwargs, traffic, fences = request
        fatal = False
        before, fenced = launched(), []
        with _Captured() as captured:
            try:
                conn.send(("phase", "importing your module"))
                module = load_drill(tree, stem)
                if not hasattr(module, name):
                    raise AttributeError(f"{tree}/{stem}.py defines no {name}(): was it renamed or deleted? "
                                         f"(make reset DRILL=... restores the stub; your file is backed up first)")
                conn.send(("phase", f"{name}()"))
                fenced = fence(flatten_tensors((args, kwargs)), fences)
                if traffic:
                    # The counters live in this process, beside the learner's code: a hostile
                    # file could patch the interpreter, tests/_counting.py or numpy here and
                    # report what it likes, or do its work in PyTorch ops we never see (the
                    # report then says fewer bytes than the op needs). What it cannot do is
                    # touch the test process's checks: it only chooses the numbers it sends. So a
                    # file that fakes its counts can pass a forbidden-read test and show a good
                    # traffic line; the value checks, made in the test process, it cannot pass.
                    import _counting  # numpy and Triton's interpreter hooks: only when counting
                    result, counts = _counting.measure_here(getattr(module, name), flatten_tensors((args, kwargs)),
                                                           *args, **kwargs)
                else:
                    result = getattr(module, name)(*args, **kwargs)
                if torch.cuda.is_available() and torch.cuda.is_initialized():
                    torch.cuda.synchronize()
                reply = ("ok", _by_reference(result, flatten_tensors((args, kwargs))))
                if traffic:
                    reply = ("ok", (reply[1], counts and counts.to_data()))
            except BaseException as error:  # the learner's code may raise anything, SystemExit included
                text = str(error)
                fatal = _is_cuda_fatal(text)
                if isinstance(error, FileNotFoundError):
                    text += " (make reset DRILL=... restores the stub)"
                reply = ("error", (type(error).__name__, text, _where(error, tree), fatal))
        unfence(fenced)  # the storages may come back in a later call
        try:
            conn.send((*reply, captured.out, captured.err, launched() - before))
        except Exception as error:  # e.g. a result that cannot be pickled
            conn.send(("error", (type(error).__name__, f"the result of {name}() could not be sent back: {error}",
                                 None, False), captured.out, captured.err, 0))
        del request, args, kwargs, reply
        if fatal:
            os._exit(3)  # a CUDA error leaves the context unusable: let the next call start afresh


def _is_cuda_fatal(text):
    return "CUDA error" in text or "illegal memory access" in text or "device-side assert" in text


def _where(error, tree):
    """The last line of the tree's own code the exception passed through."""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if f.filename.startswith(tree)]
    return f"{frames[-1].filename}:{frames[-1].lineno}: {frames[-1].line}" if frames else None


class _Captured:
    """What the learner's code prints during one call, at the file-descriptor level
    (the interpreter's and the GPU's prints too), handed back with the reply."""

    def __enter__(self):
        sys.stdout.flush(), sys.stderr.flush()
        self.files = [tempfile.TemporaryFile(), tempfile.TemporaryFile()]
        self.saved = [os.dup(1), os.dup(2)]
        for fd, f in zip((1, 2), self.files):
            os.dup2(f.fileno(), fd)
        self.py = sys.stdout, sys.stderr
        sys.stdout = io.TextIOWrapper(os.fdopen(os.dup(1), "wb"), write_through=True)
        sys.stderr = io.TextIOWrapper(os.fdopen(os.dup(2), "wb"), write_through=True)
        return self

    def __exit__(self, *exc):
        sys.stdout.close(), sys.stderr.close()
        sys.stdout, sys.stderr = self.py
        for fd, saved in zip((1, 2), self.saved):
            os.dup2(saved, fd)
            os.close(saved)
        texts = []
        for f in self.files:
            f.seek(0)
            texts.append(f.read().decode(errors="replace")[-4000:])
            f.close()
        self.out, self.err = texts
        return False
