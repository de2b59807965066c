"""What a drill is, as the shared machinery sees it. Names no drill.

Each drill's folder (tests/drills/<id>/) builds one `Drill` in its __init__.py;
tests/_manifest.py lists them in order. Everything that knows a drill hangs off
its entry here, so the grader, the bench, the pictures and the planted-bug
fixtures reach it through the entry, never by a name spelled in a string.

`Planted` is the part of a drill its own checks need while they diagnose (its
pitfalls and mistakes, and where they are planted and explained): a drill's
`mistakes.py` builds it, its `checks.py` uses it, and its `__init__.py` builds the
`Drill` from it, so no part of a drill imports the entry it is part of.
"""
from dataclasses import dataclass, field, fields
from typing import Callable

ELEMENT_SIZE = {"float16": 2, "bfloat16": 2, "float32": 4}


@dataclass(frozen=True)
class BenchCase:
    name: str
    params: dict
    bytes: int           # fewest bytes through device memory
    flops: int = 0
    graph: bool = False  # short op: time CUDA-graph replays, not single launches


@dataclass(frozen=True)
class Pitfall:
    """A mistake the drill's page names (tagged `pitfall:<name>` there).

    `edits` are (exact text, replacement) pairs that plant it in the reference;
    each text must occur exactly once. Tests marked `@pytest.mark.pitfall(name)`
    exist to catch it, and the diagnosis names it only on evidence. `crashes`: the
    mistake's known symptom is a crash (an offset far outside every tensor), so a
    crash in a test marked with it is evidence; for any other pitfall it is not.
    `races`: on a GPU the mistake's programs write one place in no fixed order, so
    its output there is one of several: a match names it, a mismatch is no evidence
    against it (undecided).
    """
    says: str
    edits: tuple
    crashes: bool = False
    races: bool = False
    interpreter_only: bool = False  # on a GPU the mistake changes nothing (the hardware does what the edit
                                    # removes): planted and graded only under the interpreter
    counts_only: bool = False  # right values, more bytes: only the load counts show it, and they are the
                               # worker's word, which decides no test; so it fails no test, and the traffic
                               # report names it as advice (tests/test_wrong.py checks both)

    def applies(self, interpret):
        return interpret or not self.interpreter_only


@dataclass(frozen=True)
class Mistake:
    """A wrong kernel that is not one of the page's pitfalls (a learner wrote it, or it
    breaks the output contract). The grade must fail it and name NO pitfall; `shows`
    is a phrase its first failure must contain (the structural description)."""
    edits: tuple
    shows: str


@dataclass(frozen=True)
class Planted:
    """A drill's planted mistakes, as the diagnosis (tests/_diagnose.py) and the planting
    (tests/_wrong.py) read them: the reference solutions/<stem>.py is where they are
    planted, `section` the page's section that explains them."""
    id: str
    stem: str
    section: str                  # e.g. "content/l1.md §8"
    pitfalls: dict                # {name: Pitfall}
    mistakes: dict = field(default_factory=dict)  # {name: Mistake}

    def fields(self):
        """Its fields as keyword arguments of `Drill` (not deep-copied, unlike asdict)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class Drill:
    id: str
    stem: str
    title: str
    mirrors: str                 # what it is in vLLM / FlashInfer
    api: tuple                   # public names of the module, in the order the page teaches them
    section: str                 # where the page explains the pitfalls, e.g. "content/l1.md §8"
    test_shapes: dict = field(default_factory=dict)
    pitfalls: dict = field(default_factory=dict)    # {name: Pitfall}
    mistakes: dict = field(default_factory=dict)    # {name: Mistake}
    bench: tuple = ()            # BenchCase, ...
    bench_work: Callable = None  # (module, params, device, n_sets) -> (ours, {name: (baseline, graph_safe)})
    bench_run: Callable = None   # (module, start) -> [case result]: a bench that is one long run (a whole
                                 # generate), timed once by the drill itself instead of the cases above,
                                 # start() once warm (tests/_bench.py's bench_drill says what it does);
                                 # each row {name, unit, ours: {us, rate}, baselines: {name: {us, rate}}, tier}
    picture: Callable = None     # (module, console) -> None: run the learner's code on a small case and draw it
    draw_case: Callable = None   # (saved case, console) -> None: draw a failing case the tests saved
    page_checks: tuple = ()      # functions(page text) that recompute every number the page works out
    fixture_checks: tuple = ()   # functions(device) that check the drill's own case builders
    torch_only: tuple = ()       # functions of the contract written in plain PyTorch (no kernel need run)
    traffic: Callable = None     # (module) -> dict: its traffic case's bytes against the fewest (tests/_traffic.py)
    writes: dict = field(default_factory=dict)  # {function: names of the arguments it writes}; the others it
                                                # only reads, and the worker's call fails if one comes back changed
    milestones: dict = field(default_factory=dict)  # {test name: a line the grade prints when it passes}
    preload: tuple = ()          # modules of ours the worker imports before it is confined: what the drill's
                                 # arguments are made of (a class of its cases), since tests/ is closed to it after

    @property
    def page(self):
        return f"content/{self.id}.md"

    @property
    def files(self):
        return (self.page, f"mine/{self.stem}.py", f"solutions/{self.stem}.py", f"tests/test_{self.stem}.py")

    @property
    def contract(self):
        """{function: (its parameter names, the names it writes)} for tests/_worker.py, the
        names read from the reference's signatures."""
        from _tree import parameters
        return {fn: (names, tuple(self.writes.get(fn, ()))) for fn, names in parameters(self.stem).items()}

    @property
    def planted(self):
        return Planted(self.id, self.stem, self.section, self.pitfalls, self.mistakes)
