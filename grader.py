#!/usr/bin/env python3
"""Grade a tree of drills: each drill's status, its first failure in plain words,
and on a GPU the bandwidth report.

    python grader.py                          # grade mine/, every drill
    python grader.py l1                       # one drill
    python grader.py --tree solutions         # the reference solutions
    python grader.py --tree ~/alice/mine --json alice.json   # an instructor
    python grader.py show|hint|reset|watch|diff l1, python grader.py doctor
                                              # see tests/_commands.py

Each drill runs in a process of its own with a time limit, so one broken kernel
(exception, compile error, hang, crash) is reported for its drill and the others
are still graded. Exit status 0 only when every selected drill passes.
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "tests"))

import _env  # noqa: E402  -- first: decides CPU interpreter vs GPU
import _commands  # noqa: E402
import _picture  # noqa: E402
import _wrong  # noqa: E402
from _manifest import DRILLS, drill as find_drill  # noqa: E402
from _tree import default_tree, tree_path  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.panel import Panel  # noqa: E402
from rich.table import Table  # noqa: E402
from rich.text import Text  # noqa: E402

STYLE = {"passed": "bold green", "failing": "bold red", "not started": "yellow"}


def run_process(cmd, timeout, env=None):
    """(returncode or None if killed at the time limit, stdout, stderr). The whole process group dies on timeout."""
    # One thread per child: the tensors are tiny, and two graders side by side on a
    # 2-core machine would otherwise oversubscribe it several times over.
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env={"OMP_NUM_THREADS": "1", **os.environ, **(env or {})})
    try:
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, out, err
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return None, out, err


def grade_drill(drill, tree, timeout, workdir=None):
    """Run one drill's tests in a fresh process and summarise them. The first small
    failing case is saved to <workdir>/<id>-case.pt for the picture."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.jsonl"
        cmd = [sys.executable, "-m", "pytest", f"tests/test_{drill.stem}.py", "--tree", str(tree), "-q",
               "--drills-report", str(report)]
        started = time.monotonic()
        dump = {"DRILLS_CASE_DUMP": str(Path(workdir) / f"{drill.id}-case.pt")} if workdir else {}
        code, out, err = run_process(cmd, timeout, dump)
        seconds = time.monotonic() - started
        lines = [json.loads(line) for line in report.read_text().splitlines()] if report.exists() else []
    collected = next((r["collected"] for r in lines if "collected" in r), 0)
    results = {r["test"]: r for r in lines if "outcome" in r}
    ran = list(results.values())
    passed = sum(r["outcome"] == "passed" for r in ran)
    skipped = sum(r["outcome"] == "skipped" for r in ran)
    failures = [r for r in ran if r["outcome"] == "failed"]
    total = collected - skipped
    summary = dict(id=drill.id, stem=drill.stem, title=drill.title, page=drill.page, passed=passed,
                   failed=total - passed, skipped=skipped, total=total, seconds=round(seconds, 1),
                   problem=None, first_failure=None)

    unfinished = [r for r in lines if "start" in r and r["start"] not in results]
    crashed = code is not None and (code < 0 or (code > 1 and unfinished))
    if code is None or crashed:
        where = unfinished[-1]["start"].split("::")[-1] if unfinished else "collecting the tests"
        if code is None:
            summary["problem"] = f"timed out after {timeout:.0f} s in {where} (an endless loop? a huge grid?)"
        else:
            summary["problem"] = (f"the test process crashed ({_signal_name(code)}) in {where}: usually a read "
                                  f"or write far outside a tensor")
    elif not lines or collected == 0:
        tail = "\n".join((err or out).strip().splitlines()[-12:])
        summary["problem"] = f"the tests could not start (pytest exit {code}):\n{tail}"
        summary["failed"] = summary["total"] = max(summary["total"], 1)

    real = [r for r in failures if r.get("kind") != "not_implemented"]
    named = [r for r in real if r.get("pitfalls")]
    first = (named or real or failures or [None])[0]
    if first:
        summary["first_failure"] = {k: first.get(k) for k in ("name", "kind", "message", "where", "example")}
    # A pitfall is named only on evidence: the learner's output is exactly a known-wrong
    # variant's, or the process died inside a test that exists to catch that pitfall.
    died_in = unfinished[-1]["pitfalls"] if (code is None or crashed) and unfinished else []
    evidence = (first or {}).get("pitfalls") or died_in
    summary["diagnosis"] = [dict(pitfall=p, says=_wrong.pitfalls(drill.stem)[p]["says"],
                                 section=_wrong.section(drill.stem)) for p in evidence]
    if summary["failed"] == 0 and summary["problem"] is None:
        summary["status"] = "passed"
    elif passed == 0 and failures and not real and summary["problem"] is None:
        summary["status"] = "not started"
    else:
        summary["status"] = "failing"
    return summary


