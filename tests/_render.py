"""Drawing a grade in the terminal, as grader.py makes it: a header, then each drill's
lines (its status row, its first failure, its picture, its traffic line) as soon as
that drill is graded, then a footer (the bandwidth table, what the integrity check
found, what was left running). Names no drill; grader.py hands it what it assembled.

Everything the learner's code printed or raised is text here: `clean_text` removes
control characters from it (grader.py and tests/_report.py apply it where the grade's
records are made), and nothing learner-derived is printed through rich markup.
"""
import os
import re
import shlex
import sys
import unicodedata

from rich.console import Console
from rich.panel import Panel
from rich.style import Style
from rich.table import Table
from rich.text import Text


def make_console():
    # Off a terminal (make bench | tee, a CI log) rich would fall back to 80 columns and
    # cut the report's cells; use a width that fits it.
    return Console() if sys.stdout.isatty() else Console(width=int(os.environ.get("COLUMNS", 160)))


# --- the learner's text is text ------------------------------------------------------

# C0 but newline and tab, DEL, C1: what moves the cursor, clears or retitles the screen,
# rings the bell, or starts an escape sequence (ESC; 0x9b, CSI on its own). A whole escape
# sequence (CSI, OSC, or ESC and one byte) goes first, so no "[2J" is left behind. Then
# the line and paragraph separators U+2028/U+2029 (a line break to some terminals and
# viewers, none to others).
_CONTROL = re.compile("(?:\x1b\\[|\x9b)[0-?]*[ -/]*[@-~]|(?:\x1b\\]|\x9d)[^\x07\x1b\n]*(?:\x07|\x1b\\\\)?|"
                      "\x1b[@-_]|[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029]")


def clean_text(text):
    """`text` without escape sequences and control characters but newline and tab, and
    without Unicode format characters (category Cf: bidi overrides and isolates, which
    reorder what a reader sees ("Trojan Source"), zero-width spaces and joiners, the BOM):
    anything not a string is returned as it is. An ASCII string has no Cf character, so
    only other strings are read character by character."""
    if not isinstance(text, str):
        return text
    text = _CONTROL.sub("", text)
    return text if text.isascii() else "".join(c for c in text if unicodedata.category(c) != "Cf")


