"""The worker's confinement: Linux Landlock, entered before the learner's module is
imported. Names no drill; imports nothing of ours.

What the learner's code may do afterwards, enforced by the kernel for the worker and
every process it starts (a Landlock domain is inherited and cannot be left):
- write only below its own scratch folder (its Triton cache, its temporary files),
  /dev/shm (torch's shared-memory tensors), /dev/null, the GPU's device files, and its
  own threads' files under /proc/self/task (CUDA's initialisation writes there: on the
  H200 it fails with "Error 304: OS call failed" without them);
  everything else it may read and execute, but not create, change, rename or remove;
- not ptrace, read the memory of (/proc/<pid>/mem), or signal any process outside its
  domain: the test process, the grader, the fork server (Landlock ABI 6 scopes signals
  and abstract Unix sockets; ptrace is scoped from ABI 1);
- not bind or connect TCP sockets (ABI 4).

Why ctypes and not a package: the lent GPU machine has no network, so nothing can be
installed there, and the Landlock bindings on the package index stop before ABI 6's
scopes. The three system calls are small: landlock_create_ruleset, landlock_add_rule,
landlock_restrict_self (see the kernel's Documentation/userspace-api/landlock.rst).
"""
import ctypes
import os
import platform

# System call numbers: the same on x86_64 and aarch64 (the generic table).
_SYS_CREATE_RULESET, _SYS_ADD_RULE, _SYS_RESTRICT_SELF = 444, 445, 446
_CREATE_RULESET_VERSION = 1 << 0
_RULE_PATH_BENEATH = 1
_PR_SET_NO_NEW_PRIVS = 38

# Filesystem rights (include/uapi/linux/landlock.h), with the ABI that brought each.
_FS = dict(EXECUTE=(1 << 0, 1), WRITE_FILE=(1 << 1, 1), READ_FILE=(1 << 2, 1), READ_DIR=(1 << 3, 1),
           REMOVE_DIR=(1 << 4, 1), REMOVE_FILE=(1 << 5, 1), MAKE_CHAR=(1 << 6, 1), MAKE_DIR=(1 << 7, 1),
           MAKE_REG=(1 << 8, 1), MAKE_SOCK=(1 << 9, 1), MAKE_FIFO=(1 << 10, 1), MAKE_BLOCK=(1 << 11, 1),
           MAKE_SYM=(1 << 12, 1), REFER=(1 << 13, 2), TRUNCATE=(1 << 14, 3), IOCTL_DEV=(1 << 15, 5))
# Everything that changes the filesystem is handled (denied unless a rule allows it);
# reading and executing are not, so Python, torch, Triton and the tree load as usual.
_WRITES = ("WRITE_FILE", "REMOVE_DIR", "REMOVE_FILE", "MAKE_CHAR", "MAKE_DIR", "MAKE_REG", "MAKE_SOCK",
           "MAKE_FIFO", "MAKE_BLOCK", "MAKE_SYM", "REFER", "TRUNCATE", "IOCTL_DEV")
_FILE_RIGHTS = ("WRITE_FILE", "TRUNCATE", "IOCTL_DEV")  # all a rule on a single file may grant
_NET_BIND_TCP, _NET_CONNECT_TCP = 1 << 0, 1 << 1        # ABI 4
_SCOPE_ABSTRACT_UNIX_SOCKET, _SCOPE_SIGNAL = 1 << 0, 1 << 1  # ABI 6


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


def _device_files():
    """The GPU's device files, which CUDA opens for writing and drives by ioctl."""
    found = [os.path.join("/dev", n) for n in os.listdir("/dev") if n.startswith(("nvidia", "dri", "kfd"))]
    return found + ["/dev/null", "/dev/zero", "/dev/full"]


def confine(scratch):
    """Confine this thread, and all it starts, to the rules above; `scratch` is the one
    folder it may write. Call it in a process with one thread (a new worker), before any
    untrusted code runs. Returns the ABI used; raises OSError where Landlock refused."""
    version = abi()
    if version < 1:
        raise OSError("landlock is not available on this kernel")
    handled = _rights(_WRITES, version)
    attr = _RulesetAttr(handled_access_fs=handled,
                        handled_access_net=(_NET_BIND_TCP | _NET_CONNECT_TCP) if version >= 4 else 0,
                        scoped=(_SCOPE_ABSTRACT_UNIX_SOCKET | _SCOPE_SIGNAL) if version >= 6 else 0)
    # An older ABI rejects a struct larger than it knows: hand it only its own fields.
    size = ctypes.sizeof(_RulesetAttr) if version >= 6 else (16 if version >= 4 else 8)
    ruleset = _libc.syscall(_SYS_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    if ruleset < 0:
        raise _error("create_ruleset")
    try:
        allowed = [(scratch, handled), ("/dev/shm", handled & ~_rights(("IOCTL_DEV",), version))]
        allowed += [(path, _rights(_FILE_RIGHTS, version)) for path in _device_files()]
        allowed.append(("/proc/self/task", _rights(("WRITE_FILE", "TRUNCATE"), version)))
        for path, rights in allowed:
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                continue  # no such device here
            try:
                rule = _PathBeneathAttr(allowed_access=rights, parent_fd=fd)
                if not os.path.isdir(path):
                    rule.allowed_access &= _rights(_FILE_RIGHTS, version)
                if _libc.syscall(_SYS_ADD_RULE, ctypes.c_int(ruleset), ctypes.c_int(_RULE_PATH_BENEATH),
                                 ctypes.byref(rule), ctypes.c_uint32(0)) < 0:
                    raise _error(f"add_rule({path})")
            finally:
                os.close(fd)
        if _libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise _error("prctl(PR_SET_NO_NEW_PRIVS)")
        if _libc.syscall(_SYS_RESTRICT_SELF, ctypes.c_int(ruleset), ctypes.c_uint32(0)) < 0:
            raise _error("restrict_self")
    finally:
        os.close(ruleset)
    return version
