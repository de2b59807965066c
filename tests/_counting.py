"""How many bytes a kernel moved, counted under Triton's CPU interpreter. Names no drill,
and imports nothing of ours but tests/_env.py: the worker (tests/_worker.py) runs it
beside the learner's code, tests/_traffic.py reports what it counted.
The interpreter runs every `tl.load` / `tl.store` of every program through two
builder methods, `InterpreterBuilder.create_masked_load` and `create_masked_store`
(triton/runtime/interpreter.py): plain loads and stores, `other=`-less loads,
atomic loads and stores and tensor-descriptor loads and stores (hence block
pointers' descriptor path, and descriptor gather/scatter) all funnel into them. We
wrap those two, and `GridExecutor.__call__` to learn the tensors each launch gets,
for as long as a measurement is active. Not counted: atomic read-modify-writes and
compare-and-swaps (`tl.atomic_add`, `tl.atomic_cas`: they go straight to the C++
interpreter), and anything done outside Triton kernels (a PyTorch op in the
wrapper moves bytes we never see; a report then shows fewer bytes than the op
needs, and says so). L1, L2 and L4 use tl.load and tl.store only.

What one load instruction counts: the bytes of its unmasked lanes, with lanes that
read the same address counted once (a GPU's coalescer merges them into one
request), so `tl.load(table + pos // BLOCK_SIZE)` over a tile of tokens costs one
entry per block, while a load per token in separate instructions costs one per
token. Summed over instructions and programs: re-reads across programs (each
query head's program reading the same K) count every time, as they cost DRAM
traffic on a GPU when they do not meet in its caches.

Addresses are mapped back to tensors by the data_ptr ranges of their storages:
first the tensors the measured call got (so a drill names them in its own terms),
then any other tensor a launch got (buffers the code allocated itself: "scratch").
An address in no tensor's storage counts as "outside".

On a GPU nothing runs through the interpreter: `measure_here` counts nothing there.
"""
from __future__ import annotations  # np.ndarray below is a type hint: numpy is imported where it is used

import inspect
from dataclasses import dataclass, field

_HOOKS = (("InterpreterBuilder", "create_masked_load", ("ptrs", "mask", "other")),
          ("InterpreterBuilder", "create_masked_store", ("ptrs", "value", "mask")),
          ("GridExecutor", "__call__", ()))


class TrafficUnavailable(RuntimeError):
    """Triton's interpreter no longer has the hooks this counts with (renamed or reshaped)."""


def interpreter():
    """triton.runtime.interpreter, checked to still have every hook and argument we wrap.
    Raises TrafficUnavailable naming what changed, never counts zero bytes silently."""
    try:
        from triton.runtime import interpreter as module
    except ImportError as error:
        raise TrafficUnavailable(f"triton.runtime.interpreter cannot be imported ({error})") from None
    for cls, name, params in _HOOKS:
        method = getattr(getattr(module, cls, None), name, None)
        if method is None:
            raise TrafficUnavailable(f"triton.runtime.interpreter.{cls}.{name} is gone (Triton renamed it?): "
                                     f"tests/_counting.py must follow it")
        got = list(inspect.signature(method).parameters)[1:1 + len(params)]
        if tuple(got) != params:
            raise TrafficUnavailable(f"triton.runtime.interpreter.{cls}.{name} takes {got}, not {list(params)}: "
                                     f"tests/_counting.py must follow it")
    return module


@dataclass
class TensorTraffic:
    """What one tensor (or the scratch / outside bucket) saw during a measurement."""
    loaded: int = 0        # bytes, masked-off lanes excluded, same-address lanes of one load once
    stored: int = 0
    distinct_loaded: int = 0
    distinct_stored: int = 0
    read: np.ndarray = None     # per byte of the tensor's storage: how many loads touched it (None: a bucket)
    written: np.ndarray = None

    @property
    def reread(self):
        """Bytes loaded again after their first load."""
        return self.loaded - self.distinct_loaded

    def to_data(self):
        """As numbers and tensors, which is all a worker's reply may hold (tests/_data.py)."""
        import torch
        arrays = [None if a is None else torch.from_numpy(a) for a in (self.read, self.written)]
        return (self.loaded, self.stored, self.distinct_loaded, self.distinct_stored, *arrays)

    @classmethod
    def from_data(cls, data):
        *counts, read, written = data
        return cls(*counts, *[None if t is None else t.numpy() for t in (read, written)])


