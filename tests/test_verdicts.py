"""Verdicts a learner can trust to the letter (issue 48): a file that does not import is
said in one line and runs nothing else; a pass that was only a refusal of bad input counts
once the worked example passes; a crash keeps a name the other failures support; and a
busy machine makes a grade slower, never different (the learner's limit and the planted
variants' time grow with the load, and a variant out of time is no evidence)."""
import os
import subprocess
import sys

import pytest

import _grading
import _wrong
from _manifest import BY_ID
from _tree import ROOT

L1 = BY_ID["l1"]


def test_a_file_that_does_not_import_is_said_in_one_line_and_nothing_else_runs(tmp_path):
    """A typo: the grade asks the worker to import the file before any test calls it, says
    in one line that it does not import, with the line and a caret under it, and runs no
    test (48 s for a typo before, naming test_worked_example and leaking LearnerError)."""
    tree = tmp_path / "typo"
    tree.mkdir()
    source = (ROOT / "solutions" / f"{L1.stem}.py").read_text().splitlines()
    line = next(i for i, text in enumerate(source) if text.startswith("def ")) + 1
    source.insert(line - 1, "x = = 3")
    (tree / f"{L1.stem}.py").write_text("\n".join(source) + "\n")
    summary = _grading.grade_drill(L1, tree, 300)
    problem = summary["problem"] or ""
    assert summary["status"] == "failing" and summary.get("does_not_import"), f"not graded as not importing: {summary}"
    head, code, caret = (problem.splitlines() + ["", "", ""])[:3]
    assert head == f"{tree / L1.stem}.py does not import, line {line}: SyntaxError: invalid syntax", head
    assert code == "    x = = 3" and caret.strip() and set(caret.strip()) == {"^"}, f"no line and caret:\n{problem}"
    assert summary["first_failure"] is None and summary["passed"] == 0 and summary["failed"] == summary["total"], \
        f"a file that does not import has no first failing test to point at: {summary}"
    assert "LearnerError" not in problem and "worked_example" not in problem, problem


def test_an_error_at_import_shows_its_line_and_the_learners_own_error():
    from _diagnose import does_not_import
    from _worker import LearnerError
    error = LearnerError("ModuleNotFoundError: No module named 'trtion'")
    error.where = "/home/a/mine/l1.py:3: import trtion as tl"
    said = str(does_not_import("mine/l1.py", error))
    assert said == ("mine/l1.py does not import, line 3: ModuleNotFoundError: No module named 'trtion'\n"
                    "    import trtion as tl\n    ^^^^^^^^^^^^^^^^^^^"), said


REFUSING = """
from _diagnose import expect_value_error
def test_worked_example():
    assert WORKED, "the worked example is wrong"
def test_rejects_bad_input():
    with expect_value_error("a bad input", "content/x.md"):
        raise ValueError("refused")
def test_plain():
    pass
"""


def test_refusals_count_only_once_the_worked_example_passes(tmp_path):
    """A function that only raises ValueError passes every input-rejection test (L2: 18 of
    50): such a pass is marked `rejects` by the plugin (it passed on an expected
    ValueError) and counts once the worked example passes; until then the grade counts it
    neither passed nor failed and says how many there are (issue 48). One test process
    runs a file whose worked example is wrong and one whose worked example is right."""
    from rich.console import Console

    import _render
    from _report import read_signed
    files = {worked: f"test_refusing_{str(worked).lower()}.py" for worked in (False, True)}
    for worked, name in files.items():
        (tmp_path / name).write_text(f"WORKED = {worked}\n" + REFUSING)
    key, report = b"k" * 32, tmp_path / "report.jsonl"
    read, write = os.pipe()
    os.write(write, key)
    os.close(write)
    ran = subprocess.run([sys.executable, "-m", "pytest", "-p", "_plugin", "-p", "no:cacheprovider", "-q",
                          "--drills-report", str(report), "--drills-key-fd", str(read), *files.values()],
                         cwd=tmp_path, capture_output=True, text=True, pass_fds=(read,),
                         env={**os.environ, "PYTHONPATH": str(ROOT / "tests")})
    os.close(read)
    records, forged = read_signed(report, key)
    assert forged == 0 and records, f"the run wrote no report:\n{ran.stdout}{ran.stderr}"
    collected = next(r["collected"] for r in records if "collected" in r)
    for worked, name in files.items():
        ours = [r for r in records if "outcome" in r and r["test"].startswith(name)]
        marked = {r["name"]: r.get("rejects") for r in ours}
        assert marked == dict(test_worked_example=False, test_rejects_bad_input=True, test_plain=False), \
            f"only the test that passed on a refusal should be marked rejects: {marked}"
        summary = _grading.summarize(BY_ID["l2"], [dict(collected=[t for t in collected if t.startswith(name)]), *ours])
        counts = {k: summary[k] for k in ("passed", "failed", "total", "rejections_not_counted")}
        want = dict(passed=3, failed=0, total=3, rejections_not_counted=0) if worked else \
            dict(passed=1, failed=1, total=3, rejections_not_counted=1)
        assert counts == want, f"with the worked example {'right' if worked else 'wrong'}: {counts}, not {want}"
        console = Console(record=True, width=200)
        _render.Printer(console, dict(tree="t", tree_name="mine", device="CPU", drills=[summary])).drill(summary)
        said = "1 input-rejection test(s) pass too; they count once the worked example passes"
        assert (said in console.export_text()) is not worked, console.export_text()


