#!/usr/bin/env python3
"""Grade a tree of drills: each drill's status, its first failure in plain words,
and on a GPU the bandwidth report.

    .venv/bin/python grader.py                    # grade mine/, every drill (= make grade)
    .venv/bin/python grader.py l1                 # one drill (= make grade DRILL=l1)
    .venv/bin/python grader.py --tree solutions   # the reference solutions
    .venv/bin/python grader.py --tree ~/alice/mine --json alice.json   # an instructor
    .venv/bin/python grader.py show|hint|walkthrough|page|reset|watch|diff l1, grader.py doctor
                                                  # see tests/_commands.py

This file is the front: arguments and the top-level flow; tests/_render.py draws
what the grading run (tests/_grading.py) returns. Each drill runs in a test process of its own and the
learner's code in a worker process behind it, with a time limit per test, so one
broken kernel (exception, compile error, hang, crash) costs a test, not the grade.
Each drill's lines are printed as soon as it is graded. Exit status: 0 when every
selected drill passes, 1 when one does not, 2 for a usage error (a drill or tree
that does not exist).
"""
import argparse
import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "tests"))

import _catalog  # noqa: E402  -- the drills by name, without importing them (and torch)
import _commands  # noqa: E402
from _process import become_subreaper, kill_leftovers, stop_children_on_signals  # noqa: E402
from _render import Printer, cleaned, for_json, make_console  # noqa: E402
from _tree import default_tree, tree_path  # noqa: E402

COMMANDS = ("show", "doctor", "watch", "bench", "chat", "grade", "class")  # and _commands.LIGHT


def load_machinery(named=()):
    """Import grading's machinery (torch behind it) here, _env first; the manifest's entries of `named`."""
    global _env, _grading, _integrity, _picture, _sandbox, DRILLS, SANDBOX, SHORT_TIMEOUT, TIMEOUT, live_pids
    import _env, _grading, _integrity, _picture, _sandbox  # noqa: E401
    from _manifest import DRILLS, drill
    from _worker import SANDBOX, SHORT_TIMEOUT, TIMEOUT, live_pids
    return [drill(d.id) for d in named]


def __getattr__(name):  # front._grading, front.SANDBOX (the tests): the machinery, loaded on first use
    if not name.startswith("__"):
        load_machinery()
    if name not in globals():
        raise AttributeError(name)
    return globals()[name]


def command(argv):
    """The commands of tests/_commands.py: `grader.py show l1 [--tree T]` and friends; `grade`
    is the grade (`grader.py grade l1` = `grader.py l1`), `chat` E1's (tests/drills/e1/bench.py)."""
    if argv[0] in ("grade", "class"):  # class: a roster of learners into a gradebook (tests/_class.py)
        return main(argv[1:]) if argv[0] == "grade" else __import__("_class").main(argv[1:])
    if argv[0] == "chat":
        from drills.e1.bench import chat
        return chat(argv[1:])
    parser = argparse.ArgumentParser(prog=f"grader.py {argv[0]}")
    if argv[0] != "doctor":
        parser.add_argument("drill", nargs="*" if argv[0] == "bench" else None)
    parser.add_argument("--tree", default=default_tree())
    parser.add_argument("--case", help="(show) draw this saved failing case instead of running the page's example")
    args = parser.parse_args(argv[1:])
    console = make_console()
    if argv[0] == "doctor":
        return _commands.doctor(console)
    try:
        named = [_catalog.drill(d) for d in (args.drill if argv[0] == "bench" else [args.drill])]
        tree_path(args.tree)
    except (KeyError, FileNotFoundError) as error:
        return _commands.usage_error(console, error)
    load = lambda: load_machinery(named) or list(DRILLS)  # noqa: E731 -- the drills, torch behind them
    if argv[0] == "bench":  # the reference's bandwidth report; without a GPU, said before torch loads, traffic lines
        no_gpu = _commands.surely_no_gpu() or load() and _env.INTERPRET
        return _commands.bench_without_gpu(load, console) if no_gpu else main(["--tree", "solutions", *args.drill])
    drill, *_ = load()
    if argv[0] == "show":
        return _picture.show(drill, tree_path(args.tree), console, args.case)
    return _commands.watch(drill, args.tree, lambda: main([drill.id, "--tree", args.tree, "--no-bench"]), console)


