"""The commands of issue 48 beside the grade: `make diff` (markers, not colour; the width;
"identical"; two learners), `make bench` without a GPU (at once, the reference's traffic
lines), the documented `grader.py <command>` forms, and `make show` for L5, L6 and E1."""
import os
import subprocess
import sys

import pytest

from _front import here  # noqa: F401  -- a fixture
from _tree import ROOT


# --- diff: markers, the width, identical files, two learners ----------------------------


def _edited_copy(tmp_path, name, edit):
    """A tree holding solutions/l1_paged_kv_write.py with `edit` applied to its lines."""
    tree = tmp_path / name
    tree.mkdir()
    lines = (ROOT / "solutions/l1_paged_kv_write.py").read_text().splitlines()
    (tree / "l1_paged_kv_write.py").write_text("\n".join(edit(lines)) + "\n")
    return tree


def _changed(lines):
    """One line changed, one deleted, one long line inserted."""
    lines = list(lines)
    lines[10] = "CHANGED = 1"
    del lines[20]
    lines.insert(30, "INSERTED = '" + "x" * 200 + "'")
    return lines


def test_diff_of_identical_files_says_so(here):
    code, out = here("diff", "l1", "--tree", "solutions")
    assert code == 0 and out.strip() == "identical: solutions/l1_paged_kv_write.py and solutions/l1_paged_kv_write.py"


def test_diff_side_by_side_marks_changes_without_colour(here, tmp_path):
    """Piped (no colour), wide: diff -y's markers; a long line folds, its pieces marked alike."""
    tree = _edited_copy(tmp_path, "alice", _changed)
    code, out = here("diff", "l1", "--tree", str(tree))
    assert code == 0 and "\x1b[" not in out
    rows = out.splitlines()
    assert all(len(r) <= 160 for r in rows)
    changed = [r for r in rows if " | " in r and "CHANGED = 1" in r]
    deleted = [r for r in rows if r.rstrip().endswith("<")]
    inserted = [r for r in rows if " > " in r and "x" * 20 in r]
    assert len(changed) == 1 and changed[0].split(" | ")[0].strip().startswith("11 ")
    assert len(deleted) == 1 and len(inserted) >= 2  # the 212-character line folds in two or more rows


def test_diff_at_80_columns_is_a_unified_diff_that_fits(here, tmp_path, monkeypatch):
    tree = _edited_copy(tmp_path, "alice", _changed)
    monkeypatch.setenv("COLUMNS", "80")
    code, out = here("diff", "l1", "--tree", str(tree))
    rows = out.splitlines()
    assert code == 0 and rows[0].startswith("--- solutions/") and f"+++ {tree}/l1_paged_kv_write.py".startswith(rows[1])
    assert all(len(r) <= 80 for r in rows), max(rows, key=len)
    assert "+CHANGED = 1" in rows and sum(r.startswith("+") and "xxxx" in r for r in rows) >= 3
    assert any(r.startswith("-") and not r.startswith("---") for r in rows) and any(r.startswith("@@") for r in rows)


def test_diff_puts_two_learners_side_by_side(here, tmp_path):
    alice = _edited_copy(tmp_path, "alice", _changed)
    bob = _edited_copy(tmp_path, "bob", lambda lines: lines)
    code, out = here("diff", "l1", "--tree", str(alice), "--other", str(bob))
    header = out.splitlines()[0]
    assert code == 0 and str(bob) in header and str(alice) in header and header.index(str(bob)) < header.index(str(alice))
    code, out = here("diff", "l1", "--tree", str(bob), "--other", str(tmp_path / "nobody"))
    assert code == 2 and "is not a folder" in out


# --- bench without a GPU: at once, the reference's traffic lines, no grade ---------------


def test_bench_without_a_gpu_prints_traffic_lines_and_grades_nothing(tmp_path):
    """It says so before torch is imported (a sitecustomize marks the import), then prints
    the reference's traffic lines, and runs no test."""
    (tmp_path / "sitecustomize.py").write_text(
        "import sys\nclass Mark:\n    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torch':\n            print('torch imported', flush=True)\n"
        "sys.meta_path.insert(0, Mark())\n")
    result = subprocess.run([sys.executable, "grader.py", "bench", "l1", "e1"], cwd=ROOT, capture_output=True,
                            text=True, timeout=180, env={**os.environ, "COLUMNS": "200", "TRITON_INTERPRET": "1",
                                                         "PYTHONPATH": str(tmp_path)})
    rows = [row for row in result.stdout.splitlines() if row != "torch imported"]
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("bandwidth: needs a GPU") and "torch imported" in result.stdout
    assert rows[1].startswith("L1  loads 1.00× the fewest bytes") and rows[1].endswith("at the roofline")
    assert rows[2].startswith("E1  no traffic case") and len(rows) == 3


def test_the_documented_command_forms_answer(here):
    """README: each command also runs as `python grader.py <command> ...`."""
    assert here("grade", "nope")[0] == 2 and "no drill 'nope'" in here("grade", "nope")[1]
    with pytest.raises(SystemExit) as stop:
        here("chat", "--help")
    assert stop.value.code == 0


# --- the L5, L6 and E1 pictures: the page's example, what is wrong marked -----------------


@pytest.mark.parametrize("drill,says", [("l5", "every slot right, and nothing else written"), ("l6", "A B C | D E Y")])
def test_the_l5_l6_e1_pictures_draw_the_reference_with_nothing_marked_wrong(here, drill, says):
    code, out = here("show", drill, "--tree", "solutions")
    assert code == 0 and says in out, out
    assert not [line for line in out.splitlines() if "✗" in line and "wrong" not in line], out  # legends alone


@pytest.mark.parametrize("drill,planted,says", [
    ("l5", "no_saturation", "1 (token, head) rows wrong"),
    ("l6", "suffix_not_offset", "prefix counted twice (pitfall:suffix_not_offset)"),
    ("e1", "sample_wrong_row", "every step as the page schedules it")])
def test_the_l5_l6_e1_pictures_mark_a_planted_mistake(here, tmp_path, monkeypatch, drill, planted, says):
    import _wrong
    from _manifest import BY_ID

    monkeypatch.setenv("DRILLS_KERNELS", str(ROOT / "solutions"))  # E1's planted tree holds its engine alone
    code, out = here("show", drill, "--tree", str(_wrong.plant(BY_ID[drill], planted, tmp_path / "wrong")))
    assert code == 0 and says in out, out
    if drill == "e1":  # its steps are the page's; the token sampled from the wrong row is not
        assert "first differs at new token 0" in out and out.count("✗") == 2, out
