"""E1: a paged serving engine that runs a `transformers` Llama-family model on your
L1 (reshape_and_cache) and L3 (paged_prefill_attention) (vLLM V1's / nano-vllm's shape).

Read content/e1.md first. Replace each `raise NotImplementedError` with your code;
`make grade DRILL=e1` tells you how far you are and what is still wrong. By default
the engine runs on the kernels of this same folder (mine/l1_paged_kv_write.py and
mine/l3_paged_prefill.py): pass L1 and L3 first, or grade E1 on the reference kernels
with `make grade DRILL=e1 KERNELS=solutions`.
"""
import importlib.util
import os
import sys

import torch


class _Namespace:
    """Attributes from keywords (the step's tensors, the default kernels)."""

    def __init__(self, **values):
        self.__dict__.update(values)


def _sibling(stem):
    """Given: <stem>.py of this file's own folder, loaded by path (the trees never import
    each other by name), registered in sys.modules because Triton looks a kernel's globals
    up through its module."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{stem}.py")
    name = f"{__name__}_{stem}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _tree_kernels():
    """Given: the default `kernels=`: L1 and L3 of the same tree."""
    return _Namespace(reshape_and_cache=_sibling("l1_paged_kv_write").reshape_and_cache,
                      paged_prefill_attention=_sibling("l3_paged_prefill").paged_prefill_attention)


class BlockManager:
    """A free list of physical blocks and a block list per sequence. A sequence of n
    tokens owns exactly ceil(n / block_size) blocks; no block is owned twice."""

    def __init__(self, num_blocks, block_size):
        # TODO(e1 §4): the free blocks (all of them), and each sequence's blocks and token count.
        raise NotImplementedError("BlockManager: read content/e1.md §4")

    @property
    def num_free_blocks(self):
        # TODO(e1 §4)
        raise NotImplementedError("BlockManager.num_free_blocks: read content/e1.md §4")

    def allocate(self, seq_id, num_tokens):
        """A new sequence of num_tokens tokens. ValueError if it is larger than the whole cache."""
        # TODO(e1 §4)
        raise NotImplementedError("BlockManager.allocate: read content/e1.md §4")

    def append(self, seq_id, num_tokens):
        """num_tokens more tokens of seq_id: new blocks only when the last one is full."""
        # TODO(e1 §4)
        raise NotImplementedError("BlockManager.append: read content/e1.md §4")

    def free(self, seq_id):
        """Return seq_id's blocks (on finish or preemption)."""
        # TODO(e1 §4)
        raise NotImplementedError("BlockManager.free: read content/e1.md §4")

    def block_table(self, seq_ids):
        """int32 [len(seq_ids), max_blocks]: row b lists seq_ids[b]'s blocks, then -1."""
        # TODO(e1 §4)
        raise NotImplementedError("BlockManager.block_table: read content/e1.md §4")

    def slot_mapping(self, seq_id, positions):
        """int64 slots of `positions` of seq_id: block * block_size + offset in the block."""
        # TODO(e1 §4)
        raise NotImplementedError("BlockManager.slot_mapping: read content/e1.md §4")


def _rotate(x, cos, sin):
    """Given: transformers' RoPE (rotate_half form) on [T, H, D], cos/sin [T, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


def generate(model, prompts, max_new_tokens, *, block_size=16, num_blocks=None, max_num_batched_tokens=256,
             kernels=None):
    """Greedy decoding of every prompt through the paged engine; per prompt, the new
    tokens only (what model.generate(..., do_sample=False) gives, EOS included)."""
    # TODO(e1 §5): the scheduler loop (§5), each step's tensors (§6) and the flattened forward
    # through kernels.reshape_and_cache and kernels.paged_prefill_attention, once per layer (§7).
    raise NotImplementedError("generate: read content/e1.md §5")


def replay_block_manager(num_blocks, block_size, ops):
    """Given (not part of the exercise): run `ops` on a BlockManager and return what each
    gives, as data, for the tests (your code runs in a worker that sends back data only).
    An op is ("allocate", seq_id, n), ("append", seq_id, n), ("free", seq_id),
    ("block_table", [seq_ids]), ("slot_mapping", seq_id, positions) or ("num_free_blocks",);
    a refused op gives ("ValueError", its message)."""
    manager, out = BlockManager(num_blocks, block_size), []
    for op, *args in ops:
        try:
            out.append(manager.num_free_blocks if op == "num_free_blocks" else getattr(manager, op)(*args))
        except ValueError as error:
            out.append(("ValueError", str(error)))
    return out
