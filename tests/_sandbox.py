"""The worker's confinement: Linux Landlock and seccomp, entered after the worker has
imported torch, Triton, numpy and its own machinery, and before it imports the
learner's module. Names no drill; imports only the standard library (and pyseccomp,
lazily). Both are inherited by every process the worker starts and cannot be left.

How the contract's "Confined before the import" and "Not root" are met:
- Reads: Landlock handles reading, listing and executing as well as every write, so
  the worker reads only what a rule names (`_rules`): the interpreter's library folders
  (sysconfig's stdlib, platstdlib and include: Triton builds against Python.h),
  site-packages, sys.path, the folders of the libraries already loaded, the interpreter
  itself (each link on the way to it) and the venv's pyvenv.cfg (a child interpreter
  reads it); never a prefix's own folder, which holds a venv's pip.conf (an index token)
  and the install's scripts; symlinks resolved, since a rule binds the target), the system's library and toolchain
  folders and the C compiler's own (Triton on a GPU builds a launcher with it and runs
  ptxas), a few /etc files the C library reads, /sys, its own /proc/<pid> (resolved when
  the rule is made: never another process's environ or maps), /proc/cpuinfo, meminfo
  and stat, /dev/null, zero, full, random, urandom, and the `readable` folders (the
  learner's tree). Not readable: the home folder, /tmp beyond the scratch folder, the
  project root (solutions/, tests/), other learners' trees: a candidate folder inside
  the project (the venv aside) or holding the home folder, the project, /tmp or a named
  folder is left out.
- Writes: only the scratch folder and the `writable` folders (every right but making a
  block or character device), /dev/shm (its files, not its listing), the GPU's device
  files (with ioctl), and its own /proc/<pid>/task (CUDA names its threads there:
  without it CUDA's initialisation fails with error 304).
- Landlock's scopes: ptrace of any process outside the domain (ABI 1); TCP bind and
  connect refused (ABI 4); signals and abstract Unix sockets scoped (ABI 6). An older
  kernel is handed only the fields and rights it knows.
- seccomp, for what Landlock does not mediate (default allow; these fail with EPERM):
  socket (every family; where a GPU is present, AF_UNIX SOCK_SEQPACKET alone is let
  through, for CUDA's own listener), socketpair and connect (the channel, made before,
  keeps working; so UDP and pathname Unix sockets are closed); prlimit64,
  sched_setaffinity, sched_setscheduler, sched_setparam, sched_setattr, migrate_pages and
  move_pages unless pid 0 (itself); setpriority and ioprio_set unless on itself (which =
  process, who = 0); ptrace, process_vm_readv/writev, process_madvise, pidfd_getfd,
  kcmp; io_uring (its operations pass by the filter); the kernel keyrings (secrets); and
  the calls only root may make (modules, reboot, mount, bpf, perf_event_open, fanotify,
  open_by_handle_at, the clock...), since the lent GPU machines grade as root. Whatever
  the uid (tests/_seccomp.py's `_MASKED`): mknod/mknodat of a block or character device (one of the system
  disk, opened raw, passes every Landlock rule); ioctl FS_IOC_SETFLAGS (and its 32-bit
  form) and FS_IOC_FSSETXATTR (chattr: an immutable file outlives the grade's clean-up;
  the command's low 32 bits compared, as the kernel reads them); sched_setscheduler with
  SCHED_FIFO, SCHED_RR or SCHED_DEADLINE (a busy loop at priority 99 starves the grader
  on few cores) and sched_setattr whole (its policy is in memory); unshare, setns, clone
  with a namespace flag, and clone3 answered ENOSYS (its flags are in memory; the C
  library falls back to clone). Loaded on every thread (TSYNC), after no_new_privs.
  Foreign-ABI calls kill the thread.
- Not root (tests/_unroot.py's `drop_root`, where the process runs as root: the lent GPU machines grade
  so): before Landlock, in mount and network namespaces of its own, every path a rule
  names is made reachable by the unprivileged uid (`_expose`: a folder on the way it may
  not pass, e.g. root's 0700 home holding a pyenv Python, is covered by an empty tmpfs in
  which only the needed paths are bound again, at the same place); the scratch folder is
  given to the uid; the capability bounding set is dropped, supplementary groups cleared,
  gid and uid set (which clears the other capability sets), the process made dumpable
  again (its /proc files are then its own: CUDA writes its threads' names there) and its
  parent-death signal asked again (a change of credentials clears it). The uid is the
  grade's DRILLS_WORKER_UID (one per drill: tests/_grading.py), else nobody's; the gid the
  same number, or the GPU device files' group where only it may open them. Its
  /proc/<pid>/net then lists an empty network namespace. The learner's tree must be
  readable by others (its own mode is not changed); else the worker refuses to start,
  saying so. Where the namespaces cannot be had, it leaves root all the same and says so.
  On a GPU host root is kept (tests/_unroot.py's GPU_LEAVE_ROOT): on an H100 a worker of
  another uid could not open the test process's CUDA IPC handles; there the refusals are
  seccomp's alone, its /proc/<pid>/net lists the host's sockets (no network namespace is
  tried beside CUDA IPC), and describe() says both.
- Why pyseccomp (tests/_seccomp.py): a small ctypes binding of the system's libseccomp.so.2, which builds
  the BPF for the architecture, rather than hand-written BPF. Where pyseccomp or
  libseccomp is missing, `missing()` and `describe()` say so and Landlock stands alone.

What remains unguarded: threads made before `confine` stay outside Landlock below ABI 8
(from ABI 8 the domain covers every thread): start the worker with OMP_NUM_THREADS=1
(else OpenBLAS and OpenMP start one a core), and `confine` says how many it could not
cover; signals below ABI 6; sockets, UDP and pathname Unix sockets where seccomp is
missing; /dev/shm files whose names are known; /sys and the system's folders, read; CPU
time and memory (the caller's limits). Run as a user (not root): the worker keeps that
uid, and /proc/<pid>/net (readable under the /proc/<pid> rule, which also covers
/proc/<pid>/task/<tid>/net for threads not yet made: Landlock cannot leave out part of a
folder it allows) would list the host's sockets, so before Landlock and seccomp it enters
a user namespace of its own (unprivileged; its uid and gid mapped to themselves, so its
files and ids read as before, other owners' files as 65534; no capability kept there) and
a network namespace in it, which its /proc/<pid>/net then lists, empty (tests/_unroot.py's
own_network_namespace; seccomp refuses a namespace after). Where the kernel refuses user
namespaces to users (a sysctl, AppArmor's restrict_unprivileged_userns, a container's
seccomp: tried once in a child, user_namespace_refused), the host's sockets stay listed
and describe() says so; on a GPU host it is not tried (a worker in a network namespace of
its own is untried with CUDA IPC) unless DRILLS_GPU_LEAVE_ROOT=1 asks for a trial. Point
TMPDIR, HOME, TRITON_CACHE_DIR and CUDA_CACHE_PATH at the scratch folder: the only place
the worker can create files.
"""
import ctypes
import glob
import os
import platform
import shutil
import sys

