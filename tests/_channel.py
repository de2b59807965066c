"""What crosses the boundary between a test process and the learner's worker, and how.
Names no drill; imports nothing of ours.

One channel: a Unix socketpair made before the worker starts, the worker's only
inherited descriptor. A message is a length-prefixed byte string; the test process
may attach file descriptors to its own messages (SCM_RIGHTS), and never takes any
from the worker's (it reads with plain recv, which drops them).

Tensors go one way by sharing and come back as data:
- To the worker, each storage behind the call's tensors is copied into a fresh shared
  buffer (a memfd on the CPU, sent as a descriptor; a new CUDA allocation, sent as
  torch's CUDA IPC handle), and the worker sees views of those copies. The test's own
  tensors are never shared: the worker cannot write them, before, during or after the
  call (`Sharing`).
- After the reply, `Sharing.collect` copies each written storage back into the test's
  tensor once, and compares each read-only one with it, so the checks only ever read
  private memory and an input the worker changed is found.
- From the worker, a reply is plain data (tests/_data.py): a tensor in it is either a
  view of one of the shared storages (an `out=` returned) or its bytes, inline.
"""
import fcntl
import io
import mmap
import os
import pickle
import socket
import struct
import time

import torch

_HEADER = struct.Struct("<QI")    # payload length, number of descriptors attached
MAX_MESSAGE = 1 << 31             # a reply past 2 GiB is refused rather than read
MAX_FDS = 250                     # SCM_RIGHTS carries at most 253 descriptors a message
_CHUNK = 64 << 20                 # copies in 64 MiB pieces: a 4 GiB cache never needs a second 4 GiB


def send(sock, payload, fds=(), deadline=None):
    """Send one message, with these descriptors attached (the test process only): the
    first MAX_FDS with the header, any more in batches of one byte each (SCM_RIGHTS takes
    at most 253 a message, and a model's parameters are hundreds of storages). With a
    `deadline` (time.monotonic()), the whole message is sent by then or TimeoutError: a
    peer that stops reading cannot hold us past it."""
    header = _HEADER.pack(len(payload), len(fds))
    fds = list(fds)
    if fds:
        _until(sock, deadline)
        socket.send_fds(sock, [header], fds[:MAX_FDS])
        for at in range(MAX_FDS, len(fds), MAX_FDS):
            _until(sock, deadline)
            socket.send_fds(sock, [b"+"], fds[at:at + MAX_FDS])
    else:
        _until(sock, deadline)
        sock.sendall(header)
    view = memoryview(payload)
    while view:  # piece by piece, each with what is left of the one deadline
        _until(sock, deadline)
        view = view[sock.send(view[:_CHUNK]):]


def recv(sock, take_fds=False, deadline=None, limit=MAX_MESSAGE):
    """(payload, fds) of the next message. take_fds=False (the test process) takes no
    descriptor: any the peer attached are dropped by the kernel. EOFError at the end.
    With a `deadline` (time.monotonic()), the whole message arrives by then or
    TimeoutError: one deadline for the message, not a timeout for each read (a peer that
    announces a huge message and sends a byte now and then cannot stretch the wait).
    A message announced longer than `limit` bytes is refused (TooLarge) before any of
    it is read."""
    if take_fds:
        data, fds, _, _ = socket.recv_fds(sock, _HEADER.size, MAX_FDS)
        if len(data) < _HEADER.size:
            data += _exactly(sock, _HEADER.size - len(data))
    else:
        data, fds = _exactly(sock, _HEADER.size, deadline), []
    length, count = _HEADER.unpack(data)
    if length > min(limit, MAX_MESSAGE):
        raise TooLarge(length, min(limit, MAX_MESSAGE))
    while take_fds and len(fds) < count:
        more, extra, _, _ = socket.recv_fds(sock, 1, MAX_FDS)
        if more != b"+" or not extra:
            break
        fds += extra
    if len(fds) != (count if take_fds else 0):
        for fd in fds:
            os.close(fd)
        raise EOFError("a message's descriptors did not arrive")
    return _exactly(sock, length, deadline), fds


class TooLarge(EOFError):
    """A message announced longer than the receiver allows (what the call may return)."""

    def __init__(self, length, limit):
        super().__init__(f"a message of {length} bytes, more than the {limit} allowed")
        self.length, self.limit = length, limit


def _until(sock, deadline):
    """Set the socket's timeout to what is left until `deadline` (None: block); TimeoutError
    when nothing is left."""
    if deadline is None:
        return
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the deadline passed")
    sock.settimeout(left)


def _exactly(sock, n, deadline=None):
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        _until(sock, deadline)
        k = sock.recv_into(view[got:], min(n - got, _CHUNK))
        if k == 0:
            raise EOFError("the channel closed")
        got += k
    return bytes(buf)


