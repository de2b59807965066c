"""`make chat` (tests/drills/e1/bench.py's chat, tests/_chat.py, tests/_progress.py): a line per
step of the engine while it runs in the worker, read back as numbers; replies as text without
special tokens; a chat of turns on E2, or on E1 saying so. The real model is tested by
tests/test_e1_paged_engine.py; here the tiny random models serve."""
import os
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest

import _progress
from _chat import StepLines
from _tree import ROOT


def test_a_progress_note_is_read_as_numbers_only(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    _progress.note(3, 1, 2)
    assert _progress.read(tmp_path) == (3, 1, 2)
    for junk in ('["3"]', '{"a": 1}', "not json", "[-1]", "[1.5]", "[" + ",".join(["1"] * 17) + "]"):
        (tmp_path / _progress.NAME).write_text(junk)
        assert _progress.read(tmp_path) is None, junk
    (tmp_path / _progress.NAME).unlink()
    (tmp_path / "elsewhere").write_text("[1, 2]")
    (tmp_path / _progress.NAME).symlink_to(tmp_path / "elsewhere")  # a learner's link is not followed
    assert _progress.read(tmp_path) is None and _progress.read(tmp_path / "missing") is None


def test_step_lines_say_each_step_the_layer_of_a_slow_one_and_a_bound_on_the_rest(capsys):
    lines = StepLines(tokens=5, slow=10)
    for note, seconds in [((0, 0, 0, 0, 8, 30), 11.0), ((0, 0, 0, 0, 9, 30), 12.0), ((1, 2, 70, 37, 0, 30), 30.0),
                          ((2, 2, 2, 38, 0, 30), 34.0), ((3, 2, 2, 39, 0, 30), 37.0), ((5, 2, 2, 41, 0, 30), 43.0)]:
        lines.show(note, seconds)
    out = capsys.readouterr().out.splitlines()
    assert out == ["  step 1: at layer 8 of 30 · 11.0 s",
                   "  step 1: 2 sequences, 70 tokens in, longest context 37 · 30.0 s",
                   "  step 2: 2 sequences, 2 tokens in, longest context 38 · 34.0 s",
                   "  step 3: 2 sequences, 2 tokens in, longest context 39 · 37.0 s · 3.00 s a decode step: at most 2 "
                   "more, ~6 s",
                   "  step 5: 2 sequences, 2 tokens in, longest context 41 · 43.0 s · 3.00 s a decode step: at most 0 "
                   "more, ~0 s"]


class Tokens:
    """A tokenizer without a chat template, for the tiny models: a character a token."""
    chat_template = None

    def __call__(self, text):
        return SimpleNamespace(input_ids=[1 + ord(c) % 60 for c in text])

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(ord("a") + i % 26) for i in ids)


FAKE_E2 = '''"""A stand-in E2: E1's engine, and stats as design.md's E2 gives them."""
import importlib.util
from pathlib import Path


def generate(model, prompts, max_new_tokens, *, kernels=None, return_stats=False, **kwargs):
    spec = importlib.util.spec_from_file_location("e1_under_e2", Path(__file__).with_name("e1_paged_engine.py"))
    e1 = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(e1)
    tokens = e1.generate(model, prompts, max_new_tokens, kernels=kernels, **kwargs)
    total = sum(map(len, prompts))
    stats = dict(prompt_tokens=total, computed_prompt_tokens=total - 16, reused_prompt_tokens=16, steps=4,
                 cascade_steps=1, preemptions=0)
    return (tokens, stats) if return_stats else tokens
'''


@pytest.fixture
def tree(tmp_path):
    """A tree with the reference E1, L1, L3 and L6 and no E2."""
    folder = tmp_path / "tree"
    folder.mkdir()
    for stem in ("e1_paged_engine", "l1_paged_kv_write", "l3_paged_prefill", "l6_cascade_attention"):
        shutil.copy(ROOT / "solutions" / f"{stem}.py", folder)
    return folder


@pytest.mark.parametrize("e2", [None, FAKE_E2])
def test_a_chat_of_turns_repeats_the_earlier_turns_and_says_what_each_reused(tree, capsys, e2):
    """Served in the worker (the kernels note each step, read back as numbers), on E2 when the tree
    has one (a stand-in here), else on E1, saying so."""
    from drills.e1 import bench
    from drills.e1.cases import tiny_model
    from _worker import tree_module

    if e2:
        (tree / "e2_prefix_cache.py").write_text(e2)
    try:
        model, tokenizer = tiny_model(eos=None), Tokens()
        engine = bench.e2_engine(tree, str(tree), 60) or tree_module(tree, "e1_paged_engine", readable=[tree],
                                                                        preload=bench.PRELOAD)
        args = SimpleNamespace(tokens=2)
        assert bench.chat_of_turns(engine, bool(e2), model, tokenizer, ["hi", "and?"], args, str(tree), 60) == 0
    finally:
        (tree / "e2_prefix_cache.py").unlink(missing_ok=True)
    out = capsys.readouterr().out
    first, second = out.split("[turn 2]")
    # turn 2's prompt: "hi", the reply (2 tokens, a letter each) and "and?", a line each
    assert "(2 prompt tokens" in first and f"({2 + 1 + 2 + 1 + 4} prompt tokens" in second
    # a line per step, from the worker while it served: the prefill made token 1, one decode step token 2
    assert "  step 2: 1 sequence, 1 token in, longest context 3 · " in first
    if e2:
        assert out.count("reused 16 of ") == 2 and "1 of 4 steps through cascade" in out
    else:
        assert "has no e2_prefix_cache.py: the chat runs on E1's engine" in first
        assert out.count("E1 reuses nothing") == 2
    assert out.count("equal to transformers' generate") == 2


def test_chat_answers_a_usage_error_at_once_without_a_runpy_warning():
    result = subprocess.run([sys.executable, "grader.py", "chat", "--turns", "9"], cwd=ROOT, capture_output=True,
                            text=True, timeout=120, env={**os.environ, "COLUMNS": "160"})
    assert result.returncode == 2 and "TURNS=9, but there are 4 messages" in result.stderr, result.stderr
    assert "RuntimeWarning" not in result.stderr
