"""What comes back from the learner's process is data. Names no drill; imports nothing
of ours.

The worker's replies are pickles made by a process the learner's code controls, and
unpickling runs whatever callables a pickle names. So the test process reads them with
an unpickler that knows only an allow-list: tensors (torch's own shared-memory
reductions: a storage by file descriptor or CUDA IPC handle, then a view of it), dtypes,
sizes, devices, and the marker for "the i-th tensor argument". Numbers, strings, bytes,
None, and tuples, lists and dicts of these need no names at all. Anything else (a numpy
array, a learner's class, os.system) is refused, naming what came back.
"""
import io
import pickle

import torch

# (module, name) pairs a reply may name, beyond the dtypes below.
ALLOWED = {
    ("torch.multiprocessing.reductions", "rebuild_tensor"),
    ("torch.multiprocessing.reductions", "rebuild_typed_storage"),
    ("torch.multiprocessing.reductions", "rebuild_typed_storage_child"),
    ("torch.multiprocessing.reductions", "rebuild_storage_fd"),
    ("torch.multiprocessing.reductions", "rebuild_storage_empty"),
    ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"),
    ("torch.multiprocessing.reductions", "rebuild_event"),
    ("torch", "Tensor"), ("torch", "Size"), ("torch", "device"),
    ("torch", "UntypedStorage"), ("torch.storage", "UntypedStorage"), ("torch.storage", "TypedStorage"),
    ("multiprocessing.resource_sharer", "DupFd"),  # a CPU storage's file descriptor, fetched from the sender
    ("builtins", "complex"), ("builtins", "slice"),
    ("_worker", "_Arg"),
}


class NotData(Exception):
    """A reply named something that is not data."""


class _Unpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) in ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise NotData(f"{module}.{name}")


def loads(payload):
    """The reply in `payload` (bytes), or NotData naming the first thing it may not hold."""
    return _Unpickler(io.BytesIO(payload)).load()