@dataclass
class Traffic:
    """One measured call: `tensors[i]` for the i-th tensor argument of the call (in the
    order tests/_worker.py flattens them), plus scratch and outside."""
    tensors: list
    scratch: TensorTraffic = field(default_factory=TensorTraffic)
    outside: TensorTraffic = field(default_factory=TensorTraffic)
    launches: int = 0

    @property
    def loaded(self):
        return sum(t.loaded for t in self.tensors) + self.scratch.loaded + self.outside.loaded

    def to_data(self):
        return ([t.to_data() for t in self.tensors], self.scratch.to_data(), self.outside.to_data(), self.launches)

    @classmethod
    def from_data(cls, data):
        if data is None:
            return None
        tensors, scratch, outside, launches = data
        return cls([TensorTraffic.from_data(t) for t in tensors], TensorTraffic.from_data(scratch),
                   TensorTraffic.from_data(outside), launches)

    @property
    def stored(self):
        return sum(t.stored for t in self.tensors) + self.scratch.stored + self.outside.stored


def bytes_of(view):
    """Byte offsets of every element of `view`, from the start of its storage."""
    import numpy as np

    offsets = np.full(view.shape, view.storage_offset(), dtype=np.int64)
    for dim, (size, stride) in enumerate(zip(view.shape, view.stride())):
        shape = [1] * view.dim()
        shape[dim] = size
        offsets = offsets + (np.arange(size, dtype=np.int64) * stride).reshape(shape)
    size = view.element_size()
    return (offsets.reshape(-1, 1) * size + np.arange(size)).ravel()


# ---------------------------------------------------------------------------
# The counting (runs where the kernels run: the worker process)


class _Region:
    def __init__(self, storage_ptr, nbytes):
        import numpy as np
        self.start, self.end = storage_ptr, storage_ptr + nbytes
        self.read = np.zeros(nbytes, dtype=np.int32)
        self.written = np.zeros(nbytes, dtype=np.int32)
        self.owners = []  # (index or None, lo, hi): byte span of each tensor in it, storage-relative


class _Recorder:
    def __init__(self, tensors):
        self.regions = {}
        self.count = {}     # key (argument index, "scratch", "outside") -> TensorTraffic
        self.launches = 0
        for i, t in enumerate(tensors):
            self._add(t, i)

    def _add(self, tensor, key):
        storage = tensor.untyped_storage()
        region = self.regions.get(storage.data_ptr())
        if region is None:
            region = self.regions[storage.data_ptr()] = _Region(storage.data_ptr(), storage.nbytes())
        lo = tensor.storage_offset() * tensor.element_size()
        span = sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride())) + 1 if tensor.numel() else 0
        region.owners.append((key, lo, lo + span * tensor.element_size()))

    def launch(self, tensors):
        self.launches += 1
        for t in tensors:
            if t.device.type == "cpu" and t.untyped_storage().data_ptr() not in self.regions:
                self._add(t, "scratch")

    def access(self, ptrs, mask, element_bytes, store):
        import numpy as np
        ptrs, mask = np.broadcast_arrays(np.asarray(ptrs), np.asarray(mask, dtype=bool))
        addresses = ptrs[mask]
        addresses = np.unique(addresses.astype(np.uint64)).astype(np.int64)
        counted = np.zeros(len(addresses), dtype=bool)
        for region in self.regions.values():
            inside = (addresses >= region.start) & (addresses < region.end)
            if not inside.any():
                continue
            counted |= inside
            offsets = addresses[inside] - region.start
            spans = (offsets[:, None] + np.arange(element_bytes)).ravel()
            spans = spans[spans < len(region.read)]
            np.add.at(region.written if store else region.read, spans, 1)
            owner = np.full(len(offsets), -1)
            for k, (_, lo, hi) in reversed(list(enumerate(region.owners))):
                owner[(offsets >= lo) & (offsets < hi)] = k
            owner[owner < 0] = 0  # past every view (a guard region): the storage's first tensor
            for k in np.unique(owner):
                self._bump(region.owners[k][0], int((owner == k).sum()) * element_bytes, store)
        if not counted.all():
            self._bump("outside", int((~counted).sum()) * element_bytes, store)

    def _bump(self, key, nbytes, store):
        record = self.count.setdefault(key, TensorTraffic())
        if store:
            record.stored += nbytes
        else:
            record.loaded += nbytes

    def result(self, num_tensors):
        per_region = {}
        for region in self.regions.values():
            for key, _, _ in region.owners:
                per_region.setdefault(key, []).append(region)
        tensors = []
        for i in range(num_tensors):
            record = self.count.get(i, TensorTraffic())
            region = per_region[i][0]
            record.read, record.written = region.read, region.written
            # Distinct bytes of this tensor's own span (its views of a shared storage).
            _, lo, hi = next(o for o in region.owners if o[0] == i)
            record.distinct_loaded = int((region.read[lo:hi] > 0).sum())
            record.distinct_stored = int((region.written[lo:hi] > 0).sum())
            tensors.append(record)
        scratch = self.count.get("scratch", TensorTraffic())
        for region in {id(r): r for r in per_region.get("scratch", [])}.values():
            scratch.distinct_loaded += int((region.read > 0).sum())
            scratch.distinct_stored += int((region.written > 0).sum())
        return Traffic(tensors, scratch, self.count.get("outside", TensorTraffic()), self.launches)


