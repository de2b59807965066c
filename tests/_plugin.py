"""The seam between the shared tests and a tree (a pytest plugin that
pyproject.toml loads with `-p _plugin`). Names no drill.

`--tree` / DRILLS_TREE choose mine/ (default), solutions/ or a folder; tests get
the drill module from the `drill` fixture, which runs it in a worker process
(tests/_worker.py), and never import a tree themselves.
"""
import functools
import os
import sys
import zlib
from pathlib import Path

# One thread per process, set before torch and numpy load their thread pools: the test
# tensors are tiny, and a session runs several processes at once (the tests, the
# learner's worker, the planted-bug grading and its worker). On 2 cores, pools of 2
# threads each spun against each other: the suite took 115-123 s, with one thread 98 s.
for _pool in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_pool, "1")

# The learner's limit per test (tests/_worker.py's TIMEOUT: DRILLS_TIMEOUT, else 60 s) is
# for a machine that is not busy. On a busy one (the 1-minute load average above the number
# of cores) the same code takes longer, and a verdict may take longer, never change: unless
# DRILLS_TIMEOUT is set, the limit grows with the load (up to 10x), set here before
# tests/_worker.py reads it, so every message that states it states the limit applied.
def limit_under_load(load, cores, quiet=60):
    """The learner's limit per test, in seconds, on a machine this busy: `quiet` (tests/_worker.py's
    default) times the load over the cores, at least 1x and at most 10x."""
    return round(quiet * min(10.0, max(1.0, load / max(1, cores))))


def scale_the_limit(environ, load, cores):
    """Set DRILLS_TIMEOUT in `environ` to the limit under this load, unless it is set or the
    machine is not busy."""
    if "DRILLS_TIMEOUT" not in environ and load > cores:
        environ["DRILLS_TIMEOUT"] = str(limit_under_load(load, cores))


scale_the_limit(os.environ, os.getloadavg()[0], os.cpu_count() or 1)

# A grading run plans this process's worker: started first, its imports overlap ours.
from _process import start_planned_worker  # noqa: E402  -- imports no torch
_PLANNED = start_planned_worker()

import _env  # noqa: E402  -- first of ours: sets TRITON_INTERPRET before anything imports Triton
import pytest
from hypothesis import HealthCheck, Phase, settings

from _manifest import BY_STEM, DRILLS
from _paged import release_big_memory
from _tree import ROOT, default_tree, tree_path, worker_trees
import _wrong
from _diagnose import REFUSED, Mismatch, does_not_import
from _process import become_subreaper
from _worker import ISOLATE, WORKER, calls_made, end_strays, reset_all, stop_all, tree_module

WORKER.planned = _PLANNED  # taken by the `drill` fixture's first call if the plan was right, else ended

# Under the CPU interpreter every Triton program runs in Python: few, small examples.
_common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
               print_blob=True)
# No shrinking: it would rerun the learner's code hundreds of times (and eat the test's
# time limit), while the failure message already says which token, head or block is wrong.
_common["phases"] = (Phase.explicit, Phase.reuse, Phase.generate)
settings.register_profile("cpu", max_examples=20, **_common)
# On a GPU nearly every random example meets a specialisation no example before it met, so
# an example there is mostly a Triton compile (BENCHMARKS.md, "Grade time on the H200"):
# 100 of them made a drill's grade take minutes. 24: a few more than the interpreter's,
# split evenly over 2, 3, 4, 6 or 8 grading shards.
settings.register_profile("gpu", max_examples=24, **_common)
settings.register_profile("quick", max_examples=5, **_common)  # planted bugs
settings.load_profile(os.environ.get("DRILLS_HYPOTHESIS_PROFILE", "cpu" if _env.INTERPRET else "gpu"))


def pytest_addoption(parser):
    parser.addoption("--tree", default=None,
                     help="which drill modules to test: mine (default), solutions, or a folder (also DRILLS_TREE)")
    parser.addoption("--drills-report", default=None, help="(grading run) write signed JSON lines to this file")
    parser.addoption("--drills-key-fd", type=int, default=None, help="(grading run) read the signing key here")
    parser.addoption("--drills-variants", default=None,
                     help="(planted-bug run) a folder of <stem>/<name>/<stem>.py trees: run each against the tests "
                          "that can reveal it")
    parser.addoption("--drills-shard", default=None, metavar="I/K",
                     help="(grading run) run shard I of K: every K-th test, and each hypothesis test with 1/K of "
                          "its examples (the other shards, in processes of their own, draw the rest)")


