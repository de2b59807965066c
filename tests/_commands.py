"""The learner's and the instructor's commands besides grading:

    python grader.py show l1     draw the drill's data for your code (L1: the cache)
    python grader.py hint l1     the next hint you have not seen yet (content/l1-hints.md)
    python grader.py walkthrough l1   the reference read line by line (asks first until L1 passes)
    python grader.py page l1     the page, rendered for the terminal (--answers: self-test answers shown)
    python grader.py reset l1    back up mine/<stem>.py, then restore the stub
    python grader.py doctor      check Python, torch, Triton, numpy and the interpreter
    python grader.py watch l1    re-grade a drill whenever its file changes
    python grader.py diff l1     your file and the reference side by side
"""
import ast
import difflib
import json
import os
import signal
import subprocess
import sys
import time

from rich.cells import cell_len
from rich.markdown import Markdown
from rich.table import Table
from rich.text import Text

import _pages
from _tree import ROOT, default_tree, tree_path

STATE = ROOT / ".drills"  # ignored by git: hint progress, the last grade of each drill, backups


# --- the light commands: files only, so they answer at once ---------------------

LIGHT = ("hint", "walkthrough", "page", "reset", "diff")


def light(argv, console):
    """`grader.py hint|walkthrough|page|reset|diff l1 [...]`. They read and write files only:
    the drill is found by tests/_catalog.py, and nothing here imports torch (grader.py's
    machinery costs 6-15 s on a busy machine), so a hint, an error or --help comes at once."""
    import argparse

    import _catalog
    parser = argparse.ArgumentParser(prog=f"grader.py {argv[0]}")
    parser.add_argument("drill", help="a drill id, e.g. l1")
    parser.add_argument("--tree", default=default_tree(), help="mine (default), solutions, or a folder")
    if argv[0] == "diff":
        parser.add_argument("--other", help="the tree whose file goes on the left, instead of the reference")
    if argv[0] == "walkthrough":
        parser.add_argument("--yes", action="store_true", help="show it without asking, passed or not")
    if argv[0] == "page":
        parser.add_argument("--answers", action="store_true", help="show the self-tests' answers")
    args = parser.parse_args(argv[1:])
    try:
        drill = _catalog.drill(args.drill)
        for tree in (args.tree, args.other) if argv[0] == "diff" else ():
            if tree:
                tree_path(tree)
    except (KeyError, FileNotFoundError) as error:
        return usage_error(console, error)
    if argv[0] == "diff":
        return diff(drill, args.tree, console, args.other)
    if argv[0] == "walkthrough":
        return walkthrough(drill, console, yes=args.yes)
    if argv[0] == "page":
        return page(drill, console, answers=args.answers)
    return hint(drill, console) if argv[0] == "hint" else reset(drill, console)


def usage_error(console, error):
    """A drill or tree that does not exist: said in red (as text: it holds what was typed), exit status 2."""
    console.print(str(error.args[0] if isinstance(error, KeyError) else error), style="red", markup=False,
                  soft_wrap=True)  # a path stays whole at any width
    return 2


# --- hints, the walkthrough and the page ---------------------------------------


def hint(drill, console):
    """The next hint of content/<id>-hints.md the learner has not seen; progress in .drills/hints.json.
    A hint is printed as text (never as rich markup, which would eat `block_table[seq_idx, 逻辑块]`)."""
    all_hints = _pages.hints(drill.id)
    state_file = STATE / "hints.json"
    seen = json.loads(state_file.read_text()) if state_file.exists() else {}
    n = min(seen.get(drill.id, 0) + 1, len(all_hints))
    seen[drill.id] = n
    STATE.mkdir(exist_ok=True)
    state_file.write_text(json.dumps(seen))
    source = _pages.hints_file(drill.id).relative_to(ROOT)
    console.print(Text(f"{drill.id.upper()} hint {n} of {len(all_hints)}", style="bold") + Text(f" (from {source})\n"))
    console.print(Text(all_hints[n - 1]), soft_wrap=True)
    if n == len(all_hints):
        console.print(Text(f"\nThat was the last hint; the reference read line by line is "
                           f"`make walkthrough DRILL={drill.id}`.", style="dim"))
    return 0


def record_grades(tree, summaries):
    """Remember each drill's status at its last grade of mine/ (.drills/grades.json), so that
    `walkthrough` shows the reference without asking once the learner has passed."""
    if tree != tree_path("mine"):
        return
    state_file = STATE / "grades.json"
    grades = json.loads(state_file.read_text()) if state_file.exists() else {}
    grades.update({s["id"]: s["status"] for s in summaries})
    STATE.mkdir(exist_ok=True)
    state_file.write_text(json.dumps(grades))


