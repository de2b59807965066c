"""The grading run holds up against its learner: a learner's file cannot forge a pass,
cannot reach the checks, and a hang, a crash or an early exit costs one test with a
message that says what happened and where."""
import io
import json
import os
import re
import subprocess
import sys
import sysconfig
import time

import pytest

import _grading
import _integrity
import _wrong
from _manifest import BY_ID
from _tree import ROOT, load_front
from _worker import SANDBOX

L1 = BY_ID["l1"]


def planted(tmp_path, pitfall, extra=""):
    """The L1 reference with `pitfall` planted, and `extra` code run at its import."""
    folder = _wrong.plant(L1, pitfall, tmp_path / "tree")
    path = folder / f"{L1.stem}.py"
    path.write_text(path.read_text() + "\n" + extra)
    return folder


FORGE = r'''
import os as _os
def _forge():
    # What a learner's file could try: find the report in the command line of the test
    # process (an ancestor of this one) and write "passed" lines into it, and switch
    # the checks off where it can.
    pid, report = _os.getppid(), None
    while pid > 1 and report is None:
        try:  # the sandbox closes other processes' /proc entries where Landlock is
            args = open(f"/proc/{pid}/cmdline").read().split("\0")
        except PermissionError:
            print("reading the test process: stopped by the sandbox")
            break
        report = next((a.split("=", 1)[1] for a in args if a.startswith("--drills-report=")), None)
        if report is None and "--drills-report" in args:
            report = args[args.index("--drills-report") + 1]
        pid = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
    if report:
        try:  # the sandbox (tests/_sandbox.py) refuses this open where Landlock is
            with open(report, "a") as f:
                for name in ("test_write_worked_example", "test_slot_mapping_worked_example"):
                    f.write('{"test": "tests/x.py::%s", "name": "%s", "outcome": "passed"}\t0\n' % (name, name))
        except PermissionError:
            print("forging the report: stopped by the sandbox")
    import sys as _sys
    for module in list(_sys.modules.values()):
        for attr in ("check_kv_write", "check_slot_mapping", "classify"):
            if hasattr(module, attr):
                setattr(module, attr, lambda *a, **k: None)
_forge()
'''


@pytest.fixture(scope="module")
def hostile_grade(tmp_path_factory):
    """One grading run of a wrong L1 (position_as_slot) that prints its positions and
    tries to forge its report (one run serves the tests below: each takes seconds)."""
    tree = planted(tmp_path_factory.mktemp("hostile"), "position_as_slot", FORGE)
    path = tree / f"{L1.stem}.py"
    path.write_text(path.read_text().replace('    """Slot of each new token', '    print("my positions:", positions)\n'
                                                                             '    """Slot of each new token', 1))
    return _grading.grade_drill(L1, tree, 300, select="worked_example")


def test_a_learner_file_cannot_forge_a_pass(hostile_grade):
    """Under Landlock the forged lines are never written; without it they are written,
    and the signature check finds them."""
    assert hostile_grade["status"] == "failing"
    if SANDBOX == "none":
        assert "did not write" in (hostile_grade["problem"] or ""), hostile_grade["problem"]
    else:
        assert not hostile_grade["problem"], hostile_grade["problem"]
    assert "position_as_slot" in [d["pitfall"] for d in hostile_grade["diagnosis"]]


def test_the_first_failure_shows_what_the_learner_printed(hostile_grade):
    assert "my positions:" in hostile_grade["first_failure"]["stdout"]


def test_changed_machinery_is_reported(tmp_path):
    cloned = subprocess.run(["git", "clone", "-q", str(ROOT), str(tmp_path / "repo")], capture_output=True)
    if cloned.returncode != 0 or not (tmp_path / "repo/tests/_grading.py").exists():
        pytest.skip("this copy of the repository has no git history of its own")
    clean = _integrity.integrity(tmp_path / "repo")
    assert clean[0] is True, clean
    test_file = tmp_path / "repo" / "tests" / f"test_{L1.stem}.py"
    test_file.write_text(test_file.read_text().replace("def test_", "def skipped_"))
    dirty = _integrity.integrity(tmp_path / "repo")
    assert dirty[0] is False and f"test_{L1.stem}.py" in dirty[1], dirty