import _seccomp
from _unroot import WORKER_UID, drop_root, gpu_host, worker_user  # noqa: F401  -- WORKER_UID, gpu_host: others'
from _unroot import own_network_namespace, user_namespace_refused, user_namespace_wanted

# System call numbers: the same on x86_64 and aarch64 (the generic table).
_SYS_CREATE_RULESET, _SYS_ADD_RULE, _SYS_RESTRICT_SELF = 444, 445, 446
_CREATE_RULESET_VERSION = 1 << 0
_RESTRICT_SELF_TSYNC = 1 << 3  # ABI 8: the domain covers every thread of the process
_RULE_PATH_BENEATH = 1
_PR_SET_NO_NEW_PRIVS = 38

# Filesystem rights (include/uapi/linux/landlock.h), with the ABI that brought each.
_FS = dict(EXECUTE=(1 << 0, 1), WRITE_FILE=(1 << 1, 1), READ_FILE=(1 << 2, 1), READ_DIR=(1 << 3, 1),
           REMOVE_DIR=(1 << 4, 1), REMOVE_FILE=(1 << 5, 1), MAKE_CHAR=(1 << 6, 1), MAKE_DIR=(1 << 7, 1),
           MAKE_REG=(1 << 8, 1), MAKE_SOCK=(1 << 9, 1), MAKE_FIFO=(1 << 10, 1), MAKE_BLOCK=(1 << 11, 1),
           MAKE_SYM=(1 << 12, 1), REFER=(1 << 13, 2), TRUNCATE=(1 << 14, 3), IOCTL_DEV=(1 << 15, 5))
