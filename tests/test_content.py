"""The content pages cannot rot: every number the code can check is checked here.

Conventions every page follows (content/README.md in words, here in code):
- numbered sections are `## N. title`; "content/<id>.md §N" anywhere in the code
  must name one of them;
- a drill's hints are the `### 提示 N` blocks of content/<id>-hints.md (shown by `make hint`), and
  the reference read line by line is content/<id>-walkthrough.md (shown by `make walkthrough`):
  the page itself, read with `cat` where `<details>` does not fold, holds no hint and no line of
  the reference, and its hint and walkthrough sections say where they are;
- a citation of the reference is a link `[solutions/<stem>.py:A-B](../solutions/<stem>.py#LA-LB)`
  followed by a ```python block that reproduces exactly lines A..B, in whichever of the
  three files holds it;
- what the page still folds (self-test answers, long measurements) sits in `<details>` blocks
  whose summary says 先做题 (do the drill first);
- each pitfall is tagged `pitfall:<name>`;
- the numbered sections come in one order (ORDER below);
- a number quoted from BENCHMARKS.md or its history (MEASURED below) stands on a line that names
  the file, and is in that file.
Then each drill's own page checks (tests/drills/<id>/page.py) recompute its worked examples
and self-test answers against the references.
"""
import ast
import math
import re

import pytest

from _manifest import DRILLS
from _pages import DETAILS, HINT, hints, hints_file, numbered_sections, walkthrough_file
from _tree import ROOT

PAGES = {d.id: ROOT / d.page for d in DRILLS}
# Each drill's three files: the page, its hints, its walkthrough.
TEXTS = {d.id: (ROOT / d.page, hints_file(d.id), walkthrough_file(d.id)) for d in DRILLS}
CITATION = re.compile(r"\[(solutions/\w+\.py):(\d+)-(\d+)\]\(\.\./\1#L\2-L\3\)\s*\n```python\n(.*?)```", re.S)


def page(drill_id):
    return PAGES[drill_id].read_text()


def sections(text):
    return {int(n) for n in re.findall(r"^## (\d+)\. ", text, re.M)}


@pytest.mark.parametrize("drill_id", list(PAGES))
def test_citations_reproduce_the_cited_lines(drill_id):
    """Every cited line range, in the page, its hints or its walkthrough, shows those lines now."""
    assert CITATION.findall(walkthrough_file(drill_id).read_text()), (
        f"{walkthrough_file(drill_id).name} cites no line range of its solution")
    for source in TEXTS[drill_id]:
        text = source.read_text()
        cited = CITATION.findall(text)
        assert len(cited) == text.count("](../solutions/"), (
            f"{source.name}: a citation link is not followed by its ```python block")
        for path, first, last, shown in cited:
            lines = (ROOT / path).read_text().splitlines()[int(first) - 1:int(last)]
            assert shown.rstrip("\n").splitlines() == lines, (
                f"{source.name} cites {path}:{first}-{last}, but the block it shows is not those lines now")


def answer_lines(stem):
    """The reference's lines that give an answer away, by the rule of the before-stop hook
    (/work/shared/hooks/before-stop): longer than 25 characters, not a comment, an import or a
    docstring's opening, and not also in the stub (signatures and parameter lists are)."""
    stub = {line.strip() for line in (ROOT / "mine" / f"{stem}.py").read_text().splitlines()}
    return [line.strip() for line in (ROOT / "solutions" / f"{stem}.py").read_text().splitlines()
            if len(line.strip()) > 25 and line.strip() not in stub
            and not line.strip().startswith(("#", "import", "from", '"""'))]


def shared_runs(text, other, length=30):
    """The runs of `length` characters of `other` that stand in `text` too, whitespace and the
    names of files (a citation such as "（tests/benchmarks-history.md）") aside."""
    squeeze = lambda s: re.sub(r"\s+|[\w./-]+\.(?:md|py)", "", s)  # noqa: E731
    text, other = squeeze(text), squeeze(other)
    return sorted({other[i:i + length] for i in range(len(other) - length + 1)} & 
                  {text[i:i + length] for i in range(len(text) - length + 1)})


