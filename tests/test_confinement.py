"""The worker's confinement (tests/_sandbox.py), tried directly: a fresh interpreter
imports torch, Triton and numpy, confines itself to a scratch folder with a tree it may
read, and then tries what the learner's code may and may not do. Each check is made in
that one process (importing torch costs about 2 s) and reported back as JSON; each test
below reads its part. A check skips only where this machine lacks Landlock or seccomp.
"""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import _sandbox

pytestmark = pytest.mark.meta

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
STATUS = _sandbox.status()
NO_LANDLOCK = "no Landlock on this kernel"
NO_SECCOMP = f"no seccomp here ({_sandbox.describe()})"
MARKER = f"drills-host-socket-{os.getpid()}"

LEARNER = '''
import torch, triton, triton.language as tl

@triton.jit
def _double(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, 2 * tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)

def double(x):
    out = torch.empty_like(x)
    _double[(triton.cdiv(x.numel(), 32),)](x, out, x.numel(), BLOCK=32)
    return out
'''

# Runs in the confined process. `checks[name]` is "ok", or "denied <errno>" where the
# kernel refused, or "error <what>" for anything else.
PROBE = r'''
import ctypes, errno, fcntl, json, os, resource, socket, stat, struct, subprocess, sys
import numpy, torch, triton
sys.path.insert(0, TESTS)
import _sandbox

checks = {}
def check(name, action):
    try:
        action()
        checks[name] = "ok"
    except OSError as e:
        checks[name] = f"denied {errno.errorcode.get(e.errno, e.errno)}" if e.errno in (errno.EACCES, errno.EPERM) \
            else f"error {e!r}"
    except Exception as e:
        checks[name] = f"error {e!r}"

def read(path):
    with open(path, "rb") as f:
        f.read()

def write(path):
    with open(path, "w") as f:
        f.write("x")

ppid = os.getppid()
channel, peer = socket.socketpair()  # made before, as the worker's channel is
description = _sandbox.confine(SCRATCH, readable=[TREE])

# What must work.
def learner():
    sys.path.insert(0, TREE)
    import learner_mod
    x = torch.arange(100, dtype=torch.float32)
    assert torch.equal(learner_mod.double(x), 2 * x)
check("learner module and Triton kernel", learner)
check("torch matmul", lambda: (torch.randn(32, 32) @ torch.randn(32, 32)).sum().item())
# How Triton finds libcuda on a GPU (a shell script that runs ldconfig.real on Debian and Ubuntu).
check("ldconfig -p", lambda: subprocess.run(["/sbin/ldconfig", "-p"], capture_output=True, check=True))
check("torch shared memory", lambda: torch.zeros(8).share_memory_())
check("read own /proc entry", lambda: read("/proc/self/status"))
check("write in scratch", lambda: write(os.path.join(SCRATCH, "ok.txt")))
check("the channel works", lambda: (channel.sendall(b"ping"), peer.recv(4) == b"ping" or 1 / 0))
check("own rlimit", lambda: resource.prlimit(0, resource.RLIMIT_NOFILE))
check("own priority", lambda: os.setpriority(os.PRIO_PROCESS, 0, os.getpriority(os.PRIO_PROCESS, 0)))
check("own affinity", lambda: os.sched_setaffinity(0, os.sched_getaffinity(0)))

# What must be refused: reads.
check("read sibling solutions", lambda: read(os.path.join(SOLUTIONS, "secret.py")))
check("import from sibling solutions", lambda: (sys.path.insert(0, SOLUTIONS), __import__("secret")))
check("read outside scratch", lambda: read(OUTSIDE))
check("list tmp dir", lambda: os.listdir(os.path.dirname(SCRATCH)))
check("list /tmp", lambda: os.listdir("/tmp"))
check("list home", lambda: os.listdir(HOME))
check("read project tests", lambda: read(os.path.join(TESTS, "_sandbox.py")))
check("list project", lambda: os.listdir(os.path.dirname(TESTS)))
check("read parent environ", lambda: read(f"/proc/{ppid}/environ"))
check("read parent maps", lambda: read(f"/proc/{ppid}/maps"))
# ... writes.
check("write outside scratch", lambda: write(os.path.join(os.path.dirname(SCRATCH), "new.txt")))
check("write in tree", lambda: write(os.path.join(TREE, "new.txt")))
check("write in project", lambda: write(os.path.join(TESTS, "new.txt")))
# ... sockets and other processes.
check("UDP socket", lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM))
check("TCP socket", lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM))
check("Unix socket", lambda: socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
check("socketpair", lambda: socket.socketpair())
check("prlimit parent", lambda: resource.prlimit(ppid, resource.RLIMIT_NOFILE))
check("setpriority parent", lambda: os.setpriority(os.PRIO_PROCESS, ppid, os.getpriority(os.PRIO_PROCESS, ppid)))
check("setaffinity parent", lambda: os.sched_setaffinity(ppid, os.sched_getaffinity(ppid)))
check("signal parent", lambda: os.kill(ppid, 0))
# ... what root could do, and what would outlive the grade or starve it.
check("mknod char device", lambda: os.mknod(os.path.join(SCRATCH, "null"), 0o600 | stat.S_IFCHR, os.makedev(1, 3)))
check("mknod block device", lambda: os.mknod(os.path.join(SCRATCH, "disk"), 0o600 | stat.S_IFBLK, os.makedev(7, 0)))
check("mkfifo in scratch", lambda: os.mkfifo(os.path.join(SCRATCH, "fifo")))
def chattr(request, value):
    fd = os.open(os.path.join(SCRATCH, "ok.txt"), os.O_RDONLY)
    try:
        fcntl.ioctl(fd, request, value)
    finally:
        os.close(fd)
check("chattr +i", lambda: chattr(0x40086602, struct.pack("l", 0x10)))       # FS_IOC_SETFLAGS, FS_IMMUTABLE_FL
check("chattr +i high bits", lambda: chattr(0x140086602, struct.pack("l", 0x10)))  # the same, upper bits set
check("fsxattr", lambda: chattr(0x401C5820, bytes(28)))                      # FS_IOC_FSSETXATTR
check("SCHED_FIFO", lambda: os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1)))
check("SCHED_RR reset on fork", lambda: os.sched_setscheduler(0, os.SCHED_RR | 0x40000000, os.sched_param(1)))
libc = ctypes.CDLL(None, use_errno=True)
def unshare(flags):
    if libc.unshare(flags) != 0:
        raise OSError(ctypes.get_errno(), "unshare")
check("unshare user namespace", lambda: unshare(0x10000000))
# ... and what it reads of the install and the host.
check("read venv script", lambda: read(os.path.join(sys.prefix, "bin", "activate")))
check("list venv", lambda: os.listdir(sys.prefix))
check("read pyvenv.cfg", lambda: read(os.path.join(sys.prefix, "pyvenv.cfg")))
def host_sockets():
    if MARKER in open("/proc/self/net/unix").read():
        raise LookupError("the host's Unix sockets are listed")
check("host sockets not listed", host_sockets)
checks["uid"] = os.getuid()
checks["gid"] = os.getgid()
checks["groups"] = os.getgroups()
checks["caps"] = [line.split()[1] for line in open("/proc/self/status") if line.startswith(("CapPrm", "CapEff", "CapBnd"))]

# A child inherits both.
child = subprocess.run([sys.executable, "-S", "-c", CHILD], capture_output=True, text=True, timeout=30)
checks["child"] = child.stdout.strip() or child.stderr[-300:]
print(json.dumps({"description": description, "checks": checks}))
'''

