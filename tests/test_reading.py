"""The learner's reading commands: `make hint`, `make walkthrough` and `make page` read
content/<id>-hints.md, content/<id>-walkthrough.md and content/<id>.md and print them as
written; they, and every usage error, answer without importing torch (tests/_catalog.py)."""
import os
import subprocess
import sys

import pytest

from _front import make_echo
from _tree import ROOT


# --- hints, the walkthrough and the page: read from content/, printed as text -------------


def _every_drill():
    from _manifest import DRILLS
    return [d.id for d in DRILLS]


@pytest.mark.parametrize("drill_id", _every_drill())
def test_every_hint_prints_exactly_as_written(drill_id, tmp_path, monkeypatch):
    """`make hint` goes through content/<id>-hints.md in order, and each hint's text is printed
    as it stands in the file, square brackets and all (as rich markup, L1's hint 1 lost
    `block_table[seq_idx, 逻辑块]`), at any width; the last one points at the walkthrough."""
    import re

    from rich.console import Console

    import _catalog
    import _commands

    monkeypatch.setattr(_commands, "STATE", tmp_path / ".drills")
    text = (ROOT / "content" / f"{drill_id}-hints.md").read_text()
    written = [block.strip() for block in re.split(r"^### 提示 \d+\n", text, flags=re.M)[1:]]
    assert written, f"content/{drill_id}-hints.md has no `### 提示 N` block"
    for n, hint in enumerate(written, 1):
        console = Console(record=True, width=60)
        assert _commands.hint(_catalog.drill(drill_id), console) == 0
        out = console.export_text()
        header, _, printed = out.partition("\n\n")
        assert header == f"{drill_id.upper()} hint {n} of {len(written)} (from content/{drill_id}-hints.md)"
        last = "\n\nThat was the last hint"
        assert printed.split(last)[0].rstrip("\n") == hint, f"{drill_id} hint {n} is not printed as written"
        assert (last in printed) == (n == len(written))
    if drill_id == "l1":
        assert "block_table[seq_idx, 逻辑块]" in written[0]


def test_the_walkthrough_asks_first_until_the_drill_passes(tmp_path, monkeypatch):
    """Not passed and not on a terminal: it says how to confirm, shows nothing, exits 0; --yes
    shows it; once a grade of mine/ recorded a pass, it shows it without asking."""
    from rich.console import Console

    import _catalog
    import _commands

    monkeypatch.setattr(_commands, "STATE", tmp_path / ".drills")
    l1 = _catalog.drill("l1")
    shown = "block_table[seq_idx, page].long()"  # a line of the reference the walkthrough cites

    def walkthrough(**kwargs):
        console = Console(record=True, width=200)
        assert _commands.walkthrough(l1, console, **kwargs) == 0
        return console.export_text()
    out = walkthrough()
    assert "make walkthrough DRILL=l1 YES=1" in out and shown not in out
    assert shown in walkthrough(yes=True)
    _commands.record_grades(ROOT / "solutions", [dict(id="l1", status="passed")])  # another tree: not the learner's
    assert shown not in walkthrough()
    _commands.record_grades(ROOT / "mine", [dict(id="l1", status="passed")])
    assert shown in walkthrough()
    _commands.record_grades(ROOT / "mine", [dict(id="l1", status="failing")])
    assert shown not in walkthrough()


def on_a_terminal(argv, answer, state):
    """grader.py `argv` on a pseudo-terminal, `answer` typed in, progress in `state`:
    (exit status, what it printed, colours removed)."""
    import pty
    import re

    probe = (f"import sys; sys.path.insert(0, 'tests'); import _commands, pathlib; "
             f"_commands.STATE = pathlib.Path({str(state)!r}); sys.argv = ['grader.py', *{argv!r}]; "
             f"import runpy; runpy.run_path('grader.py', run_name='__main__')")
    pid, fd = pty.fork()
    if pid == 0:  # the child: grader.py on the pseudo-terminal
        os.chdir(ROOT)
        os.environ["COLUMNS"] = "200"
        os.execv(sys.executable, [sys.executable, "-c", probe])
    out = b""
    os.write(fd, answer.encode())
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), re.sub(r"\x1b\[[0-9;]*m", "", out.decode(errors="replace"))


@pytest.mark.parametrize("answer,shows", [("y\n", True), ("\n", False)])
def test_the_walkthrough_asks_y_or_n_on_a_terminal(answer, shows, tmp_path):
    """On a terminal the learner answers y/N; N is the default."""
    code, text = on_a_terminal(["walkthrough", "l1"], answer, tmp_path / ".drills")
    assert code == 0, text
    assert "Show it anyway? [y/N]" in text
    assert ("block_table[seq_idx, page].long()" in text) == shows and ("Not shown." in text) != shows


@pytest.mark.parametrize("answer,shows", [("\n", True), ("q\n", False)])
def test_the_page_shows_the_answers_after_a_key_press_on_a_terminal(answer, shows, tmp_path):
    """On a terminal the page ends by offering the answers: Enter shows them, q stops."""
    code, text = on_a_terminal(["page", "l1"], answer, tmp_path / ".drills")
    assert code == 0, text
    assert "Press Enter to show the self-tests' answers" in text
    assert ("4063" in text) == shows  # self-test 2's answer: 4096 slots reserved, 4063 wasted


