"""A pytest plugin for the grading run: one signed JSON line per test, written as
the run goes. Names no drill.

A line `{"start": nodeid, "pitfalls": [...]}` goes out before each test, so if the
test process dies the grading run still knows which test it was in. Each line is
signed with a key the grading run hands over through a pipe, so a line written by
anything else (the learner's code appending "passed" to the file) is detected.
"""
import hashlib
import hmac
import json
import os
import re
import traceback

import pytest

from _diagnose import DoesNotImport, Mismatch, explain_error, said_error
from _render import INTERPRETER_MARK, LIBRARY_MARK, cleaned
from _worker import LearnerCrash, LearnerTimeout


def sign(key, text):
    return hmac.new(key, text.encode(), hashlib.sha256).hexdigest()


def read_signed(path, key):
    """(records, forged): the lines of a report whose signature checks, and how many do not."""
    records, forged = [], 0
    if not os.path.exists(path):
        return records, forged
    for line in open(path, encoding="utf-8", errors="replace"):
        text, _, mac = line.rstrip("\n").rpartition("\t")
        if text and hmac.compare_digest(sign(key, text), mac):
            records.append(json.loads(text))
        elif line.strip():
            forged += 1
    return records, forged


def _first_leaf(error):
    while isinstance(error, BaseExceptionGroup):  # hypothesis: several distinct failures
        error = error.exceptions[0]
    return error


def classify(error):
    """(kind, message) for a failed test's exception."""
    error = _first_leaf(error)
    chain = [error]
    while chain[-1].__cause__ is not None or chain[-1].__context__ is not None:
        chain.append(chain[-1].__cause__ or chain[-1].__context__)
    if any(isinstance(e, NotImplementedError) for e in chain):
        stub = next(e for e in chain if isinstance(e, NotImplementedError))
        return "not_implemented", str(stub)
    if isinstance(error, DoesNotImport):
        return "import", str(error)
    if isinstance(error, LearnerCrash):
        meaning = explain_error(str(error))
        return "crash", str(error) + (f"\n  which usually means: {meaning}" if meaning else "")
    if isinstance(error, LearnerTimeout):
        return "timeout", str(error)
    if isinstance(error, Mismatch):
        return "mismatch", str(error)
    if isinstance(error, AssertionError):
        return "mismatch", str(error).split("\nassert ")[0]
    message = said_error(error)
    meaning = explain_error(message)
    return "error", message + (f"\n  which usually means: {meaning}" if meaning else "")


def _where(error, tree):
    """Where in the tree's own code the exception was raised."""
    error = _first_leaf(error)
    if getattr(error, "where", None):
        return error.where
    frames = [f for f in traceback.extract_tb(error.__traceback__) if tree and f.filename.startswith(tree)]
    return f"{frames[-1].filename}:{frames[-1].lineno}: {frames[-1].line}" if frames else None


def _variant(item):
    callspec = getattr(item, "callspec", None)
    return callspec.params.get("variant") if callspec else None


# A warning Python printed from a library's file: "<...>/site-packages/<path>:<line>: <Category>: <message>",
# followed by the library's source line, indented.
_LIBRARY_WARNING = re.compile(r"^(?:\S*[/\\])?(?:site|dist)-packages[/\\](\S+?):(\d+): (\w+): (.*)$")


def _mark_library_warnings(lines):
    """Each warning a library printed (Triton's interpreter: a RuntimeWarning of numpy's,
    overflow in exp and the like) as one line marked as not the learner's, its path
    short (triton/runtime/interpreter.py:725) and the library's source line dropped."""
    out, skip_source = [], False
    for line in lines:
        if skip_source and line.startswith("  "):
            skip_source = False
            continue
        match = _LIBRARY_WARNING.match(line)
        skip_source = bool(match)
        if match:
            path, lineno, category, message = match.groups()
            owner = INTERPRETER_MARK if path.startswith("triton/") else LIBRARY_MARK
            line = f"{owner}{path}:{lineno}: {category}: {message}"
        out.append(line)
    return out


def _trim(text, lines=12):
    text = _mark_library_warnings((text or "").strip("\n").splitlines())
    return "\n".join(text[-lines:]) if text else ""


# --- the traceback a learner reads when running a test: the learner's frames, not the machinery's

TESTS = os.path.dirname(os.path.abspath(__file__))


def is_machinery(path):
    """A frame of the shared layer (tests/_*.py) or of a drill's folder (tests/drills/):
    what a learner's traceback need not show. Test files and the learner's tree are kept."""
    path = os.path.abspath(str(path))
    return (os.path.dirname(path) == TESTS and os.path.basename(path).startswith("_")) or \
        path.startswith(os.path.join(TESTS, "drills") + os.sep)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Registered by tests/_plugin.py for every run (not only the grading run's report):
    a failure's traceback loses the machinery's frames (the check's own source, the
    worker's call), since the message already says what the check found; an error the
    learner's code raised in the worker gains a section saying where in their file.
    `pytest --fulltrace` keeps every frame (pytest then does not call the filter)."""
    excinfo = call.excinfo
    original = getattr(item, "_traceback_filter", None)  # pytest's own filter (cut at the test, hidden frames)
    if excinfo is not None and original is not None and not getattr(original, "hides_machinery", False):
        def without_machinery(info):
            traceback = original(info)
            kept = traceback.filter(lambda entry: not is_machinery(entry.path))
            return kept if len(kept) else traceback
        without_machinery.hides_machinery = True
        item._traceback_filter = without_machinery
    report = (yield).get_result()
    where = getattr(_first_leaf(excinfo.value), "where", None) if excinfo is not None else None
    if report.failed and where:
        report.sections.append(("where your code raised it", where))


class Reporter:
    def __init__(self, path, key):
        self.out = open(path, "a", buffering=1, encoding="utf-8")
        self.key = key

    def _write(self, **record):
        # What the learner's code printed or raised (message, where, example, stdout,
        # stderr) leaves the test process as text: no control characters.
        text = json.dumps(cleaned(record))
        self.out.write(f"{text}\t{sign(self.key, text)}\n")

    def pytest_collection_finish(self, session):
        everything = getattr(session.config, "drills_collected", None)  # a shard: the drill's whole collection
        self._write(collected=everything or [item.nodeid for item in session.items],
                    variants=[None] * len(everything) if everything else [_variant(item) for item in session.items])

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item):
        self._write(start=item.nodeid, variant=_variant(item),
                    pitfalls=[m.args[0] for m in item.iter_markers("pitfall")])

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        report = (yield).get_result()
        if report.when == "call" or report.failed or report.skipped:
            record = dict(test=item.nodeid, name=item.name, outcome=report.outcome, variant=_variant(item),
                          pitfall_test=[m.args[0] for m in item.iter_markers("pitfall")],
                          rejects=item.get_closest_marker("rejects") is not None)
            if report.skipped:  # why, so the grade can say which tests it left out
                record["message"] = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            if report.failed and call.excinfo is not None:
                error = call.excinfo.value
                record["kind"], record["message"] = classify(error)
                record["where"] = _where(error, str(item.funcargs.get("tree", "")))
                record["example"] = "\n".join(getattr(_first_leaf(error), "__notes__", []))
                record["pitfalls"] = list(getattr(_first_leaf(error), "pitfalls", []))
                record["undecided"] = list(getattr(_first_leaf(error), "undecided", []))
                record["stdout"], record["stderr"] = _trim(report.capstdout), _trim(report.capstderr)
            self._write(**record)

    def pytest_unconfigure(self):
        self.out.close()
