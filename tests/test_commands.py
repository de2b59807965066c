"""The learner's and instructor's commands: reset never loses work, doctor catches
a broken set-up, hints come one at a time, show and diff draw."""
import os
import subprocess
import sys

import pytest
import torch

from _front import here  # noqa: F401  -- a fixture
from _tree import ROOT, load_front


def grader(*args, cwd=ROOT, env=None):
    return subprocess.run([sys.executable, "grader.py", *args], cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, "COLUMNS": "160", **(env or {})}, timeout=120)


@pytest.fixture
def clone(tmp_path):
    """A fresh clone of the committed repository, where a learner has started L1."""
    cloned = subprocess.run(["git", "clone", "-q", str(ROOT), str(tmp_path / "repo")], capture_output=True)
    if cloned.returncode != 0 or not (tmp_path / "repo/mine/l1_paged_kv_write.py").exists():
        pytest.skip("this copy of the repository has no git history of its own (reset and hints need it)")
    return tmp_path / "repo"


def test_reset_backs_up_the_learners_file_then_restores_the_stub(clone):
    stub = (clone / "mine/l1_paged_kv_write.py").read_text()
    work = stub.replace('raise NotImplementedError("slot_mapping', 'return 42  # my attempt\n    raise NotImplementedError("')
    (clone / "mine/l1_paged_kv_write.py").write_text(work)
    result = grader("reset", "l1", cwd=clone)
    assert result.returncode == 0, result.stderr
    assert (clone / "mine/l1_paged_kv_write.py").read_text() == stub
    backups = list((clone / ".drills/backups").glob("l1_paged_kv_write-*.py"))
    assert len(backups) == 1 and backups[0].read_text() == work
    assert "saved as .drills/backups/" in result.stdout


def test_reset_finds_the_stub_even_after_the_learner_committed(clone):
    stub = (clone / "mine/l1_paged_kv_write.py").read_text()
    (clone / "mine/l1_paged_kv_write.py").write_text(stub.replace("raise NotImplementedError", "return None  #"))
    subprocess.run(["git", "-c", "user.name=l", "-c", "user.email=l@x", "commit", "-qam", "my work"], cwd=clone,
                   check=True)
    assert grader("reset", "l1", cwd=clone).returncode == 0
    assert (clone / "mine/l1_paged_kv_write.py").read_text() == stub


def test_reset_of_e1_keeps_the_given_helper_and_finds_the_stub(clone):
    """E1's stub gives replay_block_manager written out (design.md): a helper written exactly
    as in the reference is not an exercise, so the stub is still a stub."""
    path = clone / "mine/e1_paged_engine.py"
    stub = path.read_text()
    path.write_text(stub.replace('raise NotImplementedError("generate',
                                 'return []  # mine\n    raise NotImplementedError("'))
    result = grader("reset", "e1", cwd=clone)
    assert result.returncode == 0, result.stdout + result.stderr
    assert path.read_text() == stub


def test_a_stub_may_give_helpers_written_as_the_reference_has_them():
    from _commands import is_stub

    helper = "def helper(x):\n    return x + 1\n"
    stub = "def f(x):\n    raise NotImplementedError('f: read content/l1.md §4')\n\n\n" + helper
    assert is_stub(stub, "def f(x):\n    return x\n\n\n" + helper)
    assert not is_stub(stub, "def f(x):\n    return x\n\n\ndef helper(x):\n    return x + 2\n")  # a learner's
    assert not is_stub(stub) and not is_stub(helper, helper)  # nothing left to write is no stub


@pytest.mark.parametrize("target,exits,make_exits", [("grade", 1, 0), ("grade", 2, 2), ("watch", 130, 0),
                                                     ("watch", 2, 2), ("show", 130, 2)])
