"""Not root (tests/_sandbox.py's "Not root" says how the contract is met): where the grade
runs as root, a confined process leaves root before the learner's code runs; where it runs
as a user, the process enters a user and a network namespace of its own, so that its
/proc/<pid>/net lists no host socket. Names no drill; imports only the standard library."""
import ctypes
import errno
import functools
import os

_libc = ctypes.CDLL(None, use_errno=True)


_CLONE_NEWNS, _CLONE_NEWNET, _CLONE_NEWUSER = 0x00020000, 0x40000000, 0x10000000
_LINUX_CAPABILITY_VERSION_3 = 0x20080522
_MS_NOSUID, _MS_NODEV, _MS_BIND, _MS_REC, _MS_PRIVATE = 0x2, 0x4, 0x1000, 0x4000, 0x40000
_PR_SET_PDEATHSIG, _PR_SET_DUMPABLE, _PR_CAPBSET_DROP, _PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL = 1, 4, 24, 47, 4
WORKER_UID = "DRILLS_WORKER_UID"  # the uid a grade running as root hands its confined processes
NOBODY = 65534


def _inside(path, folder):
    return path == folder or path.startswith(folder.rstrip("/") + "/")


# On a GPU host root is kept (uid 0, as before): measured on an H100 (2026-12-07), a worker of
# another uid could not open the test process's CUDA IPC handles (torch's rebuild failed with
# a CUDA error; the ref-count file given to it), so every GPU test crashed. DRILLS_GPU_LEAVE_ROOT=1
# leaves root there too, for a trial on a GPU (graded as a user: own_network_namespace there too).
# The seccomp refusals hold whatever the uid.
GPU_LEAVE_ROOT = "DRILLS_GPU_LEAVE_ROOT"


def gpu_host():
    """Whether this machine has a GPU's device files (NVIDIA, DRM or KFD)."""
    try:
        return any(n.startswith(("nvidia", "dri", "kfd")) for n in os.listdir("/dev"))
    except OSError:
        return False


def worker_user():
    """(uid, gid) a confined process runs as where the grade runs as root, else None (also on a
    GPU host: see GPU_LEAVE_ROOT): the
    grade's DRILLS_WORKER_UID (one per drill: tests/_scratch.py, so that what a drill's
    workers leave in /dev/shm is known by its owner), else nobody's 65534. The gid is the
    same number, or the GPU device files' group where only their group may open them."""
    if os.geteuid() != 0 or (gpu_host() and os.environ.get(GPU_LEAVE_ROOT) != "1"):
        return None
    uid = int(os.environ.get(WORKER_UID) or NOBODY)
    gid = uid
    try:
        info = os.stat("/dev/nvidiactl")
        if not info.st_mode & 0o006 and info.st_mode & 0o060:
            gid = info.st_gid
    except OSError:
        pass
    return uid, gid


def _reachable(path, uid, gid):
    """The first folder on the way to `path` that uid/gid may not pass (no search right), or None."""
    at = "/"
    for part in path.strip("/").split("/")[:-1]:
        at = os.path.join(at, part)
        info = os.stat(at)
        bit = 0o100 if info.st_uid == uid else 0o010 if info.st_gid == gid else 0o001
        if not info.st_mode & bit:
            return at
    return None


def _mount(source, target, fstype, flags, data=None):
    enc = (lambda x: x.encode() if isinstance(x, str) else x)
    if _libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {target}: {os.strerror(err)}")


def _expose(paths, uid, gid):
    """In this process's own mount namespace: every one of `paths` made reachable by
    uid/gid, the same path as before. A folder on the way that they may not pass (root's
    home, 0700, holding the Python install; pytest's 0700 temporary folders) is covered
    with an empty tmpfs in which only the needed paths below it are bound again, so
    everything else there (the home folder itself) is not even visible. Returns the
    folders covered."""
    covered, paths = [], sorted({p for p in paths if os.path.lexists(p)}, key=lambda p: (p.count("/"), p))
    for path in paths:
        for _ in range(8):  # a bound folder may hold another that blocks the way
            blocking = _reachable(path, uid, gid)
            if blocking is None or blocking in paths:
                break
            under = [p for p in paths if _inside(p, blocking)]
            under = [p for p in under if not any(q != p and _inside(p, q) for q in under)]
            links = {p: os.readlink(p) for p in under if os.path.islink(p)}  # made again, not bound
            fds = {p: os.open(p, os.O_PATH | os.O_CLOEXEC) for p in under if p not in links}  # before the tmpfs
            try:
                _mount("tmpfs", blocking, "tmpfs", _MS_NOSUID | _MS_NODEV, "mode=0755,size=1m")
                for p, target in links.items():
                    os.makedirs(os.path.dirname(p), mode=0o755, exist_ok=True)
                    os.symlink(target, p)
                for p, fd in fds.items():
                    folder = os.path.isdir(f"/proc/self/fd/{fd}")
                    os.makedirs(os.path.dirname(p) if not folder else p, mode=0o755, exist_ok=True)
                    if not folder:
                        os.close(os.open(p, os.O_CREAT | os.O_WRONLY, 0o644))
                    _mount(f"/proc/self/fd/{fd}", p, None, _MS_BIND | _MS_REC)
            finally:
                for fd in fds.values():
                    os.close(fd)
            covered.append(blocking)
    return covered


