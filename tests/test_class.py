"""The class grade (`grader.py class ROSTER`, tests/_class.py): every output's format,
resume, Ctrl-C, bad rosters, the boundary between learners, copy detection on planted
copies and on independent right answers, and the GitHub Classroom workflow. Stub trees
grade "not started" in seconds; one real drill of one tree (the boundary's probe) runs."""
import builtins
import csv
import io
import json
import keyword
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import tokenize
from types import SimpleNamespace

import pytest

import _class
import _sandbox
import _similarity
from _front import make_echo
from _gradebook import Book, feedback
from _manifest import DRILLS, drill
from _render import make_console
from _tree import ROOT

pytestmark = pytest.mark.meta

L1 = drill("l1")
STUB = _class.stub(L1.stem)
FILE = f"{L1.stem}.py"
CASES = ROOT / "tests" / "similarity_cases" / "l1"


def learner(roster, name, text=STUB, clone=False):
    folder = roster / name / ("mine" if clone else "")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / FILE).write_bytes(text if isinstance(text, bytes) else text.encode())
    return roster / name


@pytest.fixture
def klass(capsys, monkeypatch):
    """`grader.py class ROSTER --drills l1 --out OUT ...` run in this process (each learner's
    grade is its own grader.py process all the same): (exit status, stdout, stderr)."""
    monkeypatch.setenv("COLUMNS", "160")
    # Other work on tests/ while this runs would have every learner graded again (as it should):
    # the machinery's hash is held still here; test_the_key_changes_... checks that it counts.
    monkeypatch.setattr(_class, "machinery_digest", lambda stubs: "the machinery")

    def run(roster, out, *more):
        try:
            code = _class.main([str(roster), "--drills", "l1", "--out", str(out), *more], DRILLS)
        except SystemExit as stop:  # argparse's usage errors
            code = stop.code
        captured = capsys.readouterr()
        return SimpleNamespace(returncode=code, stdout=captured.out, stderr=captured.err)
    return run


PROBE = """import os
here = os.path.dirname(os.path.abspath(__file__))
tries = [("own", __file__), ("amy", {amy!r}), ("roster", {roster!r}), ("out", {out!r}), ("book", {book!r})]
tries += [("copy", os.path.join(here, "..", "..", str(k), "tree", {file!r})) for k in range(8)]
tries = [(name, path) for name, path in tries if name == "own" or os.path.realpath(path) != os.path.realpath(__file__)]
seen = []
for name, path in tries:
    try:
        open(path).read() if os.path.isfile(path) else os.listdir(path)
        seen.append(name)
    except OSError:
        pass
raise RuntimeError(f"READABLE={{seen}}")
"""


def gradebook(out):
    with open(out / "gradebook.csv", newline="") as f:
        return {row["learner"]: row for row in csv.DictReader(f)}


# --- the roster ----------------------------------------------------------------------------

def test_each_bad_roster_entry_gets_one_line_and_the_rest_is_graded(tmp_path, monkeypatch):
    roster = tmp_path / "roster"
    learner(roster, "ok")
    learner(roster, "clone", clone=True)
    learner(roster, "Dup"), learner(roster, "dup")
    for name in ("-x", "a..b", "new\nline"):
        learner(roster, name)
    (roster / "empty").mkdir()
    (roster / "notes.txt").write_text("not a learner")
    (roster / "link").symlink_to(roster / "ok")
    spaced = learner(roster, "Ann Lee")
    (spaced / "helper.py").write_text("x = 1\n")
    learner(roster, "locked")
    learner(roster, ".hidden"), (roster / ".git").mkdir(), (roster / ".DS_Store").write_text("")
    real = os.listdir
    monkeypatch.setattr(_class.os, "listdir", lambda p: (_ for _ in ()).throw(PermissionError(13, "Permission denied"))
                        if str(p).endswith("locked") else real(p))
    found = {one["name"]: one for one in _class.roster(roster, [L1], [d.stem for d in DRILLS])}
    problems = {name: one["problem"] for name, one in found.items()}
    assert problems["ok"] is None and found["ok"]["files"] == {L1.stem: STUB}
    assert problems["clone"] is None and found["clone"]["tree"].endswith("mine")
    assert "same name as dup once normalised" in problems["Dup"] and "same name as Dup" in problems["dup"]
    assert "would read as an option" in problems["-x"]
    assert "'..'" in problems["a..b"]
    assert "newline" in problems[ascii("new\nline")]
    assert "holds no tree" in problems["empty"]
    assert "a file, not a folder" in problems["notes.txt"]
    assert "a link" in problems["link"]
    assert problems["locked"] == "unreadable: Permission denied"
    assert "a hidden folder" in problems[".hidden"] and ".git" not in problems and ".DS_Store" not in problems
    assert problems["Ann Lee"] is None and found["Ann Lee"]["slug"] == "ann-lee"
    assert "extra files, not graded: helper.py" in "; ".join(found["Ann Lee"]["notes"])
    assert all("\n" not in (p or "") for p in problems.values())


