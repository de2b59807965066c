"""Drawing a grade in the terminal: the status table, the first failure of each failing
drill, the traffic lines and the bandwidth table. Names no drill; grader.py hands it
the grade it assembled.
"""
import os
import sys

from rich.console import Console
from rich.panel import Panel
from rich.table import Table
from rich.text import Text


def make_console():
    # Off a terminal (make bench | tee, a CI log) rich would fall back to 80 columns and
    # cut the report's cells; use a width that fits it.
    return Console() if sys.stdout.isatty() else Console(width=int(os.environ.get("COLUMNS", 160)))


# How tests/_report.py marks a line of the learner's output that a library printed.
INTERPRETER_MARK, LIBRARY_MARK = "(Triton's interpreter, not your print) ", "(a library, not your print) "

STYLE = {"passed": "bold green", "failing": "bold red", "not started": "yellow"}


def status_text(s):
    label = {"passed": f"passed {s['passed']}/{s['total']}",
             "not started": "not started",
             "failing": f"failing {s['failed']} of {s['total']}"}[s["status"]]
    return Text(label, style=STYLE[s["status"]])


def show(console, grade):
    console.print(f"[bold]drills[/] · tree [cyan]{grade['tree']}[/] · {grade['device']}")
    if grade.get("sandbox") == "none":
        console.print("[bold yellow]warning:[/] no Landlock on this kernel (Linux >= 5.13 has it): the learner's code "
                      "runs unconfined, so this grade is not tamper-proof here")
    if grade.get("integrity") and not grade["integrity"]["ok"]:
        console.print(f"[bold yellow]warning:[/] {grade['integrity']['says']}")
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
        if s["status"] == "failing":
            console.print(_failure_panel(s, grade["tree_name"]))
            if s.get("picture"):
                console.print(Text.from_ansi(s["picture"]))

    _traffic_lines(console, grade)
    console.print()
    if grade.get("bench_note"):
        console.print(f"[dim]bandwidth: {grade['bench_note']}[/]")
        return
    _bench_table(console, grade)


TIER_STYLE = {"at the roofline": "green", "fair": "yellow", "wasteful": "bold red", "not all counted": "yellow"}


def _traffic_lines(console, grade):
    """One line per drill: the bytes its traffic case moved against the fewest (CPU only)."""
    rows = [s for s in grade["drills"] if s.get("traffic")]
    if not rows:
        return
    console.print("\n[bold]traffic[/] · bytes each drill's traffic case moved in Triton's CPU interpreter, "
                  "against the fewest the op needs (the bytes the GPU bandwidth report counts). The total weighs "
                  "each tensor by its bytes; the reference's line, the one its page prints, is beside yours")
    for s in rows:
        t = s["traffic"]
        if "error" in t:
            console.print(f"{s['id'].upper()}  [red]{t['error']}[/]")
            continue
        line = Text(t["line"].removesuffix(t["tier"]))
        line.append(t["tier"], style=TIER_STYLE.get(t["tier"], ""))
        console.print(line)
        if t.get("reference"):
            console.print(f"    [dim]reference: {t['reference'].removeprefix(s['id'].upper()).strip()}[/]")
        if t.get("shares"):
            console.print(f"    [dim]the total is set by {matters(t['shares'])}[/]")
        for where in t["where"]:
            console.print(f"    [yellow]{where}[/]")


def matters(shares, floor=0.05):
    """"K/V 97%, query 3% of the fewest bytes; block table, lengths under 5% each": which
    tensors set the total and which barely move it."""
    big = [f"{label} {100 * share:.0f}%" for label, share in shares.items() if share >= floor]
    small = [label for label, share in shares.items() if share < floor]
    return ", ".join(big) + " of the fewest bytes loaded" + (
        f"; {', '.join(small)} under {100 * floor:.0f}% each, so their ratios barely move the total" if small else "")


def _failure_panel(s, tree):
    body = Text()
    for finding in s.get("diagnosis", []):
        body.append(f"looks like: {finding['says']} ({finding['section']}, pitfall:{finding['pitfall']})\n",
                    style="bold yellow")
    if s["problem"]:
        body.append(s["problem"] + "\n", style="bold red")
    first = s["first_failure"]
    if first:
        kind = {"crash": " (crashed)", "timeout": " (timed out)"}.get(first["kind"], "")
        body.append(f"first failing test: {first['name']}{kind}\n", style="bold")
        message = [line for line in first["message"].strip().splitlines()
                   if not (s.get("diagnosis") and line.strip().startswith("looks like:"))]
        body.append("\n".join(message) + "\n")
        if first.get("where"):
            body.append(f"at {first['where']}\n", style="dim")
        if first.get("example") and first["kind"] != "not_implemented":
            example = first["example"].strip().splitlines()
            body.append("\n".join(example[:14]) + ("\n..." if len(example) > 14 else "") + "\n", style="dim")
        for stream in ("stdout", "stderr"):
            if first.get(stream):
                body.append(f"your code printed ({stream}, last lines):\n", style="dim")
                for line in first[stream].splitlines():  # the learner's own lines stand out, a library's are dim
                    body.append(line + "\n", style="dim" if line.startswith((INTERPRETER_MARK, LIBRARY_MARK)) else "")
    body.append(f"read {s['page']}; run this drill alone with: python grader.py {s['id']} --tree {tree}; "
                f"a hint: python grader.py hint {s['id']}; one test with its output: "
                f".venv/bin/pytest --tree={tree} -m {s['id']} -x -s -k NAME", style="italic")
    return Panel(body, title=f"{s['id'].upper()} {s['title']}: {s['failed']} of {s['total']} failing",
                 border_style="red", expand=False)


def compared(theirs_us, ours_us):
    """"1.52× faster" or "3.6× slower": a ratio below 1 reads as slower, never "0.28× faster"."""
    ratio = theirs_us / ours_us
    return f"{ratio:.2f}× faster" if ratio >= 1 else f"{1 / ratio:.1f}× slower"


def _bench_table(console, grade):
    console.print(f"[bold]bandwidth[/] · copy ceiling {grade['ceiling_gbps']:.0f} GB/s "
                  f"(1 GiB device-to-device copy, measured here)")
    table = Table(header_style="bold", box=None, padding=(0, 2))
    for column in ("drill", "case", "µs", "rate", "of ceiling", "tier", "baseline", "its rate", "ours is"):
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
            rate, unit = ("tflops", "TFLOP/s") if case.get("compute_bound") else ("gbps", "GB/s")
            for i, (name, base) in enumerate(case["baselines"].items()):
                first = i == 0
                table.add_row(s["id"].upper() if first else "", case["name"] if first else "",
                              f"{ours['us']:.1f}" if first else "", f"{ours[rate]:.0f} {unit}" if first else "",
                              "" if not first or case.get("compute_bound") else f"{100 * ours['of_ceiling']:.1f} %",
                              case["tier"] if first else "", name, f"{base[rate]:.0f} {unit}",
                              compared(base["us"], ours["us"]))
    console.print(table)