def _caps_left():
    """The capability sets still held (CapPrm, CapEff, CapBnd, CapAmb, as in /proc/self/status)."""
    with open(f"/proc/{os.getpid()}/status") as f:
        return {k: int(v, 16) for k, v in (line.split(":") for line in f if line.startswith("Cap"))
                if k != "CapInh" and int(v, 16)}


def drop_root(paths, scratch, user, trees=()):
    """Where the grade runs as root: this process (one thread) leaves root for `user`
    (uid, gid) with no capability and no supplementary group. First, in a mount and a
    network namespace of its own: the `paths` it must read made reachable by that user
    (`_expose`), and /proc/<pid>/net showing an empty network namespace rather than the
    host's sockets; the scratch folder is given to the user. Then the bounding set is
    dropped, the ids set (which clears the other capability sets), and the process made
    dumpable again (else its /proc files stay root's and CUDA cannot name its threads).
    Returns a few words for describe()'s line; raises OSError where a step failed."""
    uid, gid = user
    for tree in trees:  # a folder on the way can be covered; the tree's own mode is the learner's
        info = os.stat(tree)
        shift = 6 if info.st_uid == uid else 3 if info.st_gid == gid else 0
        if not (info.st_mode >> shift) & 0o1:  # passing it is enough to import by name (0711 is fine)
            raise OSError(errno.EACCES, f"{tree} is not readable by others (mode {info.st_mode & 0o777:o}), and the "
                                        f"learner's code runs as uid {uid}, not root: chmod o+rx it (and its "
                                        f"files o+r), or grade as its owner")
    os.umask(0o022)
    net = namespaces = _libc.unshare(_CLONE_NEWNS | _CLONE_NEWNET) == 0
    if not namespaces:  # a kernel or container without network namespaces: the mount one alone
        namespaces = _libc.unshare(_CLONE_NEWNS) == 0
    covered = []
    if namespaces:
        _mount(None, "/", None, _MS_REC | _MS_PRIVATE)  # nothing done here reaches the host
        covered = _expose([*paths, scratch], uid, gid)
    for folder, dirs, files in os.walk(scratch):
        for name in (folder, *(os.path.join(folder, n) for n in dirs + files)):
            os.lchown(name, uid, gid)
    _drop_bounding_set()
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    parent = os.getppid()
    os.setresuid(uid, uid, uid)
    _libc.prctl(_PR_SET_DUMPABLE, 1, 0, 0, 0)
    # A change of credentials clears the parent-death signal: asked again, so that the process
    # still dies with the one that started it (and at once if that one is already gone).
    _libc.prctl(_PR_SET_PDEATHSIG, 9, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(0)
    left = _caps_left()
    if os.getuid() == 0 or os.geteuid() == 0 or left.get("CapPrm") or left.get("CapEff"):
        raise OSError(errno.EPERM, f"still privileged after the drop: uid {os.getuid()}, {left}")
    where = (f"; own mount{' and network' if net else ''} namespace{'s' * net}"
             f"{', covered ' + ', '.join(covered) if covered else ''}" if namespaces else "; no namespace of its own")
    where += "" if net else " (/proc/<pid>/net shows the host's sockets)"
    return f"uid {uid} gid {gid}, no capabilities{where}"



def _drop_bounding_set():
    """The capability bounding set dropped (what an exec could regain) and the ambient set cleared."""
    for cap in range(64):
        if _libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 and ctypes.get_errno() == errno.EINVAL:
            break  # past the last capability this kernel knows
    _libc.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)


def user_namespace_wanted():
    """Whether a confined process that is not root enters `own_network_namespace`: not as root
    (drop_root makes its namespaces), and on a GPU host only for a trial (GPU_LEAVE_ROOT): a
    worker in a network namespace of its own is untried there with CUDA IPC."""
    return os.geteuid() != 0 and (not gpu_host() or os.environ.get(GPU_LEAVE_ROOT) == "1")


def own_network_namespace():
    """Where the grade runs as a user: this process (one thread: the kernel refuses a threaded
    one) enters a user namespace of its own, in which only its uid and gid are mapped, each to
    itself (its uid, gid and files read as before; files of other owners read as 65534), and a
    network namespace of its own, so its /proc/<pid>/net lists an empty namespace, not the
    host's sockets. The capabilities the new user namespace grants are dropped at once. Returns
    None, or the errno for which the kernel refused (nothing changed); raises OSError where the
    namespace was made but its maps or the drop failed."""
    uid, gid = os.geteuid(), os.getegid()
    if _libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNET) != 0:
        return ctypes.get_errno()
    for name, line in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:  # setgroups first: a user may write gid_map only then
            f.write(line)
    _drop_bounding_set()
    header = (ctypes.c_uint32 * 2)(_LINUX_CAPABILITY_VERSION_3, 0)
    if _libc.capset(header, (ctypes.c_uint32 * 6)()) != 0:  # effective, permitted, inheritable: none
        err = ctypes.get_errno()
        raise OSError(err, f"capset in the new user namespace: {os.strerror(err)}")
    return None


@functools.lru_cache(maxsize=None)
def user_namespace_refused():
    """None where `own_network_namespace` works for this process (tried once, in a child that
    ends at once: 16-18 ms with torch loaded, on a 2-core machine), else why not, in words."""
    pid = os.fork()
    if pid == 0:
        try:
            refused = own_network_namespace()
            os._exit(0 if refused is None else min(refused, 254))
        finally:
            os._exit(255)
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    return None if code == 0 else "its uid and gid maps could not be written" if code == 255 else \
        os.strerror(code) if code > 0 else f"the trial was killed by signal {-code}"