_ALL = tuple(_FS)                                   # handled: denied unless a rule allows
_RX = ("EXECUTE", "READ_FILE", "READ_DIR")          # programs and libraries
_RO = ("READ_FILE", "READ_DIR")                     # data
_FILE_RIGHTS = ("EXECUTE", "WRITE_FILE", "READ_FILE", "TRUNCATE", "IOCTL_DEV")  # all a rule on a file may grant
_DEVICE = ("READ_FILE", "WRITE_FILE", "TRUNCATE", "IOCTL_DEV", "READ_DIR")
_SHM = ("READ_FILE", "WRITE_FILE", "TRUNCATE", "MAKE_REG", "REMOVE_FILE")  # torch's and POSIX shm; no listing
_SCRATCH = tuple(r for r in _ALL if r not in ("MAKE_BLOCK", "MAKE_CHAR"))
_NET_BIND_TCP, _NET_CONNECT_TCP = 1 << 0, 1 << 1    # ABI 4
_SCOPE_ABSTRACT_UNIX_SOCKET, _SCOPE_SIGNAL = 1 << 0, 1 << 1  # ABI 6

# The system's programs and libraries: the C library and the loader, CUDA's libraries,
# and the C toolchain (gcc, as, ld, cc1 under /usr/libexec, the headers) and ldconfig
# (Triton runs `/sbin/ldconfig -p` to find libcuda; on Debian and Ubuntu that is a shell
# script that runs /sbin/ldconfig.real), read and executed, never written.
_SYSTEM = ("/usr/lib", "/lib", "/lib64", "/usr/lib64", "/usr/local/lib", "/usr/include", "/usr/libexec",
           "/usr/bin", "/bin", "/sbin/ldconfig", "/sbin/ldconfig.real", "/usr/local/nvidia")
# The /etc files the C library reads: the loader's cache and configuration (every
# dlopen and every program started), the time zone (localtime), and the user database
# (nsswitch.conf, passwd, group: getpwuid, behind Path.home() and getpass.getuser()
# where HOME or USER is unset). passwd holds no secret (the hashes are in shadow).
_ETC = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime", "/etc/nsswitch.conf",
        "/etc/passwd", "/etc/group")
# What torch, OpenMP and the C library (get_nprocs, sysconf) read of /proc beyond the
# worker's own folder.
_PROC = ("/proc/cpuinfo", "/proc/meminfo", "/proc/stat")
_DEV_RW = ("/dev/null", "/dev/zero", "/dev/full")
_DEV_RO = ("/dev/random", "/dev/urandom")


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1  # the kernel's struct is __attribute__((packed))
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def abi():
    """The Landlock ABI this kernel offers: 0 where there is none (not Linux, a kernel
    before 5.13, or Landlock not enabled at boot)."""
    if platform.system() != "Linux":
        return 0
    version = _libc.syscall(_SYS_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(_CREATE_RULESET_VERSION))
    return max(int(version), 0)


def _rights(names, version):
    return sum(_FS[n][0] for n in names if _FS[n][1] <= version)


def _error(what):
    err = ctypes.get_errno()
    return OSError(err, f"landlock: {what} failed: {os.strerror(err)}")


# ---------------------------------------------------------------------------
# What may be read and written


def _inside(path, folder):
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def _project_root():
    return os.path.dirname(os.path.dirname(os.path.realpath(__file__)))  # this file is tests/_sandbox.py


