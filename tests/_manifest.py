"""The drills, in order. The front reads this list (the grader, the test plugin, the
entry points of the bench and the traffic line; the README table is checked against
it); the shared layer never does. A drill is its own folder, tests/drills/<id>/, whose
__init__.py builds its entry (`DRILL`); adding a drill is adding it to the import and
the tuple below.
"""
from drills import e1, e2, f1, l1, l2, l3, l4, l5, l6, l7, l8

DRILLS = (l1.DRILL, l2.DRILL, l3.DRILL, f1.DRILL, l4.DRILL, l5.DRILL, l6.DRILL, l7.DRILL, l8.DRILL, e1.DRILL, e2.DRILL)

BY_ID = {d.id: d for d in DRILLS}
BY_STEM = {d.stem: d for d in DRILLS}


def drill(key):
    """Look a drill up by id ('l1') or stem ('l1_paged_kv_write')."""
    found = BY_ID.get(key.lower()) or BY_STEM.get(key)
    if found is None:
        raise KeyError(f"no drill {key!r}; known: {', '.join(BY_ID)}")
    return found
