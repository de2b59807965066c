"""What the class grade (tests/_class.py) writes for each learner, from the grade's own
--json: the gradebook's row, Gradescope's results.json and the feedback file. Names no
drill; handed the drills and their weights.

Gradescope's autograder format (its "Autograder Specifications"): a top-level `score`
and `max_score` and `tests`, each test with `name`, `score`, `max_score`, `status`
("passed" or "failed") and `output`. One test per drill, weighted by the points table
(POINTS each unless the instructor says otherwise). A drill scores its points when it
passes and nothing otherwise, as a GitHub Classroom step does; with `partial` a failing
drill scores its share of tests passed.
"""
import csv
import io
import re

from rich.console import Console

from _render import Printer, clean_text, show

POINTS = 10


class Book:
    def __init__(self, drills, points=None, partial=False):
        self.drills, self.partial = drills, partial
        self.points = {d.id: float((points or {}).get(d.id, POINTS)) for d in drills}

    def score(self, drill, s):
        """A drill's score from its summary (None: not graded)."""
        if not s or not s.get("total"):
            return 0.0
        if s["status"] == "passed":
            return self.points[drill.id]
        return round(self.points[drill.id] * s["passed"] / s["total"], 2) if self.partial else 0.0

    def row(self, one, status, grade=None, problem=None, seconds=""):
        """The gradebook's row of one learner: per drill its status and tests passed (k/n), the
        pitfalls the grade named, the sandbox, the integrity check, the wall time, the score."""
        row = dict(learner=one["slug"], folder=one["name"], status=status)
        by_id = {s["id"]: s for s in (grade or {}).get("drills", [])}
        for drill in self.drills:
            s = by_id.get(drill.id)
            missing = drill.stem in one.get("missing", ())
            row[drill.id] = "missing" if s and missing else s["status"] if s else ""
            row[f"{drill.id} passed"] = f"{s['passed']}/{s['total']}" if s and s.get("total") else ""
        row["pitfalls"] = "; ".join(f"{s['id']}:{d['pitfall']}" for s in by_id.values() for d in s.get("diagnosis", []))
        integrity = (grade or {}).get("integrity") or {}
        row["sandbox"] = (grade or {}).get("sandbox", "")
        row["integrity"] = "" if not grade else "ok" if integrity.get("ok") else clean_text(integrity.get("says", ""))
        total = sum(self.score(d, by_id.get(d.id)) for d in self.drills)
        row.update({"wall s": seconds, "score": round(total, 2) if grade else "",
                    "max score": sum(self.points.values()), "note": "; ".join(one["notes"] + [problem] * bool(problem))})
        return row

    def columns(self):
        return ["learner", "folder", "status"] + [c for d in self.drills for c in (d.id, f"{d.id} passed")] + [
            "pitfalls", "sandbox", "integrity", "wall s", "score", "max score", "note"]

    def csv(self, rows):
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, self.columns(), extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: _cell(v) for k, v in row.items()})
        return buffer.getvalue()

    def gradescope(self, grade, problem=None):
        """results.json: one test per drill; a learner whose grade did not finish scores 0
        with the reason as the output."""
        by_id = {s["id"]: s for s in (grade or {}).get("drills", [])}
        tests = []
        for drill in self.drills:
            s = by_id.get(drill.id)
            tests.append(dict(name=f"{drill.id.upper()} {s['title'] if s else drill.stem}", score=self.score(drill, s),
                              max_score=self.points[drill.id],
                              status="passed" if s and s["status"] == "passed" else "failed",
                              output=drill_text(grade, s) if s else problem or "not graded"))
        result = dict(score=round(sum(t["score"] for t in tests), 2), max_score=sum(t["max_score"] for t in tests),
                      tests=tests, visibility="visible")
        if problem:
            result["output"] = problem
        return result


def _cell(value):
    """A gradebook cell: text a spreadsheet would read as a formula gets a leading quote."""
    return f"'{value}" if isinstance(value, str) and value[:1] in ("=", "+", "-", "@", "\t", "\r") else value


def _text_console(width=110):
    return Console(file=io.StringIO(), width=width, color_system=None, force_terminal=False, highlight=False)


def feedback(name, tree, grade):
    """<learner>.md: the terminal's lines and panels as text, in a fence longer than any
    run of backticks the text holds (the learner's own output cannot close it)."""
    console = _text_console()
    show(console, grade)
    text = console.file.getvalue()
    fence = "`" * max(3, 1 + max((len(m) for m in re.findall(r"`+", text)), default=0))
    return f"# {name}\n\nGraded from `{clean_text(tree).replace('`', chr(39))}`.\n\n{fence}text\n{text}{fence}\n"


def drill_text(grade, s):
    """One drill's lines as the terminal shows them (its row, its box, its traffic line)."""
    console = _text_console()
    Printer(console, grade, [s["title"]]).drill(s)
    return console.file.getvalue()


def summary_line(grade, status, problem, seconds):
    """A learner's one line in the terminal."""
    if not grade:
        return f"{status}: {problem}"
    parts = [f"{s['id'].upper()} {s['status']}" + (f" ({s['passed']} of {s['total']} tests pass)" if s.get("total")
                                                   and s["status"] != "passed" else f" {s['passed']}/{s['total']}"
                                                   if s.get("total") else "") for s in grade["drills"]]
    return " · ".join(parts) + f" ({seconds:.0f} s)"