@pytest.mark.parametrize("drill", DRILLS, ids=lambda d: d.id)
def test_the_page_tells_no_answer(drill):
    """A page is read with `cat` as often as in a browser, and `<details>` does not fold there: the
    page, as plain text, holds no line of the reference and no hint. Its hint section says where
    the hints are and how many; its walkthrough section, where the walkthrough is."""
    text = (ROOT / drill.page).read_text()
    quoted = [line for line in answer_lines(drill.stem) if line in text]
    assert not quoted, f"{drill.page} quotes solutions/{drill.stem}.py (it belongs in the walkthrough): {quoted}"
    assert not re.search(r"^### 提示 \d+", text, re.M), f"{drill.page} holds hint blocks"
    for n, hint in enumerate(hints(drill.id), 1):
        runs = shared_runs(text, hint)
        assert not runs, f"{drill.page} holds text of hint {n}: {runs[:3]}"
    assert text.count("<details>") == text.count("</details>") == len(DETAILS.findall(text))
    for summary, _ in DETAILS.findall(text):
        assert "先做题" in summary, f"{drill.page} has a <details> block whose summary does not say 先做题"


@pytest.mark.parametrize("drill", DRILLS, ids=lambda d: d.id)
def test_hints_and_walkthrough_files(drill):
    """Every drill of the manifest has its hints (`### 提示 1`, `### 提示 2`, ...) and its
    walkthrough beside its page, each linking back to the page."""
    found = HINT.findall(hints_file(drill.id).read_text())
    assert found and [int(n) for n, _ in found] == list(range(1, len(found) + 1))
    assert all(body.strip() for _, body in found), f"{hints_file(drill.id).name} has an empty hint"
    for source in (hints_file(drill.id), walkthrough_file(drill.id)):
        assert f"]({drill.id}.md)" in source.read_text(), f"{source.name} does not link its page"


def test_track_map_links_every_drill_in_order():
    """content/README.md, the map a newcomer reads first: a picture, and every drill page in manifest order."""
    text = (ROOT / "content" / "README.md").read_text()
    assert "```mermaid" in text
    linked = re.findall(r"\]\((?:\./)?(\w+)\.md\)", text)
    first = {}
    for i, name in enumerate(linked):
        first.setdefault(name, i)
    ids = [d.id for d in DRILLS]
    assert all(i in first for i in ids), f"content/README.md does not link {[i for i in ids if i not in first]}"
    assert sorted(ids, key=first.get) == ids, "content/README.md links the drills out of the manifest's order"
    readme = (ROOT / "README.md").read_text()
    assert "(content/README.md)" in readme, "README.md does not link the track map"


def test_track_map_states_what_the_code_does():
    """content/README.md: a bench row for every drill, the picture column as the drills'
    own `picture` parts say, and the tiers of the bandwidth report and the traffic line."""
    import _bench
    import _traffic
    text = (ROOT / "content" / "README.md").read_text()
    benched = re.findall(r"^\| (\w+) \| .* \| .* \|$", text.split("## 每道题的 bench 和谁比")[1].split("\n## ")[0], re.M)
    assert [b for b in benched if b not in ("题目", "---")] == [d.id.upper() for d in DRILLS]
    pictures = dict(re.findall(r"^\| \d+ \| \[\w+ · .*?\]\((\w+)\.md\) \|.*\| (有|—) \|$", text, re.M))
    assert pictures == {d.id: ("有" if d.picture is not None else "—") for d in DRILLS}
    assert f"不超过 {_traffic.ROOFLINE}× 是 “at the roofline”，不超过 {_traffic.FAIR}× 是 “fair”，再多是 “wasteful”" in text
    assert "读或写不到最少字节数的 0.95 倍" in text and "min(loads, stores) < 0.95" in (ROOT / "tests" / "_traffic.py").read_text()
    assert ("E1 没有 traffic 行" in text) == all(d.traffic is None for d in DRILLS if d.id == "e1")
    e1_row = next(line for line in text.splitlines() if line.startswith("| E1 | "))
    assert ("`make grade` 只计时一次" in e1_row) == all(d.bench_run is not None for d in DRILLS if d.id == "e1"), (
        "content/README.md's E1 row must say whether the grade times E1 (tests/drills/e1: bench_run)")
    tiers = "，".join(f"{round(100 * share)} % 以上{'是' if i == 0 else ''} “{name}”"
                     for i, (share, name) in enumerate(_bench.TIERS[:-1]))
    assert f"天花板的 {tiers}，再低是 “{_bench.TIERS[-1][1]}”" in text


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