def test_a_crash_names_its_pitfall_only_when_every_failure_agrees():
    """A crash in a test marked with a crashing pitfall names it when every failure of the
    run is in a test marked with it; a mistake that also fails an unmarked test (values
    written past out, say, which may crash the large-cache test too) names nothing."""
    l2 = BY_ID["l2"]
    crash = dict(name="test_large_cache[x]", kind="crash", pitfall_test=["int32_offsets"])
    marked = dict(name="test_other_marked[x]", kind="mismatch", pitfall_test=["int32_offsets"])
    unmarked = dict(name="test_plain[x]", kind="mismatch", pitfall_test=[])
    assert _grading._evidence(l2, [crash]) == ["int32_offsets"]
    assert _grading._evidence(l2, [marked, crash]) == ["int32_offsets"]
    assert _grading._evidence(l2, [unmarked, crash]) == []


# --- what the grade prints: the learner's text as text, drill by drill, advice to paste --------

# What a learner's print could hold to repaint the screen as a pass: clear it, bold green,
# carriage return, bell, and CSI as one C1 byte.
REPAINT = "\x1b[2J\x1b[1;32mpassed 35/35\x1b[0m\r\x07\x9b"
CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def _strings(value):
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in (k, *_strings(v))]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return [value] if isinstance(value, str) else []


def _failing(drill, **first):
    return dict(id=drill.id, stem=drill.stem, title=drill.title, page=drill.page, passed=0, failed=1, skipped=0,
                total=1, problem=None, diagnosis=[], status="failing",
                first_failure=dict(dict(name="test_worked_example", kind="mismatch", message="wrong", where=None,
                                        example="", stdout="", stderr=""), **first))


def _graded_in_process(monkeypatch, tmp_path, console, summaries, argv, picture=None, traffic=None, on_grade=None):
    """grader.main run in this process on made-up summaries (no test process, no
    subprocess): what it prints, its exit status and its --json."""
    import _commands
    import _traffic
    front = load_front()
    monkeypatch.setattr(_commands, "STATE", tmp_path / ".drills")  # made-up grades: not this checkout's record
    monkeypatch.setattr(front, "make_console", lambda: console)
    monkeypatch.setattr(front, "stop_children_on_signals", lambda say: None)

    def grade_drill(drill, *args, **kwargs):
        if on_grade:
            on_grade(drill)
        return dict(summaries[drill.id])
    monkeypatch.setattr(front._grading, "grade_drill", grade_drill)
    monkeypatch.setattr(front._picture, "in_subprocess", picture if callable(picture) else lambda *a, **k: picture)
    monkeypatch.setattr(_traffic, "with_reference", lambda *a, **k: traffic)
    code = front.main([*argv, "--tree", "mine", "--json", str(tmp_path / "grade.json")])
    return code, json.loads((tmp_path / "grade.json").read_text())


