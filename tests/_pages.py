"""Reading the drill pages (content/<id>.md) the way their checks need. Names no drill."""
import re

DETAILS = re.compile(r"<details>\s*<summary>(.*?)</summary>(.*?)</details>", re.S)


def section(text, number):
    """The text of `## number. ...` up to the next `## ` heading."""
    start = re.search(rf"^## {number}\. ", text, re.M).start()
    end = re.search(r"^## ", text[start + 3:], re.M)
    return text[start:start + 3 + end.start()] if end else text[start:]


def self_test(text, number):
    """The text of self-test `number` (`**自测 n**`) up to the next self-test or heading."""
    start = text.index(f"**自测 {number}**")
    end = text.find("**自测", start + 5)
    return text[start:end if end > 0 else text.index("\n## ", start)]


def outside_details(text):
    """The page without its folded (<details>) blocks: what a learner reads before the answer."""
    return DETAILS.sub("", text)
