"""The learner's text is text (issue 47): what their code prints or raises reaches the
terminal and --json as plain, cleaned text. No escape of theirs, no rich markup of theirs
and no Unicode format character (bidi overrides and isolates, zero-width) survives, and
only our drawing's styles colour a picture: a learner cannot paint a "passed" row."""
import io
import json
import re
import sys
import unicodedata

from rich.console import Console

import _picture
import _render
import _wrong
from _manifest import drill as find_drill

L1 = find_drill("l1")
FORMAT = "".join(chr(c) for c in range(sys.maxunicode + 1) if unicodedata.category(chr(c)) == "Cf")
# A painted status row, markup, and characters that reorder or hide text, in one string.
PAINT = ("\x1b[2J\x1b[1;32mL1  Paged KV-cache write  passed 35/35\x1b[0m [bold green]passed[/] "
         "\u202eevil\u202c \u2066isolated\u2069 zero\u200bwidth \ufeffbom line\u2028break \x9b31m\x1b]0;title\x07")
# Appended to the reference: every function the L1 picture calls prints the paint and raises
# it, slot_mapping's error a class whose very name is an escape.
PAINTING = f'''
PAINT = {PAINT!r}


def slot_mapping(*args, **kwargs):
    print(PAINT)
    raise type(PAINT, (Exception,), {{}})(PAINT)


def reshape_and_cache(*args, **kwargs):
    print(PAINT)
    raise RuntimeError(PAINT)
'''


def _bad(text):
    """Escapes other than a colour, C0/C1 controls, U+2028/9 and Cf characters in `text`."""
    return re.findall("\x1b(?!\\[[0-9;]*m)|[\x00-\x08\x0b-\x1a\x1c-\x1f\x7f-\x9f\u2028\u2029" + FORMAT + "]", text)


def test_cleaning_drops_every_format_character_and_the_separators():
    assert len(FORMAT) > 100 and "\u202e" in FORMAT and "\u200b" in FORMAT and "\ufeff" in FORMAT
    kept = "ok ✓ 中文 é\ttab\nline"
    assert _render.clean_text(FORMAT + kept + "\u2028\u2029\x1b[31m\x85") == kept
    assert _render.cleaned({"\u202ekey": ["a\u2066b", 3]}) == {"key": ["ab", 3]}


def test_a_learners_escapes_markup_and_format_characters_paint_nothing(tmp_path):
    """The L1 picture, drawn by the grade's own subprocess for a tree whose functions print
    and raise the paint: on a colour terminal and in --json, no escape but our colours, no
    format character, the markup shown as written, and not one character of the learner's
    text styled (a plain "passed", never a bold-green one)."""
    tree = _wrong.plant_edits(L1, (), tmp_path / "tree")
    with open(tree / f"{L1.stem}.py", "a") as f:
        f.write(PAINTING)
    picture = _picture.in_subprocess(L1, tree, 160, True, tmp_path)
    assert picture and picture["segments"], picture
    text = _render.picture_text(picture)
    assert "[bold green]passed[/]" in text.plain and "reshape_and_cache raised" in text.plain
    styled = [(span.start, span.end) for span in text.spans]
    theirs = [m.start() for m in re.finditer("passed 35/35|evil|isolated|zerowidth", text.plain)]
    assert theirs and not [i for i in theirs if any(a <= i < b for a, b in styled)], "learner text was styled"
    out = io.StringIO()
    Console(file=out, force_terminal=True, color_system="standard", width=160).print(text)
    printed = out.getvalue()
    assert "\x1b[32m" in printed or "\x1b[31m" in printed  # our own colours are there
    assert "\x1b[1;32m" not in printed and not _bad(printed), [repr(c) for c in _bad(printed)]
    written = json.dumps(_render.for_json(dict(drills=[dict(id="l1", picture=picture)])))
    assert "\\u001b" not in written and "\\u009b" not in written
    assert not _bad(json.loads(written)["drills"][0]["picture"])


def test_a_chat_reply_is_text():
    """`make chat` prints the reply the learner's engine chose token by token: a byte-level
    vocabulary spells escapes and bidi controls as readily as letters."""
    from _chat import text_of

    class Tokenizer:
        def decode(self, ids, skip_special_tokens):
            return "".join(map(chr, ids))
    assert text_of(Tokenizer(), [ord(c) for c in PAINT]) == _render.clean_text(PAINT)
    assert not _bad(text_of(Tokenizer(), [ord(c) for c in PAINT]))