def test_the_learners_text_reaches_the_console_and_json_as_text(tmp_path, monkeypatch):
    """What the learner's code printed or raised, and what the picture, traffic and bench
    subprocesses said, reaches neither the terminal nor --json with a control character,
    and no markup in it is obeyed."""
    from rich.console import Console

    import _render
    import _report
    # tests/_report.py writes a record's text clean
    reporter = _report.Reporter(tmp_path / "report.jsonl", b"k")
    reporter._write(test="t", stdout=REPAINT, message=f"[bold green]passed[/] {REPAINT}", where=REPAINT)
    reporter.out.close()
    (record,), forged = _report.read_signed(tmp_path / "report.jsonl", b"k")
    assert forged == 0 and not any(CONTROL.search(s) for s in _strings(record)), record
    # grader.py prints and writes a summary clean, whoever made it (here a record that
    # came through a path that forgot to clean it)
    summary = _failing(L1, stdout=REPAINT, stderr=REPAINT, message=f"[bold green]passed[/] {REPAINT}",
                       where=REPAINT, example=REPAINT)
    picture = "drawn:\n\x1b[31mt0\x1b[0m \x1b[2J\x1b]0;title\x07 t1" + REPAINT
    traffic = dict(error=f"[bold green]passed[/] {REPAINT}")
    out = io.StringIO()
    code, grade = _graded_in_process(monkeypatch, tmp_path, Console(file=out, width=200), {"l1": summary}, ["l1"],
                                     picture, traffic)
    assert code == 1 and grade["drills"][0]["status"] == "failing"
    assert not CONTROL.search(out.getvalue()), repr(out.getvalue()[:2000])
    assert not [s for s in _strings(grade) if CONTROL.search(s)]
    assert grade["drills"][0]["picture"].startswith("drawn:\nt0")
    # and _render draws it clean on a terminal (no colours: any escape would be the learner's),
    # the bench error included, whose table cell would otherwise read markup
    grade = dict(grade, ceiling_gbps=1.0, bench_note=None,
                 drills=[dict(summary, picture=picture, traffic=traffic, bench=dict(error=f"[bold]{REPAINT}"))])
    out = io.StringIO()
    _render.show(Console(file=out, force_terminal=True, color_system=None, width=200), grade)
    printed = out.getvalue()
    assert not CONTROL.search(printed), repr(printed[:2000])
    assert "[bold green]passed[/] passed 35/35" in printed and "[bold]passed 35/35" in printed  # not obeyed


def test_a_picture_keeps_its_colours_and_nothing_else():
    from rich.console import Console

    import _render
    # The picture as tests/_picture.py hands it back: segments, our styles beside the learner's text
    picture = dict(title="drawn:\n", segments=[["t0", "red"],
                                              [" \x1b[2J\x1b]0;title\x07 x\x1b[?1049h\x1bc " + REPAINT, ""],
                                              ["\x1b[1;32mL1 passed 35/35\x1b[0m\u202e", "dim"]])
    for shown, colours in ((picture, {"\x1b[31m", "\x1b[2m", "\x1b[0m"}), ("\x1b[31mt0\x1b[0m" + REPAINT, set())):
        out = io.StringIO()  # a string is plain text: no colour at all
        Console(file=out, force_terminal=True, color_system="standard", width=100).print(_render.picture_text(shown))
        printed = out.getvalue()
        assert set(re.findall("\x1b\\[[0-9;]*m", printed)) == colours, repr(printed)  # ours only: no bold green
        assert "passed 35/35" in printed and ("\x1b[31mt0" in printed) == bool(colours)
        assert not re.search("\x1b[^[]|\x1b\\[[0-9;?]*[^0-9;?m]", printed), repr(printed)  # nothing but colours
        assert not re.search("[\x07\r\x80-\x9f\u202e]", printed)


def test_each_drill_prints_as_soon_as_it_is_graded_with_the_time_the_learner_waited(tmp_path, monkeypatch):
    """Off a terminal too: L1's row and box are printed (and flushed) before F1 is
    graded; its `time` counts the picture drawn after its tests."""
    from rich.console import Console

    class Log(io.StringIO):
        flushes = 0

        def flush(self):
            self.flushes += 1

    out, seen = Log(), {}
    console = Console(file=out, width=200)
    assert not console.is_terminal

    def on_grade(drill):
        seen[drill.id] = (out.getvalue(), out.flushes)

    def slow_picture(*args):
        time.sleep(0.3)
        return "the picture"
    f1 = dict(_failing(BY_ID["f1"]), status="not started")
    summaries = {"l1": _failing(L1, name="test_padding_tokens_write_nothing[first]"), "f1": f1}
    code, grade = _graded_in_process(monkeypatch, tmp_path, console, summaries, ["l1", "f1"], slow_picture,
                                     on_grade=on_grade)
    before_f1, flushes = seen["f1"]
    assert seen["l1"][0].count("\n") <= 4 and "L1 " not in seen["l1"][0]  # the header only
    assert "failing 1 of 1" in before_f1 and "test_padding_tokens_write_nothing" in before_f1 and flushes >= 2
    assert "F1 " not in before_f1 and "bandwidth" not in before_f1
    assert grade["drills"][0]["seconds"] >= 0.3
    assert "not started" in out.getvalue() and code == 1