def _home():
    """The home folder from the user database: the worker may have pointed HOME elsewhere."""
    try:
        import pwd
        return pwd.getpwuid(os.getuid()).pw_dir
    except (ImportError, KeyError):
        return None


def _mapped_library_folders():
    """The folders of the shared libraries already loaded (a conda or nix install keeps
    them outside the usual places; torch dlopens their siblings later)."""
    try:
        with open("/proc/self/maps") as maps:
            files = {line.split(None, 5)[-1].strip() for line in maps if "/" in line}
    except OSError:
        return []
    return sorted({os.path.dirname(f) for f in files if f.startswith("/") and ".so" in os.path.basename(f)})


def _python_folders(kept):
    """The interpreter's library folders (the standard library, its extension modules and
    headers: Triton builds its launcher against Python.h), site-packages, the folders
    Python imports from, each with its resolved target; less what `kept` refuses. Not the
    prefixes themselves: a venv's own folder holds its configuration (a pip.conf with an
    index token), the install's its scripts."""
    import sysconfig
    prefixes = {sys.base_prefix, sys.prefix, sys.exec_prefix, getattr(sys, "base_exec_prefix", sys.prefix)}
    paths = sysconfig.get_paths()
    found = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib", "include", "platinclude") if k in paths}
    try:
        import site
        found.update(site.getsitepackages())
    except (ImportError, AttributeError):
        pass
    found.update(p for p in sys.path if p and os.path.isabs(p))
    found.update(p for p in os.environ.get("LD_LIBRARY_PATH", "").split(":") if os.path.isabs(p))
    found.update(_mapped_library_folders())
    found.update(f for f in _compiler_folders() if not f.startswith(("/usr", "/bin")))
    found.update(os.path.realpath(p) for p in list(found))
    venvs = [os.path.realpath(p) for p in prefixes] + list(prefixes)
    found = {p for p in found if os.path.realpath(p) not in venvs}  # a prefix's folder itself, never whole
    folders = []
    for path in sorted(p for p in found if os.path.exists(p) and kept(p, venvs)):
        if not any(_inside(path, f) for f in folders):  # sorted: a folder comes before what it holds
            folders.append(path)
    return folders


def _python_files():
    """The interpreter itself (what a child `python` execs) and the venv's pyvenv.cfg, which
    a child interpreter reads to find its site-packages: its one configuration file read."""
    found, link = {os.path.realpath(sys.executable)}, sys.executable
    for _ in range(8):  # each link on the way (venv/bin/python -> .../bin/python -> python3.11)
        if not os.path.islink(link):
            break
        found.add(link)
        link = os.path.join(os.path.dirname(link), os.readlink(link))
    found.update(os.path.join(p, "pyvenv.cfg") for p in (sys.prefix, os.path.dirname(os.path.dirname(sys.executable))))
    return sorted(p for p in found if os.path.isfile(p) or os.path.islink(p))


def _compiler_folders():
    """The install folder of the C compiler Triton runs (CC, else cc, gcc or clang on
    PATH) where it is not a system one: /opt/gcc on the lent GPU machines."""
    found = []
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        where = name and shutil.which(name)
        if where:
            folder = os.path.dirname(os.path.realpath(where))
            found.append(os.path.dirname(folder) if os.path.basename(folder) == "bin" else folder)
    return found