def grade_one(drill, tree, args, workdir, spinner, console):
    """One drill's summary: its tests, and where it fails its picture and (CPU) its traffic
    line; `seconds` is the wall time the learner waited for all of it."""
    started = time.monotonic()
    summary = _grading.grade_drill(drill, tree, args.timeout, workdir, args.test_timeout)
    # Where the learner's code hung in a test, the picture and the traffic case give it a short
    # limit (tests/_worker.py's SHORT_TIMEOUT) rather than waiting the whole one again.
    limit = SHORT_TIMEOUT if summary.get("timed_out") else (args.test_timeout or TIMEOUT)
    ran = not summary.get("does_not_import")  # a file that does not import: nothing else runs it
    if summary["status"] == "failing" and ran:
        spinner.update(f"drawing {drill.id.upper()}...")
        summary["picture"] = _picture.in_subprocess(drill, tree, console.width, console.is_terminal, workdir, limit)
    if summary["status"] != "not started" and _env.INTERPRET and ran:  # on a GPU the bandwidth report speaks
        spinner.update(f"counting {drill.id.upper()}'s bytes...")
        import _traffic  # numpy: not needed by `doctor`, which checks for it
        summary["traffic"] = _traffic.with_reference(drill, tree, ROOT / "solutions", limit)
    summary["seconds"] = round(time.monotonic() - started, 1)
    # The picture's and the traffic line's words come from subprocesses that ran the
    # learner's code: text, from here on (the picture keeps its colour codes: see _render).
    return dict(cleaned({k: v for k, v in summary.items() if k != "picture"}), picture=summary.get("picture"))


def check_integrity(grade, before, graded=None, tree_name="mine"):
    """After each drill and at the end (tests/_integrity.py): a change to the machinery withdraws
    every pass; one to the files the drill just graded (`graded`) makes it "edited during grading"."""
    if graded:
        _integrity.mark_edited(grade["drills"][-1], graded, tree_name)
    ok, says = _integrity.integrity(before=before)
    if ok is False:
        grade["integrity"] = dict(ok=False, says=says, during_grading=True)
        for s in grade["drills"]:
            if s["status"] == "passed":
                s["status"], s["problem"] = "failing", f"this pass is withdrawn: {says}"