def test_usage_errors_exit_2_and_are_printed_as_typed():
    front = load_front()
    assert front.main(["l9"]) == 2
    assert front.main(["--tree", str(ROOT / "[bold]nope")]) == 2
    assert front.main(["show", "l9"]) == 2


def test_the_advice_can_be_pasted_into_the_shell_the_learner_came_from():
    """make's forms (make sets up and uses .venv; a bare `python grader.py` fails there),
    the failing test's own name instead of -k NAME, TREE= only for another tree."""
    from rich.console import Console

    import _render
    for tree, where in (("mine", ""), ("/home/alice/mine", " TREE=/home/alice/mine")):
        console = Console(record=True, width=500)
        console.print(_render._failure_panel(_failing(L1, name="test_padding_tokens_write_nothing[first]"), tree))
        text = " ".join(console.export_text().split())  # the box's lines joined
        assert f"make grade DRILL=l1{where};" in text and "make hint DRILL=l1;" in text
        assert f"make show DRILL=l1{where};" in text
        assert f".venv/bin/pytest --tree={tree} -m l1 -x -s -k test_padding_tokens_write_nothing " in text + " "
        assert "python grader.py" not in text and "NAME" not in text


def test_equal_speeds_read_the_same_speed():
    import _render
    assert _render.compared(10.0, 10.0) == "same speed" and _render.compared(10.04, 10.0) == "same speed"
    assert _render.compared(9.7, 10.0) == "1.03× slower" and _render.compared(30.0, 10.0) == "3.00× faster"
    assert _render.compared(10.0, 36.0) == "3.60× slower"


def test_a_pass_says_its_milestones_what_it_left_out_and_whose_kernels_ran():
    """make grade DRILL=e1 KERNELS=solutions: the row says whose L1 and L3 ran, each skipped
    test is said with its reason, and a milestone test that passed (SmolLM2) gets its line."""
    from rich.console import Console

    import _render
    e1 = BY_ID["e1"]
    records = [dict(collected=["a", "b", "c"]),
               dict(test="a", name="test_worked_example", outcome="passed"),
               dict(test="b", name="test_serves_smollm2_as_generate_does", outcome="passed"),
               dict(test="c", name="test_kernels_are_the_trees_own", outcome="skipped",
                    message="Skipped: KERNELS= grades E1 on other kernels")]
    summary = dict(_grading.summarize(e1, records), seconds=1, kernels="solutions")
    assert summary["status"] == "passed" and summary["left_out"][0]["why"] == "KERNELS= grades E1 on other kernels"
    console = Console(record=True, width=200)
    printer = _render.Printer(console, dict(tree="t", tree_name="mine", device="CPU", drills=[summary]))
    printer.drill(summary)
    text = console.export_text()
    assert "passed 2/2, 1 left out" in text and "the L1 and L3 of solutions (KERNELS=)" in text
    assert "left out: test_kernels_are_the_trees_own: KERNELS= grades E1 on other kernels" in text
    assert e1.milestones["test_serves_smollm2_as_generate_does"] in text


# --- integrity: what the grade stands on is what it was ------------------------------------


def _git(repo, *args):
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True,
                   capture_output=True)


