"""The learner's and the instructor's commands besides grading:

    python grader.py show l1     draw the drill's data for your code (L1: the cache)
    python grader.py hint l1     the next hint from the page you have not seen yet
    python grader.py reset l1    back up mine/<stem>.py, then restore the stub
    python grader.py doctor      check Python, torch, Triton, numpy and the interpreter
    python grader.py watch l1    re-grade a drill whenever its file changes
    python grader.py diff l1     your file and the reference side by side
"""
import ast
import difflib
import json
import os
import re
import signal
import subprocess
import sys
import time

from rich.table import Table
from rich.text import Text

from _tree import ROOT, tree_path

STATE = ROOT / ".drills"  # ignored by git: hint progress and backups


# --- hints ---------------------------------------------------------------------


def hints(drill):
    """The page's hints, weakest first: the `### 提示 N` blocks of its hint section."""
    text = (ROOT / drill.page).read_text()
    return [h.strip() for h in re.findall(r"^### 提示 \d+\n(.*?)(?=^### |^## |\Z)", text, re.M | re.S)]


def hint(drill, console):
    all_hints = hints(drill)
    state_file = STATE / "hints.json"
    seen = json.loads(state_file.read_text()) if state_file.exists() else {}
    n = min(seen.get(drill.id, 0) + 1, len(all_hints))
    seen[drill.id] = n
    STATE.mkdir(exist_ok=True)
    state_file.write_text(json.dumps(seen))
    console.print(f"[bold]{drill.id.upper()} hint {n} of {len(all_hints)}[/] (from {drill.page})\n")
    console.print(all_hints[n - 1])
    if n == len(all_hints):
        console.print("\n[dim]That was the last hint; the walkthrough is in the page's numbered sections.[/]")
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


def diff(drill, tree, console):
    """The reference and a tree's file side by side, changed lines highlighted."""
    left = (ROOT / "solutions" / f"{drill.stem}.py").read_text().splitlines()
    right_path = tree_path(tree) / f"{drill.stem}.py"
    right = right_path.read_text().splitlines()
    table = Table(header_style="bold", box=None, padding=(0, 1), expand=True)
    table.add_column("solutions/" + drill.stem + ".py", ratio=1, overflow="fold")
    table.add_column(str(right_path), ratio=1, overflow="fold")
    for op, a0, a1, b0, b1 in difflib.SequenceMatcher(None, left, right, autojunk=False).get_opcodes():
        style = None if op == "equal" else "red" if op == "delete" else "green" if op == "insert" else "yellow"
        for i in range(max(a1 - a0, b1 - b0)):
            a = left[a0 + i] if a0 + i < a1 else ""
            b = right[b0 + i] if b0 + i < b1 else ""
            table.add_row(Text(a, style=style), Text(b, style=style))
    console.print(table)
    return 0

