"""The paged-memory builder every drill's cases are made from. Names no drill.

House rules every builder follows:
- Outputs and caches start as random noise or NaN, never zeros, so an element
  nobody wrote is visible.
- Buffers a kernel writes live inside a guarded allocation: a larger buffer whose
  margins hold noise and are compared after the call, so a write before or past
  the end of the tensor is caught.
- Physical blocks come from a shuffled pool, so a kernel that mixes up logical
  and physical block numbers reads or writes the wrong place; block-table entries
  past a sequence's last block point at blocks nobody owns.
"""
import math
from dataclasses import dataclass

import torch

from _channel import as_bytes
from _drill import ELEMENT_SIZE

DTYPES = {name: getattr(torch, name) for name in ELEMENT_SIZE}
_SAME_WIDTH_INT = {2: torch.int16, 4: torch.int32, 8: torch.int64}
GUARD = 256  # elements of NaN (or spare block numbers) after an input a kernel might read past


def bits(t):
    """The raw bits of a tensor, for bit-exact comparisons (NaN == NaN, -0 != +0)."""
    return t.view(_SAME_WIDTH_INT[t.element_size()]) if t.is_floating_point() else t


def same_bits(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and bool((bits(a) == bits(b)).all())


def noise(shape, dtype, device, gen):
    """Standard normal values: never zero, never the same twice."""
    return torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype=dtype, device=device)


# A NaN no arithmetic produces (its payload is not the canonical quiet NaN), so an
# output element that still holds it after the call was never written.
POISON_BITS = {torch.float16: 0x7D5A, torch.bfloat16: 0x7FA5, torch.float32: 0x7FA5A5A5}


def poison(dtype):
    """A one-element tensor holding the poison NaN of `dtype`."""
    return torch.tensor([POISON_BITS[dtype]], dtype=_SAME_WIDTH_INT[dtype.itemsize]).view(dtype)


def never_written(t):
    """Bool mask: elements of a float tensor that still hold the poison NaN."""
    return bits(t) == bits(poison(t.dtype).to(t.device))


# ---------------------------------------------------------------------------
# Guarded buffers


@dataclass
class Guarded:
    """A tensor `view` in the middle of a flat allocation `storage`.

    The `margin` elements on each side hold noise that no kernel may touch.
    `initial` is a copy of the whole storage taken before the call under test.
    """

    storage: torch.Tensor
    view: torch.Tensor
    margin: int
    initial: torch.Tensor

    def expected(self, write):
        """The whole storage as it should be after `write(view_copy)` is applied."""
        storage = self.initial.clone()
        write(storage[self.margin:self.margin + self.view.numel()].view(self.view.shape))
        return storage

    def outside(self, storage=None):
        """The two margins of `storage` (default: the live one), joined."""
        s = self.storage if storage is None else storage
        return torch.cat([s[:self.margin], s[self.margin + self.view.numel():]])


def guarded(shape, dtype, device, gen, margin):
    numel = math.prod(shape)
    storage = noise(margin + numel + margin, dtype, device, gen)
    view = storage[margin:margin + numel].view(shape)
    return Guarded(storage, view, margin, storage.clone())


def poisoned_out(shape, dtype, device, gen, margin=None):
    """An output buffer for `out=`: its view holds the poison NaN, its margins noise.
    The default margin is one row (the last dimensions after the first) and at least 64."""
    margin = max(64, math.prod(shape[1:])) if margin is None else margin
    g = guarded(shape, dtype, device, gen, margin)
    g.view.copy_(poison(dtype).to(device).expand(shape))
    g.initial = g.storage.clone()
    return g


_BIG_MEMORY = None  # the lock file held while this process owns caches past 2**31 elements


def release_big_memory():
    """Let the next test (in this or another test process) build its large caches."""
    global _BIG_MEMORY
    if _BIG_MEMORY is not None:
        _BIG_MEMORY.close()
        _BIG_MEMORY = None