def _signal_name(code):
    try:
        return signal.Signals(-code).name if code < 0 else f"exit code {code}"
    except ValueError:
        return f"signal {-code}"


def bench_drill(drill, tree, ceiling, timeout):
    code, out, err = run_process([sys.executable, "tests/_bench.py", "--drill", drill.id, "--tree", str(tree),
                                  "--ceiling-gbps", str(ceiling)], timeout)
    if code != 0:
        return {"error": "timed out" if code is None else "\n".join(err.strip().splitlines()[-6:])}
    return json.loads(out.strip().splitlines()[-1])


def measure_ceiling(timeout):
    code, out, err = run_process([sys.executable, "tests/_bench.py", "--ceiling"], timeout)
    if code != 0:
        raise RuntimeError(f"could not measure the copy ceiling: {err.strip()[-400:]}")
    return json.loads(out.strip().splitlines()[-1])["ceiling_gbps"]


def picture(drill, tree, console, workdir):
    """`grader.py show` for a failing drill, in its own process (the learner's code may
    crash): the first small case that failed if the tests saved one, else the page's."""
    env = {"COLUMNS": str(console.width), **({"FORCE_COLOR": "1"} if console.is_terminal else {})}
    saved = Path(workdir) / f"{drill.id}-case.pt"
    which = ["--case", str(saved)] if saved.exists() else []
    code, out, err = run_process([sys.executable, "grader.py", "show", drill.id, "--tree", str(tree), *which], 60, env)
    if code != 0:
        return None
    title = "the first small failing case" if saved.exists() else f"the example of {drill.page}"
    return f"{title}, drawn (python grader.py show {drill.id}):\n{out}"


# ---------------------------------------------------------------------------
# Output


def status_text(s):
    label = {"passed": f"passed {s['passed']}/{s['total']}",
             "not started": "not started",
             "failing": f"failing {s['failed']} of {s['total']}"}[s["status"]]
    return Text(label, style=STYLE[s["status"]])


def show(console, grade):
    console.print(f"[bold]drills[/] · tree [cyan]{grade['tree']}[/] · {grade['device']}")
    table = Table(show_header=True, header_style="bold", box=None, padding=(0, 2))
    for column in ("drill", "title", "status", "time"):
        table.add_column(column)
    for s in grade["drills"]:
        table.add_row(s["id"].upper(), s["title"], status_text(s), f"{s['seconds']:.0f} s")
    console.print(table)

    for s in grade["drills"]:
        if s["status"] == "not started":
            console.print(f"\n[yellow]{s['id'].upper()} not started[/]: read {s['page']}, then write "
                          f"{grade['tree_name']}/{s['stem']}.py and run [bold]make grade[/] again.")
            break
    for s in grade["drills"]:
        if s["status"] != "failing":
            continue
        body = Text()
        for finding in s.get("diagnosis", []):
            body.append(f"looks like: {finding['says']} ({finding['section']}, pitfall:{finding['pitfall']})\n",
                        style="bold yellow")
        if s["problem"]:
            body.append(s["problem"] + "\n", style="bold red")
        first = s["first_failure"]
        if first:
            body.append(f"first failing test: {first['name']}\n", style="bold")
            message = [line for line in first["message"].strip().splitlines()
                       if not (s.get("diagnosis") and line.strip().startswith("looks like:"))]
            body.append("\n".join(message) + "\n")
            if first.get("where"):
                body.append(f"at {first['where']}\n", style="dim")
            if first.get("example") and first["kind"] != "not_implemented":
                example = first["example"].strip().splitlines()
                body.append("\n".join(example[:14]) + ("\n..." if len(example) > 14 else "") + "\n", style="dim")
        body.append(f"read {s['page']}; run this drill alone with: python grader.py {s['id']}; "
                    f"a hint: python grader.py hint {s['id']}", style="italic")
        console.print(Panel(body, title=f"{s['id'].upper()} {s['title']}: {s['failed']} of {s['total']} failing",
                            border_style="red", expand=False))
        if s.get("picture"):
            console.print(Text.from_ansi(s["picture"]))

    console.print()
    if grade.get("bench_note"):
        console.print(f"[dim]bandwidth: {grade['bench_note']}[/]")
        return
    console.print(f"[bold]bandwidth[/] · copy ceiling {grade['ceiling_gbps']:.0f} GB/s "
                  f"(1 GiB device-to-device copy, measured here)")
    table = Table(header_style="bold", box=None, padding=(0, 2))
    for column in ("drill", "case", "µs", "GB/s", "of ceiling", "tier", "baseline", "its GB/s", "ours is"):
        table.add_column(column, justify="right" if column not in ("drill", "case", "tier", "baseline") else "left")
    for s in grade["drills"]:
        bench = s.get("bench")
        if not bench:
            continue
        if "error" in bench:
            table.add_row(s["id"].upper(), "[red]bench failed[/]", bench["error"][:60])
            continue
        for case in bench["cases"]:
            ours = case["ours"]
            for i, (name, base) in enumerate(case["baselines"].items()):
                first = i == 0
                table.add_row(s["id"].upper() if first else "", case["name"] if first else "",
                              f"{ours['us']:.1f}" if first else "", f"{ours['gbps']:.0f}" if first else "",
                              f"{100 * ours['of_ceiling']:.1f} %" if first else "", case["tier"] if first else "",
                              name, f"{base['gbps']:.0f}", f"{base['us'] / ours['us']:.2f}× faster")
    console.print(table)