def time_drill(grade, bench, ceiling, args, spinner):
    """The bench of the drill just graded: timed if it passed (the ceiling measured first,
    once a grade), else ended; each step of it gets the learner's limit (tests/_bench.py)."""
    s = grade["drills"][-1]
    if s["status"] != "passed":
        return bench.cancel()
    try:
        spinner.update("measuring the copy ceiling...")
        grade["ceiling_gbps"] = ceiling.gbps(args.timeout)
    except RuntimeError as error:
        bench.cancel()
        s["bench"] = dict(error=str(error))
        return
    spinner.update(f"timing {s['id'].upper()}...")
    s["bench"] = cleaned(bench.result(grade["ceiling_gbps"], args.timeout, args.test_timeout or TIMEOUT))


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in _commands.LIGHT:  # files only: never torch
        return _commands.light(argv, make_console())
    if argv and argv[0] in COMMANDS:
        return command(argv)
    parser = argparse.ArgumentParser(description="Grade the drills of one tree.",
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("drills", nargs="*", help="drill ids (default: all), e.g. l1")
    parser.add_argument("--tree", default=default_tree(), help="mine (default), solutions, or a folder")
    parser.add_argument("--json", metavar="FILE", help="also write the grade as JSON")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds allowed per drill (default 1200)")
    parser.add_argument("--test-timeout", type=float, default=None,
                        help="seconds your code may run in one test (default 60; also DRILLS_TIMEOUT)")
    parser.add_argument("--no-bench", action="store_true", help="skip the bandwidth report")
    args = parser.parse_args(argv)

    console = make_console()
    try:
        tree = tree_path(args.tree)
        named = [_catalog.drill(d) for d in args.drills]
    except (FileNotFoundError, KeyError) as error:
        return _commands.usage_error(console, error)
    drills = load_machinery(named) or list(DRILLS)
    stop_children_on_signals(lambda text: console.print(f"\n[bold red]{text}[/]"))
    before = _integrity.snapshot()
    ok, says = _integrity.integrity()
    grade = dict(tree=str(tree), tree_name=args.tree, device=_env.describe(), interpret=_env.INTERPRET, sandbox=SANDBOX,
                 sandbox_missing=_sandbox.missing(), drills=[], integrity=dict(ok=ok, says=says),
                 leftover_processes_killed=0, orphans_removed=_grading.remove_orphans())  # what a killed grade left
    printer = Printer(console, grade, [d.title for d in drills])
    printer.header()
    # The spinner only on a terminal: in a log it would print nothing useful, or a line per update.
    quiet = contextlib.nullcontext(SimpleNamespace(update=lambda text: None))
    # On a GPU a drill that passes is timed right after its tests: its bench process (and the
    # copy ceiling's, once) started with the tests, so their imports and compiles overlap them.
    timing, ceiling = not _env.INTERPRET and not args.no_bench, None
    if timing:
        import _bench  # Triton's testing helpers: only where there is a GPU to time
    with console.status("grading...") if console.is_terminal else quiet as spinner, \
            tempfile.TemporaryDirectory() as workdir:
        for drill in drills:
            spinner.update(f"grading {drill.id.upper()} {drill.title}...")
            graded = _integrity.digests(_integrity.graded_files(drill, tree, [d.stem for d in DRILLS]))
            scratch = _grading.DrillScratch(drill.id)  # the drill's scratch root (and workers' uid, as root)
            bench = _bench.Bench(drill, tree) if timing and not _grading.is_untouched_stub(drill, tree) else None
            if bench and ceiling is None:
                ceiling = _bench.Ceiling()
            grade["drills"].append(grade_one(drill, tree, args, workdir, spinner, console))
            if bench:
                time_drill(grade, bench, ceiling, args, spinner)
            # Nothing the learner's code started may outlive its drill and touch what comes next.
            grade["leftover_processes_killed"] += kill_leftovers(keep=live_pids())
            grade["drills"][-1]["left_behind"] = scratch.close()  # its scratch and /dev/shm names, removed
            check_integrity(grade, before, graded, args.tree)
            printer.drill(grade["drills"][-1])  # with what could not be removed
        if ceiling:
            ceiling.cancel()

        if _env.INTERPRET:
            grade["bench_note"] = "needs a GPU; here kernels run in Triton's CPU interpreter (correctness only)"
        elif args.no_bench:
            grade["bench_note"] = "skipped (--no-bench)"
        elif not any(s["status"] == "passed" for s in grade["drills"]):
            grade["bench_note"] = "shown for drills that pass their tests"
    # Nothing the learner's code started may outlive the grade and touch what it writes.
    grade["leftover_processes_killed"] += kill_leftovers(keep=live_pids())
    check_integrity(grade, before)
    _commands.record_grades(tree, grade["drills"])  # `make walkthrough` asks until a drill of mine/ passes
    printer.footer()
    if args.json:
        Path(args.json).write_text(json.dumps(for_json(grade), indent=2) + "\n")
    return 0 if all(s["status"] == "passed" for s in grade["drills"]) else 1


if __name__ == "__main__":
    become_subreaper()  # a process of its own: what the grade starts, however detached, ends with it
    sys.exit(main())