def test_integrity_finds_a_new_pth_or_changed_machinery_and_nothing_else(tmp_path):
    repo, site = tmp_path / "repo", tmp_path / "site-packages"
    (repo / "tests").mkdir(parents=True)
    (repo / "mine").mkdir()
    site.mkdir()
    (repo / "tests" / "test_x.py").write_text("def test_x(): pass\n")
    (repo / "mine" / "x.py").write_text("x = 1\n")
    (repo / ".gitignore").write_text("__pycache__/\n")
    (site / "ok.pth").write_text("/somewhere\n")
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "commit", "-qm", "x")

    def changed_by(change):
        before = _integrity.snapshot(repo, [site])
        change()
        return _integrity.integrity(repo, before, [site])

    assert changed_by(lambda: None)[0] is True, f"nothing changed, yet: {changed_by(lambda: None)}"
    assert _integrity.integrity(repo)[0] is True, f"the committed machinery differs: {_integrity.integrity(repo)}"
    # no change: what grading may leave (an ignored cache), the learner's edits of their own files
    cache = changed_by(lambda: (repo / "__pycache__").mkdir() or (repo / "__pycache__" / "x.pyc").write_text("."))
    assert cache[0] is True, f"an ignored cache written during grading was taken for a change: {cache}"
    for change in (lambda: (repo / "mine" / "x.py").write_text("x = 2\n"), lambda: (repo / "mine" / "y.py").touch(),
                   lambda: (repo / "notes.md").write_text("mine\n")):
        ok, said = changed_by(change)
        assert ok is True, f"an edit of the learner's own files withdrew the grade: {said}"
    for change, says in ((lambda: (site / "evil.pth").write_text("import os\n"), "new "),
                         (lambda: (site / "ok.pth").write_text("import os\n"), "changed "),
                         (lambda: (site / "sitecustomize.py").write_text("import os\n"), "sitecustomize.py"),
                         (lambda: (repo / "tests" / "conftest.py").write_text("\n"), "new tests/conftest.py"),
                         (lambda: (repo / "conftest.py").write_text("\n"), "new conftest.py"),
                         (lambda: (repo / "pytest.ini").write_text("[pytest]\n"), "new pytest.ini"),
                         (lambda: (repo / "tests" / "test_x.py").unlink(), "removed tests/test_x.py")):
        ok, said = changed_by(change)
        assert ok is False and says in said and said.startswith("changed during grading"), \
            f"a change the grade stands on ({says!r}) was not reported as such: {ok}, {said!r}"
    # the learner's edits in mine/ before the grade are theirs; the machinery must be the committed one
    (repo / "tests" / "test_x.py").write_text("def test_x(): assert True\n")
    ok, said = _integrity.integrity(repo)
    assert ok is False and "tests/test_x.py" in said and "conftest" in said, said


def test_an_edit_during_grading_touches_only_the_drill_whose_file_it_is(tmp_path, monkeypatch):
    """Saved while L1 is graded: another drill's file changes nothing (L1 and L2 pass);
    L1's own file makes L1 "edited during grading", with no failure and no failing test to
    point at, and the command to run it again (issue 48)."""
    from rich.console import Console
    files = {d: tmp_path / f"{d}.py" for d in ("l1", "l2")}
    for path in files.values():
        path.write_text("x = 1\n")
    monkeypatch.setattr(_integrity, "graded_files", lambda drill, tree, stems: [files[drill.id]])
    monkeypatch.setattr(_integrity, "snapshot", lambda: {})
    monkeypatch.setattr(_integrity, "integrity", lambda before=None: (True, "unchanged"))
    passed = {d: dict(_failing(BY_ID[d]), status="passed", passed=1, failed=0, first_failure=None) for d in files}
    for saved, want in (("l2", ["passed", "passed"]), ("l1", ["edited during grading", "passed"])):
        out = io.StringIO()
        code, grade = _graded_in_process(
            monkeypatch, tmp_path, Console(file=out, width=200), passed, ["l1", "l2"],
            on_grade=lambda drill: drill.id == "l1" and files[saved].write_text(f"x = {time.monotonic()}\n"))
        got = [s["status"] for s in grade["drills"]]
        assert got == want, f"saving {saved}.py while L1 was graded gave {got}, not {want}:\n{out.getvalue()}"
        assert code == (0 if saved == "l2" else 1), f"exit status {code} after saving {saved}.py"
    text = out.getvalue()
    said = grade["drills"][0]["problem"]
    assert said == f"you edited {files['l1']} while it was graded: run `make grade DRILL=l1` again", said
    assert said in text and "failing" not in text and "first failing test" not in text, \
        f"an edit of the graded file must not read as a failure:\n{text}"


