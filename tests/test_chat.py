"""`make chat` (tests/drills/e1/bench.py's chat, tests/_chat.py, tests/_progress.py): a line per
step of the engine while it runs in the worker, read back as numbers; replies as text without
special tokens; a chat of turns on E2, or on E1 saying so. The real model is tested by
tests/test_e1_paged_engine.py; here the tiny random models serve."""
import os
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


SOLUTIONS = str(ROOT / "solutions")


def test_without_e2_a_chat_runs_on_e1_saying_so(tmp_path, capsys):
    from drills.e1 import bench

    assert bench.e2_engine(tmp_path, SOLUTIONS, 60) is None
    assert "has no e2_prefix_cache.py: the chat runs on E1's engine" in capsys.readouterr().out


def test_a_chat_of_turns_on_e1_repeats_the_earlier_turns_a_line_per_step(capsys):
    """Served in the worker, whose kernels note each step (read back as numbers)."""
    from drills.e1 import bench
    from drills.e1.cases import tiny_model
    from _worker import tree_module

    engine = tree_module(SOLUTIONS, "e1_paged_engine", readable=[SOLUTIONS], preload=bench.PRELOAD)
    assert bench.chat_of_turns(engine, False, tiny_model(eos=None), Tokens(), ["hi", "and?"],
                               SimpleNamespace(tokens=2), SOLUTIONS, 60) == 0
    out = capsys.readouterr().out
    first, second = out.split("[turn 2]")
    # turn 2's prompt: "hi", the reply (2 tokens, a letter each) and "and?", a line each
    assert "(2 prompt tokens" in first and f"({2 + 1 + 2 + 1 + 4} prompt tokens" in second
    # a line per step, from the worker while it served: the prefill made token 1, one decode step token 2
    assert "  step 2: 1 sequence, 1 token in, longest context 3 · " in first
    assert out.count("E1 reuses nothing") == 2 and out.count("equal to transformers' generate") == 2


def test_a_chat_on_the_reference_e2_reuses_the_previous_turns_whole_blocks(capsys):
    """The reference E2 (tiny model, blocks of 16): turn 2's prompt starts with turn 1's 40
    tokens, so its call, which serves turn 1's prompt first, reuses 2 whole blocks of it."""
    from drills.e1 import bench
    from drills.e1.cases import tiny_model

    engine = bench.e2_engine(SOLUTIONS, SOLUTIONS, 60)
    assert engine is not None, capsys.readouterr().out
    first = "a question of forty characters, and more"
    assert bench.chat_of_turns(engine, True, tiny_model(eos=None), Tokens(), [first, "and?"],
                               SimpleNamespace(tokens=2), SOLUTIONS, 60) == 0
    out = capsys.readouterr().out
    # turn 2: 40 + a line break + the 2-letter reply + a line break + "and?" = 48 tokens
    assert "reused 0 of its 40 prompt tokens" in out and "reused 32 of its 48 prompt tokens (67%), computed 16 " \
        "(and the 40 before it, to cache them)" in out, out
    assert "served after the previous turn's 40" in out and out.count("equal to transformers' generate") == 2


def test_chat_answers_a_usage_error_at_once_without_a_runpy_warning():
    result = subprocess.run([sys.executable, "grader.py", "chat", "--turns", "9"], cwd=ROOT, capture_output=True,
                            text=True, timeout=120, env={**os.environ, "COLUMNS": "160"})
    assert result.returncode == 2 and "TURNS=9, but there are 4 messages" in result.stderr, result.stderr
    assert "RuntimeWarning" not in result.stderr