CHILD = r'''
import socket
out = []
try:
    open(SECRET).read(); out.append("read")
except (PermissionError, FileNotFoundError):  # as root the folder is not even there (tests/_sandbox.py)
    out.append("no read")
try:
    socket.socket(socket.AF_INET, socket.SOCK_DGRAM); out.append("socket")
except PermissionError:
    out.append("no socket")
print(" ".join(out))
'''


def _env(scratch):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "TRITON"))}
    env.update(TRITON_INTERPRET="1", OMP_NUM_THREADS="1", TMPDIR=str(scratch), TRITON_CACHE_DIR=str(scratch / "triton"),
               PYTHONDONTWRITEBYTECODE="1")
    return env


def _layout(tmp):
    """tmp/scratch (writable), tmp/tree (readable), tmp/solutions and tmp/outside.txt
    (neither)."""
    (tmp / "scratch").mkdir()
    (tmp / "tree").mkdir()
    (tmp / "tree" / "learner_mod.py").write_text(LEARNER)
    (tmp / "solutions").mkdir()
    (tmp / "solutions" / "secret.py").write_text("ANSWER = 42\n")
    (tmp / "outside.txt").write_text("not for the learner\n")
    return tmp / "scratch", tmp / "tree"


def _run(code, tmp, timeout=120):
    scratch = tmp / "scratch"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                            cwd=scratch, env=_env(scratch))
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def _constants(tmp):
    scratch, tree = tmp / "scratch", tmp / "tree"
    import pwd
    values = dict(TESTS=str(TESTS), SCRATCH=str(scratch), TREE=str(tree), SOLUTIONS=str(tmp / "solutions"),
                  OUTSIDE=str(tmp / "outside.txt"), HOME=pwd.getpwuid(os.getuid()).pw_dir, MARKER=MARKER)
    values["CHILD"] = f"SECRET = {str(tmp / 'solutions' / 'secret.py')!r}\n" + CHILD
    return "".join(f"{k} = {v!r}\n" for k, v in values.items())


