"""The tests catch every pitfall, and the grader names it: each known-wrong solution
(tests/wrong/<stem>.py) fails its drill with that pitfall named, and the
diagnosis never names a pitfall the evidence does not show."""
import re
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from hypothesis import assume, given, settings, strategies as st

import _wrong
from _diagnose import Mismatch, _rerun_kv_write, check_kv_write, check_slot_mapping
from _manifest import DRILLS
from _paged import kv_write_params, random_kv_write_case
from _tree import ROOT, load_drill

sys.path.insert(0, str(ROOT))
import grader  # noqa: E402

CASES = [(d, name) for d in DRILLS for name in _wrong.pitfalls(d.stem)]


@pytest.fixture(scope="module")
def grades(tmp_path_factory):
    """Grade every planted bug once, two at a time (each grade is its own process)."""
    def grade(case):
        drill, name = case
        tree = _wrong.plant(drill.stem, name, tmp_path_factory.mktemp(name))
        return (drill.id, name), grader.grade_drill(drill, tree, timeout=300)

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(pool.map(grade, CASES))


@pytest.mark.parametrize("case", CASES, ids=[f"{d.id}-{n}" for d, n in CASES])
def test_planted_bug_fails_the_drill_and_is_named(grades, case):
    drill, name = case
    summary = grades[drill.id, name]
    assert summary["status"] == "failing", f"{name} planted in {drill.stem} was not caught: {summary}"
    named = [finding["pitfall"] for finding in summary["diagnosis"]]
    assert name in named, f"{name} planted in {drill.stem}: the grader named {named}; {summary['first_failure']}"


@pytest.mark.parametrize("drill", DRILLS, ids=lambda d: d.id)
def test_every_pitfall_on_the_page_has_a_wrong_solution(drill):
    named = set(re.findall(r"`pitfall:(\w+)`", (ROOT / drill.page).read_text()))
    assert named == set(_wrong.pitfalls(drill.stem)), "pitfalls on the page vs tests/wrong/" + drill.stem + ".py"


# --- the L1 diagnosis, both ways, on random cases -----------------------------

L1 = "l1_paged_kv_write"


@settings(max_examples=15)  # each example runs up to eleven kernels
@given(params=kv_write_params(), pitfall=st.sampled_from(sorted(_wrong.pitfalls(L1))))
def test_l1_diagnosis_names_the_planted_mistake_and_nothing_on_a_right_answer(device, params, pitfall):
    case = random_kv_write_case(**params, device=device)
    right = load_drill("solutions", L1)
    right.reshape_and_cache(*case.args())
    check_kv_write(case)  # a right answer: no Mismatch, so no pitfall named

    case = random_kv_write_case(**params, device=device)
    wrong = _wrong.variant(L1, pitfall)
    real = case.slot_mapping >= 0
    inputs = (case.block_table, case.seq_idx[real], case.positions[real], case.block_size)
    try:
        wrong_slots = wrong.slot_mapping(*inputs)
    except IndexError:  # the mistake crashes on this input: an error to report, not an answer to diagnose
        assume(False)
    slots_right = torch.equal(wrong_slots.cpu(), right.slot_mapping(*inputs).cpu())
    wrong.reshape_and_cache(*case.args())
    want_k, want_v = case.expected()
    writes_right = torch.equal(case.k_cache.storage, want_k) and torch.equal(case.v_cache.storage, want_v)
    assume(not (slots_right and writes_right))  # on this input the mistake changes nothing
    # A mistake whose programs write over each other (slot * D with H > 1) races on a GPU:
    # its output is then not evidence of anything, and the diagnosis rightly names nothing.
    again = _rerun_kv_write(wrong, case)
    assume(torch.equal(again[0], case.k_cache.storage) and torch.equal(again[1], case.v_cache.storage))
    with pytest.raises(Mismatch) as caught:
        if not slots_right:
            check_slot_mapping(*inputs, wrong_slots)
        check_kv_write(case)
    assert pitfall in caught.value.pitfalls
    # any other pitfall it names must give exactly the same output here
    for other in caught.value.pitfalls:
        assert other == pitfall or other in _equivalent(pitfall, case, inputs)


def _equivalent(pitfall, case, inputs):
    """Pitfalls whose variant gives the same slots and the same caches as `pitfall`'s on this case."""
    def outcome(name):
        module = _wrong.variant(L1, name)
        try:
            k, v = _rerun_kv_write(module, case)
            return module.slot_mapping(*inputs).cpu().tolist(), k.view(-1).tolist(), v.view(-1).tolist()
        except Exception:  # cannot run on this input: equivalent to nothing
            return name
    return {name for name in _wrong.pitfalls(L1) if outcome(name) == outcome(pitfall)}


# --- errors a learner meets are explained ------------------------------------


@pytest.mark.parametrize("message,meaning", [
    ("InterpreterError: ValueError('mask has unsupported dtype')", "scalar tl.where"),
    ("ValueError: arange's range must be a power of 2", "next_power_of_2"),
    ("IncompatibleTypeErrorImpl('invalid operands of type pointer<fp16> and triton.language.float32')", "float dtype"),
])
def test_known_error_messages_are_explained(message, meaning):
    from _diagnose import explain_error

    assert meaning in explain_error(message)
    assert explain_error("ZeroDivisionError: division by zero") is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="only the CPU interpreter rejects a scalar in a mask's `&`")
def test_a_scalar_in_a_mask_is_explained_by_the_grader(tmp_path):
    source = (ROOT / "solutions" / f"{L1}.py").read_text()
    (tmp_path / f"{L1}.py").write_text(source.replace("keep = cols < tl.where(slot >= 0, HD, 0)",
                                                      "keep = (cols < HD) & (slot >= 0)"))
    summary = grader.grade_drill(next(d for d in DRILLS if d.stem == L1), tmp_path, timeout=300)
    assert summary["status"] == "failing"
    assert "choose the bound with a scalar tl.where" in summary["first_failure"]["message"]
