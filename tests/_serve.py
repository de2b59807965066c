"""The worker process's side of tests/_worker.py: its imports, its confinement, then the
calls of the learner's module until the channel closes. Names no drill.

Started by `Worker._launch` as `python -I -B -c "... _serve.serve(config)"`; everything
it needs from tests/ is imported here before `_sandbox.confine`, after which tests/ is
closed to it and dropped from its path.
"""
import io
import json
import os
import pickle
import socket
import sys
import tempfile
import traceback

import torch

import _channel
import _sandbox
from _process import die_with_parent
from _worker import SANDBOX, TESTS, flatten_tensors


def serve(config):
    """The worker's life: imports, confinement, then calls until the channel closes."""
    config = json.loads(config)
    die_with_parent()
    if os.getppid() != config["parent"]:  # the test process died before we could ask to die with it
        os._exit(0)
    sock = socket.socket(fileno=config["fd"])
    scratch = config["scratch"]
    tempfile.tempdir = scratch
    import importlib

    import _env  # noqa: F401  -- the same CPU-interpreter-or-GPU decision as the test process
    import _launches
    import triton  # noqa: F401
    from _tree import load_drill
    if _env.INTERPRET:
        import _counting  # noqa: F401  -- numpy and the interpreter's hooks, imported while tests/ is readable
    for module in config["preload"]:
        importlib.import_module(module)
    launched = _launches.install()
    try:
        if SANDBOX != "none":
            _sandbox.confine(scratch, readable=config["readable"])
    except (OSError, RuntimeError) as error:
        _channel.send(sock, _channel.pickle_reply(("refused", f"the sandbox could not be entered: {error}"), {}))
        return
    sys.path.remove(TESTS)  # the machinery is loaded; the learner's code cannot read tests/ from here on
    _channel.send(sock, _channel.pickle_reply(("ready", SANDBOX), {}))
    while True:
        try:
            payload, fds = _channel.recv(sock, take_fds=True)
        except (EOFError, OSError):
            return
        _, tree, stem, name, traffic, call = pickle.loads(payload)
        printed, fds = fds[-2:], fds[:-2]  # the test process's files for what the call prints
        args, kwargs, storages = _channel.unpickle_request(call, fds)
        fatal, before, result = False, launched(), None
        with _Captured(printed):
            try:
                _channel.send(sock, _channel.pickle_reply(("phase", "importing your module"), {}))
                module = load_drill(tree, stem)
                if not hasattr(module, name):
                    raise AttributeError(f"{tree}/{stem}.py defines no {name}(): was it renamed or deleted? "
                                         f"(make reset DRILL=... restores the stub; your file is backed up first)")
                _channel.send(sock, _channel.pickle_reply(("phase", f"{name}()"), {}))
                if traffic:
                    # The counters live here, beside the learner's code: its own word, which the
                    # value checks (made in the test process, from private copies) never rely on.
                    import _counting
                    result, counts = _counting.measure_here(getattr(module, name), flatten_tensors((args, kwargs)),
                                                           *args, **kwargs)
                    result = (result, counts and counts.to_data())
                else:
                    result = getattr(module, name)(*args, **kwargs)
                if torch.cuda.is_available() and torch.cuda.is_initialized():
                    torch.cuda.synchronize()
                reply = ("ok", result)
            except BaseException as error:  # the learner's code may raise anything, SystemExit included
                text = str(error)
                fatal = _is_cuda_fatal(text)
                if isinstance(error, FileNotFoundError):
                    text += " (make reset DRILL=... restores the stub)"
                reply = ("error", (type(error).__name__, text, _where(error, tree)))
        try:
            data = _channel.pickle_reply((*reply, None, None, launched() - before, fatal), storages)
        except Exception as error:  # e.g. a result that cannot be pickled
            data = _channel.pickle_reply(("error", (type(error).__name__, f"the result of {name}() could not be "
                                                    f"sent back: {error}", None), None, None, 0, fatal), {})
        # Let go of the call's tensors before replying: a CUDA storage received by IPC is the
        # test process's memory, which it frees (or reuses) once it has our answer.
        del args, kwargs, storages, reply, result
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        _channel.send(sock, data)
        if fatal:
            os._exit(3)  # a CUDA error leaves the context unusable: let the next call start afresh


def _is_cuda_fatal(text):
    return "CUDA error" in text or "illegal memory access" in text or "device-side assert" in text


def _where(error, tree):
    """The last line of the tree's own code the exception passed through; for a SyntaxError
    in the tree (raised by the parser, not from a frame), its line and, below it, a caret
    under where the parser stopped."""
    if isinstance(error, SyntaxError) and str(error.filename or "").startswith(tree) and error.lineno:
        text = (error.text or "").rstrip("\n")
        code = text.strip()
        start = max(0, min((error.offset or 1) - 1 - (len(text) - len(text.lstrip())), len(code)))
        end = error.end_offset if error.end_lineno == error.lineno and error.end_offset else error.offset or 1
        width = max(1, min(end - (error.offset or 1), len(code) - start))
        return f"{error.filename}:{error.lineno}: {code}\n{' ' * start}{'^' * width}"
    frames = [f for f in traceback.extract_tb(error.__traceback__) if f.filename.startswith(tree)]
    return f"{frames[-1].filename}:{frames[-1].lineno}: {frames[-1].line}" if frames else None


class _Captured:
    """What the learner's code prints during one call goes, at the file-descriptor level (the
    interpreter's and the GPU's prints too), to the two files the test process handed over
    with the call (`fds`, closed at the end): it reads them itself, after the reply or after
    a crash (what CUDA said before the process died), from descriptors of its own."""

    def __init__(self, fds):
        self.fds = fds

    def __enter__(self):
        sys.stdout.flush(), sys.stderr.flush()
        self.saved = [os.dup(1), os.dup(2)]
        for fd, f in zip((1, 2), self.fds):
            os.dup2(f, fd)
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
        for f in self.fds:
            os.close(f)
        return False
