"""A learner's file cannot change its own grade: the six ways found to forge a pass
(issue 19) are planted in one wrong L1 kernel, graded by grader.py in a throwaway copy
of the checkout with a throwaway venv, and each must fail to move the grade or to
change anything under the project or the venv. Also the worker's confinement, directly.
"""
import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

import _sandbox
import _wrong
from _data import NotData, loads
from _manifest import drill as find_drill
from _process import run_process
from _tree import ROOT

pytestmark = [pytest.mark.meta, pytest.mark.skipif(not _sandbox.abi(), reason="no Landlock on this kernel")]

L1 = find_drill("l1")

# Each attack runs when the learner's module is imported in the worker, and prints what
# stopped it, so the grade's "your code printed" shows the sandbox at work. __MARKERS__
# is a folder outside the project where a successful attack leaves its proof.
ATTACKS = r'''
import glob, os, signal, site, subprocess, sys, time

def _attempt(name, action):
    try:
        action()
        print(f"attack {name}: done")
    except Exception as error:
        print(f"attack {name}: stopped ({type(error).__name__}: {error})")

def _pids(word):
    found = []
    for stat in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            if word in open(stat, "rb").read().decode(errors="replace"):
                found.append(int(stat.split("/")[2]))
        except OSError:
            pass
    return [p for p in found if p != os.getpid()]

ROOT = __ROOT__

def conftest_then_kill():  # 1: a conftest.py the resumed test process would load, then kill it
    open(os.path.join(ROOT, "conftest.py"), "w").write("import os; os.environ['FORGED'] = '1'\n")
    for pid in _pids("pytest"):
        os.kill(pid, signal.SIGKILL)

def stale_pyc():  # 2: a compiled module in tests/__pycache__ stamped to look current
    folder = os.path.join(ROOT, "tests", "__pycache__")
    os.makedirs(folder, exist_ok=True)
    open(os.path.join(folder, "_diagnose.cpython-311.pyc"), "wb").write(b"forged")

def sitecustomize():  # 3: a sitecustomize.py in the venv that sets PYTEST_PLUGINS
    target = site.getsitepackages()[0]
    open(os.path.join(target, "sitecustomize.py"), "w").write("import os; os.environ['PYTEST_PLUGINS'] = 'x'\n")

def read_the_key():  # 5: the test process's memory (its signing key), then signed lines appended
    if not _pids("--drills-report"):
        raise LookupError("no test process to read")
    for pid in _pids("--drills-report"):
        open(f"/proc/{pid}/mem", "rb").read(1)
    for pid in _pids("--drills-report"):
        args = open(f"/proc/{pid}/cmdline", "rb").read().decode().split("\0")
        open(args[args.index("--drills-report") + 1], "a").write('{"outcome": "passed"}\tforged\n')

def detached_rewriter():  # 6: outlive the grader, then rewrite its --json file
    code = ("import time, glob, json\n"
            "time.sleep(4)\n"
            "for path in glob.glob(__MARKERS__ + '/*.json'):\n"
            "    open(path, 'w').write(json.dumps(dict(forged=True)))\n")
    subprocess.Popen([sys.executable, "-c", code], start_new_session=True, stdin=subprocess.DEVNULL,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

for _name, _action in (("1 conftest", conftest_then_kill), ("2 pyc", stale_pyc), ("3 sitecustomize", sitecustomize),
                       ("5 key", read_the_key), ("6 detached", detached_rewriter)):
    _attempt(_name, _action)


class _Payload:  # 4: a reply whose unpickling runs code in the test process
    def __reduce__(self):
        return (os.system, ("touch " + __MARKERS__ + "/unpickled",))


_real_reshape_and_cache = reshape_and_cache


def reshape_and_cache(*args, **kwargs):
    _real_reshape_and_cache(*args, **kwargs)
    return _Payload()
'''


def _snapshot(folder, skip=(".hypothesis", ".git")):
    """{relative path: sha1} of every file under folder (bytecode caches included)."""
    found = {}
    for path in sorted(Path(folder).rglob("*")):
        rel = path.relative_to(folder)
        if path.is_file() and not (set(rel.parts) & set(skip)):
            found[str(rel)] = hashlib.sha1(path.read_bytes()).hexdigest()
    return found


