"""What comes back from the learner's process is data. Names no drill; imports nothing
of ours.

A reply is a pickle made by a process the learner's code controls, and unpickling
runs whatever callables a pickle names. So the test process reads it with an
unpickler that names nothing at all (`find_class` refuses every global): numbers,
strings, bytes, None, and tuples, lists, sets and dicts of these need no names. A
tensor is a persistent id (tests/_channel.py's `pickle_reply`), checked field by field
here and built by us: a view of one of the call's own storages, or a new tensor from
its bytes. Anything else (a numpy array, a learner's class, os.system) is refused,
naming what came back.
"""
import io
import math
import pickle

import torch

DTYPES = {name: getattr(torch, name) for name in (
    "float16", "bfloat16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "bool",
    "float8_e4m3fn", "float8_e5m2") if hasattr(torch, name)}


class NotData(Exception):
    """A reply named something that is not data."""


def _ints(value, what):
    if not (isinstance(value, tuple) and all(type(v) is int and 0 <= v < 2**62 for v in value)):
        raise NotData(f"a tensor with a malformed {what}")
    return value


class _Unpickler(pickle.Unpickler):
    def __init__(self, payload, view):
        super().__init__(io.BytesIO(payload))
        self.view = view

    def find_class(self, module, name):
        raise NotData(f"{module}.{name}")

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and pid and pid[0] in ("view", "bytes")):
            raise NotData("an unknown reference")
        if pid[0] == "view" and len(pid) == 6:
            _, index, dtype, shape, stride, offset = pid
            if type(index) is not int or dtype not in DTYPES or type(offset) is not int or offset < 0:
                raise NotData("a malformed tensor view")
            try:
                return self.view(index, DTYPES[dtype], _ints(shape, "shape"), _ints(stride, "stride"), offset)
            except (RuntimeError, IndexError, ValueError) as error:
                raise NotData(f"a view outside the call's tensors ({error})") from None
        if pid[0] == "bytes" and len(pid) == 5:
            _, device, dtype, shape, raw = pid
            shape = _ints(shape, "shape")
            if device not in ("cpu", "cuda") or dtype not in DTYPES or type(raw) is not bytes \
                    or len(raw) != math.prod(shape) * DTYPES[dtype].itemsize:
                raise NotData("a malformed tensor")
            t = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
            t = t.view(DTYPES[dtype]).reshape(shape)
            return t.cuda() if device == "cuda" and torch.cuda.is_available() else t
        raise NotData("a malformed reference")


def loads(payload, view=None):
    """The reply in `payload` (bytes), or NotData naming the first thing it may not hold.
    `view(index, dtype, shape, stride, offset)` builds a tensor of the call's storage `index`."""
    def no_view(*args):
        raise IndexError("no tensor was passed")
    return _Unpickler(payload, view or no_view).load()