def test_make_fails_on_a_usage_error_not_on_a_failing_grade_or_a_stopped_watch(tmp_path, target, exits, make_exits):
    """The Makefile's recipes, with grader.py replaced by a script that exits `exits`:
    a failing grade (1) and Ctrl-C out of watch (130) are a learner's normal day; a usage
    error (2) is make's error too."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin/python").write_text(f"#!/bin/sh\nexit {exits}\n")
    (venv / "bin/python").chmod(0o755)
    (venv / ".ready").touch()
    os.utime(venv / ".ready", (2 ** 31, 2 ** 31))  # newer than pyproject.toml: no set-up runs
    result = subprocess.run(["make", "-s", target, "DRILL=l1", f"VENV={venv}"], cwd=ROOT, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == make_exits, result.stdout + result.stderr
    assert ("Error" in result.stderr) == bool(make_exits), result.stderr


def test_ctrl_c_out_of_watch_exits_0(tmp_path):
    """Ctrl-C while the first grade runs (the grade's own handler exits 130) and while
    waiting for a change: watch ends with status 0 either way."""
    import signal
    import time

    from _commands import pristine_stub

    (tmp_path / "tree").mkdir()
    (tmp_path / "tree/l1_paged_kv_write.py").write_text(pristine_stub("l1_paged_kv_write"))
    tree = tmp_path / "tree"
    for wait_for in ("watching", "not started"):  # stopped in the grade, then after it
        out = tmp_path / f"out-{wait_for}"
        with open(out, "w") as sink:
            process = subprocess.Popen([sys.executable, "grader.py", "watch", "l1", "--tree", str(tree)], cwd=ROOT,
                                       stdout=sink, stderr=subprocess.STDOUT, env={**os.environ, "COLUMNS": "160"})
            deadline = time.monotonic() + 120
            while wait_for not in out.read_text() and time.monotonic() < deadline and process.poll() is None:
                time.sleep(0.2)
            time.sleep(0.5 if wait_for == "watching" else 2)
            process.send_signal(signal.SIGINT)
            assert process.wait(timeout=60) == 0, out.read_text()
        assert "stopped watching" in out.read_text()


def test_doctor_is_happy_here(here):
    code, out = here("doctor")
    assert code == 0 and "ready" in out, out


@pytest.mark.parametrize("argv,says", [(["hint", "l9"], "no drill 'l9'"),
                                       (["show", "l1", "--tree", "/nonexistent-tree"], "is not a folder")])
def test_commands_answer_bad_arguments_in_words(here, argv, says):
    code, out = here(*argv)
    assert code != 0 and says in out


def test_doctor_catches_a_missing_numpy(tmp_path):
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['numpy'] = None  # as if not installed\n")
    result = grader("doctor", env={"PYTHONPATH": str(tmp_path)})
    assert result.returncode == 1
    assert "pip install numpy" in result.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU, TRITON_INTERPRET=0 is the normal set-up")
def test_doctor_catches_an_interpreter_that_is_switched_off():
    result = grader("doctor", env={"TRITON_INTERPRET": "0"})
    assert result.returncode == 1
    assert "TRITON_INTERPRET" in result.stdout and "FAIL" in result.stdout


def test_hints_come_one_at_a_time(here, tmp_path, monkeypatch):
    import _commands

    monkeypatch.setattr(_commands, "STATE", tmp_path / ".drills")  # not this checkout's progress
    (_, first), (_, second) = here("hint", "l1"), here("hint", "l1")
    assert "hint 1 of" in first and "hint 2 of" in second
    assert (tmp_path / ".drills/hints.json").exists()


def test_show_draws_the_reference_without_red_flags(here):
    code, out = here("show", "l1", "--tree", "solutions")
    assert code == 0
    assert "k_cache, yours" in out and "t2" in out
    assert "?" not in out.split("k_cache, expected")[1].split("tN:")[0]


def test_diff_shows_both_files(here):
    code, out = here("diff", "l1", "--tree", "mine")
    assert code == 0 and "NotImplementedError" in out and "tl.program_id" in out


def test_the_l1_picture_draws_the_cache_that_is_wrong():
    from rich.console import Console

    from drills import l1

    ex = l1.WORKED_EXAMPLE
    case = l1.kv_write_case(ex["block_table"], ex["num_blocks"], ex["seq_idx"], ex["positions"], ex["block_size"],
                            num_heads=2, head_size=4)
    want_k, _ = case.expected()
    case.k_cache.storage.copy_(want_k)  # K written right, V never written
    console = Console(record=True, width=160)
    l1.draw_case(case, console)
    assert "v_cache, yours" in console.export_text()


def test_the_l2_picture_marks_what_is_wrong_and_what_was_never_written():
    from rich.console import Console

    from _paged import poisoned_out
    from drills import l2

    case = l2.small_case("cpu", [5, 17])
    out = poisoned_out(case.query.shape, case.query.dtype, "cpu", torch.Generator().manual_seed(0))
    out.view[0].copy_(case.reference()[0])  # sequence 0 right, sequence 1 never written
    console = Console(record=True, width=160)
    l2.draw_case((case, out.view), console)
    rows = console.export_text().splitlines()
    row0 = next(r for r in rows if r.strip().startswith("0 "))
    row1 = next(r for r in rows if r.strip().startswith("1 "))
    assert "✓" in row0 and "✗" not in row0 and "·" in row1


# --- the L3 and L4 pictures: `make show` exits 0 when it draws, the stub included --------


@pytest.mark.parametrize("drill,says", [("l3", "every query row right"), ("l4", "every merge right")])
def test_the_l3_and_l4_pictures_draw_the_reference_and_exit_0(here, drill, says):
    code, out = here("show", drill, "--tree", "solutions")
    assert code == 0 and says in out, out
    assert out.count("✗") == 1  # the legend's alone: no wrong output


@pytest.mark.parametrize("drill", ["l3", "l4"])
def test_the_pictures_of_a_stub_draw_what_they_can_and_exit_0(here, drill):
    """A stub is not an error of `show`: it draws the expected mask or chunks, says the
    function is not written yet, and exits 0 (tests/_picture.py show)."""
    code, out = here("show", drill, "--tree", "mine")
    assert code == 0 and "is not written yet" in out, out
    assert ("key position" if drill == "l3" else "chunks [start, end)") in out


def test_show_says_why_when_it_cannot_draw():
    import dataclasses

    from rich.console import Console

    import _picture
    from _manifest import BY_ID

    def broken(module, console):
        raise RuntimeError("the learner's process died")
    console = Console(record=True, width=200)
    code = _picture.show(dataclasses.replace(BY_ID["l3"], picture=broken), ROOT / "solutions", console)
    assert code == 1 and "could not draw L3's picture: RuntimeError: the learner's process died" in \
        console.export_text()


def test_the_l3_picture_marks_the_wrong_rows_with_the_window_they_fit():
    from rich.console import Console

    from drills.l3.picture import PICTURE_CASE, draw_case
    from drills.l3.cases import paged_prefill_case

    case = paged_prefill_case(**PICTURE_CASE)
    got = case.reference(mask="top_left").float()  # no causal offset: query i sees keys 0..i
    console = Console(record=True, width=200)
    draw_case((case, got), console)
    text = console.export_text()
    assert "q0 (pos 5)" in text and "fits keys 0..0, not 0..5" in text and "it owns blocks" in text
    assert "5 of 8 query rows wrong" in text  # the pure prefill of sequence 1 is right either way


def test_the_l4_picture_shows_empty_chunks_and_the_first_wrong_merge():
    from rich.console import Console

    from drills.l4.cases import split_case
    from drills.l4.picture import PICTURE_CASE, draw_case

    case = split_case(**PICTURE_CASE)
    console = Console(record=True, width=200)
    draw_case((case, case.reference()), console, merge=lambda v_a, s_a, v_b, s_b: (v_a, s_a))  # side b dropped
    text = console.export_text()
    assert "[0,1): 1  empty  empty  empty" in text and "[192,200): 8" in text
    assert "the first wrong merge: sequence 2, chunk 1" in text


# --- the failure panel and what the learner's code printed --------------------------------


def test_the_failure_footer_names_the_graded_tree():
    from rich.console import Console

    import _render

    s = dict(id="l3", title="Chunked-prefill attention", page="content/l3.md", failed=1, total=9, problem=None,
             first_failure=dict(name="test_worked_example", kind="mismatch", message="wrong", where=None, example="",
                                stdout="", stderr=""))
    console = Console(record=True, width=400)
    console.print(_render._failure_panel(s, "/home/alice/mine"))
    text = console.export_text()
    assert "make grade DRILL=l3 TREE=/home/alice/mine" in text and "--tree=/home/alice/mine" in text
    assert "--tree mine" not in text and "--tree=mine" not in text


@pytest.mark.parametrize("sandbox,missing,warned", [("none", None, "Landlock and no seccomp"),
                                                     ("landlock ABI 7 + seccomp", [], None),
                                                     ("landlock ABI 7; no seccomp", ["seccomp"], "no seccomp here")])
def test_a_grade_without_landlock_says_in_one_line_that_it_is_not_tamper_proof(sandbox, missing, warned, monkeypatch):
    """Where the kernel has no Landlock, or there is no seccomp, the grade says which in one
    line, and --json records it ("sandbox", "sandbox_missing": tests/_sandbox.py's describe
    and missing)."""
    from rich.console import Console

    import _render
    front = load_front()
    assert front.SANDBOX == "none" or "landlock ABI" in front.SANDBOX or "seccomp" in front.SANDBOX
    console = Console(record=True, width=300)
    _render.show(console, dict(tree="t", tree_name="mine", device="CPU", sandbox=sandbox, sandbox_missing=missing,
                               drills=[], bench_note="needs a GPU"))
    text = console.export_text()
    assert sum("not tamper-proof" in line for line in text.splitlines()) == int(bool(warned))
    assert warned is None or warned in text


def test_interpreter_warnings_are_marked_with_short_paths_and_the_learners_lines_stand_out():
    from rich.console import Console

    import _render
    import _report

    printed = ("my positions: [0, 1]\n"
               "/home/u/drills/.venv/lib/python3.11/site-packages/triton/runtime/interpreter.py:725: RuntimeWarning: "
               "overflow encountered in exp\n  return TensorHandle(op(arg.data), arg.dtype.scalar)\n"
               "/home/u/drills/mine/l3_paged_prefill.py:12: RuntimeWarning: mine\n  warnings.warn('mine')\n")
    trimmed = _report._trim(printed)
    assert trimmed.splitlines() == [
        "my positions: [0, 1]",
        f"{_render.INTERPRETER_MARK}triton/runtime/interpreter.py:725: RuntimeWarning: overflow encountered in exp",
        "/home/u/drills/mine/l3_paged_prefill.py:12: RuntimeWarning: mine", "  warnings.warn('mine')"]
    s = dict(id="l3", title="t", page="content/l3.md", failed=1, total=1, problem=None,
             first_failure=dict(name="n", kind="mismatch", message="m", where=None, example="", stdout="",
                                stderr=trimmed))
    console = Console(record=True, width=300, force_terminal=True, color_system="standard")
    console.print(_render._failure_panel(s, "mine"))
    html = console.export_html()
    assert "site-packages" not in html and "Triton&#x27;s interpreter, not your print" in html


def test_a_failing_tests_traceback_hides_the_machinery(tmp_path):
    """A plain pytest run (tests/_plugin.py registers tests/_report.py's hook for
    every run): the check's source and the worker's frames are hidden, the message stays,
    and an exception in the learner's code says where in their file it was raised."""
    import _wrong
    from _manifest import BY_ID

    wrong = _wrong.plant(BY_ID["l3"], "causal_offset_missing", tmp_path / "wrong")
    raises = _wrong.plant_edits(BY_ID["l3"], (("    _check_inputs(query, k_cache", "    [][1]\n    _check_inputs("
                                               "query, k_cache"),), tmp_path / "raises")
    for tree, says in ((wrong, "pitfall:causal_offset_missing"), (raises, "where your code raised it")):
        result = subprocess.run([sys.executable, "-m", "pytest", "-q", "tests/test_l3_paged_prefill.py",
                                 f"--tree={tree}", "-x", "-k", "chunk_over_a_prefix"], cwd=ROOT, capture_output=True,
                                text=True, timeout=300)
        out = result.stdout
        assert result.returncode == 1 and says in out, out
        assert "def check_paged_prefill" not in out and "tests/_worker.py" not in out and "tests/drills/" not in out
        assert "test_chunk_over_a_prefix_sees_the_prefix" in out