@pytest.fixture(scope="module")
def forged(tmp_path_factory):
    """The grade of the attacking tree, in throwaway copies; and what changed."""
    tmp = tmp_path_factory.mktemp("forge")
    repo, venv, markers = tmp / "repo", tmp / "venv", tmp / "markers"
    markers.mkdir()
    shutil.copytree(ROOT, repo, ignore=shutil.ignore_patterns(".venv", ".git", "__pycache__", ".hypothesis",
                                                               ".drills", ".pytest_cache"))
    # A venv of its own that sees the real one's packages through a .pth file: the attack
    # on "the venv" aims at this one's site-packages.
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site_packages = Path(sysconfig.get_path("purelib", vars={"base": str(venv), "platbase": str(venv)}))
    (site_packages / "drills-real-venv.pth").write_text(sysconfig.get_path("purelib") + "\n")
    learner = tmp / "learner"
    _wrong.plant(L1, "padding_written", learner)  # a wrong kernel: it must not pass
    module = learner / f"{L1.stem}.py"
    module.write_text(module.read_text() + ATTACKS.replace("__ROOT__", repr(str(repo))).replace("__MARKERS__", repr(str(markers))))
    before = _snapshot(repo), _snapshot(venv)
    out_json = markers / "grade.json"
    env = {"PYTHONDONTWRITEBYTECODE": "1", "COLUMNS": "200"}  # no bytecode of ours: any .pyc is the attack's
    code, out, err = run_process([str(venv / "bin" / "python"), str(repo / "grader.py"), "l1", "--tree", str(learner),
                                  "--json", str(out_json)], 600, env)
    first = json.loads(out_json.read_text())
    time.sleep(6)  # the detached rewriter's moment has passed
    return dict(code=code, out=out, err=err, grade=first, json_after=json.loads(out_json.read_text()),
                before=before, after=(_snapshot(repo), _snapshot(venv)), markers=markers)


def test_the_wrong_kernel_still_fails(forged):
    s = forged["grade"]["drills"][0]
    assert forged["code"] == 1 and s["status"] == "failing", forged["out"][-3000:]
    assert forged["grade"]["sandbox"].startswith("landlock ABI")


def test_nothing_under_the_project_or_the_venv_changed(forged):
    """Attacks 1 (conftest.py), 2 (.pyc) and 3 (sitecustomize.py) wrote nothing."""
    (repo_before, venv_before), (repo_after, venv_after) = forged["before"], forged["after"]
    assert repo_after == repo_before, sorted(set(repo_after) ^ set(repo_before))
    assert venv_after == venv_before, sorted(set(venv_after) ^ set(venv_before))


def test_the_sandbox_stopped_each_attack_and_the_grade_shows_it(forged):
    printed = forged["out"]
    for attack in ("1 conftest", "2 pyc", "3 sitecustomize", "5 key"):
        assert f"attack {attack}: stopped" in printed or f"attack {attack}: done" not in printed, attack


def test_a_reply_that_is_not_data_is_refused_not_run(forged):
    """Attack 4: the payload's code never ran in the test process, and the failure says what came back."""
    assert not (forged["markers"] / "unpickled").exists()
    assert "not data (posix.system)" in forged["out"] or "not data" in json.dumps(forged["grade"])


def test_no_process_of_the_learner_outlives_the_grade(forged):
    """Attack 6: the detached process could not rewrite the instructor's JSON."""
    assert forged["json_after"] == forged["grade"]


def test_the_allow_list_unpickler_takes_tensors_and_refuses_callables():
    import pickle

    import torch
    from multiprocessing.reduction import ForkingPickler
    data = (torch.arange(6).view(2, 3)[:, 1:], [1, 2.5, None, "s", {"k": torch.float16}], torch.Size([2]))
    back = loads(bytes(ForkingPickler.dumps(data)))
    assert torch.equal(back[0], data[0]) and back[1] == data[1] and back[2] == data[2]
    with pytest.raises(NotData, match="posix.system|os.system"):
        loads(pickle.dumps(type("P", (), {"__reduce__": lambda self: (os.system, ("true",))})()))


def test_a_confined_process_writes_only_its_scratch(tmp_path):
    scratch, outside = tmp_path / "scratch", tmp_path / "outside"
    scratch.mkdir()
    code = (f"import sys, os; sys.path.insert(0, {str(ROOT / 'tests')!r}); import _sandbox; _sandbox.confine({str(scratch)!r})\n"
            f"open({str(scratch / 'ok')!r}, 'w').write('x')\n"
            f"try:\n    open({str(outside)!r}, 'w')\nexcept PermissionError:\n    print('denied')\n"
            f"try:\n    os.kill(os.getppid(), 0)\nexcept PermissionError:\n    print('no signal')\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.stdout.splitlines() == ["denied", "no signal"], result.stderr
    assert (scratch / "ok").exists() and not outside.exists()
