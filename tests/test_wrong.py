"""The tests catch every pitfall: each known-wrong solution fails its drill."""
import re
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from _manifest import DRILLS
from _tree import ROOT
from _wrong import pitfalls, plant

sys.path.insert(0, str(ROOT))
import grader  # noqa: E402

CASES = [(d, name) for d in DRILLS for name in pitfalls(d.stem)]


@pytest.fixture(scope="module")
def grades(tmp_path_factory):
    """Grade every planted bug once, two at a time (each grade is its own process)."""
    def grade(case):
        drill, name = case
        tree = plant(drill.stem, name, tmp_path_factory.mktemp(name))
        return (drill.id, name), grader.grade_drill(drill, tree, timeout=300)

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(pool.map(grade, CASES))


@pytest.mark.parametrize("case", CASES, ids=[f"{d.id}-{n}" for d, n in CASES])
def test_planted_bug_fails_the_drill(grades, case):
    drill, name = case
    summary = grades[drill.id, name]
    assert summary["status"] == "failing", f"{name} planted in {drill.stem} was not caught: {summary}"


@pytest.mark.parametrize("drill", DRILLS, ids=lambda d: d.id)
def test_every_pitfall_on_the_page_has_a_wrong_solution(drill):
    named = set(re.findall(r"`pitfall:(\w+)`", (ROOT / drill.page).read_text()))
    assert named == set(pitfalls(drill.stem)), "pitfalls on the page vs tests/wrong/" + drill.stem + ".py"