def tail(f, limit):
    """The last `limit` bytes of one of a call's output files, as text. The file is the test
    process's: made unnamed (nothing the worker can replace with a FIFO) and handed to the
    worker as a descriptor; it may have made it gigabytes long, so only the tail is read."""
    if f is None:
        return ""
    try:
        size = os.fstat(f.fileno()).st_size
        return os.pread(f.fileno(), limit, max(0, size - limit)).decode(errors="replace")
    except OSError:
        return ""


def reply_limit(sharing):
    """The most bytes a reply may hold: what a call may return is of the order of its
    arguments (an output as large as the inputs, counts beside it), so a few times their
    size, and 64 MiB for plain data (tokens, a block manager's replay)."""
    return min(MAX_MESSAGE, (64 << 20) + 4 * sum(s.private.numel() for s in sharing.storages))


def as_bytes(t):
    """The whole storage behind `t`, as a flat uint8 tensor on its device."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def _data_ranges(fd, size):
    """The (lo, hi) byte ranges of a memfd that hold data: a sparse buffer (a 4 GiB cache
    of which a test touches a few slots) is copied and compared where it has pages only."""
    ranges, at = [], 0
    while at < size:
        try:
            lo = os.lseek(fd, at, os.SEEK_DATA)
        except OSError:  # ENXIO: no data past `at`
            break
        hi = os.lseek(fd, lo, os.SEEK_HOLE)
        ranges.append((lo, min(hi, size)))
        at = hi
    return ranges


def _pieces(ranges):
    for lo, hi in ranges:
        for at in range(lo, hi, _CHUNK):
            yield at, min(at + _CHUNK, hi)


class Sharing:
    """The shared copies of one call's storages (test-process side).

    `pickle_args(args, kwargs, written)` pickles the call with every tensor replaced by a
    reference to a shared copy of its storage; `written(path)` says whether the argument
    at `path` (its name) may be written. `collect()` after the reply copies the written
    storages back and returns the names of read-only arguments the worker changed."""

    def __init__(self, owner=None):
        self.owner = owner   # (uid, gid) of a worker that left root (tests/_sandbox.py), or None
        self.storages = []   # _Shared, by index
        self.by_key = {}
        self.fds = []
        self.passed = {}     # (index, dtype, shape, stride, offset) -> the test's tensor passed so

    def ref(self, t, name, written):
        """The persistent id that stands for tensor `t` (argument `name`) in the request."""
        if t.device.type not in ("cpu", "cuda"):  # a meta tensor (a wrong-device test) has no bytes
            return ("empty", str(t.device), str(t.dtype).removeprefix("torch."), tuple(t.shape), t.stride())
        storage = t.untyped_storage()
        key = (t.device, storage.data_ptr(), storage.nbytes()) if storage.nbytes() else id(storage)
        index = self.by_key.get(key)
        if index is None:
            index = self.by_key[key] = len(self.storages)
            private = as_bytes(t)
            if t.device.type == "cpu":
                fd = os.memfd_create("drills-shared", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
                os.ftruncate(fd, private.numel())
                # Its size is fixed for good: a worker that truncated it would make our own
                # mapping of it fault (SIGBUS) when we copy back.
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
                shared = _map(fd, private.numel())
                for lo, hi in _pieces(_source_ranges(storage, private.numel())):
                    shared[lo:hi].copy_(private[lo:hi])
                where = ("fd", len(self.fds), private.numel())
                self.fds.append(fd)
            else:
                fd, shared = None, private.clone()
                where = ("cuda",) + torch.multiprocessing.reductions.reduce_tensor(shared)
                _give_ref_counter(where[2], self.owner)
            self.storages.append(_Shared(private, shared, fd, where))
        entry = self.storages[index]
        entry.names.add(name)
        entry.written = entry.written or written
        layout = (index, t.dtype, tuple(t.shape), t.stride(), t.storage_offset())
        self.passed.setdefault(layout, t)
        return ("tensor", index, entry.where, str(t.dtype).removeprefix("torch."), *layout[2:])

    def pickle_args(self, args, kwargs, names, writes):
        """The request's bytes: each argument pickled with its name known, so a storage
        is writable when any argument the contract writes (`writes`; None: all) lies in it."""
        def dumps(value, name):
            pickler_out = _BytesPickler(self, name, writes is None or name in writes)
            return pickler_out.dumps(value)
        positional = [dumps(a, names[i] if i < len(names) else f"argument {i + 1}") for i, a in enumerate(args)]
        keyword = {k: dumps(v, k) for k, v in kwargs.items()}
        return pickle.dumps((positional, keyword))

    def collect(self):
        """After the reply: written storages copied back into the test's tensors (once);
        the names of the read-only arguments whose storage the worker changed."""
        changed = []
        for s in self.storages:
            ranges = _data_ranges(s.fd, s.private.numel()) if s.fd is not None else [(0, s.private.numel())]
            if s.written:
                for lo, hi in _pieces(ranges):
                    s.private[lo:hi].copy_(s.shared[lo:hi])
            elif any(not torch.equal(s.private[lo:hi], s.shared[lo:hi]) for lo, hi in _pieces(ranges)):
                changed.append(" / ".join(sorted(s.names)))
        return changed

    def close(self):
        for fd in self.fds:
            os.close(fd)
        self.storages, self.by_key, self.fds, self.passed = [], {}, [], {}

    def view(self, index, dtype, shape, stride, offset):
        """A view of the test's own storage `index`: the very tensor passed in (a returned
        `out=`) when it is one."""
        passed = self.passed.get((index, dtype, tuple(shape), tuple(stride), offset))
        if passed is not None:
            return passed
        private = self.storages[index].private
        return torch.empty(0, dtype=dtype, device=private.device).set_(private.untyped_storage(), offset, shape, stride)


class _Shared:
    """One storage of the call: the test's own bytes, the worker's copy, how it is sent."""

    def __init__(self, private, shared, fd, where):
        self.private, self.shared, self.fd, self.where = private, shared, fd, where
        self.names, self.written = set(), False


class _BytesPickler:
    def __init__(self, sharing, name, written):
        self.sharing, self.name, self.written = sharing, name, written

    def dumps(self, value):
        buf = io.BytesIO()
        pickler = pickle.Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL)
        pickler.persistent_id = self._pid
        pickler.dump(value)
        return buf.getvalue()

    def _pid(self, obj):
        # Exactly a tensor: a Parameter pickles as its .data, which comes here in turn.
        if type(obj) is torch.Tensor:
            return self.sharing.ref(obj, self.name, self.written)
        return None


def _give_ref_counter(args, owner):
    """torch's CUDA IPC keeps a reference count for the shared allocation in a /dev/shm file
    the sender makes (mode 0600) and the receiver opens by name: a worker that left root
    (another uid) is given that file, as it could open it when it ran as our uid."""
    if owner is None:
        return
    for value in args:
        if isinstance(value, bytes) and value.startswith(b"/torch_"):
            try:
                os.chown("/dev/shm" + value.decode(), *owner)
            except (OSError, UnicodeDecodeError):
                pass


def _source_ranges(storage, size):
    """Where the test's own storage holds data: a storage made from a sparse memfd
    (tests/_paged.py's caches past 2**31 elements) is read where it has pages only."""
    if size and storage.device.type == "cpu" and storage.is_shared():
        try:
            fd, _ = storage._share_fd_cpu_()
            return _data_ranges(fd, size)
        except RuntimeError:  # shared by file name, not by descriptor
            pass
    return [(0, size)] if size else []


def _map(fd, size):
    """A uint8 tensor over a shared mapping of `fd` (`size` bytes)."""
    if size == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(mmap.mmap(fd, size), dtype=torch.uint8)


# ---------------------------------------------------------------------------
# The worker side


def unpickle_request(payload, fds):
    """The call's (args, kwargs), each tensor a view of its shared storage, and the
    storages (uint8, by index) for the reply's references. The worker trusts the test
    process, so this is an ordinary unpickler."""
    storages = {}

    def load(pid):
        if pid[0] == "empty":
            return torch.empty_strided(pid[3], pid[4], dtype=getattr(torch, pid[2]), device=pid[1])
        _, index, where, dtype, shape, stride, offset = pid
        if index not in storages:
            if where[0] == "fd":
                storages[index] = _map(fds[where[1]], where[2])
            else:
                rebuild, args = where[1], where[2]
                storages[index] = rebuild(*args)
        storage = storages[index]
        return torch.empty(0, dtype=getattr(torch, dtype), device=storage.device).set_(
            storage.untyped_storage(), offset, shape, stride)

    def loads(data):
        unpickler = pickle.Unpickler(io.BytesIO(data))
        unpickler.persistent_load = load
        return unpickler.load()

    positional, keyword = pickle.loads(payload)
    args = [loads(a) for a in positional]
    kwargs = {k: loads(v) for k, v in keyword.items()}
    for fd in fds:  # the mappings hold the memory; the descriptors are no longer needed
        os.close(fd)
    return args, kwargs, storages


def pickle_reply(reply, storages):
    """The reply's bytes: plain data, a tensor as ("view", index, ...) when it lies in
    one of the call's storages, else ("bytes", ...) with its contents."""
    by_ptr = {s.untyped_storage().data_ptr(): i for i, s in storages.items() if s.numel()}

    def pid(obj):
        if not isinstance(obj, torch.Tensor):
            return None
        dtype = str(obj.dtype).removeprefix("torch.")
        index = by_ptr.get(obj.untyped_storage().data_ptr())
        if index is not None:
            return ("view", index, dtype, tuple(obj.shape), obj.stride(), obj.storage_offset())
        raw = obj.detach().contiguous().cpu().reshape(-1).view(torch.uint8)
        return ("bytes", obj.device.type, dtype, tuple(obj.shape), raw.numpy().tobytes())

    buf = io.BytesIO()
    pickler = pickle.Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL)
    pickler.persistent_id = pid
    pickler.dump(reply)
    return buf.getvalue()
