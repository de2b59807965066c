"""The traffic report: bytes a drill's kernels moved (counted by tests/_counting.py,
in the worker, under the CPU interpreter) against the fewest the op needs. Names no
drill: each drill's traffic.py describes its parts and its sentences.
"""
import hashlib
import json
import os
import re
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import _env
from _counting import bytes_of, measure_here
from _diagnose import Mismatch
from _process import run_process
from _worker import TreeModule, flatten_tensors


def was_read(record, view):
    """Whether any byte of `view` (a view of the tensor `record` measured) was loaded."""
    where = bytes_of(view)
    return bool(len(where)) and bool((record.read[where] > 0).any())


# The counts are made in the worker, beside the learner's code, which can rewrite them
# (design.md, "The learner's code is untrusted"): they explain a failure and fill the
# traffic report, and decide no test. Every sentence built on them says so.
COUNTS_WORD = "counted in the worker, beside your code: its word, which decides no test"


@contextmanager
def values_decide(counted, explain):
    """Around the check of a measured call's values, which alone decide: a Mismatch raised
    inside goes on, and only then does `explain(counted)` read the worker's counts, a list
    of (sentence, pitfall or None), added to it with their status said. When the values
    are right the counts are not even read: a kernel that reads what it should not but
    answers right passes here, and the traffic report names what it read, as advice."""
    try:
        yield
    except Mismatch as error:
        try:
            findings = explain(counted) if counted is not None else []
        except Exception:  # counts the worker shaped into nonsense explain nothing
            findings = []
        if not findings:
            raise
        said = "".join(f"\n  the load counts also say: {sentence} ({COUNTS_WORD})" for sentence, _ in findings)
        named = [p for _, p in findings if p and p not in error.pitfalls]
        raise Mismatch(f"{error}{said}", [*error.pitfalls, *named], error.undecided) from error


def measure(module, name, *args, **kwargs):
    """module.name(*args, **kwargs) under measurement: (result, Traffic). `module` is what
    the `drill` fixture gives (a worker proxy: the counting happens in the worker, where
    the learner's code runs) or an imported module. On a GPU there is nothing to count:
    (None, None), without running anything (a traffic case's tensors are CPU tensors)."""
    if not _env.INTERPRET:
        return None, None
    if isinstance(module, TreeModule):
        return module._worker.call(module._tree, module._stem, name, args, kwargs, traffic=True,
                                   contract=module._contract)
    return measure_here(getattr(module, name), flatten_tensors((args, kwargs)), *args, **kwargs)


# ---------------------------------------------------------------------------
# The report: measured bytes against the fewest the op needs

ROOFLINE, FAIR = 1.05, 1.5  # tiers, like the bandwidth report's


@dataclass
class Part:
    """One line item: `label` (the drill's words), the argument indices (or "scratch")
    it sums, and the fewest bytes it must load and store."""
    label: str
    keys: tuple
    fewest_loaded: int = 0
    fewest_stored: int = 0


def _sum(traffic, keys, attr):
    total = 0
    for key in keys:
        record = traffic.scratch if key == "scratch" else traffic.tensors[key]
        total += getattr(record, attr)
    return total


def report(drill_id, traffic, parts, where=()):
    """A dict the grade shows: ratios (measured over fewest), a tier and a one-line summary.
    `where`: the drill's sentences saying where extra bytes went (may be empty)."""
    fewest_loads = sum(p.fewest_loaded for p in parts)
    fewest_stores = sum(p.fewest_stored for p in parts)
    # Every byte counts against the op, including bytes outside every tensor.
    loads = traffic.loaded / fewest_loads if fewest_loads else 1.0
    stores = traffic.stored / fewest_stores if fewest_stores else 1.0
    items = [(p.label, _sum(traffic, p.keys, "loaded") / p.fewest_loaded) for p in parts if p.fewest_loaded]
    stored_items = [(p.label, _sum(traffic, p.keys, "stored") / p.fewest_stored) for p in parts if p.fewest_stored]
    worst = max(loads, stores)
    if min(loads, stores) < 0.95:
        tier = "not all counted"
        where = [*where, "fewer bytes than this count expects went through Triton kernels: part of the work may "
                         "have run elsewhere (a PyTorch op is not counted), or the kernel skips a step the count "
                         "expects"]
    else:
        tier = "at the roofline" if worst <= ROOFLINE else "fair" if worst <= FAIR else "wasteful"
    if traffic.outside.loaded or traffic.outside.stored:
        where = [*where, f"{traffic.outside.loaded + traffic.outside.stored} bytes were moved outside every tensor"]

    def fmt(ratio):
        return f"{ratio:.2f}×" if ratio < 10 else f"{ratio:.0f}×"
    line = (f"{drill_id.upper()}  loads {fmt(loads)} the fewest bytes ("
            + ", ".join(f"{label} {fmt(r)}" for label, r in items) + ")"
            + f" · stores {fmt(stores)}"
            + (" (" + ", ".join(f"{label} {fmt(r)}" for label, r in stored_items) + ")" if len(stored_items) > 1
               else "")
            + f" · {tier}")
    # Each part's share of the fewest loads: the total is a byte-weighted mean, so the
    # big tensors set it and a small one read several times over barely moves it.
    shares = {p.label: p.fewest_loaded / fewest_loads for p in parts if p.fewest_loaded}
    return dict(loads=loads, stores=stores, parts=dict(items), stored_parts=dict(stored_items), shares=shares, tier=tier,
                where=list(where), line=line, loaded=traffic.loaded, stored=traffic.stored,
                fewest_loaded=fewest_loads, fewest_stored=fewest_stores)


