"""What the tests of the commands share. Names no drill.

`here`, a fixture: this checkout's grader.py run in the test's own process (no new
interpreter to start), giving (exit status, what it printed). `make_echo(tmp_path)`: make
run against a stand-in venv whose python prints its arguments, so that a test reads the
command line a target builds without running it.
"""
import os
import subprocess

import pytest

from _tree import ROOT, load_front


@pytest.fixture
def here(monkeypatch, capsys):
    front = load_front()
    monkeypatch.setenv("COLUMNS", "160")

    def run(*args):
        code = front.main(list(args))
        return code, capsys.readouterr().out
    return run


def make_echo(tmp_path):
    """A function: make_echo(tmp_path)("hint", "DRILL=l1") runs `make -s hint DRILL=l1` with the
    stand-in venv and returns the finished process."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin/python").write_text('#!/bin/sh\necho "$@"\n')
    (venv / "bin/python").chmod(0o755)
    (venv / ".ready").touch()
    os.utime(venv / ".ready", (2 ** 31, 2 ** 31))  # newer than pyproject.toml: no set-up runs

    def make(*args):
        return subprocess.run(["make", "-s", *args, f"VENV={venv}"], cwd=ROOT, capture_output=True, text=True,
                              timeout=60)
    return make
