"""Known-wrong solutions: the reference with exactly one mistake planted.

A drill's module lists its page's pitfalls (`Drill.pitfalls`) and other wrong
kernels the grade must not misname (`Drill.mistakes`), each as (exact text,
replacement) edits of solutions/<stem>.py. Keeping edits instead of whole copies
means a change to the reference carries over to every variant, and an edit that
no longer applies fails loudly instead of silently testing nothing.

The diagnosis runs these variants on a learner's failing input, in a worker
process of their own (not the learner's, which could tamper with them): a variant
may index out of range or write far outside a tensor on that input, and on a GPU
that kills the process's CUDA context. tests/test_wrong.py grades each one, in a
test process started as soon as the session knows it needs them
(tests/_grading.py, start_grading).
"""
import atexit
import shutil
import tempfile
from pathlib import Path

from _tree import ROOT
from _worker import TIMEOUT, TreeModule, Worker

_FOLDER = None  # where this process plants the variants it loads; removed at exit
_VARIANTS = Worker()  # runs them
# The variants are our code (the reference with one edit), run to explain a learner's
# failure: the learner's per-test limit is not theirs. On a busy machine their runs take
# longer, and what the diagnosis names must not change with the load: each test (and each
# hypothesis example) gives them this many seconds, whatever the learner's limit is.
LIMIT = 10 * TIMEOUT  # 600 s on a quiet machine (the learner's limit grows with the load: tests/_plugin.py)


def give_time():
    """A fresh budget for the variants' runs (tests/_plugin.py, beside the learner's own)."""
    _VARIANTS.budget = LIMIT


def edits_of(drill, name):
    entry = drill.pitfalls.get(name) or drill.mistakes[name]
    return entry.edits


def plant(drill, name, folder):
    """Write the reference with pitfall or mistake `name` planted to folder/<stem>.py; return folder."""
    return plant_edits(drill, edits_of(drill, name), folder, name)


def plant_edits(drill, edits, folder, name="edits"):
    """Write the reference with `edits` ((exact text, replacement), each text found once) to folder/<stem>.py."""
    source = (ROOT / "solutions" / f"{drill.stem}.py").read_text()
    for old, new in edits:
        if source.count(old) != 1:
            raise ValueError(f"{drill.stem}/{name}: {old!r} appears {source.count(old)} times in the reference, "
                             f"not once")
        source = source.replace(old, new)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{drill.stem}.py").write_text(source)
    return folder


def folder():
    """Where this process plants the variants it loads (removed at exit)."""
    global _FOLDER
    if _FOLDER is None:
        _FOLDER = Path(tempfile.mkdtemp(prefix="drills-wrong-"))
        # As root the workers drop to a uid of their own (tests/_grading.py): the variants'
        # worker must read and list the variants planted here (mkdtemp makes the folder 0700).
        _FOLDER.chmod(0o755)
        atexit.register(shutil.rmtree, _FOLDER, ignore_errors=True)
    return _FOLDER


def variant(drill, name):
    """The module of the reference with `name` planted, run in the variants' worker."""
    where = folder() / drill.id / name
    if not (where / f"{drill.stem}.py").exists():
        plant(drill, name, where)
    # One worker serves every variant; it imports the drill's cases (what its arguments are made
    # of: `drill` may be a Planted, which knows no more) and may read the references (E1's
    # variants run on them). Our own code: no contract to hold it to.
    _VARIANTS.prepare(readable=[folder(), ROOT / "solutions"], preload=(f"drills.{drill.id}.cases",))
    return TreeModule(where, drill.stem, _VARIANTS)
