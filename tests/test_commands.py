"""The learner's and instructor's commands: reset never loses work, doctor catches
a broken set-up, hints come one at a time, show and diff draw."""
import os
import subprocess
import sys

import pytest
import torch

from _tree import ROOT, load_front


def grader(*args, cwd=ROOT, env=None):
    return subprocess.run([sys.executable, "grader.py", *args], cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, "COLUMNS": "160", **(env or {})}, timeout=120)


@pytest.fixture
def here(monkeypatch, capsys):
    """A command of this checkout's grader.py, run in this process (no new interpreter to
    start): (exit status, what it printed)."""
    front = load_front()
    monkeypatch.setenv("COLUMNS", "160")

    def run(*args):
        code = front.main(list(args))
        return code, capsys.readouterr().out
    return run


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