def test_a_busy_machine_costs_the_diagnosis_time_not_a_name(monkeypatch):
    """The diagnosis runs planted variants (our code) on a learner's failing input; on a busy
    machine they run longer. Each test gives them their own time (tests/_wrong.py's LIMIT),
    not the learner's limit, and a variant that still runs out of it is undecided: never
    evidence either way, so a name is neither made nor withdrawn by the load (issue 48)."""
    import torch

    import _env
    import _plugin
    from _diagnose import known_mistakes
    from _worker import TIMEOUT, WORKER, LearnerTimeout
    _plugin.pytest_runtest_setup(None)
    assert WORKER.budget == TIMEOUT and _wrong._VARIANTS.budget == _wrong.LIMIT >= 10 * TIMEOUT, \
        f"the variants' time ({_wrong._VARIANTS.budget} s) should be theirs, not the learner's ({WORKER.budget} s)"
    slow, right, *others = [p for p, pitfall in L1.pitfalls.items() if pitfall.applies(_env.INTERPRET)]
    got = (torch.zeros(3),)

    def outcome(name):
        if name == slow:
            raise LearnerTimeout("ran past its limit")
        return got if name == right else (torch.ones(3),)
    monkeypatch.setattr(_wrong, "variant", lambda drill, name: name)
    found, undecided = known_mistakes(L1, outcome, got)
    assert found == [right] and slow in undecided and right not in undecided, \
        f"a variant that ran out of time must be undecided, not ruled out: found {found}, undecided {undecided}"


def test_the_learners_limit_grows_with_the_load_unless_set():
    """A right but slow kernel on a busy machine must not time out where it passes on a
    quiet one: without DRILLS_TIMEOUT the per-test limit is 60 s times the load over the
    cores (1x to 10x); a limit the learner set is theirs, whatever the load."""
    import _plugin
    got = [_plugin.limit_under_load(load, cores) for load, cores in ((0.5, 2), (2.0, 2), (6.0, 2), (40.0, 2), (9, 16))]
    assert got == [60, 60, 180, 600, 60], f"limits for loads 0.5, 2, 6, 40 on 2 cores and 9 on 16: {got}"
    for environ, load, want in (({}, 6.0, {"DRILLS_TIMEOUT": "180"}), ({}, 1.5, {}),
                                ({"DRILLS_TIMEOUT": "7"}, 6.0, {"DRILLS_TIMEOUT": "7"})):
        told = dict(environ)
        _plugin.scale_the_limit(told, load, 2)
        assert told == want, f"at load {load} on 2 cores, an environment of {environ} became {told}, not {want}"


