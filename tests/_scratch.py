"""A drill's scratch root in a grade: made, held, removed after the drill, and removed at
the next grade's start when the grader itself was killed. Names no drill; imports no torch.

Every confined process of a drill (its workers, its picture's, traffic's and bench's)
makes its scratch folder in the drill's root (tests/_process.py's scratch_folder), so the
grader removes all they left by removing one folder, however they ended (`DrillScratch`).
A grader killed with SIGKILL (or by the out-of-memory killer) runs no clean-up of its own:
each root is therefore held with an exclusive flock for as long as the process that made
it lives. The kernel lets go of that lock however the process ends, and a pid reused later
holds nothing, so a root that no process holds is a killed grade's: the next grade removes
it (`remove_orphans`) and says so.
"""
import atexit
import fcntl
import os
import re
import secrets
import tempfile

from _process import SCRATCH_ROOT, remove_shm, remove_tree, shm_names
from _sandbox import WORKER_UID

ROOT_PREFIX = "drills-root-"
DRILL_UIDS = range(1_800_000_000, 1_900_000_000)  # the uids a grade as root gives its drills' workers


def locked_root(name):
    """A new root `drills-root-<name>-<random>` in the temporary folder, 0711 (a worker that
    left root may pass to its own folder, and list none), held by this process: (its path,
    the descriptor that holds the lock; once that is closed, the root is free)."""
    made = tempfile.mkdtemp(prefix=".drills-making-")
    lock = os.open(made, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    fcntl.flock(lock, fcntl.LOCK_EX)
    root = os.path.join(os.path.dirname(made), f"{ROOT_PREFIX}{name}-{os.path.basename(made).rpartition('-')[2]}")
    os.rename(made, root)  # named as a root only once held: a sweep never takes one being made
    os.chmod(root, 0o711)
    return root, lock


def orphaned_roots():
    """The roots of ours in the temporary folder that no live process holds, each now held
    by us: [(path, the lock's descriptor)], to be closed once the root is removed."""
    found = []
    for entry in os.scandir(tempfile.gettempdir()):
        if not entry.name.startswith(ROOT_PREFIX):
            continue
        try:
            lock = os.open(entry.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            if os.fstat(lock).st_uid == os.geteuid():  # a folder of that name another user made is not ours
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                found.append((entry.path, lock))
                continue
        except OSError:
            pass  # held: its grade is alive
        os.close(lock)
    return found


class DrillScratch:
    """One drill's scratch root and, where the grade runs as root, the uid its workers take
    (tests/_sandbox.py's worker_user), set in `environ` (grader.py: os.environ, which the
    drill's test, picture, traffic and bench processes inherit; a grading run: its env).
    `close()`, once they have all ended, removes the root and the /dev/shm names the drill's
    confined processes made, whatever became of them (a killed test process runs no atexit;
    a FIFO left in a scratch folder is unlinked, never opened; an immutable file is freed
    first), and returns a sentence for each removal that failed: a line of the grade. The
    root is held while this process lives and its name says the uid (`remove_orphans`)."""

    def __init__(self, drill_id, environ=None):
        self.environ, self.left = os.environ if environ is None else environ, None
        environ = self.environ
        # A uid of the drill's own (no user has it): what its workers leave in /dev/shm is known by its owner.
        self.uid = DRILL_UIDS.start + secrets.randbelow(len(DRILL_UIDS)) if os.geteuid() == 0 else None
        self.root, self.lock = locked_root(drill_id if self.uid is None else f"{drill_id}-u{self.uid}")
        self.saved = {k: environ.get(k) for k in (SCRATCH_ROOT, WORKER_UID)}
        environ[SCRATCH_ROOT] = self.root
        if self.uid is not None:
            environ[WORKER_UID] = str(self.uid)
        self.shm = shm_names()
        atexit.register(self.close)

    def close(self):
        if self.left is not None:
            return self.left
        atexit.unregister(self.close)
        for key, value in self.saved.items():
            if value is None:
                self.environ.pop(key, None)
            else:
                self.environ[key] = value
        try:
            self.left = remove_leftovers(self.root, self.uid, self.shm)
        finally:
            os.close(self.lock)
        return self.left


def remove_leftovers(root, uid, shm):
    """A drill's root removed, with the /dev/shm names its processes made (`uid`'s, or else
    ours that are new since `shm` and held by no process; with neither, none) and `uid`'s
    files in the temporary folder (where Landlock is missing its workers may write there).
    A sentence for each removal that failed."""
    left = [p for p in [remove_tree(root)] if p]
    left += remove_shm(shm, uid)[1] if shm is not None or uid is not None else []
    if uid is not None:
        for entry in os.scandir(tempfile.gettempdir()):
            try:
                if entry.stat(follow_symlinks=False).st_uid == uid:
                    left += [p for p in [remove_tree(entry.path) if entry.is_dir(follow_symlinks=False)
                                         else os.unlink(entry.path)] if p]
            except OSError as error:
                left.append(f"could not remove {entry.path}: {error.strerror}")
    return left


def remove_orphans():
    """The roots a killed grade left (`orphaned_roots`), removed with what their drill's uid
    left where the root names one (a grade as root); a grade calls this as it starts. A
    sentence for each root, which the grade prints."""
    said = []
    for root, lock in orphaned_roots():
        named = re.search(r"-u(\d+)-[^-]*$", os.path.basename(root))
        uid = int(named[1]) if named and int(named[1]) in DRILL_UIDS else None
        try:
            left = remove_leftovers(root, uid, None)
        finally:
            os.close(lock)
        with_shm = f" (with uid {uid}'s /dev/shm names)" if uid is not None else ""
        said.append(f"removed {root}, left by a grade that was killed{with_shm}" + "".join(f"; {p}" for p in left))
    return said