@pytest.fixture(scope="module")
def confined(tmp_path_factory):
    """The checks of one confined process (skipped where there is no Landlock)."""
    if not STATUS["landlock"]:
        pytest.skip(NO_LANDLOCK)
    tmp = tmp_path_factory.mktemp("confined")
    _layout(tmp)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as marker:  # a socket of the host's, by name
        marker.bind("\0" + MARKER)
        marker.listen(1)
        out = _run(_constants(tmp) + PROBE, tmp)
    return out["description"], out["checks"], tmp


def _refused(checks, names, errno_name, hidden=False):
    """Each check refused with `errno_name`; with hidden=True, as root, also a path not there at
    all: a worker that left root sees a 0700 folder on the way (pytest's own) as an empty
    tmpfs holding only what it may read (tests/_sandbox.py's _expose)."""
    ok = {f"denied {errno_name}"} | ({"error FileNotFoundError(2, 'No such file or directory')"}
                                     if hidden and os.geteuid() == 0 else set())
    wrong = {n: checks[n] for n in names if checks[n] not in ok}
    assert not wrong, f"not refused with {errno_name}: {wrong}"


def test_the_learner_module_and_a_triton_kernel_run_confined(confined):
    description, checks, _ = confined
    assert description.startswith(f"landlock ABI {STATUS['landlock']} (read and write rules"), description
    assert ("seccomp" in description) == STATUS["seccomp"], description
    works = ("learner module and Triton kernel", "torch matmul", "ldconfig -p", "torch shared memory",
             "read own /proc entry", "write in scratch", "the channel works", "own rlimit", "own priority",
             "own affinity")
    assert {n: checks[n] for n in works} == dict.fromkeys(works, "ok")


def test_it_reads_nothing_beyond_python_the_system_and_its_tree(confined):
    _, checks, _ = confined
    _refused(checks, ("read sibling solutions", "read outside scratch", "list tmp dir", "list /tmp", "list home",
                      "read project tests", "list project", "read parent environ", "read parent maps"), "EACCES",
             hidden=True)
    assert checks["import from sibling solutions"].startswith("error ModuleNotFoundError"), checks


def test_it_writes_only_its_scratch(confined):
    _, checks, tmp = confined
    _refused(checks, ("write outside scratch", "write in tree", "write in project"), "EACCES")
    assert (tmp / "scratch" / "ok.txt").read_text() == "x"
    assert not (tmp / "new.txt").exists() and not (tmp / "tree" / "new.txt").exists()
    assert not (TESTS / "new.txt").exists()


def test_it_makes_no_socket_and_leaves_other_processes_alone(confined):
    _, checks, _ = confined
    if STATUS["landlock"] >= 6:
        _refused(checks, ("signal parent",), "EPERM")
    if not STATUS["seccomp"]:
        pytest.skip(NO_SECCOMP)
    _refused(checks, ("UDP socket", "TCP socket", "Unix socket", "socketpair", "prlimit parent",
                      "setpriority parent", "setaffinity parent"), "EPERM")


def test_a_child_of_the_confined_process_is_confined_too(confined):
    _, checks, _ = confined
    assert checks["child"].startswith("no read"), checks["child"]
    if not STATUS["seccomp"]:
        pytest.skip(NO_SECCOMP)
    assert checks["child"] == "no read no socket"


OLD_ABI = r'''
import json, os, sys
sys.path.insert(0, TESTS)
import _sandbox
_sandbox.abi = lambda: VERSION
_sandbox._seccomp_filter = lambda: None
description = _sandbox.confine(SCRATCH, readable=[TREE])
out = [description]
for name, path, mode in (("tree", os.path.join(TREE, "learner_mod.py"), "r"),
                         ("scratch", os.path.join(SCRATCH, "f"), "w"),
                         ("outside", OUTSIDE, "r"), ("write outside", OUTSIDE, "a")):
    try:
        open(path, mode).close(); out.append(f"{name} ok")
    except (PermissionError, FileNotFoundError):  # FileNotFoundError: as root, hidden (tests/_sandbox.py)
        out.append(f"{name} denied")
print(json.dumps(out))
'''