def test_a_crash_in_a_marked_test_keeps_the_name_the_other_failures_support():
    """An L7 kernel with no head mask: five tests marked head_tile_unmasked name it, the sixth
    crashes (its stores past the end of lse abort the process). The crash says nothing
    against the name, so it stays; a crash alone names no pitfall that does not crash."""
    l7 = BY_ID["l7"]
    pitfall = "head_tile_unmasked"
    named = [dict(name=f"test_head_tile_spare_rows_are_masked[{h}]", kind="mismatch", pitfall_test=[pitfall],
                  pitfalls=[pitfall]) for h in (1, 3)]
    crash = dict(name="test_head_tile_spare_rows_are_masked[63]", kind="crash", pitfall_test=[pitfall], pitfalls=[])
    silent = dict(name="test_head_tile_spare_rows_are_masked[63]", kind="mismatch", pitfall_test=[pitfall],
                  pitfalls=[])
    for ordered in ([*named, crash], [crash, *named]):
        said = _grading._evidence(l7, ordered)
        assert said == [pitfall], f"a crash in a marked test withdrew the name its other tests support: {said}"
    said = _grading._evidence(l7, [*named, silent])
    assert said == [], f"a marked test that ran to its end without naming the pitfall must withdraw it: {said}"
    assert not l7.pitfalls[pitfall].crashes, f"{pitfall} is now a crashing pitfall: this test needs another"
    said = _grading._evidence(l7, [crash])
    assert said == [], f"a crash alone named a pitfall that is not a crashing one: {said}"


def test_no_hypothesis_deadline_where_learner_code_runs():
    """A hypothesis deadline fails an example that runs longer than it, so the machine's
    speed would set the verdict: every profile has none, and no test sets one."""
    import ast

    from hypothesis import settings
    for name in ("cpu", "gpu", "quick"):
        assert settings.get_profile(name).deadline is None, f"the {name} profile has a deadline"
    assert settings.default.deadline is None, f"the loaded profile has a deadline: {settings.default.deadline}"
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            called = getattr(node, "func", None)
            if getattr(called, "id", getattr(called, "attr", None)) not in ("settings", "register_profile"):
                continue
            for keyword in node.keywords:
                assert not (keyword.arg == "deadline" and not (isinstance(keyword.value, ast.Constant)
                                                                and keyword.value.value is None)), \
                    f"{path.relative_to(ROOT)}:{node.lineno} sets a hypothesis deadline"


def test_a_grade_watches_the_files_it_runs_and_never_waits_on_one(tmp_path):
    """What a drill's grade stands on, of the learner's tree: its own file, and for a drill
    that imports the same tree's kernels (E1) theirs too; a FIFO in a file's place is
    watched as what it is, never read (the grade would wait on it)."""
    import _integrity
    from _manifest import DRILLS
    stems = [d.stem for d in DRILLS]
    for drill, want in ((BY_ID["e1"], ["e1_paged_engine.py", "l1_paged_kv_write.py", "l3_paged_prefill.py"]),
                        (L1, ["l1_paged_kv_write.py"])):
        got = [path.name for path in _integrity.graded_files(drill, ROOT / "solutions", stems)]
        assert got == want, f"{drill.id.upper()}'s grade watches {got}, not {want}"
    os.mkfifo(tmp_path / f"{L1.stem}.py")
    got = _integrity.digests(_integrity.graded_files(L1, tmp_path, stems))
    assert got == {str(tmp_path / f"{L1.stem}.py"): "not a file"}, f"a FIFO in the graded file's place: {got}"


def test_a_failure_the_reference_shares_or_of_another_kind_names_nothing(monkeypatch):
    """E2 names preempt_keeps_refs from how a run on a small cache ends (the planted engine
    raises when nothing can run again). On the H100 every generate raised, the reference's
    too (Triton could not find libcuda in the sandbox), and the grade named the pitfall on the
    reference: a failure the reference shares is no evidence, nor one of another type."""
    from drills.e2 import checks
    from drills.e2.cases import prefix_case
    from drills.e1.cases import tiny_model
    from _diagnose import Mismatch
    from _worker import LearnerError

    case = prefix_case(8, [0, 5, 0], [9, 6, 8], exact=[(2, 0)], block_size=4, num_blocks=7, budget=8, seed=5,
                       model=tiny_model(seed=5, layers=1))

    class Raises:
        def __init__(self, error):
            self.error = error

        def generate(self, *args, **kwargs):
            raise self.error

    stuck = LearnerError("RuntimeError: the scheduler made no progress")
    reference_runs = checks._reference_runs
    for error, reference, named in ((stuck, reference_runs, ["preempt_keeps_refs"]),
                                    (stuck, lambda case: False, []),
                                    (LearnerError("CalledProcessError: ldconfig -p"), reference_runs, [])):
        monkeypatch.setattr(checks, "_reference_runs", reference)
        with pytest.raises(Mismatch) as caught:
            checks.run_generate(Raises(error), case, ROOT / "solutions", candidates=["preempt_keeps_refs"])
        assert caught.value.pitfalls == named, (str(error), caught.value.pitfalls)