def test_the_key_changes_with_the_graded_files_the_drills_and_the_machinery():
    one = dict(files={L1.stem: STUB})
    key = _class.grade_key(one, [L1], "m", {})
    assert key == _class.grade_key(dict(files={L1.stem: STUB}), [L1], "m", {})
    assert key != _class.grade_key(dict(files={L1.stem: STUB + b"#"}), [L1], "m", {})
    assert key != _class.grade_key(one, [L1, drill("l2")], "m", {})
    assert key != _class.grade_key(one, [L1], "changed tests", {})


# --- the run: outputs, resume, Ctrl-C, crashes --------------------------------------------

def test_a_class_run_writes_every_output_keeps_learners_apart_and_a_second_run_keeps_them(tmp_path, klass):
    """Amy and Bob have the untouched stub; Eve's module, imported by its worker, tries to read
    Amy's file in the roster, Amy's private copy beside its own, the roster and the outputs
    (amy, a stub, is written while Eve's grade starts), and its error says what it could read."""
    roster, out = tmp_path / "roster", tmp_path / "out"
    learner(roster, "amy"), learner(roster, "bob", clone=True), (roster / "empty").mkdir()
    learner(roster, "-x")
    learner(roster, "eve", PROBE.format(amy=str(roster / "amy" / FILE), file=FILE, roster=str(roster), out=str(out),
                                        book=str(out / "gradebook.csv")))
    run = klass(roster, out, "--jobs", "2", "--points", "l1=25")
    assert run.returncode == 0, run.stderr
    eve = json.loads((out / "eve.json").read_text())["drills"][0]
    if not _sandbox.missing():  # the error, as the grade reports a module that does not import
        assert "READABLE=['own']" in json.dumps(eve)
    assert "drills-class-" not in (out / "eve.json").read_text()  # the private copy's path reads as Eve's folder
    assert gradebook(out)["eve"]["l1"] == "failing" and gradebook(out)["eve"]["l1 passed"] == f"0/{eve['total']}"
    assert "empty: not graded: holds no tree" in run.stdout and "-x: not graded:" in run.stdout
    book = gradebook(out)
    assert list(book) == ["x", "amy", "bob", "empty", "eve"]  # the roster's order
    assert book["amy"]["status"] == "graded" and book["amy"]["l1"] == "not started"
    assert book["amy"]["max score"] == "25.0" and book["amy"]["score"] == "0.0"
    assert book["empty"]["status"] == "not graded" and "holds no tree" in book["empty"]["note"]
    assert book["x"]["folder"] == "'-x"  # what a spreadsheet would read as a formula is quoted
    assert next(csv.reader(open(out / "gradebook.csv")))[:5] == ["learner", "folder", "status", "l1", "l1 passed"]
    grade = json.loads((out / "bob.json").read_text())
    assert grade["tree"] == str(roster / "bob" / "mine") and grade["drills"][0]["status"] == "not started"
    results = json.loads((out / "amy" / "results.json").read_text())
    assert set(results) >= {"score", "max_score", "tests"} and results["max_score"] == 25
    assert [set(t) >= {"name", "score", "max_score", "status", "output"} for t in results["tests"]] == [True]
    assert results["tests"][0]["status"] == "failed" and "not started" in results["tests"][0]["output"]
    feedback_text = (out / "amy.md").read_text()
    assert feedback_text.startswith("# amy") and "```text" in feedback_text and "L1    Paged" in feedback_text
    assert "## L1 " in (out / "similarity.md").read_text()
    before = {p.name: p.stat().st_mtime_ns for p in out.glob("*.json")}

    started = time.monotonic()
    again = klass(roster, out)
    assert again.returncode == 0 and time.monotonic() - started < 10  # (and the command's own start, 2-5 s)
    assert "eve: unchanged since the last run: kept" in again.stdout
    assert "amy: unchanged since the last run: kept" in again.stdout and "bob: unchanged" in again.stdout
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("*.json")} == before
    (out / "bob.json").unlink()  # an output gone: that learner is graded again
    assert "bob: L1 not started" in klass(roster, out).stdout