@pytest.mark.parametrize("version", [1, 3, 4, 5])
def test_an_older_landlock_is_handed_only_what_it_knows(tmp_path, version):
    if STATUS["landlock"] < version:
        pytest.skip(f"this kernel's Landlock is ABI {STATUS['landlock']}")
    _layout(tmp_path)
    out = _run(_constants(tmp_path) + f"VERSION = {version}\n" + OLD_ABI, tmp_path, timeout=30)
    assert out[0].startswith(f"landlock ABI {version} (read and write rules)"), out
    assert out[1:] == ["tree ok", "scratch ok", "outside denied", "write outside denied"]


SECCOMP_ONLY = r'''
import json, os, socket, subprocess, sys
sys.path.insert(0, TESTS)
import _sandbox
out = [_sandbox.seccomp()]
for family, kind in ((socket.AF_INET, socket.SOCK_DGRAM), (socket.AF_UNIX, socket.SOCK_STREAM)):
    try:
        socket.socket(family, kind).close(); out.append("socket made")
    except PermissionError:
        out.append("no socket")
child = subprocess.run([sys.executable, "-S", "-c", "import socket; socket.socket()"], capture_output=True, text=True)
out.append("child: no socket" if "PermissionError" in child.stderr else "child: socket made")
print(json.dumps(out))
'''


def test_seccomp_alone_refuses_sockets_and_its_children_inherit_it(tmp_path):
    if not STATUS["seccomp"]:
        pytest.skip(NO_SECCOMP)
    _layout(tmp_path)
    out = _run(_constants(tmp_path) + SECCOMP_ONLY, tmp_path, timeout=30)
    assert out == [True, "no socket", "no socket", "child: no socket"]


def test_status_describe_and_missing_agree():
    status, missing, line = _sandbox.status(), _sandbox.missing(), _sandbox.describe()
    assert set(status) == {"landlock", "seccomp"} and status["landlock"] == _sandbox.abi()
    assert ("Landlock" in missing) == (not status["landlock"]) and ("seccomp" in missing) == (not status["seccomp"])
    if status["landlock"] and status["seccomp"]:
        kept = (" + root kept (a GPU host: CUDA IPC fails across uids); /proc/<pid>/net lists the host's sockets"
                if os.geteuid() == 0 else _sandbox._as_a_user())
        kept = " + not root" if _sandbox.worker_user() else kept
        assert line == f"landlock ABI {status['landlock']} + seccomp" + kept
    elif not status["landlock"] and not status["seccomp"]:
        assert line == "none"
    else:
        assert "no " in line, line


def test_it_makes_no_device_node_sets_no_file_flag_and_takes_no_realtime_policy(confined):
    """Issue 47: a block device of the disk made in the scratch folder passes every rule; an
    immutable file outlives the grade's clean-up; a SCHED_FIFO busy loop starves the grader.
    seccomp refuses each (EPERM), whatever the uid; a FIFO is still a file it may make."""
    _, checks, _ = confined
    if not STATUS["seccomp"]:
        pytest.skip(NO_SECCOMP)
    _refused(checks, ("mknod char device", "mknod block device", "chattr +i", "chattr +i high bits", "fsxattr",
                      "SCHED_FIFO", "SCHED_RR reset on fork", "unshare user namespace"), "EPERM")
    assert checks["mkfifo in scratch"] == "ok"


def test_it_reads_python_not_the_venvs_own_folder(confined):
    """The interpreter's library folders and site-packages, not the prefix: a pip.conf (an index
    token) or a script in the venv's own folder is not read; pyvenv.cfg is (a child interpreter
    reads it)."""
    _, checks, _ = confined
    _refused(checks, ("read venv script", "list venv"), "EACCES", hidden=True)
    assert checks["read pyvenv.cfg"] == "ok" or not os.path.exists(os.path.join(sys.prefix, "pyvenv.cfg"))


