"""Reading the drill pages (content/<id>.md) the way their checks need. Names no drill."""
import re

DETAILS = re.compile(r"<details>\s*<summary>(.*?)</summary>(.*?)</details>", re.S)


def section(text, number):
    """The text of `## number. ...` up to the next `## ` heading."""
    start = re.search(rf"^## {number}\. ", text, re.M).start()
    end = re.search(r"^## ", text[start + 3:], re.M)
    return text[start:start + 3 + end.start()] if end else text[start:]


def outside_details(text):
    """The page without its folded (<details>) blocks: what a learner reads before the answer."""
    return DETAILS.sub("", text)
