"""The drills as the commands that must answer at once see them (hint, walkthrough, page,
reset, diff, and every usage error): their ids in the manifest's order and their stems,
read from the files. tests/_manifest.py imports each drill's package, and with it torch
(6-15 s on a busy machine); this reads tests/_manifest.py as text and looks for each
drill's reference, so it imports nothing heavy. tests/test_commands.py checks that it
agrees with the manifest. Names no drill.
"""
import ast
from dataclasses import dataclass

from _tree import ROOT


@dataclass(frozen=True)
class Entry:
    id: str
    stem: str

    @property
    def page(self):
        return f"content/{self.id}.md"


def ids():
    """The drill ids in the manifest's order: the names in `DRILLS = (l1.DRILL, ...)`."""
    tree = ast.parse((ROOT / "tests" / "_manifest.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "DRILLS" for t in node.targets):
            return [element.value.id for element in node.value.elts]
    raise RuntimeError("tests/_manifest.py defines no DRILLS tuple")


def entries():
    """Each drill's id and stem: the stem is its reference's name, solutions/<id>_<...>.py (or
    its stub's, mine/<id>_<...>.py, while a drill is being written)."""
    found = []
    for drill_id in ids():
        stems = [sorted(p.stem for p in (ROOT / tree).glob(f"{drill_id}_*.py")) for tree in ("solutions", "mine")]
        stems = next((s for s in stems if s), [])
        if len(stems) != 1:
            raise RuntimeError(f"solutions/ or mine/ should hold one {drill_id}_*.py, they hold {stems}")
        found.append(Entry(drill_id, stems[0]))
    return found


def drill(key):
    """Look a drill up by id ('l1') or stem ('l1_paged_kv_write'), as tests/_manifest.py's drill() does."""
    known = entries()
    for entry in known:
        if key.lower() == entry.id or key == entry.stem:
            return entry
    raise KeyError(f"no drill {key!r}; known: {', '.join(e.id for e in known)}")
