"""Known-wrong solutions: the reference with exactly one pitfall planted.

tests/wrong/<stem>.py maps each pitfall named on the drill's page to what the
mistake is (`says`) and the edits that plant it in solutions/<stem>.py.
Keeping edits instead of whole copies means a change to the reference carries
over to every variant, and an edit that no longer applies fails loudly instead
of silently testing nothing.

The diagnosis runs these variants on a learner's failing input: if the
learner's output is bit for bit a variant's, that variant's mistake is named.
"""
import importlib.util
import tempfile
from pathlib import Path

from _tree import ROOT, load_drill

_FOLDER = None  # where this process plants the variants it loads


def _catalogue(stem):
    path = ROOT / "tests" / "wrong" / f"{stem}.py"
    if not path.exists():
        return None
    spec = importlib.util.spec_from_file_location(f"wrong_{stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def pitfalls(stem):
    """{pitfall name: {"says": ..., "edits": [(old, new), ...]}}, or {} if none yet."""
    catalogue = _catalogue(stem)
    return catalogue.PITFALLS if catalogue else {}


def section(stem):
    """Where the drill's page explains its pitfalls, e.g. 'content/l1.md §8'."""
    return _catalogue(stem).SECTION


def plant(stem, pitfall, folder):
    """Write the reference with `pitfall` planted to folder/<stem>.py; return folder."""
    source = (ROOT / "solutions" / f"{stem}.py").read_text()
    for old, new in pitfalls(stem)[pitfall]["edits"]:
        if source.count(old) != 1:
            raise ValueError(f"{stem}/{pitfall}: {old!r} appears {source.count(old)} times in the reference, not once")
        source = source.replace(old, new)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{stem}.py").write_text(source)
    return folder


def variant(stem, pitfall):
    """The module of the reference with `pitfall` planted, loaded once per process."""
    global _FOLDER
    if _FOLDER is None:
        _FOLDER = Path(tempfile.mkdtemp(prefix="drills-wrong-"))
    folder = _FOLDER / pitfall
    if not (folder / f"{stem}.py").exists():
        plant(stem, pitfall, folder)
    return load_drill(str(folder), stem)