def _rules(scratch, readable, writable, version):
    """(path, rights) for every rule, in the order they are added."""
    scratch = os.path.realpath(scratch)
    project = _project_root()
    guarded = [project, _home(), os.path.expanduser("~"), "/tmp", os.environ.get("TMPDIR", "/tmp"), scratch]
    guarded += [os.path.realpath(p) for p in (*readable, *writable)]
    guarded = [os.path.realpath(g) for g in guarded if g]

    def kept(path, venvs):
        path = os.path.realpath(path)
        if path == "/" or any(_inside(g, path) for g in guarded):
            return False  # it holds the home folder, the project, /tmp or a tree
        return not _inside(path, project) or any(_inside(path, v) for v in venvs)

    rx, ro = _rights(_RX, version), _rights(_RO, version)
    rules = [(p, rx) for p in _python_folders(kept)]
    rules += [(p, rx if os.access(p, os.X_OK) else ro) for p in _python_files()]
    rules += [(p, rx) for p in _SYSTEM + tuple(sorted(glob.glob("/usr/local/cuda*")))]
    rules += [(p, ro) for p in _ETC + _PROC + ("/sys",) + _DEV_RO]
    pid = str(os.getpid())  # /proc/self, resolved now: the worker's own folder, no other
    rules += [(f"/proc/{pid}", ro), (f"/proc/{pid}/task", _rights(_RO + ("WRITE_FILE", "TRUNCATE"), version))]
    rules += [(p, ro) for p in readable]
    rules += [(p, _rights(_DEVICE, version)) for p in _DEV_RW + _device_files()]
    rules += [("/dev/shm", _rights(_SHM, version))]
    # No block or character device made there: a device node of the system disk, opened raw,
    # would pass every rule above (seccomp refuses the mknod too).
    rules += [(p, _rights(_SCRATCH, version)) for p in (scratch, *writable)]
    return rules


def _device_files():
    """The GPU's device files (NVIDIA, and DRM and KFD for ROCm), opened for writing and
    driven by ioctl."""
    try:
        names = os.listdir("/dev")
    except OSError:
        return ()
    return tuple(os.path.join("/dev", n) for n in sorted(names) if n.startswith(("nvidia", "dri", "kfd")))


# ---------------------------------------------------------------------------
# Landlock


def _landlock(rules, version):
    handled = _rights(_ALL, version)
    attr = _RulesetAttr(handled_access_fs=handled,
                        handled_access_net=(_NET_BIND_TCP | _NET_CONNECT_TCP) if version >= 4 else 0,
                        scoped=(_SCOPE_ABSTRACT_UNIX_SOCKET | _SCOPE_SIGNAL) if version >= 6 else 0)
    # An older ABI rejects a struct larger than it knows: hand it only its own fields.
    size = ctypes.sizeof(_RulesetAttr) if version >= 6 else (16 if version >= 4 else 8)
    ruleset = _libc.syscall(_SYS_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    if ruleset < 0:
        raise _error("create_ruleset")
    try:
        for path, rights in rules:
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)  # follows symlinks: binds the target
            except OSError:
                continue  # not on this machine
            try:
                if not os.path.isdir(f"/proc/self/fd/{fd}"):
                    rights &= _rights(_FILE_RIGHTS, version)
                rule = _PathBeneathAttr(allowed_access=rights & handled, parent_fd=fd)
                if _libc.syscall(_SYS_ADD_RULE, ctypes.c_int(ruleset), ctypes.c_int(_RULE_PATH_BENEATH),
                                 ctypes.byref(rule), ctypes.c_uint32(0)) < 0:
                    raise _error(f"add_rule({path})")
            finally:
                os.close(fd)
        _no_new_privs()
        flags = _RESTRICT_SELF_TSYNC if version >= 8 else 0
        if _libc.syscall(_SYS_RESTRICT_SELF, ctypes.c_int(ruleset), ctypes.c_uint32(flags)) < 0:
            raise _error("restrict_self")
    finally:
        os.close(ruleset)


def _no_new_privs():
    if _libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise _error("prctl(PR_SET_NO_NEW_PRIVS)")


# ---------------------------------------------------------------------------
# seccomp (tests/_seccomp.py builds the filter)


def _seccomp_filter():
    """The filter, built (not loaded); None where seccomp cannot be had."""
    return _seccomp.build_filter(gpu=bool(_device_files()))


def seccomp():
    """Load the seccomp filter alone (no_new_privs first). Returns False where seccomp
    cannot be had; raises OSError where the kernel refused it."""
    flt = _seccomp_filter()
    if flt is None:
        return False
    _no_new_privs()
    flt.load()
    return True


# ---------------------------------------------------------------------------
# The whole confinement