def has_passed(drill):
    """The drill's last recorded grade of mine/ passed (no grade recorded: not passed)."""
    state_file = STATE / "grades.json"
    return state_file.exists() and json.loads(state_file.read_text()).get(drill.id) == "passed"


def walkthrough(drill, console, yes=False):
    """content/<id>-walkthrough.md, the reference read line by line. Before the drill has passed
    the learner confirms first: y/N on a terminal, `yes` (--yes, YES=1) in a script; without
    either it says how, shows nothing, and exits 0."""
    source = _pages.walkthrough_file(drill.id)
    if not (yes or has_passed(drill)):
        warning = (f"{drill.id.upper()} has not passed here yet (no passing `make grade DRILL={drill.id}` recorded), "
                   f"and {source.relative_to(ROOT)} shows the reference solution, line by line.")
        if not sys.stdin.isatty():
            console.print(Text(f"{warning}\nTo read it anyway: make walkthrough DRILL={drill.id} YES=1 "
                               f"(or python grader.py walkthrough {drill.id} --yes)."))
            return 0
        console.print(Text(warning))
        if console.input(Text("Show it anyway? [y/N] ")).strip().lower() not in ("y", "yes"):
            console.print("Not shown.")
            return 0
    console.print(Markdown(source.read_text()))
    return 0


def page(drill, console, answers=False):
    """content/<id>.md rendered for the terminal, the self-tests' answers folded: shown with
    `answers` (ANSWERS=1, --answers), or on a terminal by a key press after the page."""
    text = _pages.page_file(drill.id).read_text()
    hidden = f"(answer folded: make page DRILL={drill.id} ANSWERS=1 shows the answers)"
    console.print(Markdown(_pages.for_terminal(text, answers, hidden)))
    if answers or not (console.is_terminal and sys.stdin.isatty()):
        return 0
    if console.input(Text("\nPress Enter to show the self-tests' answers, or q and Enter to stop: ")).strip() == "q":
        return 0
    tests = [body for _, title, body in _pages.numbered_sections(_pages.for_terminal(text, True, hidden))
             if "自测" in title]
    console.print(Markdown("\n".join(tests)))
    return 0


# --- reset ---------------------------------------------------------------------