# ---------------------------------------------------------------------------
# The grade's traffic line, computed in a process of its own (the learner's code may crash)


def check_page_line(text, drill_id, result):
    """The traffic line a page shows (`L2  loads ...`, on a line of its own) is the one
    `result` gives: the drill's `traffic` run on its reference (None on a GPU)."""
    shown = re.search(rf"^({drill_id.upper()}  loads .*)$", text, re.M).group(1)
    assert result is None or shown == result["line"], f"the page shows {shown!r}, the reference gives {result['line']!r}"


def in_subprocess(drill, tree, test_timeout=None):
    """The drill's traffic report for `tree` as a dict, or dict(error=...) ; None without
    a traffic case or on a GPU. Run in a process of its own (tests/_entry.py), since the
    learner's code may crash. The report comes back through a file this process made and
    handed over as a descriptor, not on the output the learner's prints share (a print
    left without its newline would run into it)."""
    if drill.traffic is None or not _env.INTERPRET:
        return None
    limit = test_timeout or float(os.environ.get("DRILLS_TIMEOUT", 60))
    with tempfile.TemporaryFile() as result:
        # The learner's code obeys the grade's limit here too; the rest is this process's start and its worker's.
        code, out, err = run_process([sys.executable, "tests/_entry.py", "traffic", drill.id, str(tree)], 90 + limit,
                                     {"DRILLS_TIMEOUT": str(limit), "DRILLS_TRAFFIC_FD": str(result.fileno())},
                                     pass_fds=(result.fileno(),))
        result.seek(0)
        written = result.read()
    if code != 0:
        tail = (err or out or "").strip().splitlines()[-1:] or ["no output"]
        return dict(error=f"the traffic case did not run ({'timed out' if code is None else f'exit {code}'}): "
                          f"{tail[0][:200]}")
    try:
        report = json.loads(written)
    except ValueError:
        report = "unreadable"
    return report if report is None or isinstance(report, dict) else dict(error="the traffic case wrote no report")


def with_reference(drill, tree, reference, test_timeout=None):
    """in_subprocess for `tree`, with the `reference` tree's line for the same case beside
    it (result["reference"]), so a learner can tell their ratios from the page's. The
    reference's line is kept in .drills/ (keyed by the reference's and the drill's files),
    so a grade runs only the learner's case."""
    result = in_subprocess(drill, tree, test_timeout)
    if result is not None and Path(tree).resolve() != Path(reference).resolve():
        result["reference"] = _reference_line(drill, reference)
    return result


def _reference_line(drill, reference):
    root = Path(__file__).resolve().parent
    key = hashlib.sha1()
    for path in [Path(reference) / f"{drill.stem}.py", *sorted((root / "drills" / drill.id).glob("*.py")),
                 root / "_traffic.py", root / "_counting.py"]:
        key.update(path.read_bytes() if path.is_file() else b"")
    cache = root.parent / ".drills" / f"traffic-{drill.id}-{key.hexdigest()[:16]}.json"
    if cache.is_file():
        return json.loads(cache.read_text()).get("line")
    theirs = in_subprocess(drill, reference)
    if theirs and "line" in theirs:
        cache.parent.mkdir(exist_ok=True)
        cache.write_text(json.dumps(dict(line=theirs["line"])))
    return theirs.get("line") if theirs else None

