"""A long call's progress, as data. Names no drill.

The learner's code runs in a worker, whose reply comes only when the call ends
(tests/_worker.py). Where a command shows progress meanwhile (`make chat`: a line a step
of the engine), what it hands the worker (a namespace of kernels, say) writes a note of a
few numbers into the worker's scratch folder (`note`, in the worker), and the command
polls it (`Watch`, in its own process). A note is read as numbers, never printed as
text: the learner's code could write one too, and the worst it can do is a wrong count.
"""
import json
import os
import stat
import tempfile
import threading
import time

NAME = "progress.json"


def note(*numbers):
    """(In the worker.) Replace the note with these ints."""
    path = os.path.join(tempfile.gettempdir(), NAME)
    with open(path + ".tmp", "w") as f:
        f.write(json.dumps([int(n) for n in numbers]))
    os.replace(path + ".tmp", path)


def read(folder):
    """The note in `folder` as a tuple of ints; None when there is none, or it is not a
    plain file holding a short list of ints."""
    try:
        fd = os.open(os.path.join(folder, NAME), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except (OSError, TypeError):
        return None
    with os.fdopen(fd, "rb") as f:
        data = f.read(1000) if stat.S_ISREG(os.fstat(f.fileno()).st_mode) else b""
    try:
        numbers = json.loads(data)
    except ValueError:
        return None
    ok = isinstance(numbers, list) and len(numbers) <= 16 and all(type(n) is int and 0 <= n < 2 ** 53
                                                                   for n in numbers)
    return tuple(numbers) if ok else None


class Every:
    """A `with` block during which a thread calls `tick()` every `every` seconds; at its end
    `seconds` is how long the block took. Watch and tests/_chat.py's Ticker are two."""
    every = 1.0

    def tick(self):
        raise NotImplementedError

    def _run(self):
        while not self.done.wait(self.every):
            self.tick()

    def __enter__(self):
        self.done, self.started = threading.Event(), time.monotonic()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join()
        self.seconds = time.monotonic() - self.started
        return False


class Watch(Every):
    """`with Watch(folder, show):` calls show(note, seconds since the block began) from a
    thread for each new note while the block runs, polled every `every` s, and once more
    at its end. `folder()` names the worker's scratch folder (it changes when a worker
    is replaced); a note left from an earlier call is removed first."""

    def __init__(self, folder, show, every=0.5):
        self.folder, self.show, self.every, self.last = folder, show, every, None

    def tick(self):
        found = read(self.folder())
        if found is not None and found != self.last:
            self.last = found
            self.show(found, time.monotonic() - self.started)

    def __enter__(self):
        if self.folder():
            try:
                os.remove(os.path.join(self.folder(), NAME))
            except OSError:
                pass
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        self.tick()
        return False