def measure_here(fn, tensors, *args, **kwargs):
    """Run fn(*args, **kwargs) with the interpreter's loads and stores counted, in this
    process. `tensors`: the call's tensor arguments, in order. Returns (result, Traffic),
    or (result, None) on a GPU. Raises TrafficUnavailable when the hooks are gone, and
    when kernels ran but no load reached our hook."""
    import _env
    if not _env.INTERPRET:
        return fn(*args, **kwargs), None
    module = interpreter()
    import torch

    recorder = _Recorder(tensors)
    builder, executor = module.InterpreterBuilder, module.GridExecutor
    load, store, call = builder.create_masked_load, builder.create_masked_store, executor.__call__

    def element_bytes(ptrs):
        # get_element_ty() since Triton 3.1 or so; older interpreters spelled it dtype.element_ty
        ty = ptrs.get_element_ty() if hasattr(ptrs, "get_element_ty") else ptrs.dtype.element_ty
        return ty.primitive_bitwidth // 8

    def counted_load(self, ptrs, mask, other, *rest, **kw):
        recorder.access(ptrs.data, mask.data, element_bytes(ptrs), store=False)
        return load(self, ptrs, mask, other, *rest, **kw)

    def counted_store(self, ptrs, value, mask, *rest, **kw):
        recorder.access(ptrs.data, mask.data, element_bytes(ptrs), store=True)
        return store(self, ptrs, value, mask, *rest, **kw)

    def counted_call(self, *args_dev, **kw):
        found = []

        def walk(x):
            if isinstance(x, torch.Tensor):
                found.append(x)
            elif isinstance(x, (tuple, list)):
                for y in x:
                    walk(y)
            elif hasattr(x, "base") and isinstance(getattr(x, "base"), torch.Tensor):  # a TensorDescriptor
                found.append(x.base)
        walk(args_dev)
        walk(list(kw.values()))
        recorder.launch(found)
        return call(self, *args_dev, **kw)

    builder.create_masked_load, builder.create_masked_store = counted_load, counted_store
    executor.__call__ = counted_call
    try:
        result = fn(*args, **kwargs)
    finally:
        builder.create_masked_load, builder.create_masked_store, executor.__call__ = load, store, call
    traffic = recorder.result(len(tensors))
    if traffic.launches and not (traffic.loaded or traffic.stored):
        raise TrafficUnavailable(f"{traffic.launches} kernel launch(es) ran but no load or store reached "
                                 f"InterpreterBuilder.create_masked_load/store: Triton routes them elsewhere now, "
                                 f"and tests/_counting.py must follow")
    return result, traffic