def confine(scratch, readable=(), writable=()):
    """Confine this process, and all it starts, to the rules above: `scratch` and the
    `writable` folders are all it may write; `readable` (the learner's tree) it may read.
    Call it once everything the worker needs from elsewhere is imported, before any
    untrusted code runs. Applies what this machine offers and returns a one-line account
    of it (e.g. "landlock ABI 7 (read and write rules), seccomp"); raises OSError where
    the kernel refused a part it offers."""
    readable, writable = [str(p) for p in readable], [str(p) for p in writable]
    if not os.path.isdir(scratch):
        raise FileNotFoundError(f"the scratch folder {scratch} does not exist")
    version = abi()
    flt = _seccomp_filter()  # built first: pyseccomp's import reads what Landlock will hide
    done = []
    user = worker_user()
    rules = _rules(str(scratch), readable, writable, version)
    # Root is left first (the rules' paths made reachable for the user), Landlock and seccomp
    # then bind the unprivileged process.
    dropped = drop_root([p for p, _ in rules], str(scratch), user, readable) if user is not None else None
    if user is None and user_namespace_wanted():  # as a user: no host socket listed in its /proc/<pid>/net
        refused = own_network_namespace()
        if refused is not None and user_namespace_refused() is None:  # the trial said yes: describe() said so
            threads = len(os.listdir(f"/proc/{os.getpid()}/task"))  # EINVAL: more than one (OMP_NUM_THREADS=1)
            raise OSError(refused, f"unshare(CLONE_NEWUSER | CLONE_NEWNET) failed: {os.strerror(refused)} "
                                   f"({threads} thread{'s' * (threads > 1)}; a user namespace needs one)")
        dropped = "own user and network namespaces" if refused is None else "the host's sockets listed"
    if version >= 1:
        threads = len(os.listdir(f"/proc/{os.getpid()}/task"))
        _landlock(rules, version)
        uncovered = threads - 1 if version < 8 else 0
        note = f"; {uncovered} earlier thread{'s' * (uncovered > 1)} not covered" if uncovered else ""
        done.append(f"landlock ABI {version} (read and write rules{note})")
    if flt is not None:
        _no_new_privs()
        flt.load()
        done.append("seccomp")
    if dropped:
        done.append(dropped)
    return ", ".join(done) or "none"


def status():
    """What this machine offers, without applying anything: {"landlock": ABI or 0,
    "seccomp": bool}."""
    return {"landlock": abi(), "seccomp": _seccomp.kernel_has_seccomp() and _seccomp.pyseccomp() is not None}


def missing():
    """The parts of the confinement this machine lacks, by name: "Landlock", "seccomp"."""
    have = status()
    return [name for name, ok in (("Landlock", have["landlock"]), ("seccomp", have["seccomp"])) if not ok]


def describe():
    """One line for the grade and --json: "landlock ABI 7 + seccomp", or what is missing;
    as root, with the uid the workers run as."""
    have = status()
    why = "kernel without seccomp" if not _seccomp.kernel_has_seccomp() else "libseccomp or pyseccomp missing"
    user = worker_user()
    as_user = (f" + not root (uid {user[0]})" if os.environ.get(WORKER_UID) else " + not root") if user else \
        " + root kept (a GPU host: CUDA IPC fails across uids); /proc/<pid>/net lists the host's sockets" \
        if os.geteuid() == 0 else _as_a_user()
    if have["landlock"] and have["seccomp"]:
        return f"landlock ABI {have['landlock']} + seccomp{as_user}"
    if have["landlock"]:
        return f"landlock ABI {have['landlock']}; no seccomp ({why}){as_user}"
    if have["seccomp"]:
        return f"seccomp; no Landlock (kernel without it){as_user}"
    return "none"


def _as_a_user():
    """describe()'s words for a grade run as a user: whether its /proc/<pid>/net lists the host's sockets."""
    if not user_namespace_wanted():
        return "; /proc/<pid>/net lists the host's sockets (a GPU host: a network namespace is untried with CUDA IPC)"
    refused = user_namespace_refused()
    return f"; /proc/<pid>/net lists the host's sockets (no user namespace: {refused})" if refused else \
        " + own network namespace"