def caches_past_int32(block_size, num_kv_heads, head_size, device, dtype=torch.float16):
    """k/v caches [num_blocks, block_size, H_kv, D] of just over 2**31 elements each
    (4 GiB in fp16), for the int64-offset tests. Never filled: on the CPU they are
    sparse files in shared memory from the start (the learner's code runs in another
    process), so only the pages a kernel writes take memory. A kernel that writes all
    over them would still take 8 GiB: one test at a time on this machine holds them (a
    lock file, released when the test ends). Skips the test where they do not fit."""
    import fcntl
    import os
    import tempfile

    import pytest

    global _BIG_MEMORY
    if torch.device(device).type == "cpu" and _BIG_MEMORY is None:
        _BIG_MEMORY = open(os.path.join(tempfile.gettempdir(), "drills-big-memory.lock"), "w")
        fcntl.flock(_BIG_MEMORY, fcntl.LOCK_EX)

    num_blocks = 2**31 // (block_size * num_kv_heads * head_size) + 4
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    try:
        if torch.device(device).type == "cpu":
            def make():
                nbytes = math.prod(shape) * dtype.itemsize
                if not hasattr(os, "memfd_create"):  # not Linux (macOS): every page reserved up front
                    storage = torch.UntypedStorage._new_shared(nbytes)
                    return torch.empty(0, dtype=dtype).set_(storage, 0, shape)
                # A sparse file in memory: pages exist only once written, so the few slots a
                # test touches cost what they hold, not 4 GiB (UntypedStorage._new_shared
                # reserves every page up front, which takes most of a second).
                fd = os.memfd_create("drills-cache-past-int32")
                try:
                    os.ftruncate(fd, nbytes)
                    storage = torch.UntypedStorage._new_shared_fd_cpu(fd, nbytes)
                finally:
                    os.close(fd)  # the storage holds its own copy of the descriptor
                return torch.empty(0, dtype=dtype).set_(storage, 0, shape)
            return make(), make()
        k_cache = torch.empty(shape, dtype=dtype, device=device)
        return k_cache, torch.empty_like(k_cache)
    except RuntimeError as error:
        pytest.skip(f"cannot reserve the 8 GiB this test maps: {error}")


def followed_by(t, guard, device):
    """t on `device` as the front of a longer buffer that continues with `guard`, so a
    kernel that reads past t's end reads the guard rather than memory outside any tensor."""
    return torch.cat([t.flatten().cpu(), guard.to(t.dtype)]).to(device)[:t.numel()].view(t.shape)


def snapshot(*tensors):
    """Byte copies of the whole storages behind `tensors`, to prove later that a call
    changed none of them (NaN included, guard tails included)."""
    return [(t, as_bytes(t).clone()) for t in tensors if isinstance(t, torch.Tensor)]


def changed(snap):
    """Positions in the snapshot of the tensors whose storage is no longer byte-identical."""
    return [i for i, (t, before) in enumerate(snap) if not torch.equal(as_bytes(t), before)]


# ---------------------------------------------------------------------------
# The block pool


def allocate_blocks(seq_lens, block_size, gen, spare_blocks=2, extra_columns=1):
    """Give each sequence ceil(len / block_size) blocks from one shuffled pool.

    Returns (block_table [B, max_blocks] int32, num_blocks). Columns past a
    sequence's last block are garbage, as in a real server: they point at spare
    blocks that no sequence owns, so a kernel that reads them reads junk.
    """
    owned = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = max(sum(owned) + spare_blocks, 1)  # a cache has at least one block
    pool = torch.randperm(num_blocks, generator=gen)
    spare = pool[sum(owned):] if num_blocks > sum(owned) else pool
    width = max(owned, default=0) + extra_columns
    table = spare[torch.randint(len(spare), (len(seq_lens), width), generator=gen)]
    start = 0
    for b, n in enumerate(owned):
        table[b, :n] = pool[start:start + n]
        start += n
    return table.to(torch.int32), num_blocks


def owned_columns(seq_lens, block_size, width):
    """[B, width] bool: which block-table columns each sequence's tokens use."""
    need = (torch.as_tensor(seq_lens).long().cpu() + block_size - 1) // block_size
    return torch.arange(width) < need[:, None]


def nan_outside(cache, table, seq_lens, block_size, tail="noise"):
    """NaN in every block no sequence owns and, if tail == "nan", in each last block's
    unused slots. Returns the numbers of the unowned (spare) blocks."""
    owned = owned_columns(seq_lens, block_size, table.shape[1])
    unowned = torch.ones(cache.shape[0], dtype=torch.bool)
    unowned[table[owned].long()] = False
    cache[unowned] = float("nan")
    if tail == "nan":
        for b, n in enumerate(seq_lens):
            if n % block_size:
                cache[table[b, n // block_size].long(), n % block_size:] = float("nan")
    return unowned.nonzero().flatten()


def guarded_table(table, spare, gen, device):
    """The block table followed by GUARD numbers of spare (NaN) blocks."""
    return followed_by(table, spare[torch.randint(len(spare), (GUARD,), generator=gen)], device)


def guarded_nan(t, device):
    """t followed by GUARD NaN."""
    return followed_by(t, torch.full((GUARD,), float("nan")), device)