def cleaned(value):
    """`value` (a test record, a drill's summary, a traffic or bench result: dicts, lists
    and strings) with `clean_text` applied to every string in it, keys included."""
    if isinstance(value, dict):
        return {clean_text(k): cleaned(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [cleaned(v) for v in value]
    return clean_text(value)


def picture_text(picture):
    """A drill's picture as a Text to print. tests/_picture.py draws it in a process of its
    own and hands it back as data: {"title": ..., "segments": [[text, style], ...]}, the
    styles our drawing's own, the text cleaned here (its numbers and words may come from
    the learner's code). Colour comes from those styles and from nothing else: a string
    (a picture from anywhere else) is plain text, its escape codes removed, never read as
    colours, so no learner's escape can paint a row."""
    if not isinstance(picture, dict):
        return Text(clean_text(str(picture or "")))
    text = Text(clean_text(str(picture.get("title") or "")))
    for segment in picture.get("segments") or ():
        if not (isinstance(segment, (list, tuple)) and len(segment) == 2 and all(isinstance(x, str) for x in segment)):
            continue
        try:
            style = Style.parse(segment[1]) if segment[1] else None
        except Exception:  # not a style rich knows: the text, plain
            style = None
        text.append(clean_text(segment[0]), style=style)
    return text


def for_json(grade):
    """The grade as --json writes it: the pictures as plain text (no escape codes)."""
    return dict(grade, drills=[dict(s, picture=picture_text(s["picture"]).plain) if s.get("picture") else s
                               for s in grade["drills"]])


# --- what to run next -------------------------------------------------------------------

def commands(drill_id, tree, test=None):
    """The commands a failure box suggests, in the form that works from the shell the
    learner came from (make sets up and uses .venv; there a bare `python grader.py` is
    ModuleNotFoundError: torch). `test`: the failing test, by its function's name."""
    where = "" if str(tree) == "mine" else f" TREE={shlex.quote(str(tree))}"
    one = f" -k {test.split('[')[0]}" if test else ""
    return dict(grade=f"make grade DRILL={drill_id}{where}", hint=f"make hint DRILL={drill_id}",
                show=f"make show DRILL={drill_id}{where}",
                test=f".venv/bin/pytest --tree={shlex.quote(str(tree))} -m {drill_id} -x -s{one}")


# --- the grade, printed as it is made ------------------------------------------------------

# How tests/_report.py marks a line of the learner's output that a library printed.
INTERPRETER_MARK, LIBRARY_MARK = "(Triton's interpreter, not your print) ", "(a library, not your print) "

STYLE = {"passed": "bold green", "failing": "bold red", "not started": "yellow",
         "edited during grading": "bold yellow"}


def status_text(s):
    failing = f"failing {s['failed']} of {s['total']}" if s["failed"] else "failing"  # 0: withdrawn, see its box
    passed = f"passed {s['passed']}/{s['total']}" + (f", {len(s['left_out'])} left out" if s.get("left_out") else "")
    label = {"passed": passed, "not started": "not started", "failing": failing,
             "edited during grading": "edited during grading"}
    return Text(label[s["status"]], style=STYLE[s["status"]])


class Printer:
    """Prints a grade while grader.py makes it: `header` first, `drill` as soon as each
    drill is graded, `footer` last, flushing after each, so a log or a pipe (| tee, CI)
    shows each drill's lines when a terminal would."""

    def __init__(self, console, grade, titles=()):
        self.console, self.grade = console, grade
        self.title_width = max(map(len, titles), default=0)
        self.said = set()  # the explanations printed once: "not started", "traffic"

    def _flush(self):
        self.console.file.flush()

    def header(self):
        print_ = self.console.print
        print_(Text.assemble(("drills", "bold"), " · tree ", (clean_text(self.grade["tree"]), "cyan"),
                             f" · {self.grade['device']}"))
        missing = self.grade.get("sandbox_missing") or (["Landlock", "seccomp"] if self.grade.get("sandbox") == "none"
                                                        else [])
        if missing:
            why = {"Landlock": "Landlock (Linux >= 5.13) would keep it to its own files",
                   "seccomp": "seccomp (libseccomp and pyseccomp) would refuse its sockets and calls on other processes"}
            print_(f"[bold yellow]warning:[/] no {' and no '.join(missing)} here, so the learner's code runs less "
                   f"confined and this grade is not tamper-proof: " + "; ".join(why[m] for m in missing))
        integrity = self.grade.get("integrity")
        if integrity and not integrity["ok"]:
            print_(Text.assemble(("warning: ", "bold yellow"), clean_text(integrity["says"])))
        for line in self.grade.get("orphans_removed") or ():  # tests/_scratch.py's remove_orphans
            print_(Text(clean_text(line), style="dim"))
        print_(self._row("drill", "title", Text("status"), "time"), style="bold")
        self._flush()

    def _row(self, drill, title, status, time):
        status.pad_right(max(0, 18 - len(status)))
        return Text.assemble(f"{drill:<5} ", f"{title:<{self.title_width}}  ", status, f"{time:>6}")

    def drill(self, s):
        """One drill's lines: its status row, then for a first not-started drill what to do,
        for a failing one its box and picture, and on the CPU its traffic line."""
        print_ = self.console.print
        self.title_width = max(self.title_width, len(s["title"]))
        print_(self._row(s["id"].upper(), s["title"], status_text(s), f"{s.get('seconds', 0):.0f} s"))
        if s.get("kernels"):  # make grade KERNELS=...: say whose kernels ran, and what that left out
            print_(Text(f"      graded on the L1 and L3 of {clean_text(s['kernels'])} (KERNELS=), not this tree's",
                        style="dim"))
        for line in s.get("milestones") or ():
            print_(Text(f"      {line}", style="bold green"))
        for left in s.get("left_out") or ():
            print_(Text(f"      left out: {clean_text(left['name'])}: {clean_text(left['why'])}", style="dim"))
        if s["status"] == "not started" and "not started" not in self.said:
            self.said.add("not started")
            print_(Text.assemble((f"{s['id'].upper()} not started", "yellow"), f": read {s['page']}, then write "
                                 f"{clean_text(self.grade['tree_name'])}/{s['stem']}.py and run ",
                                 (commands(s["id"], self.grade["tree_name"])["grade"], "bold"), " again."))
        if s.get("rejections_not_counted"):  # tests/_grading.py's summarize: refusals alone are no progress
            print_(Text(f"      {s['rejections_not_counted']} input-rejection test(s) pass too; they count once the "
                        f"worked example passes", style="dim"))
        if s["status"] == "edited during grading":  # the learner saved while it ran: not a verdict
            print_(Text(f"      {clean_text(s['problem'])}", style="yellow"))
        if s["status"] == "failing":
            print_(_failure_panel(s, self.grade["tree_name"]))
            if s.get("picture"):
                print_(picture_text(s["picture"]))
        if s.get("traffic"):
            if "traffic" not in self.said:
                self.said.add("traffic")
                _traffic_intro(self.console)
            _traffic_line(self.console, s)
        for line in s.get("left_behind") or ():  # what the grader could not remove after the drill
            print_(Text(f"      left behind: {clean_text(line)}", style="yellow"))
        self._flush()

    def footer(self):
        print_ = self.console.print
        print_()
        if self.grade.get("bench_note"):
            print_(Text(f"bandwidth: {self.grade['bench_note']}", style="dim"))
        else:
            _bench_table(self.console, self.grade)
        integrity = self.grade.get("integrity")
        if integrity and integrity.get("during_grading"):
            print_(Text.assemble(("integrity: ", "bold red"), clean_text(integrity["says"]),
                                 "; every pass of this grade is withdrawn"))
        if self.grade.get("leftover_processes_killed"):
            print_(Text(f"ended {self.grade['leftover_processes_killed']} leftover process(es) after the tests",
                        style="dim"))
        self._flush()


def show(console, grade):
    """The whole grade at once (the same lines grader.py prints as it goes)."""
    printer = Printer(console, grade, [s["title"] for s in grade["drills"]])
    printer.header()
    for s in grade["drills"]:
        printer.drill(s)
    printer.footer()


TIER_STYLE = {"at the roofline": "green", "fair": "yellow", "wasteful": "bold red", "not all counted": "yellow"}


def _traffic_intro(console):
    console.print("\n[bold]traffic[/] · bytes each drill's traffic case moved in Triton's CPU interpreter, "
                  "against the fewest the op needs (the bytes the GPU bandwidth report counts). The total weighs "
                  "each tensor by its bytes; the reference's line, the one its page prints, is beside yours. "
                  "Counted in the worker, beside your code: its word, so advice, which decides no test (a pitfall "
                  "named here, such as a row read that should not be, fails nothing while the values are right)")


def _traffic_line(console, s):
    """A drill's traffic line (CPU only): the bytes its traffic case moved against the fewest."""
    t = cleaned(s["traffic"])
    if "error" in t:
        console.print(Text.assemble(f"{s['id'].upper()}  ", (t["error"], "red")))
        return
    line = Text(t["line"].removesuffix(t["tier"]))
    line.append(t["tier"], style=TIER_STYLE.get(t["tier"], ""))
    console.print(line)
    if t.get("reference"):
        console.print(Text(f"    reference: {t['reference'].removeprefix(s['id'].upper()).strip()}", style="dim"))
    if t.get("shares"):
        console.print(Text(f"    the total is set by {matters(t['shares'])}", style="dim"))
    for where in t["where"]:
        console.print(Text(f"    {where}", style="yellow"))


def _traffic_lines(console, grade):
    """Every drill's traffic line, under the explanation."""
    rows = [s for s in grade["drills"] if s.get("traffic")]
    if rows:
        _traffic_intro(console)
    for s in rows:
        _traffic_line(console, s)


def matters(shares, floor=0.05):
    """"K/V 97%, query 3% of the fewest bytes; block table, lengths under 5% each": which
    tensors set the total and which barely move it."""
    big = [f"{label} {100 * share:.0f}%" for label, share in shares.items() if share >= floor]
    small = [label for label, share in shares.items() if share < floor]
    return ", ".join(big) + " of the fewest bytes loaded" + (
        f"; {', '.join(small)} under {100 * floor:.0f}% each, so their ratios barely move the total" if small else "")


def _failure_panel(s, tree):
    s = cleaned(s)  # the learner's text, whoever made the summary
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
    run = commands(s["id"], tree, first and first["name"])
    body.append(f"read {s['page']}; this drill alone: {run['grade']}; a hint: {run['hint']}; its picture: "
                f"{run['show']}" + (f"; the first failing test, with all your code prints: {run['test']}" if first
                                    else ""), style="italic")
    # No failed test (a pass withdrawn, a grade that could not run): no count to show.
    count = f"{s['failed']} of {s['total']} failing" if s["failed"] else "failing"
    return Panel(body, title=Text(f"{s['id'].upper()} {s['title']}: {count}"),
                 border_style="red", expand=False)


def compared(theirs_us, ours_us):
    """"1.52× faster", "3.60× slower" or "same speed" (equal times never read "1.0× slower");
    a ratio below 1 reads as slower, never "0.28× faster"."""
    ratio = theirs_us / ours_us
    factor = f"{max(ratio, 1 / ratio):.2f}"
    return "same speed" if factor == "1.00" else f"{factor}× {'faster' if ratio > 1 else 'slower'}"


def duration(us):
    """A time in the unit that reads best: "257.4 µs", "12.44 ms", "2.15 s"."""
    if us < 1e3:
        return f"{us:.1f} µs"
    return f"{us / 1e3:.2f} ms" if us < 1e6 else f"{us / 1e6:.2f} s"


def _rate(case):
    """(the key of a row's rate, its unit): GB/s, TFLOP/s for a compute-bound case, or the
    unit a self-timed case names (tokens/s)."""
    if case.get("unit"):
        return "rate", case["unit"]
    return ("tflops", "TFLOP/s") if case.get("compute_bound") else ("gbps", "GB/s")


def drawable(bench):
    """Whether a bench result has what the table reads (names, positive times, rates): it
    comes from a process that ran the learner's code, and a row it cannot draw would end
    the grade."""
    def row(r, rate):
        return isinstance(r, dict) and all(isinstance(r.get(k), (int, float)) for k in ("us", rate)) and r["us"] > 0

    def case_ok(case):
        if not isinstance(case, dict) or not all(isinstance(case.get(k), str) for k in ("name", "tier")):
            return False
        rate, _ = _rate(case)
        baselines = case.get("baselines")
        return (row(case.get("ours"), rate) and isinstance(case["ours"].get("of_ceiling", 0), (int, float))
                and isinstance(case.get("unit") or "", str) and isinstance(baselines, dict)
                and all(isinstance(name, str) and row(base, rate) for name, base in baselines.items()))
    return isinstance(bench, dict) and isinstance(bench.get("cases"), list) and all(map(case_ok, bench["cases"]))


def _bench_table(console, grade):
    console.print(f"[bold]bandwidth[/] · copy ceiling {grade['ceiling_gbps']:.0f} GB/s "
                  f"(1 GiB device-to-device copy, measured here)")
    table = Table(header_style="bold", box=None, padding=(0, 2))
    for column in ("drill", "case", "time", "rate", "of ceiling", "tier", "baseline", "its rate", "ours is"):
        table.add_column(column, justify="right" if column not in ("drill", "case", "tier", "baseline") else "left")
    for s in grade["drills"]:
        bench = cleaned(s.get("bench"))
        if not bench:
            continue
        if not drawable(bench):  # an error, or what the table cannot draw
            # Text, not markup: the error is the learner's process's output
            error = bench.get("error") if isinstance(bench, dict) else None
            table.add_row(s["id"].upper(), Text("bench failed", style="red"),
                          Text(str(error or "its output is not a bench result")[:60]))
            continue
        for case in bench["cases"]:
            ours = case["ours"]
            rate, unit = _rate(case)
            for i, (name, base) in enumerate(case["baselines"].items()):
                first = i == 0
                cells = (s["id"].upper() if first else "", case["name"] if first else "",
                         duration(ours["us"]) if first else "", f"{ours[rate]:.0f} {unit}" if first else "",
                         "" if not first or "of_ceiling" not in ours or case.get("compute_bound")
                         else f"{100 * ours['of_ceiling']:.1f} %",
                         case["tier"] if first else "", name, f"{base[rate]:.0f} {unit}",
                         compared(base["us"], ours["us"]))
                table.add_row(*map(Text, cells))
    console.print(table)
