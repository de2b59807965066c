"""The seccomp half of the worker's confinement (tests/_sandbox.py says how it serves the
contract; this is the filter): the calls refused, whatever the uid, built with pyseccomp
(a small ctypes binding of the system's libseccomp.so.2, which builds the BPF for the
architecture, rather than hand-written BPF). Names no drill; imports only the standard
library (and pyseccomp, lazily)."""
import ctypes
import errno
import platform
import sys

_libc = ctypes.CDLL(None, use_errno=True)
_PR_GET_SECCOMP = 21

_DENIED = (
    "socketpair", "connect",                                      # no new sockets (below), no connecting
    "ptrace", "process_vm_readv", "process_vm_writev", "process_madvise", "pidfd_getfd", "kcmp",
    "io_uring_setup", "io_uring_enter", "io_uring_register",      # its own socket and open operations
    "keyctl", "add_key", "request_key",                           # the kernel keyrings may hold secrets
    # Only root may make these; the lent GPU machines grade as root.
    "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load", "reboot",
    "swapon", "swapoff", "mount", "umount2", "pivot_root", "bpf", "perf_event_open", "fanotify_init",
    "name_to_handle_at", "open_by_handle_at", "settimeofday", "clock_settime", "clock_adjtime", "adjtimex",
    "sethostname", "setdomainname", "syslog", "acct", "quotactl", "iopl", "ioperm",
    # A real-time policy's busy loop starves the grader on few cores; sched_setattr's policy
    # lies in memory the filter cannot read, so it is refused whole (sched_setscheduler below).
    "sched_setattr",
    # New namespaces (a user namespace's capabilities, a mount of its own) and joining others'.
    "unshare", "setns",
)
# (call, argument, mask, value): refused where (argument & mask) == value.
_S_IFMT, _S_IFCHR, _S_IFBLK = 0o170000, 0o020000, 0o060000
_FS_IOC_SETFLAGS, _FS_IOC32_SETFLAGS, _FS_IOC_FSSETXATTR = 0x40086602, 0x40046602, 0x401C5820
_CLONE_NAMESPACES = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000)
_MASKED = (
    # Device nodes: a block device of the system disk, opened raw, passes every Landlock rule.
    ("mknod", 1, _S_IFMT, _S_IFCHR), ("mknod", 1, _S_IFMT, _S_IFBLK),
    ("mknodat", 2, _S_IFMT, _S_IFCHR), ("mknodat", 2, _S_IFMT, _S_IFBLK),
    # chattr: an immutable file outlives the grade's removal of the scratch folder. The command
    # is an unsigned int: only its low 32 bits are compared.
    ("ioctl", 1, 0xFFFFFFFF, _FS_IOC_SETFLAGS), ("ioctl", 1, 0xFFFFFFFF, _FS_IOC32_SETFLAGS),
    ("ioctl", 1, 0xFFFFFFFF, _FS_IOC_FSSETXATTR),
    # Real-time policies (SCHED_FIFO 1, SCHED_RR 2, SCHED_DEADLINE 6, with or without
    # SCHED_RESET_ON_FORK), on itself too.
    ("sched_setscheduler", 1, 0x7, 1), ("sched_setscheduler", 1, 0x7, 2), ("sched_setscheduler", 1, 0x7, 6),
    # clone with a namespace flag (its flags are its first argument on x86_64 and aarch64).
    *(("clone", 0, flag, flag) for flag in _CLONE_NAMESPACES),
)
_AF_UNIX, _SOCK_SEQPACKET = 1, 5
# (call, argument, the one value allowed): refused where that argument holds anything else.
_ON_ITSELF_ONLY = (
    ("prlimit64", 0, 0), ("sched_setaffinity", 0, 0), ("sched_setscheduler", 0, 0), ("sched_setparam", 0, 0),
    ("sched_setattr", 0, 0), ("migrate_pages", 0, 0), ("move_pages", 0, 0),
    ("setpriority", 0, 0), ("setpriority", 1, 0),                 # PRIO_PROCESS, who = 0
    ("ioprio_set", 0, 1), ("ioprio_set", 1, 0),                   # IOPRIO_WHO_PROCESS, who = 0
)


def pyseccomp():
    """pyseccomp, or None where it or libseccomp is missing. Its import asks
    ctypes.util.find_library, which runs `ldconfig -p` in a subprocess (some 50 ms):
    the usual sonames are tried first."""
    if "pyseccomp" in sys.modules:
        return sys.modules["pyseccomp"]
    import ctypes.util
    slow = ctypes.util.find_library

    def find_library(name):
        soname = {"c": "libc.so.6", "seccomp": "libseccomp.so.2"}.get(name)
        if soname:
            try:
                ctypes.CDLL(soname)
                return soname
            except OSError:
                pass
        return slow(name)

    ctypes.util.find_library = find_library
    try:
        import pyseccomp
        return pyseccomp
    except (ImportError, RuntimeError, OSError, AttributeError):
        return None
    finally:
        ctypes.util.find_library = slow


def kernel_has_seccomp():
    return platform.system() == "Linux" and _libc.prctl(_PR_GET_SECCOMP, 0, 0, 0, 0) >= 0


def build_filter(gpu):
    """The filter, built (not loaded); None where seccomp cannot be had. `gpu`: the GPU's
    device files are present (CUDA's one socket is let through)."""
    sc = pyseccomp() if kernel_has_seccomp() else None
    if sc is None:
        return None
    refuse = sc.ERRNO(errno.EPERM)
    flt = sc.SyscallFilter(sc.ALLOW)
    for name in _DENIED:
        _add(sc, flt, refuse, name)
    if gpu:
        # CUDA's initialisation makes one socket, an abstract AF_UNIX SOCK_SEQPACKET
        # listener ("@cuda-uvmfd-..."); refused, it fails with error 304. Every other
        # family and type is still refused, and with connect refused it reaches nothing.
        _add(sc, flt, refuse, "socket", sc.Arg(0, sc.NE, _AF_UNIX))
        for kind in range(16):  # the type's low four bits; the rest are flags
            if kind != _SOCK_SEQPACKET:
                _add(sc, flt, refuse, "socket", sc.Arg(1, sc.MASKED_EQ, 0xF, kind))
    else:
        _add(sc, flt, refuse, "socket")
    for name, arg, allowed in _ON_ITSELF_ONLY:
        _add(sc, flt, refuse, name, sc.Arg(arg, sc.NE, allowed))
    for name, arg, mask, value in _MASKED:
        _add(sc, flt, refuse, name, sc.Arg(arg, sc.MASKED_EQ, mask, value))
    # clone3 passes its flags in memory the filter cannot read: ENOSYS makes the C library
    # fall back to clone, whose flags it can (as container runtimes do).
    _add(sc, flt, sc.ERRNO(errno.ENOSYS), "clone3")
    try:
        flt.set_attr(sc.Attr.CTL_TSYNC, 1)  # every thread, not only this one
    except OSError:
        pass  # a libseccomp too old for it: this thread and those it starts
    return flt


def _add(sc, flt, action, name, *args):
    if sc.resolve_syscall(sc.Arch.NATIVE, name) < 0:
        return  # a call this architecture (iopl on aarch64) or this libseccomp does not know
    flt.add_rule(action, name, *args)
