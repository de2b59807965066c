"""Reading the drill pages the way their checks and the commands need. Names no drill.

A drill's teaching lives in three files (content/README.md says so in words): the page
content/<id>.md, which a learner reads before writing anything; its hints,
content/<id>-hints.md, `### 提示 N` blocks shown one at a time by `make hint`; and the
reference read line by line, content/<id>-walkthrough.md, shown by `make walkthrough`.
Nothing here imports torch: the commands that read these files answer at once.
"""
import re

from _tree import ROOT

CONTENT = ROOT / "content"
DETAILS = re.compile(r"<details>\s*<summary>(.*?)</summary>(.*?)</details>", re.S)
HINT = re.compile(r"^### 提示 (\d+)\n(.*?)(?=^### |^## |\Z)", re.M | re.S)


def page_file(drill_id):
    return CONTENT / f"{drill_id}.md"


def hints_file(drill_id):
    return CONTENT / f"{drill_id}-hints.md"


def walkthrough_file(drill_id):
    return CONTENT / f"{drill_id}-walkthrough.md"


def hints(drill_id):
    """The drill's hints, weakest first: the text of each `### 提示 N` block of its hints file."""
    found = HINT.findall(hints_file(drill_id).read_text())
    assert [int(n) for n, _ in found] == list(range(1, len(found) + 1)), f"{hints_file(drill_id)} skips a number"
    return [body.strip() for _, body in found]


def walkthrough(drill_id):
    """The text of the drill's walkthrough (its `## N.` sections are those of the page they belong to)."""
    return walkthrough_file(drill_id).read_text()


def section(text, number):
    """The text of `## number. ...` up to the next `## ` heading."""
    start = re.search(rf"^## {number}\. ", text, re.M).start()
    end = re.search(r"^## ", text[start + 3:], re.M)
    return text[start:start + 3 + end.start()] if end else text[start:]


def numbered_sections(text):
    """[(number, title, body)] of the text's `## N. title` sections, in order."""
    found = list(re.finditer(r"^## (\d+)\. (.*)$", text, re.M))
    ends = [m.start() for m in found[1:]] + [len(text)]
    return [(int(m.group(1)), m.group(2), text[m.end():end]) for m, end in zip(found, ends)]


def self_test(text, number):
    """The text of self-test `number` (`**自测 n**`) up to the next self-test or heading."""
    start = text.index(f"**自测 {number}**")
    end = text.find("**自测", start + 5)
    return text[start:end if end > 0 else text.index("\n## ", start)]


def outside_details(text):
    """The page without its folded (<details>) blocks: what a learner reads before the answer."""
    return DETAILS.sub("", text)


def for_terminal(text, answers, hidden):
    """The page as `make page` renders it (rich's Markdown drops HTML): a fold's summary becomes
    a bold line above its content, except the self-tests' answers, which are the line `hidden`
    (saying how to show them) unless `answers`."""
    tests = next((m for m in re.finditer(r"^## \d+\. .*自测.*$", text, re.M)), None)
    start = tests.start() if tests else len(text)
    end = re.search(r"^## ", text[start + 3:], re.M)
    end = start + 3 + end.start() if tests and end else len(text)

    def unfold(m, hide):
        if hide:
            return f"*{hidden}*\n"
        return f"**{re.sub(r'</?code>', '`', m.group(1)).strip()}**\n\n{m.group(2).strip()}\n"
    before, tests_text, after = text[:start], text[start:end], text[end:]
    return (DETAILS.sub(lambda m: unfold(m, False), before) + DETAILS.sub(lambda m: unfold(m, not answers), tests_text)
            + DETAILS.sub(lambda m: unfold(m, False), after))
