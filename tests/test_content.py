"""The content pages cannot rot: every number the code can check is checked here.

Conventions every page follows (content/README in words, here in code):
- numbered sections are `## N. title`; "content/<id>.md §N" anywhere in the code
  must name one of them;
- a citation of the reference is a link `[solutions/<stem>.py:A-B](../solutions/<stem>.py#LA-LB)`
  followed by a ```python block that reproduces exactly lines A..B;
- each pitfall is tagged `pitfall:<name>`;
- a number quoted from BENCHMARKS.md stands on a line that says so, and is in BENCHMARKS.md.
Then, per page, the worked examples and self-test answers against the references.
"""
import math
import re

import pytest

from _manifest import DRILLS
from _tree import ROOT

PAGES = {d.id: ROOT / d.page for d in DRILLS}
CITATION = re.compile(r"\[(solutions/\w+\.py):(\d+)-(\d+)\]\(\.\./\1#L\2-L\3\)\s*\n```python\n(.*?)```", re.S)


def page(drill_id):
    return PAGES[drill_id].read_text()


def sections(text):
    return {int(n) for n in re.findall(r"^## (\d+)\. ", text, re.M)}


@pytest.mark.parametrize("drill_id", list(PAGES))
def test_citations_reproduce_the_cited_lines(drill_id):
    text = page(drill_id)
    cited = CITATION.findall(text)
    assert cited, f"{PAGES[drill_id]} cites no line range of its solution"
    assert len(cited) == text.count("](../solutions/"), "a citation link is not followed by its ```python block"
    for path, first, last, shown in cited:
        lines = (ROOT / path).read_text().splitlines()[int(first) - 1:int(last)]
        assert shown.rstrip("\n").splitlines() == lines, (
            f"{PAGES[drill_id].name} cites {path}:{first}-{last}, but the block it shows is not those lines now")


def test_section_references_point_at_real_sections():
    sources = [*ROOT.glob("mine/*.py"), *ROOT.glob("solutions/*.py"), *ROOT.glob("tests/*.py"),
               *ROOT.glob("content/*.md")]
    for source in sources:
        for drill_id, number in re.findall(r"content/(\w+)\.md §(\d+)", source.read_text()):
            assert int(number) in sections(page(drill_id)), f"{source.name} points at {drill_id}.md §{number}"


@pytest.mark.parametrize("drill_id", list(PAGES))
def test_page_has_a_picture_pitfalls_and_self_tests(drill_id):
    text = page(drill_id)
    assert "```mermaid" in text
    assert re.search(r"`pitfall:\w+`", text)
    assert "自测" in text


@pytest.mark.parametrize("drill_id", list(PAGES))
def test_benchmark_numbers_are_the_measured_ones(drill_id):
    bench = (ROOT / "BENCHMARKS.md").read_text()
    quoted = [line for line in page(drill_id).splitlines() if "BENCHMARKS.md" in line]
    numbers = [n for line in quoted for n in re.findall(r"(\d[\d.,]*) ?(?:GB/s|µs|%|×)", line)]
    for number in numbers:
        assert number in bench, f"{drill_id}.md quotes {number} from BENCHMARKS.md, which does not hold it"


def test_readme_table_lists_every_drill_in_order():
    readme = (ROOT / "README.md").read_text()
    rows = re.findall(r"^\| (\w+) \| \[([^\]]+)\]\((content/\w+\.md)\) \| `(\w+)` \|", readme, re.M)
    assert rows == [(d.id.upper(), d.title, d.page, d.stem) for d in DRILLS]


@pytest.mark.parametrize("drill,check", [(d, c) for d in DRILLS for c in d.page_checks],
                         ids=[f"{d.id}-{c.__name__}" for d in DRILLS for c in d.page_checks])
def test_page_numbers(drill, check):
    """Each drill's own checks of the numbers its page works out (tests/drills/<id>.py)."""
    check((ROOT / drill.page).read_text())


@pytest.mark.parametrize("drill_id", list(PAGES))
def test_arithmetic_on_the_page(drill_id):
    """Every `a / b = c %` and every product `a × b × ... = c` written on a page."""
    text = page(drill_id)
    for a, b, c in re.findall(r"(\d+) / (\d+) = ([\d.]+) ?%", text):
        assert 100 * int(a) / int(b) == pytest.approx(float(c), abs=0.05), f"{a} / {b} = {c} %"
    for left, result in re.findall(r"((?:\d+[^\d×=+\n]*×\s*)+\d+)[^\d=+\n]*= (\d+)", text):
        factors = [int(n) for n in re.findall(r"\d+", left)]
        assert math.prod(factors) == int(result), f"{left} = {result}"
