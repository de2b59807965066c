"""Terminal pictures of a drill's data. Names no drill: each drill's module draws
its own (`Drill.picture` runs the learner's code on a small case and draws it;
`Drill.draw_case` draws a failing case the tests saved). This runs one of them in
a process of its own for the grade, since the learner's code may crash.
"""
import sys
from pathlib import Path

from _process import run_process
from _worker import TIMEOUT

SUBPROCESS_SLACK = 90  # seconds for a subprocess's own start and its worker's, beside the learner's time


def in_subprocess(drill, tree, width, color, workdir, test_timeout=None):
    """`grader.py show` for a failing drill: the first small case that failed if the
    tests saved one, else the page's example. None when there is no picture."""
    if drill.picture is None:
        return None
    saved = Path(workdir) / f"{drill.id}-case.pt"
    which = ["--case", str(saved)] if saved.exists() and drill.draw_case else []
    env = {"COLUMNS": str(width), **({"FORCE_COLOR": "1"} if color else {})}
    if test_timeout:  # the learner's code obeys the grade's limit here too
        env["DRILLS_TIMEOUT"] = str(test_timeout)
    code, out, err = run_process([sys.executable, "grader.py", "show", drill.id, "--tree", str(tree), *which],
                                 SUBPROCESS_SLACK + (test_timeout or TIMEOUT), env)
    if code != 0:
        return None
    title = "the first small failing case" if which else f"the example of {drill.page}"
    return f"{title}, drawn (make show DRILL={drill.id}):\n{out}"


def show(drill, tree, console, case_path=None):
    """Draw a saved case, or run the tree's code on the drill's example and draw that.

    Exit status 0 whenever a picture is drawn, whatever the learner's code did there (a
    stub's NotImplementedError, an exception, a wrong answer: the picture says which);
    1 only when no picture could be drawn, with a sentence saying why."""
    if drill.picture is None:
        console.print(f"{drill.id.upper()} has no picture; make grade DRILL={drill.id} grades it")
        return 0
    try:
        if case_path:
            import torch
            drill.draw_case(torch.load(case_path, weights_only=False), console)
        else:
            from _worker import WORKER, tree_module
            try:
                drill.picture(tree_module(tree, drill.stem, drill.contract, preload=drill.preload), console)
            finally:
                WORKER.stop()
    except Exception as error:  # a crash of the learner's process, or of the picture itself
        console.print(f"[bold red]could not draw {drill.id.upper()}'s picture: {type(error).__name__}: {error}[/]")
        return 1
    return 0