def test_a_change_during_grading_withdraws_every_pass(tmp_path, monkeypatch):
    from rich.console import Console

    def integrity(root=ROOT, before=None, site_folders=None):
        return (False, "changed during grading: new evil.pth") if before is not None else (True, "committed")
    monkeypatch.setattr(_integrity, "integrity", integrity)
    passed = dict(_failing(L1), status="passed", passed=1, failed=0, first_failure=None)
    out = io.StringIO()
    code, grade = _graded_in_process(monkeypatch, tmp_path, Console(file=out, width=200), {"l1": passed}, ["l1"])
    assert code == 1 and grade["drills"][0]["status"] == "failing"
    assert grade["integrity"] == dict(ok=False, says="changed during grading: new evil.pth", during_grading=True)
    assert "new evil.pth" in grade["drills"][0]["problem"] and "every pass of this grade is withdrawn" in out.getvalue()
    # a withdrawn pass has no failing test: the box neither counts "0 of 1 failing" nor points at one
    assert "0 of 1" not in out.getvalue() and "first failing test" not in out.getvalue(), out.getvalue()


def test_integrity_of_this_repository_takes_under_a_second():
    started = time.monotonic()
    before = _integrity.snapshot()
    assert _integrity.integrity(before=before)[0] is not None
    assert time.monotonic() - started < 1
    assert any(path.endswith(".pth") for path in before) or not any(
        name.endswith(".pth") for name in os.listdir(sysconfig.get_paths()["purelib"]))


SHARDED = '''
from hypothesis import given, strategies as st
DRAWN = []
@given(st.integers())
def test_drawn(x):
    DRAWN.append(x)
@given(st.integers())
@pytest.mark.parametrize("p", [1, 2])
def test_parametrized(p, x):
    DRAWN.append(x)
def test_a(): pass
def test_b(): pass
def test_c(): pass
def teardown_module():
    print("EXAMPLES", len(DRAWN))
'''


def test_a_drill_graded_in_shards_runs_every_test_once_and_every_example(tmp_path):
    """On a GPU the grade runs a drill's tests in K shards at once (tests/_grading.py,
    shards()): each plain test in one shard, each hypothesis test in all of them with 1/K of
    its examples; the report lists the whole collection, and a test any shard failed fails."""
    (tmp_path / "test_sharded.py").write_text("import pytest\n" + SHARDED)
    ran, drawn = [], 0
    for shard in ("0/2", "1/2"):
        out = subprocess.run([sys.executable, "-m", "pytest", "-p", "_plugin", "-p", "no:cacheprovider", "-q", "-s",
                              "-rA", f"--drills-shard={shard}", str(tmp_path / "test_sharded.py")], cwd=tmp_path,
                             capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT / "tests")})
        assert out.returncode == 0, out.stdout + out.stderr
        ran += re.findall(r"^PASSED \S+::(\S+)", out.stdout, re.M)
        drawn += int(re.search(r"EXAMPLES (\d+)", out.stdout).group(1))
    plain = sorted(t for t in ran if not t.startswith(("test_drawn", "test_parametrized")))
    assert plain == ["test_a", "test_b", "test_c"]  # each in one shard
    assert sorted(ran).count("test_drawn") == 2  # each hypothesis test in both
    from hypothesis import settings
    assert drawn == 3 * 2 * -(-settings.default.max_examples // 2)  # three hypothesis items, half each per shard
    # and the shards' records merge into one run's
    collected = dict(collected=["t::a", "t::b", "t::h"], variants=[None] * 3)
    records, problems = _grading._merged([
        ([collected, dict(test="t::h", outcome="passed"), dict(test="t::b", outcome="skipped")], ["slow"]),
        ([collected, dict(test="t::a", outcome="passed"), dict(test="t::h", outcome="failed")], ["slow", "odd"])])
    assert records == [collected, dict(test="t::a", outcome="passed"), dict(test="t::b", outcome="skipped"),
                       dict(test="t::h", outcome="failed")]
    assert problems == ["slow", "odd"]
