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
    """Which physical block belongs to which sequence (content/e1.md §4).

    Blocks are numbered 0..num_blocks - 1. A sequence of n tokens owns exactly
    ceil(n / block_size) blocks, kept in token order; no block belongs to two live
    sequences; a sequence's blocks keep their place as it grows; freed blocks can be
    given out again."""

    def __init__(self, num_blocks, block_size):
        # TODO(e1): your block manager (content/e1.md §4; hints in §8).
        raise NotImplementedError("BlockManager: read content/e1.md §4")

    @property
    def num_free_blocks(self):
        # TODO(e1 §4)
        raise NotImplementedError("BlockManager.num_free_blocks: read content/e1.md §4")

    def allocate(self, seq_id, num_tokens):
        """A new sequence seq_id (any hashable id) of num_tokens tokens: it gets its blocks.

        ValueError when num_tokens is more than the whole cache holds (num_blocks *
        block_size). Fewer free blocks than it needs, or a seq_id already live: the tests
        never ask; raising ValueError and changing nothing, as the reference does, is the
        safe answer (content/e1.md §4)."""
        # TODO(e1 §4)
        raise NotImplementedError("BlockManager.allocate: read content/e1.md §4")

    def append(self, seq_id, num_tokens):
        """num_tokens more tokens of the live sequence seq_id: it owns ceil(total / block_size)
        blocks afterwards, its earlier blocks unmoved. ValueError when the total is more
        than the whole cache holds; fewer free blocks than it needs: as allocate
        (content/e1.md §4)."""
        # TODO(e1 §4)
        raise NotImplementedError("BlockManager.append: read content/e1.md §4")

    def free(self, seq_id):
        """Return seq_id's blocks (on finish or preemption)."""
        # TODO(e1 §4)
        raise NotImplementedError("BlockManager.free: read content/e1.md §4")

    def block_table(self, seq_ids):
        """int32 tensor [len(seq_ids), width]: row b lists the blocks of seq_ids[b] in token
        order, then -1 up to the width; the width is at least the most blocks any of
        them owns (content/e1.md §4)."""
        # TODO(e1 §4)
        raise NotImplementedError("BlockManager.block_table: read content/e1.md §4")

    def slot_mapping(self, seq_id, positions):
        """int64 tensor: the slot of each of `positions` (positions inside seq_id, all in
        its owned blocks), L1's slot (content/l1.md §3)."""
        # TODO(e1 §4)
        raise NotImplementedError("BlockManager.slot_mapping: read content/e1.md §4")


def _rotate(x, cos, sin):
    """Given: transformers' RoPE (rotate_half form) on [T, H, D], cos/sin [T, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


def generate(model, prompts, max_new_tokens, *, block_size=16, num_blocks=None, max_num_batched_tokens=256,
             kernels=None):
    """Greedy decoding of every prompt through the paged engine: a list with, per prompt,
    the new token ids only (a list of ints), ending at the model's EOS (included) or
    after max_new_tokens (content/e1.md §1 and §5). The EOS ids are
    model.generation_config.eos_token_id (what model.generate uses): an int or a list,
    any of which ends a request.

    prompts: non-empty lists of token ids; max_new_tokens: an int >= 1 or one per
    prompt. Each token must be the model's greedy choice up to floating point (its
    logit within 1e-3 of the step's top one). One paged KV cache per layer of exactly
    num_blocks blocks (None: room for every request at once); a step holds at most
    max_num_batched_tokens tokens; every step calls kernels.reshape_and_cache and
    kernels.paged_prefill_attention once per layer for the whole batch (None: L1 and
    L3 of this folder) and nothing else computes attention; the model's weights are
    never changed. ValueError for bad arguments and for a request that could never
    fit in num_blocks.
    """
    # TODO(e1): your scheduler, step tensors and forward (content/e1.md §5 to §7; hints in §8).
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