COMMANDS = ("show", "hint", "reset", "doctor", "watch", "diff")


def command(argv):
    """The commands of tests/_commands.py: `grader.py show l1 [--tree T]` and friends."""
    parser = argparse.ArgumentParser(prog=f"grader.py {argv[0]}")
    if argv[0] != "doctor":
        parser.add_argument("drill")
    parser.add_argument("--tree", default=default_tree())
    parser.add_argument("--case", help="(show) draw this saved failing case instead of running the page's example")
    args = parser.parse_args(argv[1:])
    console = Console()
    if argv[0] == "doctor":
        return _commands.doctor(console)
    drill = find_drill(args.drill)
    if argv[0] == "show":
        if not hasattr(_picture, drill.id):
            console.print(f"{drill.id.upper()} has no picture yet")
            return 1
        if args.case:
            import torch
            getattr(_picture, f"{drill.id}_case")(torch.load(args.case, weights_only=False), console)
            return 0
        from _tree import load_drill
        getattr(_picture, drill.id)(load_drill(args.tree, drill.stem), console)
        return 0
    if argv[0] == "hint":
        return _commands.hint(drill, console)
    if argv[0] == "reset":
        return _commands.reset(drill, console)
    if argv[0] == "diff":
        return _commands.diff(drill, args.tree, console)
    return _commands.watch(drill, args.tree, lambda: main([drill.id, "--tree", args.tree, "--no-bench"]), console)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in COMMANDS:
        return command(argv)
    parser = argparse.ArgumentParser(description="Grade the drills of one tree.",
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("drills", nargs="*", help="drill ids (default: all), e.g. l1")
    parser.add_argument("--tree", default=default_tree(), help="mine (default), solutions, or a folder")
    parser.add_argument("--json", metavar="FILE", help="also write the grade as JSON")
    parser.add_argument("--timeout", type=float, default=600, help="seconds allowed per drill (default 600)")
    parser.add_argument("--no-bench", action="store_true", help="skip the bandwidth report")
    args = parser.parse_args(argv)

    console = Console()
    try:
        tree = tree_path(args.tree)
        drills = [find_drill(d) for d in args.drills] or list(DRILLS)
    except (FileNotFoundError, KeyError) as error:
        console.print(f"[red]{error}[/]")
        return 2
    grade = dict(tree=str(tree), tree_name=args.tree, device=_env.describe(), interpret=_env.INTERPRET, drills=[])
    with console.status("grading...") as spinner, tempfile.TemporaryDirectory() as workdir:
        for drill in drills:
            spinner.update(f"grading {drill.id.upper()} {drill.title}...")
            summary = grade_drill(drill, tree, args.timeout, workdir)
            if summary["status"] == "failing" and hasattr(_picture, drill.id):
                summary["picture"] = picture(drill, tree, console, workdir)
            grade["drills"].append(summary)

        if _env.INTERPRET:
            grade["bench_note"] = "needs a GPU; here kernels run in Triton's CPU interpreter (correctness only)"
        elif args.no_bench:
            grade["bench_note"] = "skipped (--no-bench)"
        elif not any(s["status"] == "passed" for s in grade["drills"]):
            grade["bench_note"] = "shown for drills that pass their tests"
        else:
            spinner.update("measuring the copy ceiling...")
            grade["ceiling_gbps"] = measure_ceiling(args.timeout)
            for s, drill in zip(grade["drills"], drills):
                if s["status"] == "passed":
                    spinner.update(f"timing {drill.id.upper()}...")
                    s["bench"] = bench_drill(drill, tree, grade["ceiling_gbps"], args.timeout)
    show(console, grade)
    if args.json:
        Path(args.json).write_text(json.dumps(grade, indent=2) + "\n")
    return 0 if all(s["status"] == "passed" for s in grade["drills"]) else 1


if __name__ == "__main__":
    sys.exit(main())
