"""Terminal pictures of a drill's data. Names no drill: each drill's module draws
its own (`Drill.picture` runs the learner's code on a small case and draws it;
`Drill.draw_case` draws a failing case the tests saved). This runs one of them in
a process of its own for the grade, since the learner's code may crash.

A picture is drawn with rich's styles, and the learner's text in it (an error it
raised, a name it chose) goes in as plain Text, cleaned (`said`): never inside
markup. For the grade the picture comes back as data, not as terminal output: its
segments, (text, our style) each, written to a file the grade's process made and
handed over as a descriptor, never to the output the learner's prints share; the
grade prints them through tests/_render.py's `picture_text`, which cleans the text
again. So only our drawing's styles colour a picture.
"""
import io
import json
import os
import sys
import tempfile

from rich.console import Console
from rich.text import Text

from _process import run_process
from _render import clean_text
from _worker import TIMEOUT

SUBPROCESS_SLACK = 90  # seconds for a subprocess's own start and its worker's, beside the learner's time
SEGMENTS_FD = "DRILLS_PICTURE_FD"  # the descriptor `show` writes its segments to, for in_subprocess
SAID_LINES, SAID_CHARS = 6, 600    # how much of the learner's own text a picture shows


def plain(theirs):
    """The learner's text (an error's words, a name it chose) as a picture shows it: a
    Text with no style, cleaned and cut to a few lines; never markup, never their escapes."""
    text = clean_text(str(theirs))
    lines = text.splitlines()
    if len(lines) > SAID_LINES or len(text) > SAID_CHARS:
        text = "\n".join(lines[:SAID_LINES])[:SAID_CHARS] + " ..."
    return Text(text)


def said(ours, theirs, style="red"):
    """A picture's line that quotes the learner's code: our words `ours` in `style`, then
    `theirs` (an error's text, as tests/_diagnose.py's said_error gives it), plain."""
    return Text.assemble((ours, style), plain(theirs))


def in_subprocess(drill, tree, width, color, workdir, test_timeout=None):
    """`grader.py show` for a failing drill: the first small case that failed if the
    tests saved one, else the page's example. None when there is no picture; else
    {"title": ..., "segments": [[text, style], ...]} (styles left out when `color` is
    False), which tests/_render.py's picture_text prints."""
    if drill.picture is None:
        return None
    saved = os.path.join(workdir, f"{drill.id}-case.pt")
    which = ["--case", saved] if os.path.exists(saved) and drill.draw_case else []
    with tempfile.TemporaryFile() as segments:
        env = {"COLUMNS": str(width), SEGMENTS_FD: str(segments.fileno())}
        if test_timeout:  # the learner's code obeys the grade's limit here too
            env["DRILLS_TIMEOUT"] = str(test_timeout)
        code, _, _ = run_process([sys.executable, "grader.py", "show", drill.id, "--tree", str(tree), *which],
                                 SUBPROCESS_SLACK + (test_timeout or TIMEOUT), env, pass_fds=(segments.fileno(),))
        segments.seek(0)
        try:
            drawn = json.loads(segments.read().decode()) if code == 0 else None
        except ValueError:
            drawn = None
    if not isinstance(drawn, list):
        return None
    title = "the first small failing case" if which else f"the example of {drill.page}"
    return dict(title=f"{title}, drawn (make show DRILL={drill.id}):\n",
                segments=[[seg[0], seg[1] if color else ""] for seg in drawn if isinstance(seg, list) and seg])


class Recording:
    """What `show` draws on, for in_subprocess: a console stand-in that keeps each
    printed line as segments, (text, style), instead of printing them."""

    def __init__(self, width):
        self._console = Console(width=width, force_terminal=True, color_system="truecolor", file=io.StringIO())
        self.segments = []

    def print(self, *objects):
        for renderable in objects:
            for line in self._console.render_lines(renderable, pad=False, new_lines=True):
                self.segments += [[clean_text(s.text), str(s.style or "")] for s in line if not s.control]


def show(drill, tree, console, case_path=None):
    """Draw a saved case, or run the tree's code on the drill's example and draw that.

    Exit status 0 whenever a picture is drawn, whatever the learner's code did there (a
    stub's NotImplementedError, an exception, a wrong answer: the picture says which);
    1 only when no picture could be drawn, with a sentence saying why. Started by
    in_subprocess (DRILLS_PICTURE_FD set), it draws on a Recording and writes the
    segments to that descriptor instead of printing them."""
    if drill.picture is None:
        console.print(f"{drill.id.upper()} has no picture; make grade DRILL={drill.id} grades it")
        return 0
    fd = os.environ.get(SEGMENTS_FD)
    canvas = Recording(console.width) if fd else console
    try:
        if case_path:
            import torch
            drill.draw_case(torch.load(case_path, weights_only=False), canvas)
        else:
            from _worker import WORKER, tree_module
            try:
                drill.picture(tree_module(tree, drill.stem, drill.contract, preload=drill.preload), canvas)
            finally:
                WORKER.stop()
    except Exception as error:  # a crash of the learner's process, or of the picture itself
        from _diagnose import said_error
        console.print(said(f"could not draw {drill.id.upper()}'s picture: ", said_error(error), "bold red"))
        return 1
    if fd:
        with os.fdopen(int(fd), "w") as out:
            json.dump(canvas.segments, out)
    return 0