# Where measured numbers stand: the current tables, and the history of tried variants and
# earlier runs (BENCHMARKS.md points at it). A page's line that quotes a number names the file.
MEASURED = ("BENCHMARKS.md", "tests/benchmarks-history.md")


@pytest.mark.parametrize("drill_id", list(PAGES))
def test_benchmark_numbers_are_the_measured_ones(drill_id):
    """A number a page (or its hints or walkthrough) quotes on a line that names BENCHMARKS.md
    or its history stands in one of the files that line names."""
    files = {name: (ROOT / name).read_text() for name in MEASURED}
    for line in "\n".join(f.read_text() for f in TEXTS[drill_id]).splitlines():
        named = [name for name in MEASURED if name in line]
        for number in re.findall(r"(\d[\d.,]*) ?(?:GB/s|µs|%|×)", line) if named else ():
            assert any(number in files[name] for name in named), (
                f"{drill_id}.md quotes {number} from {' or '.join(named)}, which does not hold it")


def test_readme_table_lists_every_drill_in_order():
    readme = (ROOT / "README.md").read_text()
    rows = re.findall(r"^\| (\w+) \| \[([^\]]+)\]\((content/\w+\.md)\) \| `(\w+)` \|", readme, re.M)
    assert rows == [(d.id.upper(), d.title, d.page, d.stem) for d in DRILLS]


@pytest.mark.parametrize("drill,check", [(d, c) for d in DRILLS for c in d.page_checks],
                         ids=[f"{d.id}-{c.__name__}" for d in DRILLS for c in d.page_checks])
def test_page_numbers(drill, check):
    """Each drill's own checks of the numbers its page works out (tests/drills/<id>/page.py)."""
    check((ROOT / drill.page).read_text())


@pytest.mark.parametrize("drill_id", list(PAGES))
def test_arithmetic_on_the_page(drill_id):
    """Every `a / b = c %` and every product `a × b × ... = c` written on a page, its hints or its walkthrough."""
    text = "\n".join(f.read_text() for f in TEXTS[drill_id])
    for a, b, c in re.findall(r"(\d+) / (\d+) = ([\d.]+) ?%", text):
        assert 100 * int(a) / int(b) == pytest.approx(float(c), abs=0.05), f"{a} / {b} = {c} %"
    for left, result in re.findall(r"((?:\d+[^\d×=+\n]*×\s*)+\d+)[^\d=+\n]*= (\d+)", text):
        factors = [int(n) for n in re.findall(r"\d+", left)]
        assert math.prod(factors) == int(result), f"{left} = {result}"


# A repository path a page names: under tests/, solutions/, mine/ or content/, a bare *.md
# (top level or a page), or a top-level file; not part of a longer (upstream) path, and not
# a pattern such as tests/test_<stem>.py.
REPO_PATH = re.compile(r"(?<![\w./<>-])((?:tests|solutions|mine|content)/[\w./-]*[\w/]|[\w-]+\.md|Makefile|grader\.py)"
                       r"(?![\w<>-])")