def test_ctrl_c_keeps_the_learners_already_graded(tmp_path):
    roster, out = tmp_path / "roster", tmp_path / "out"
    learner(roster, "a-first")
    learner(roster, "b-hangs", "while True:\n    pass\n")  # its worker never finishes importing it
    proc = subprocess.Popen([sys.executable, "grader.py", "class", str(roster), "--drills", "l1", "--out", str(out),
                             "--jobs", "1"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 90
        while not (out / "a-first.json").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(1.5)  # b-hangs is being graded now
        proc.send_signal(signal.SIGINT)
        stdout, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130 and "stopped: 1 graded" in stdout
    assert list(gradebook(out)) == ["a-first"]
    assert set(json.loads((out / "state.json").read_text())) == {"a-first"}
    assert not (out / "b-hangs.json").exists() and (out / "a-first" / "results.json").is_file()


def test_a_grade_that_crashes_or_times_out_gets_that_status_and_the_class_goes_on(tmp_path, monkeypatch, capsys):
    roster = tmp_path / "roster"
    learner(roster, "amy"), learner(roster, "bob")
    crash = tmp_path / "crash.py"
    crash.write_text("import sys\nprint('the grader broke', file=sys.stderr)\nsys.exit(3)\n")
    monkeypatch.setattr(_class, "FRONT", crash)
    assert _class.main([str(roster), "--drills", "l1", "--out", str(tmp_path / "a")], DRILLS) == 0
    book = gradebook(tmp_path / "a")
    assert [row["status"] for row in book.values()] == ["crashed", "crashed"]
    assert "exit code 3: the grader broke" in book["bob"]["note"]
    monkeypatch.undo()
    assert _class.main([str(roster), "--drills", "l1", "--out", str(tmp_path / "b"), "--learner-timeout", "0.3"],
                       DRILLS) == 0
    book = gradebook(tmp_path / "b")
    assert [row["status"] for row in book.values()] == ["timed out", "timed out"]
    assert "amy: timed out: the grade ran past 0 s" in capsys.readouterr().out


def test_usage_errors(tmp_path, klass):
    assert klass(tmp_path / "nowhere", tmp_path / "out").returncode == 2
    roster = tmp_path / "roster"
    learner(roster, "amy")
    assert "inside the roster" in klass(roster, roster / "out").stdout
    assert "not ignored by git" in klass(roster, ROOT / "tests" / "class-here").stdout
    wrong = klass(roster, tmp_path / "out", "--drills", "zz")
    assert wrong.returncode == 2 and "no drill zz" in wrong.stderr


# --- the outputs' formats -------------------------------------------------------------------

def summary(status, passed=0, total=10, diagnosis=()):
    return dict(id="l1", stem=L1.stem, title=L1.title, page=L1.page, status=status, passed=passed, total=total,
                failed=total - passed, skipped=0, problem=None, first_failure=None if status == "passed" else dict(
                    name="test_x", kind="assertion", message="wrong ``` slot", where=None, example=None, stdout=None,
                    stderr=None), diagnosis=[dict(pitfall=p, says="says", section="§8") for p in diagnosis],
                milestones=[], left_out=[], seconds=1.0)


def grade_of(*drills):
    return dict(tree="/r/amy", tree_name="/r/amy", device="cpu", sandbox="landlock ABI 7 + seccomp", drills=list(drills),
                integrity=dict(ok=True, says="fine"), leftover_processes_killed=0, bench_note="needs a GPU")


def test_the_gradebook_row_and_gradescope_results_weigh_each_drill():
    one = dict(slug="amy", name="=amy", notes=["a note"], missing=set())
    book = Book([L1], {"l1": 20})
    failing = grade_of(summary("failing", 7, 10, ["padding_written"]))
    row = book.row(one, "graded", failing, None, 3.5)
    assert row["l1"] == "failing" and row["l1 passed"] == "7/10" and row["pitfalls"] == "l1:padding_written"
    assert row["score"] == 0.0 and row["max score"] == 20.0 and row["sandbox"].startswith("landlock")
    assert "'=amy" in book.csv([row])
    assert Book([L1], {"l1": 20}, partial=True).row(one, "graded", failing)["score"] == 14.0
    results = book.gradescope(grade_of(summary("passed", 10, 10)))
    assert results["score"] == results["max_score"] == 20.0
    assert results["tests"][0]["status"] == "passed" and results["tests"][0]["name"] == "L1 Paged KV-cache write"
    assert book.row(dict(one, missing={L1.stem}), "graded", grade_of(summary("not started")))["l1"] == "missing"
    crashed = book.gradescope(None, "the grade ended with exit code 3")
    assert crashed["score"] == 0 and crashed["output"] == "the grade ended with exit code 3"
    text = feedback("amy", "/r/amy", failing)
    assert text.count("````") == 2 and "wrong ``` slot" in text  # the learner's backticks cannot close the fence


# --- copy detection ------------------------------------------------------------------------

def renamed(source, numbers=True, keywords=True):
    """What a copier does: every name the file chose renamed, comments and strings rewritten,
    numbers changed, the spacing redone (tokenize's untokenize)."""
    names, out, depth = {}, [], 0
    toks = list(tokenize.generate_tokens(io.StringIO(source).readline))
    for i, tok in enumerate(toks):
        text = tok.string
        depth += (text in "([{") - (text in ")]}") if tok.type == tokenize.OP else 0
        argument = depth > 0 and i + 1 < len(toks) and toks[i + 1].string == "="  # a keyword argument's name
        if tok.type == tokenize.NAME and not keyword.iskeyword(text) and text not in dir(builtins) \
                and text not in ("torch", "triton") and toks[i - 1].string != "." and (keywords or not argument):
            text = names.setdefault(text, f"my_{len(names)}")
        elif tok.type == tokenize.COMMENT:
            text = "# mine"
        elif tok.type == tokenize.STRING:
            text = '"mine"'
        elif tok.type == tokenize.NUMBER and numbers:
            text = str(int(text) + 3) if text.isdigit() else text
        out.append((tok.type, text))
    return tokenize.untokenize(out)


def answers():
    return {p.stem: p.read_text() for p in sorted(CASES.glob("*.py"))}


def test_ten_independent_right_answers_are_not_flagged():
    found = answers()
    assert len(found) == 10
    reference = (ROOT / "solutions" / FILE).read_text()
    assert _similarity.pairs(found, STUB.decode(), reference) == []
    prints = {name: _similarity.fingerprints(text, _similarity.base_hashes(STUB.decode())) for name, text in found.items()}
    scores = [_similarity.compare(prints[a], prints[b])[0] for a in prints for b in prints if a < b]
    assert max(scores) < 0.3  # the README says so


def test_renamed_copies_are_flagged_with_their_regions():
    files = answers()
    reference = (ROOT / "solutions" / FILE).read_text()
    files["copied_solution"] = renamed(reference)
    files["twin_a"] = renamed(files["a05_chunks"], numbers=False)
    files["twin_b"] = renamed(files["a05_chunks"])
    flagged = {(a, b): (score, regions) for score, _, a, b, regions in _similarity.pairs(files, STUB.decode(), reference)}
    assert set(flagged) == {("copied_solution", "solutions/"), ("twin_a", "twin_b"), ("a05_chunks", "twin_a"),
                            ("a05_chunks", "twin_b")}
    assert all(score >= 0.8 for score, _ in flagged.values())
    (a0, a1), (b0, b1) = flagged["copied_solution", "solutions/"][1][-1]
    assert a1 - a0 > 40 and b1 - b0 > 40  # the kernel and the wrapper, matched as one region


def test_names_comments_strings_and_spacing_do_not_change_the_tokens():
    source = (ROOT / "solutions" / FILE).read_text()
    assert [t for t, _ in _similarity.tokens(renamed(source, numbers=False, keywords=False))] == \
           [t for t, _ in _similarity.tokens(source)]
    assert _similarity.tokens("def f(:\n") == [("def", 1), ("V", 1), ("(", 1), (":", 1)]  # a syntax error: what came before


def test_the_similarity_report_names_each_pair_and_the_command_to_compare_them():
    reference = (ROOT / "solutions" / FILE).read_bytes()
    learners = [dict(slug="amy", tree="/r/amy", files={L1.stem: reference}),
                dict(slug="bob", tree="/r/bob b", files={L1.stem: renamed(reference.decode()).encode()}),
                dict(slug="cat", tree="/r/cat", files={L1.stem: STUB})]
    text = _similarity.class_report(learners, [L1], {L1.stem: STUB}, "/r")
    assert "2 learner file(s) compared" in text and "3 pair(s) flagged" in text
    assert "| 100% | amy | solutions/ |" in text
    assert "`make diff DRILL=l1 TREE=/r/amy OTHER='/r/bob b'`" in text
    assert re.search(r"\| \d+% \| amy \| bob \| \d+ \| \d+-\d+ ~ \d+-\d+", text)


# --- GitHub Classroom ----------------------------------------------------------------------

def workflow():
    yaml = pytest.importorskip("yaml")  # PyYAML: installed with transformers, a dependency already
    return yaml.safe_load((ROOT / ".github" / "workflows" / "classroom.yml").read_text())


def test_the_classroom_workflow_grades_each_drill_as_a_step_with_points():
    flow = workflow()
    assert flow["name"] == "Autograding Tests" and list(flow["jobs"]) == ["run-autograding-tests"]
    steps = flow["jobs"]["run-autograding-tests"]["steps"]
    graders = [s for s in steps if s.get("uses", "").startswith("classroom-resources/autograding-command-grader@")]
    assert [s["id"] for s in graders] == [d.id for d in DRILLS], "one step per drill of the manifest, in its order"
    assert all(s["with"]["max-score"] > 0 and s["with"]["timeout"] <= 60 for s in graders)
    reporter = next(s for s in steps if s.get("uses", "").startswith("classroom-resources/autograding-grading-reporter@"))
    assert reporter["with"]["runners"].split(",") == [d.id for d in DRILLS]
    assert set(reporter["env"]) == {f"{d.id.upper()}_RESULTS" for d in DRILLS}
    assert all(reporter["env"][f"{s['id'].upper()}_RESULTS"] == f"${{{{steps.{s['id']}.outputs.result}}}}"
               for s in graders)


def test_every_command_of_the_workflow_is_one_the_readme_documents():
    readme = (ROOT / "README.md").read_text()
    steps = workflow()["jobs"]["run-autograding-tests"]["steps"]
    commands = [s["run"] for s in steps if "run" in s]
    commands += [s["with"]["command"].replace(s["id"], "l1") for s in steps if "command" in s.get("with", {})]
    for command in commands:
        assert command.strip() in readme, f"the README does not document {command!r}"


def test_on_a_gpu_each_passing_drill_is_benched_after_the_tests_then_kept(tmp_path, monkeypatch):
    """The bench phase, with the bench processes stood in for (no GPU here): one at a time,
    the ceiling once, the learner's outputs written again, and the learner kept only then."""
    calls = []

    class Bench:
        def __init__(self, drill, tree):
            calls.append(("start", drill.id, os.path.basename(tree)))

        def result(self, ceiling, timeout):
            calls.append(("time", ceiling))
            return dict(cases=[])

    class Ceiling:
        def gbps(self, timeout):
            return 4000.0

        def cancel(self):
            calls.append("ceiling ended")
    monkeypatch.setitem(sys.modules, "_bench", SimpleNamespace(Bench=Bench, Ceiling=Ceiling))
    monkeypatch.setattr(_class, "surely_no_gpu", lambda: False)
    monkeypatch.setattr(sys.modules["_env"], "INTERPRET", False)
    args = SimpleNamespace(out=str(tmp_path), timeout=60, test_timeout=None, no_bench=False, points={}, partial=False,
                           jobs=1, roster=str(tmp_path), learner_timeout=None)
    one = dict(name="amy", slug="amy", tree="/r/amy", files={}, notes=[], missing=set(), problem=None)
    run = _class.ClassRun(args, [L1], make_console(), [one])
    try:
        run.record(0, one, "key", "graded", grade_of(summary("passed", 10, 10)), None, 3.0)
        assert "amy" not in run.state  # stopped before its bench, amy would be graded again
        run.bench()
    finally:
        shutil.rmtree(run.work)
    assert calls == [("start", "l1", "tree"), ("time", 4000.0), "ceiling ended"]
    saved = json.loads((tmp_path / "amy.json").read_text())
    assert saved["ceiling_gbps"] == 4000.0 and "bench_note" not in saved and saved["drills"][0]["bench"] == {"cases": []}
    assert run.state["amy"]["key"] == "key"


def test_make_class_passes_the_roster_and_its_options(tmp_path):
    make = make_echo(tmp_path)
    bare = make("class")
    assert bare.returncode == 2 and "usage: make class ROSTER=dir" in bare.stdout
    full = make("class", "ROSTER=/r/a b", "DRILL=l1,l2", "JOBS=2", "OUT=/o")
    assert full.stdout.strip() == "grader.py class /r/a b --drills l1,l2 --jobs 2 --out /o"
