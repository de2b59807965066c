"""The seam between the shared tests and a tree (a pytest plugin that
pyproject.toml loads with `-p _plugin`).

`--tree` / DRILLS_TREE choose mine/ (default), solutions/ or a folder; tests get
the drill module from the `drill` fixture and never import a tree themselves.
"""
import os

import _env  # noqa: F401  -- first: sets TRITON_INTERPRET before anything imports Triton
import pytest
from hypothesis import HealthCheck, settings

from _manifest import BY_STEM, DRILLS
from _tree import default_tree, load_drill, tree_path

# Under the CPU interpreter every Triton program runs in Python: few, small examples.
_common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
               print_blob=True)
settings.register_profile("cpu", max_examples=20, **_common)
settings.register_profile("gpu", max_examples=100, **_common)
settings.register_profile("quick", max_examples=5, **_common)  # the grader's own tests
settings.load_profile(os.environ.get("DRILLS_HYPOTHESIS_PROFILE", "cpu" if _env.INTERPRET else "gpu"))


def pytest_addoption(parser):
    parser.addoption("--tree", default=None,
                     help="which drill modules to test: mine (default), solutions, or a folder (also DRILLS_TREE)")
    parser.addoption("--drills-report", default=None, help="(grader) write one JSON line per test to this file")


def pytest_configure(config):
    for d in DRILLS:
        config.addinivalue_line("markers", f"{d.id}: drill {d.id.upper()}, {d.title} (pytest -m {d.id})")
    config.addinivalue_line("markers", "meta: checks of the repository itself (stubs, pages, grader)")
    config.addinivalue_line("markers", "pitfall(name): the test exists to catch this pitfall of the drill's page")
    if config.getoption("--drills-report"):
        import _report

        config.pluginmanager.register(_report.Reporter(config.getoption("--drills-report")), "drills-report")


def pytest_collection_modifyitems(items):
    for item in items:
        stem = item.path.stem.removeprefix("test_")
        item.add_marker(BY_STEM[stem].id if stem in BY_STEM else "meta")


@pytest.fixture(scope="session")
def tree(request):
    """The path of the tree under test."""
    return tree_path(request.config.getoption("--tree") or default_tree())


@pytest.fixture(scope="module")
def drill(request, tree):
    """The module of this test file's drill, imported from the chosen tree."""
    stem = request.path.stem.removeprefix("test_")
    return load_drill(str(tree), stem)


@pytest.fixture(scope="session")
def device():
    return _env.DEVICE