LINK = re.compile(r"\]\((?!https?:|#)([^)#\s]+)(?:#[^)]*)?\)")


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "content").glob("*.md")))
def test_paths_a_page_names_exist(name):
    """Every repository path a page mentions (tests/..., solutions/..., mine/..., content/...,
    BENCHMARKS.md; no file from outside the repository) and every relative link exists: drills move (tests/drills/<id>/ was once one
    file), and a page must not send a learner to a file that is gone."""
    text = (ROOT / "content" / name).read_text()
    named = {m.rstrip(".") for m in REPO_PATH.findall(text)}
    missing = sorted(p for p in named if not (ROOT / p).exists() and not (ROOT / "content" / p).exists())
    missing += sorted(link for link in set(LINK.findall(text)) if not (ROOT / "content" / link).exists())
    assert not missing, f"content/{name} names paths that do not exist: {missing}"


# The order every page teaches in: the problem (§1); concepts and the worked example
# (the first section that works one by hand, 手算), in whatever order the drill needs,
# up to the interface (the host side); then one section each of hints (where they are),
# pitfalls and self-tests; last the walkthrough (where it is) and the map of upstream
# sources. Each part is found by the keywords of its `## N. title`.
ORDER = (("interface", ("host 端",)), ("hints", ("提示",)), ("pitfalls", ("常见坑",)), ("self-tests", ("自测",)),
         ("walkthrough", ("逐行",)), ("source map", ("对照",)))


def part_of(title):
    names = [name for name, words in ORDER if any(w in title for w in words)]
    assert len(names) <= 1, f"the section title {title!r} names two parts: {names}"
    return names[0] if names else None


@pytest.mark.parametrize("drill_id", PAGES)
def test_page_follows_the_common_order(drill_id):
    """Problem, concepts, worked example, interface, hints, pitfalls, self-tests, then the
    walkthrough and the source map: what content/README.md promises of every page. The hint
    section says how many hints there are and how to see them; the walkthrough section, how
    to see the walkthrough."""
    secs = numbered_sections(page(drill_id))
    numbers = [n for n, _, _ in secs]
    assert numbers == list(range(1, len(secs) + 1)), f"{drill_id}.md numbers its sections {numbers}"
    assert "题目" in secs[0][1], f"{drill_id}.md §1 is not the problem (题目)"
    parts = [part_of(title) for _, title, _ in secs]
    assert "interface" in parts, f"{drill_id}.md has no host-side section (host 端)"
    start = parts.index("interface")
    before, after = secs[1:start], secs[start:]
    example = [n for n, _, body in before if "手算" in body]
    assert example, f"{drill_id}.md works no example by hand (手算) before its interface section"
    assert any(n < example[0] and "手算" not in body for n, _, body in before), (
        f"{drill_id}.md has no concept section between the problem and the worked example (§{example[0]})")
    assert all(p is None for p in parts[1:start]), f"{drill_id}.md has {parts[1:start]} before its interface"
    got = [(n, p) for (n, _, _), p in zip(after, parts[start:])]
    assert [p for _, p in got] == [name for name, _ in ORDER], (
        f"{drill_id}.md from its interface on reads {got}; it should be one section each of "
        f"{[name for name, _ in ORDER]}, in that order")
    body = dict(zip(parts[start:], (b for _, _, b in after)))
    assert f"这道题有 {len(hints(drill_id))} 条提示" in body["hints"], (
        f"{drill_id}.md's hint section does not say how many hints {hints_file(drill_id).name} holds")
    assert f"[{drill_id}-hints.md]({drill_id}-hints.md)" in body["hints"] and f"make hint DRILL={drill_id}" in body["hints"]
    assert f"[{drill_id}-walkthrough.md]({drill_id}-walkthrough.md)" in body["walkthrough"]
    assert f"make walkthrough DRILL={drill_id}" in body["walkthrough"]
    assert "<details>" in body["source map"], f"{drill_id}.md's source map is not folded in <details>"