def pytest_configure(config):
    become_subreaper()  # a learner's process that detaches from its worker is re-parented here, and ended
    for d in DRILLS:
        config.addinivalue_line("markers", f"{d.id}: drill {d.id.upper()}, {d.title} (pytest -m {d.id})")
    config.addinivalue_line("markers", "meta: checks of the repository itself (stubs, pages, grader)")
    config.addinivalue_line("markers", "pitfall(name): the test exists to catch this pitfall of the drill's page")
    config.addinivalue_line("markers", "mistake(name): the test exists to catch this other planted mistake of the drill")
    config.addinivalue_line("markers", "launches_nothing: the test's calls have nothing to do, so no kernel need run")
    config.addinivalue_line("markers", "rejects: the test passes when the learner's code refuses bad input (set by "
                                       "the plugin on a test whose pass was an expected ValueError); the grade "
                                       "counts it only once the drill's worked example passes")
    if config.getoption("--drills-shard"):
        config.pluginmanager.register(Shard(config.getoption("--drills-shard")), "drills-shard")
    import _report
    config.pluginmanager.register(_report, "drills-tracebacks")  # the learner's frames, not the machinery's
    if config.getoption("--drills-report"):

        fd = config.getoption("--drills-key-fd")
        key = os.read(fd, 256) if fd is not None else b""
        if fd is not None:
            os.close(fd)
        config.pluginmanager.register(_report.Reporter(config.getoption("--drills-report"), key), "drills-report")


def _variants(config, stem):
    """The planted bugs of the drill with this stem (--drills-variants)."""
    root = config.getoption("--drills-variants")
    folder = Path(root) / stem if root else None
    return sorted(p.name for p in folder.iterdir() if p.is_dir()) if folder and folder.is_dir() else []


def pytest_generate_tests(metafunc):
    names = _variants(metafunc.config, metafunc.definition.path.stem.removeprefix("test_"))
    if names and "variant" in metafunc.fixturenames:
        metafunc.parametrize("variant", names, scope="module")


def pytest_collection_modifyitems(config, items):
    for item in items:
        stem = item.path.stem.removeprefix("test_")
        item.add_marker(BY_STEM[stem].id if stem in BY_STEM else "meta")
    if not config.getoption("--drills-variants"):
        return
    # A planted pitfall runs against the tests marked with it and the page's worked
    # example; any other planted mistake against the worked example, every test marked
    # with any pitfall (the fixed cases that exist to catch mistakes) and the tests
    # marked with that mistake (a case only some machines need, such as a GPU's).
    keep, drop = [], []
    for item in items:
        callspec = getattr(item, "callspec", None)
        name = callspec.params.get("variant") if callspec else None
        stem = item.path.stem.removeprefix("test_")
        drill = BY_STEM.get(stem)
        if name is None or drill is None:
            drop.append(item)
            continue
        marked = {m.args[0] for m in item.iter_markers("pitfall")}
        for_mistake = {m.args[0] for m in item.iter_markers("mistake")}
        if (name not in drill.pitfalls and marked) or name in marked or name in for_mistake \
                or "worked_example" in item.name:
            keep.append(item)
        else:
            drop.append(item)
    config.hook.pytest_deselected(items=drop)
    items[:] = keep