# A grade run as a user, confined (played by root where the suite runs as root: it loads what the
# user could not reach, then becomes nobody, as a user's process is, dumpable). It reads its
# /proc/self/net before and after the confinement, and tries a namespace again after it.
AS_A_USER = r'''
import ctypes, json, os, sys
sys.path.insert(0, TESTS)
import _sandbox
libc = ctypes.CDLL(None, use_errno=True)
if REFUSED:  # a kernel that refuses user namespaces to users, played
    _sandbox.own_network_namespace, _sandbox.user_namespace_refused = lambda: 1, lambda: "Operation not permitted"
if os.geteuid() == 0:
    _sandbox._seccomp_filter(), _sandbox._rules(SCRATCH, [], [], _sandbox.abi())
    os.setgroups([]), os.setresgid(65534, 65534, 65534), os.setresuid(65534, 65534, 65534)
    libc.prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE
listed = lambda: {name: open(f"/proc/self/net/{name}").read() for name in ("tcp", "tcp6", "unix")}
ids, before, line = (os.getuid(), os.getgid()), listed(), _sandbox.describe()
description = _sandbox.confine(SCRATCH)
again = "made" if libc.unshare(0x10000000 | 0x40000000) == 0 else os.strerror(ctypes.get_errno())
caps = [l.split()[1] for l in open("/proc/self/status") if l.startswith(("CapPrm", "CapEff"))]
print(json.dumps(dict(ids=ids, after_ids=(os.getuid(), os.getgid(), os.stat(SCRATCH).st_uid), before=before,
                      after=listed(), line=line, description=description, again=again, caps=caps)))
'''


def _as_a_user(tmp_path, refused=False):
    """AS_A_USER run while this process listens on TCP and on a named Unix socket: (its
    report, the TCP port as /proc/net/tcp writes it, the Unix socket's path)."""
    import tempfile
    scratch = tempfile.mkdtemp(prefix="drills-as-user-")  # not under pytest's 0700 folders: nobody reaches it
    if os.geteuid() == 0:
        os.chown(scratch, 65534, 65534)
    unix = os.path.join(tempfile.gettempdir(), f"{MARKER}-unix")
    with socket.socket() as tcp, socket.socket(socket.AF_UNIX) as named:
        tcp.bind(("127.0.0.1", 0)), tcp.listen(1), named.bind(unix), named.listen(1)
        port = f":{tcp.getsockname()[1]:04X} "
        try:
            constants = f"TESTS = {str(TESTS)!r}\nSCRATCH = {scratch!r}\nREFUSED = {refused}\n"
            done = subprocess.run([sys.executable, "-c", constants + AS_A_USER], capture_output=True, text=True,
                                  timeout=60, cwd=scratch, env=_env(tmp_path))
        finally:
            os.unlink(unix)
            subprocess.run(["rm", "-rf", scratch])
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.splitlines()[-1])
    assert port in out["before"]["tcp"] and unix in out["before"]["unix"]  # listed, unconfined: the test can see
    return out, port, unix


def test_as_a_user_its_proc_net_lists_no_host_socket(tmp_path):
    """Issue 47: /proc/<pid>/net lists the host's sockets (names and addresses). Graded as a
    user, the confined process enters a user and a network namespace of its own (its uid and
    gid mapped to themselves), so it lists none of the TCP and Unix sockets this process
    holds, and it has no capability there; a namespace asked for after the confinement is
    refused (seccomp). Where user namespaces are refused here, the grade's line says so."""
    out, port, unix = _as_a_user(tmp_path)
    if "own network namespace" not in out["line"]:
        assert "/proc/<pid>/net lists the host's sockets (" in out["line"], out["line"]
        pytest.skip(f"no network namespace for a user here: {out['line']}")
    assert out["description"].endswith("own user and network namespaces"), out["description"]
    assert port not in out["after"]["tcp"] + out["after"]["tcp6"] and unix not in out["after"]["unix"], out["after"]
    assert out["after_ids"] == [*out["ids"], out["ids"][0]] and out["caps"] == ["0000000000000000"] * 2, out
    if STATUS["seccomp"]:
        assert out["again"] == "Operation not permitted", out


def test_where_user_namespaces_are_refused_the_line_says_the_host_sockets_are_listed(tmp_path):
    out, port, unix = _as_a_user(tmp_path, refused=True)
    assert out["line"].endswith("; /proc/<pid>/net lists the host's sockets (no user namespace: Operation not "
                                "permitted)") or "(a GPU host:" in out["line"], out["line"]
    assert "own user and network namespaces" not in out["description"] and port in out["after"]["tcp"], out


@pytest.mark.skipif(_sandbox.worker_user() is None, reason="root is left where the grade is root, not on a GPU host")
def test_as_root_it_leaves_root_before_the_learners_code(confined):
    """Issue 47: where the grade runs as root, the confined process runs as an unprivileged uid
    with no capability and no supplementary group, and its /proc/<pid>/net shows a network
    namespace of its own, not the host's sockets."""
    description, checks, _ = confined
    assert checks["uid"] != 0 and checks["gid"] != 0 and checks["groups"] == [], checks
    assert checks["caps"] == ["0000000000000000"] * 3, checks["caps"]
    assert f"uid {checks['uid']}" in description and "no capabilities" in description, description
    assert checks["host sockets not listed"] == "ok", checks