@pytest.mark.parametrize("drill_id", _every_drill())
def test_the_page_renders_with_the_answers_folded(drill_id):
    """`make page` renders content/<id>.md with rich's Markdown: each self-test answer is one
    line saying how to show it, and ANSWERS=1 (--answers) shows them all."""
    from rich.console import Console

    import _catalog
    import _commands
    import _pages

    text = (ROOT / "content" / f"{drill_id}.md").read_text()
    tests = next((body for _, title, body in _pages.numbered_sections(text) if "自测" in title), None)
    assert tests is not None, f"content/{drill_id}.md has no self-test section (## N. 自测)"
    folded = tests.count("<details>")

    def page(answers):
        console = Console(record=True, width=160)
        assert _commands.page(_catalog.drill(drill_id), console, answers=answers) == 0
        return console.export_text()
    out, shown = page(False), page(True)
    assert out.count(f"make page DRILL={drill_id} ANSWERS=1") == folded, out[-2000:]
    assert "ANSWERS=1" not in shown and len(shown) > len(out)
    assert "<details>" not in shown and "<summary>" not in out


def test_make_passes_yes_and_answers_on(tmp_path):
    """make walkthrough YES=1 and make page ANSWERS=1 reach grader.py as --yes and --answers."""
    run = make_echo(tmp_path)

    def make(*args):
        return run(*args).stdout.strip()
    assert make("walkthrough", "DRILL=l1") == "grader.py walkthrough l1 --tree mine"
    assert make("walkthrough", "DRILL=l1", "YES=1") == "grader.py walkthrough l1 --tree mine --yes"
    assert make("page", "DRILL=l7", "ANSWERS=1") == "grader.py page l7 --tree mine --answers"
    assert make("hint", "DRILL=l1") == "grader.py hint l1 --tree mine"


# --- commands that answer without torch ------------------------------------------------------

# grader.py run as `make` runs it, reporting at exit which heavy modules it imported; progress
# (.drills/) goes to a folder of the test's.
PROBE = """
import atexit, json, os, runpy, sys
atexit.register(lambda: open(os.environ["PROBE_OUT"], "w").write(json.dumps(
    sorted(m for m in ("torch", "triton", "numpy") if m in sys.modules))))
sys.path.insert(0, "tests")
import pathlib, _commands
_commands.STATE = pathlib.Path(os.environ["PROBE_STATE"])
sys.argv = ["grader.py", *sys.argv[1:]]
runpy.run_path("grader.py", run_name="__main__")
"""


@pytest.mark.parametrize("argv,code,says", [
    (["--help"], 0, "usage: grader.py"), (["nope"], 2, "no drill 'nope'"), (["grade", "l9"], 2, "no drill 'l9'"),
    (["--tree", "/nonexistent-tree", "l1"], 2, "is not a folder"), (["show", "nope"], 2, "no drill 'nope'"),
    (["watch", "nope"], 2, "no drill 'nope'"), (["hint", "--help"], 0, "usage: grader.py hint"),
    (["hint", "l1"], 0, "L1 hint 1 of"), (["walkthrough", "l7"], 0, "YES=1"), (["page", "l5"], 0, "L5"),
    (["reset", "nope"], 2, "no drill 'nope'"), (["diff", "l1"], 0, "solutions/l1_paged_kv_write.py")],
    ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_commands_answer_without_importing_torch(argv, code, says, tmp_path):
    """Arguments, usage errors, --help, hint, walkthrough, page, reset and diff never load torch,
    Triton or numpy (6-15 s on a busy machine): each answers in well under the 5 s allowed here
    (quiet, 2 cores: 0.1-0.3 s)."""
    import time

    started = time.monotonic()
    result = subprocess.run([sys.executable, "-c", PROBE, *argv], cwd=ROOT, capture_output=True, text=True,
                            env={**os.environ, "COLUMNS": "200", "PROBE_OUT": str(tmp_path / "modules.json"),
                                 "PROBE_STATE": str(tmp_path / ".drills")}, timeout=120)
    seconds = time.monotonic() - started
    assert result.returncode == code, result.stdout + result.stderr
    assert says in result.stdout, result.stdout + result.stderr
    assert (tmp_path / "modules.json").read_text() == "[]", f"grader.py {' '.join(argv)} imported it"
    assert seconds < 5, f"grader.py {' '.join(argv)} took {seconds:.1f} s"


def test_the_catalog_agrees_with_the_manifest():
    """tests/_catalog.py finds the drills without importing them: the manifest's ids, in its
    order, with their stems, and the same answer for a name it does not know."""
    import _catalog
    from _manifest import DRILLS, drill

    assert [(e.id, e.stem, e.page) for e in _catalog.entries()] == [(d.id, d.stem, d.page) for d in DRILLS]
    assert _catalog.drill("L3").id == "l3" and _catalog.drill("l3_paged_prefill").id == "l3"
    with pytest.raises(KeyError) as ours:
        _catalog.drill("nope")
    with pytest.raises(KeyError) as theirs:
        drill("nope")
    assert ours.value.args == theirs.value.args