class Shard:
    """--drills-shard I/K: keep this shard's part of the drill's tests (tests/_grading.py runs
    the K shards at once, each with its own worker: on a GPU most of a grade is compiling
    the kernels its examples specialise, one core at a time). A test belongs to the shard
    its node id hashes to (the same in every shard, and after a restart that deselects the
    tests already run); a hypothesis test runs in every shard with 1/K of its examples
    (rounded up), each shard drawing its own, so the K together run at least as many as one
    process would. The report still lists the whole collection. Last of the collection
    hooks: after -m, -k and --deselect have chosen the tests."""

    def __init__(self, spec):
        self.index, self.count = map(int, spec.split("/"))

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config, items):
        config.drills_collected = [item.nodeid for item in items]
        keep, drop, divided = [], [], set()
        for item in items:
            test = getattr(getattr(item, "obj", None), "hypothesis", None) and item.obj
            if test:
                if test not in divided:  # a parametrized test's items share one function
                    divided.add(test)
                    current = getattr(test, "_hypothesis_internal_use_settings", None) or settings.default
                    test._hypothesis_internal_use_settings = settings(
                        current, max_examples=max(1, -(-current.max_examples // self.count)))
                keep.append(item)
            else:
                mine = zlib.crc32(item.nodeid.encode()) % self.count == self.index
                (keep if mine else drop).append(item)
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_collection_finish(session):
    # Grading the planted bugs takes a test process of its own for a minute or more: start
    # it now, so that it runs beside the other tests rather than after them.
    if any("planted_grades" in getattr(item, "fixturenames", ()) for item in session.items):
        import _grading

        _grading.start_grading(DRILLS)


def pytest_runtest_setup(item):
    reset_all(calls=True)  # each test gets its own time for the learner's code
    _wrong.give_time()     # and the planted variants theirs: our code, whose runs take longer under load
    REFUSED.clear()
    _per_example_budget(item)


def _per_example_budget(item):
    """A hypothesis test runs the learner's code once per example (100 on a GPU, each a new
    kernel specialisation to compile): each example, not the whole test, gets the time
    limit, so that a slow compile cannot fail a right kernel while a hang still fails."""
    hypothesis_test = getattr(getattr(item, "obj", None), "hypothesis", None)
    inner = getattr(hypothesis_test, "inner_test", None)
    if inner is None or getattr(inner, "_drills_budget", False):
        return

    @functools.wraps(inner)
    def each_example(*args, **kwargs):
        reset_all()
        _wrong.give_time()
        return inner(*args, **kwargs)
    each_example._drills_budget = True
    hypothesis_test.inner_test = each_example  # hypothesis's documented hook for wrapping a test


NO_TRITON = ("your function returned the right answer but no Triton kernel ran; the drill is to write it in "
             "Triton ({function}: {calls} call(s), 0 kernel launches)")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """A drill's kernel test that passed fails after all if none of the drill's kernel
    functions it called launched a Triton kernel (a right answer in plain PyTorch is not
    the drill). Counted in the learner's worker (tests/_launches.py); the functions the
    contract writes in plain PyTorch (`Drill.torch_only`) are exempt."""
    result = yield
    if REFUSED:  # it passed by refusing bad input: progress only once the worked example passes
        item.add_marker("rejects")
    drill = BY_STEM.get(item.path.stem.removeprefix("test_"))
    if drill is None or not ISOLATE or item.get_closest_marker("launches_nothing"):
        return result
    kernels = {name: counts for name, counts in calls_made().items() if name not in drill.torch_only}
    if kernels and not any(launched for _, launched in kernels.values()):
        name, (calls, _) = next(iter(kernels.items()))
        raise Mismatch(NO_TRITON.format(function=f"{name}()", calls=calls))
    return result


SKIPPED_AFTER_CALL = ("this test skipped after your code ran ({reason}): a skip is allowed only for a reason the "
                      "reference's run has too (no GPU, the interpreter), so one your code's run caused counts as a "
                      "failure")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A skip is not a pass: a test that skips after the learner's code ran in it (a count
    that did not come back, a resource its run used up) fails instead. The skips the
    reference has too (no GPU, the interpreter) are decided before any call."""
    report = yield
    if report.skipped and call.when == "call" and calls_made() and ISOLATE \
            and BY_STEM.get(item.path.stem.removeprefix("test_")) is not None:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = SKIPPED_AFTER_CALL.format(reason=reason.removeprefix("Skipped: "))
    return report


def pytest_runtest_teardown(item):
    end_strays()  # nothing the learner's code started outlives the test
    release_big_memory()


def pytest_sessionfinish(session):
    stop_all()


@pytest.fixture(scope="session")
def tree(request):
    """The path of the tree under test."""
    return tree_path(request.config.getoption("--tree") or default_tree())


@pytest.fixture(scope="module")
def variant():
    """The planted bug under test (--drills-variants); None in a normal run."""
    return None


@pytest.fixture(scope="module")
def drill(request, tree, variant):
    """The module of this test file's drill, from the chosen tree (or planted variant),
    run in a worker process."""
    stem = request.path.stem.removeprefix("test_")
    if variant is not None:
        tree = Path(request.config.getoption("--drills-variants")) / stem / variant
    path = Path(tree) / f"{stem}.py"
    if not path.is_file():
        pytest.fail(f"{path} does not exist: make reset DRILL={BY_STEM[stem].id} restores the stub", pytrace=False)
    # What the worker may read: the tree under test (all planted variants at once, so that one
    # worker serves them), the session's tree, and the kernels E1 runs on (make grade KERNELS=).
    readable = worker_trees(Path(tree).parent if variant is not None else tree, request.getfixturevalue("tree"))
    entry = BY_STEM[stem]
    module = tree_module(tree, stem, contract=entry.contract, readable=readable, preload=entry.preload)
    if ISOLATE:
        _imports(request, path)
    return module


def _imports(request, path):
    """The first question of a drill's file, asked in its worker (the import is the learner's
    code) before any test calls it: does it import? If not, this test fails saying so in
    one line, with the line and a caret (tests/_report.py's kind "import"), and every other
    test of the module fails at once the same way (a module fixture's error is kept); a
    grading run of one tree stops there: nothing else of the drill runs."""
    try:  # a module's __dir__: every module has one, and its answer is plain data
        WORKER.call(path.parent, path.stem, "__dir__", (), {})
        WORKER.calls.pop("__dir__", None)  # not a call of the drill's (the launch count, a skip after a call)
    except Exception as error:
        if str(error).startswith("the worker process could not start"):  # the machinery's, not the file's
            raise
        if request.config.getoption("--drills-report") and not request.config.getoption("--drills-variants"):
            request.session.shouldfail = "the file does not import"  # exit status 1, as for -x
        shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        raise does_not_import(shown, error) from None


@pytest.fixture(scope="session")
def device():
    return _env.DEVICE


if __name__ == "__main__":  # pragma: no cover
    sys.exit("this is a pytest plugin: pyproject.toml loads it with -p _plugin")