def _public_functions(source):
    return {n.name: n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")}


def is_stub(source, reference=None):
    """Every public function raises NotImplementedError (a pristine stub), but for the
    helpers the stub gives: those written exactly as in `reference` (the solution's source),
    such as E1's replay_block_manager (design.md: "given in the stub")."""
    functions = _public_functions(source)
    given = _public_functions(reference) if reference else {}
    exercise = [f for name, f in functions.items()
                if name not in given or ast.dump(f) != ast.dump(given[name])]
    return bool(exercise) and all(
        any(isinstance(x, ast.Raise) and "NotImplementedError" in ast.unparse(x) for x in ast.walk(f))
        for f in exercise)


def _git_show(commit, path):
    return subprocess.run(["git", "show", f"{commit}:{path}"], cwd=ROOT, capture_output=True, text=True).stdout


def pristine_stub(stem):
    """The newest committed version of mine/<stem>.py that is still a stub (its given helpers
    compared with the solution of the same commit, else of the working tree)."""
    path = f"mine/{stem}.py"
    log = subprocess.run(["git", "log", "--format=%H", "--", path], cwd=ROOT, capture_output=True, text=True)
    if log.returncode != 0:
        raise RuntimeError("reset needs the git history of this repository (git log failed)")
    current = ROOT / "solutions" / f"{stem}.py"
    for commit in log.stdout.split():
        source = _git_show(commit, path)
        if not source:
            continue
        references = [_git_show(commit, f"solutions/{stem}.py")] + ([current.read_text()] if current.exists() else [])
        if any(is_stub(source, reference) for reference in references if reference) or is_stub(source):
            return source
    raise RuntimeError(f"no committed version of {path} is a stub")


def reset(drill, console):
    target = ROOT / "mine" / f"{drill.stem}.py"
    stub = pristine_stub(drill.stem)
    if target.exists() and target.read_text() == stub:
        console.print(f"{target.relative_to(ROOT)} is already the stub; nothing to do.")
        return 0
    backup = None
    if target.exists():
        backup = STATE / "backups" / f"{drill.stem}-{time.strftime('%Y%m%d-%H%M%S')}.py"
        backup.parent.mkdir(parents=True, exist_ok=True)
        backup.write_text(target.read_text())
    target.write_text(stub)
    console.print(f"restored the stub {target.relative_to(ROOT)}"
                  + (f"; your version is saved as {backup.relative_to(ROOT)}" if backup else ""))
    return 0


# --- doctor --------------------------------------------------------------------


def doctor(console):
    """Check the set-up a learner needs, and run one tiny kernel with a known answer."""
    rows, ok = [], True

    def check(name, passed, detail, fix=""):
        nonlocal ok
        ok &= passed
        rows.append((name, Text("ok", style="green") if passed else Text("FAIL", style="bold red"), detail,
                     "" if passed else fix))

    check("python", sys.version_info >= (3, 11), sys.version.split()[0], "use Python 3.11 or newer")
    try:
        import numpy
        check("numpy", True, numpy.__version__)
    except ImportError as error:
        check("numpy", False, f"not importable ({error})", "pip install numpy (Triton's interpreter needs it)")
    import torch
    cuda = torch.cuda.is_available()
    check("torch", True, f"{torch.__version__}, CUDA {'available' if cuda else 'not available'}")
    try:
        import triton
        check("triton", True, triton.__version__)
    except ImportError as error:
        check("triton", False, str(error), "pip install triton (Linux only)")
        return _doctor_report(console, rows, False)

    import _env
    interpret_set = os.environ.get("TRITON_INTERPRET")
    if not cuda and not _env.INTERPRET:
        check("mode", False, f"no CUDA device, but TRITON_INTERPRET={interpret_set!r}",
              "unset TRITON_INTERPRET (or set it to 1): without a GPU kernels must run in the interpreter")
        return _doctor_report(console, rows, False)
    check("mode", True, "Triton CPU interpreter" if _env.INTERPRET else f"GPU: {torch.cuda.get_device_name()}")

    try:
        import _probe
        detail = _probe.run(_env.DEVICE)
        check("tiny kernel", detail is None, detail or "y = 2x + 1 on 5 of 8 lanes: right values, tail untouched",
              "reinstall triton and numpy in .venv (make clean && make setup)")
    except Exception as error:  # a broken set-up shows up here, whatever it is
        check("tiny kernel", False, f"{type(error).__name__}: {str(error)[:200]}",
              "reinstall triton and numpy in .venv (make clean && make setup)")
    return _doctor_report(console, rows, ok)


def _doctor_report(console, rows, ok):
    table = Table(header_style="bold", box=None, padding=(0, 2))
    for column in ("check", "", "found", "fix"):
        table.add_column(column)
    for row in rows:
        table.add_row(*row)
    console.print(table)
    console.print("[green]ready[/]" if ok else "[bold red]not ready: fix the FAIL rows above[/]")
    return 0 if ok else 1


# --- watch and diff ------------------------------------------------------------


def watch(drill, tree, grade_once, console, interval=1.0):
    """Grade the drill now and whenever its file changes; Ctrl-C is how a learner stops, so
    it ends with exit status 0, whether it comes while waiting or in a grade (whose own
    handler stops the test processes and exits 128 + SIGINT: tests/_process.py)."""
    path = tree_path(tree) / f"{drill.stem}.py"
    console.print(f"watching {path}; Ctrl-C to stop")
    last = None
    try:
        while True:
            stamp = path.stat().st_mtime if path.exists() else None
            if stamp != last:
                last = stamp
                grade_once()
            time.sleep(interval)
    except KeyboardInterrupt:
        pass
    except SystemExit as stop:
        if stop.code != 128 + signal.SIGINT:
            raise
    console.print("stopped watching")
    return 0


def _fold(text, width):
    """`text` (tabs expanded) cut into pieces of at most `width` terminal cells; at least one."""
    pieces, piece = [], ""
    for ch in text.expandtabs(4):
        if piece and cell_len(piece + ch) > width:
            pieces.append(piece)
            piece = ""
        piece += ch
    return [*pieces, piece]


SIDE_BY_SIDE = 120  # columns from which the two files stand side by side; below, a unified diff
# Markers as diff -y and diff -u have them, so a diff reads the same piped, saved or in colour.
_STYLE = {"-": "red", "+": "green", "<": "red", ">": "green", "|": "yellow", "@": "cyan"}


def diff(drill, tree, console, other=None):
    """A tree's file against the reference's (or `other` tree's): side by side with diff -y's
    markers ('|' changed, '<' only on the left, '>' only on the right) on a terminal of at least
    SIDE_BY_SIDE columns, else a unified diff ('-' left, '+' right, 3 lines of context); long
    lines fold at the width, their continuations marked alike. Colour only adds to the markers.
    The files are the learner's text: printed as text, control characters removed."""
    from _render import clean_text
    left_path = tree_path(other) / f"{drill.stem}.py" if other else ROOT / "solutions" / f"{drill.stem}.py"
    right_path = tree_path(tree) / f"{drill.stem}.py"
    names = [_shown(p) for p in (left_path, right_path)]
    for path in (left_path, right_path):
        if not path.is_file():
            console.print(f"{_shown(path)} does not exist", style="red", markup=False, highlight=False)
            return 2
    left, right = (clean_text(p.read_text(errors="replace")).splitlines() for p in (left_path, right_path))
    if left == right:
        console.print(f"identical: {names[0]} and {names[1]}", markup=False, highlight=False)
        return 0
    lines = (_side_by_side if console.width >= SIDE_BY_SIDE else _unified)(left, right, names, console.width)
    for marker, line in lines:
        console.print(Text(line, style=_STYLE.get(marker) if console.is_terminal else None), soft_wrap=True,
                      highlight=False)
    return 0


def _shown(path):
    return os.path.relpath(path, ROOT) if str(path).startswith(str(ROOT) + os.sep) else str(path)


def _side_by_side(left, right, names, width):
    """(marker, line) rows: the left line's number and text, the marker, the right's."""
    side = (width - 3) // 2 - 5  # "1234 text" on each side of " m "
    yield "", f"{'':5}{names[0][:side]:<{side}}   {'':5}{names[1][:side]}"
    for op, a0, a1, b0, b1 in difflib.SequenceMatcher(None, left, right, autojunk=False).get_opcodes():
        for i in range(max(a1 - a0, b1 - b0)):
            a = a0 + i if a0 + i < a1 else None
            b = b0 + i if b0 + i < b1 else None
            marker = " " if op == "equal" else "|" if a is not None and b is not None else "<" if b is None else ">"
            pieces_a = _fold(left[a], side) if a is not None else [""]
            pieces_b = _fold(right[b], side) if b is not None else [""]
            for k in range(max(len(pieces_a), len(pieces_b))):
                number_a = f"{a + 1}" if a is not None and k == 0 else ""
                number_b = f"{b + 1}" if b is not None and k == 0 else ""
                text_a = pieces_a[k] if k < len(pieces_a) else ""
                text_b = pieces_b[k] if k < len(pieces_b) else ""
                pad = " " * (side - cell_len(text_a))
                yield marker, f"{number_a:>4} {text_a}{pad} {marker} {number_b:>4} {text_b}".rstrip()


def _unified(left, right, names, width):
    """(marker, line) rows of a unified diff ('-' left, '+' right), each line folded at `width`."""
    for line in difflib.unified_diff(left, right, names[0], names[1], n=3, lineterm=""):
        if line.startswith(("---", "+++", "@@")):
            yield from ((line[:1] if line.startswith("@@") else "", piece) for piece in _fold(line, width))
            continue
        for piece in _fold(line[1:], width - 1):
            yield line[:1], line[:1] + piece


# --- bench without a GPU -------------------------------------------------------


def surely_no_gpu():
    """Whether the bench surely cannot time here, known before torch is imported (seconds):
    the interpreter asked for, or no NVIDIA device file. False: ask _env (it imports torch)."""
    from pathlib import Path
    asked = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    return asked or not any(Path("/dev").glob("nvidia[0-9]*"))


def bench_without_gpu(load, console, reference=ROOT / "solutions"):
    """`make bench` where kernels run in Triton's CPU interpreter: it says at once that the
    bandwidth report needs a GPU, then prints each drill's (`load()`) traffic line for the reference
    (tests/_traffic.py: its traffic case with every load and store counted, no test run;
    the line is kept in .drills/ once counted, as the grade keeps it). Exit status 0."""
    console.print("bandwidth: needs a GPU (kernels run in Triton's CPU interpreter here); the reference's traffic "
                  "lines instead, no test run:", markup=False, highlight=False)
    import _traffic  # numpy and torch: after the first line
    for drill in load():
        if drill.traffic is None:
            console.print(f"{drill.id.upper()}  no traffic case: its kernels' bytes are counted in the drills they "
                          f"come from", markup=False, highlight=False)
            continue
        line = _traffic._reference_line(drill, reference)
        console.print(line or f"{drill.id.upper()}  the traffic case did not run (make grade DRILL={drill.id} "
                      f"TREE=solutions says why)", markup=False, highlight=False)
    return 0
