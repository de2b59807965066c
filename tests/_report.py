"""A pytest plugin for the grader: one JSON line per test, written as the run goes.

A line `{"start": nodeid, "pitfalls": [...]}` goes out before each test, so if
the process dies (a segfault, an illegal memory access, a hang killed by the
grader) the grader still knows which test it was in, and which pitfalls that
test exists to catch (its `@pytest.mark.pitfall(...)` marks).
"""
import json
import traceback

import pytest

from _diagnose import Mismatch, explain_error


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
    if isinstance(error, Mismatch):
        return "mismatch", str(error)
    if isinstance(error, AssertionError):
        return "mismatch", str(error).split("\nassert ")[0]
    message = f"{type(error).__name__}: {error}"
    meaning = explain_error(message)
    return "error", message + (f"\n  which usually means: {meaning}" if meaning else "")


def _where(error, tree):
    """The last line of the tree's own code that the exception passed through."""
    frames = [f for f in traceback.extract_tb(_first_leaf(error).__traceback__) if f.filename.startswith(tree)]
    return f"{frames[-1].filename}:{frames[-1].lineno}: {frames[-1].line}" if frames else None


class Reporter:
    def __init__(self, path):
        self.out = open(path, "a", buffering=1)

    def _write(self, **record):
        self.out.write(json.dumps(record) + "\n")

    def pytest_collection_finish(self, session):
        self._write(collected=len(session.items))

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item):
        self._write(start=item.nodeid, pitfalls=[m.args[0] for m in item.iter_markers("pitfall")])

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        report = (yield).get_result()
        if report.when == "call" or report.failed or report.skipped:
            record = dict(test=item.nodeid, name=item.name, outcome=report.outcome)
            if report.failed and call.excinfo is not None:
                error = call.excinfo.value
                record["kind"], record["message"] = classify(error)
                tree = str(item.config.getoption("--tree") or "")
                record["where"] = _where(error, str(item.funcargs.get("tree", tree)))
                record["example"] = "\n".join(getattr(_first_leaf(error), "__notes__", []))
                record["pitfalls"] = list(getattr(_first_leaf(error), "pitfalls", []))
            self._write(**record)

    def pytest_unconfigure(self):
        self.out.close()
