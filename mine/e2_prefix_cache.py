"""E2: automatic prefix caching on top of your E1 engine (content/e2.md).

Read content/e2.md first. Replace each `raise NotImplementedError` with your code;
`make grade DRILL=e2` tells you how far you are and what is still wrong.

You do not write the engine again. `_e1` below is your own E1 module
(mine/e1_paged_engine.py, loaded from this folder): take from it what stays the same
(your request, your scheduler, your step tensors and forward), and change only what
prefix caching changes (content/e2.md §5). By default the engine runs on the kernels
of this same folder: L1, L3 and L6 (pass them first, or grade E2 on the reference
kernels with `make grade DRILL=e2 KERNELS=solutions`).
"""
import importlib.util
import os
import sys

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))


def _sibling(stem):
    """Given: <stem>.py of this folder, loaded by path (the trees never import each other by
    name), registered in sys.modules because Triton looks a kernel's globals up through its
    module."""
    name = f"{__name__}_{stem}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, os.path.join(_HERE, f"{stem}.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


_e1 = _sibling("e1_paged_engine")  # given: your E1, to build on


def _tree_kernels():
    """Given: the default `kernels=`: L1, L3 and L6 of the same tree."""
    l1, l3, l6 = (_sibling(s) for s in ("l1_paged_kv_write", "l3_paged_prefill", "l6_cascade_attention"))
    return _e1._Namespace(slot_mapping=l1.slot_mapping, reshape_and_cache=l1.reshape_and_cache,
                          paged_prefill_attention=l3.paged_prefill_attention,
                          cascade_prefix_len=l6.cascade_prefix_len, cascade_attention=l6.cascade_attention)


def hash_block_tokens(parent_hash, token_ids):
    """The hash of one full block (content/e2.md §2): a non-negative int of at most eight
    bytes, a function of parent_hash (None for a sequence's first block, else an earlier
    block's hash) and of the block's token ids only, the same in every process and every
    run: never Python's hash()."""
    # TODO(e2 §2): a chained hash.
    raise NotImplementedError("hash_block_tokens: read content/e2.md §2")


class PrefixCachingBlockManager:
    """E1's block manager (content/e1.md §4) plus reference counts and a cache of full blocks
    by hash (content/e2.md §3).

    Blocks are numbered 0..num_blocks - 1. A sequence of n tokens owns exactly
    ceil(n / block_size) blocks, in token order; a block may be owned by several live
    sequences (its reference count), but only a full, cached block, and a shared block is
    never written. A block no sequence references but that is cached stays cached
    (evictable) until a new block is needed; new blocks come from never-cached free
    blocks first, then from evictable blocks, least recently freed first, and an
    evicted block's hash is forgotten."""

    def __init__(self, num_blocks, block_size):
        # TODO(e2 §3): your block manager, E1's plus the cache.
        raise NotImplementedError("PrefixCachingBlockManager: read content/e2.md §3")

    @property
    def num_free_blocks(self):
        """Free blocks: never cached, or cached and referenced by no live sequence."""
        raise NotImplementedError("PrefixCachingBlockManager.num_free_blocks: read content/e2.md §3")

    def allocate(self, seq_id, token_ids):
        """A new sequence seq_id holding all of token_ids (a prompt). Reuses the longest run of
        leading full blocks that are cached (hash found, tokens equal) and returns how many
        tokens it reused: a multiple of block_size, at most len(token_ids) - 1. ValueError
        (changing nothing) for a seq_id already live, for more tokens than the whole cache
        holds, or for fewer free blocks than it needs (content/e2.md §3)."""
        raise NotImplementedError("PrefixCachingBlockManager.allocate: read content/e2.md §3")

    def cache_full_blocks(self, seq_id, num_tokens):
        """The first num_tokens tokens of seq_id have their K/V (or get it in this step): its
        full blocks among them enter the cache; a block whose hash is already cached is not
        cached again (content/e2.md §3)."""
        raise NotImplementedError("PrefixCachingBlockManager.cache_full_blocks: read content/e2.md §3")

    def append(self, seq_id, token_ids):
        """More tokens of the live seq_id (E1's append, with the tokens' ids): a block they
        fill enters the cache. ValueError as allocate (content/e2.md §3)."""
        raise NotImplementedError("PrefixCachingBlockManager.append: read content/e2.md §3")

    def free(self, seq_id):
        """Drop seq_id's references, its last block first; a cached block left with none stays
        cached, evictable (content/e2.md §3)."""
        raise NotImplementedError("PrefixCachingBlockManager.free: read content/e2.md §3")

    def stats(self):
        """dict of ints: queried_tokens (tokens passed to allocate, summed), reused_tokens (what
        allocate returned, summed), evictions (blocks whose hash was forgotten to make room)."""
        raise NotImplementedError("PrefixCachingBlockManager.stats: read content/e2.md §3")

    def block_table(self, seq_ids):
        """As E1's: int32 [len(seq_ids), width], each row the sequence's blocks then -1."""
        raise NotImplementedError("PrefixCachingBlockManager.block_table: read content/e2.md §3")

    def slot_mapping(self, seq_id, positions):
        """As E1's: the int64 slots of `positions` of seq_id."""
        raise NotImplementedError("PrefixCachingBlockManager.slot_mapping: read content/e2.md §3")


def generate(model, prompts, max_new_tokens, *, block_size=16, num_blocks=None, max_num_batched_tokens=256,
             enable_prefix_caching=True, kernels=None, return_stats=False):
    """E1's generate (content/e1.md §1 and §5: greedy tokens within E1's 1e-3, EOS,
    preemption, the ValueError and RuntimeError rules), with automatic prefix caching
    (content/e2.md §5): the same tokens with enable_prefix_caching on or off.

    With caching, a prompt's reused blocks are not computed again (its prefill starts at
    the reused length), and blocks enter the cache as requests fill them, so a request
    admitted later in the same call reuses an earlier one's prefix. Every step computes
    kernels.cascade_prefix_len for its batch: positive, the step attends through
    kernels.cascade_attention with that length, else through kernels.paged_prefill_attention;
    every step writes K/V with kernels.reshape_and_cache (None: L1, L3 and L6 of this
    folder). With caching off nothing is shared. return_stats=True returns (tokens,
    stats), stats a dict of ints: prompt_tokens, computed_prompt_tokens and
    reused_prompt_tokens (each prompt token counted once, at its first admission), steps,
    cascade_steps and preemptions (content/e2.md §6).
    """
    # TODO(e2 §5): your E1 engine, prefix-aware.
    raise NotImplementedError("generate: read content/e2.md §5")


def replay_prefix_cache(num_blocks, block_size, ops):
    """Given (not part of the exercise): run `ops` on a PrefixCachingBlockManager and return
    what each gives, as data, for the tests (your code runs in a worker that sends back
    data only). An op is ("allocate", seq_id, token_ids), ("append", seq_id, token_ids),
    ("free", seq_id), ("block_table", [seq_ids]), ("slot_mapping", seq_id, positions),
    ("num_free_blocks",) or ("stats",); a refused op gives ("ValueError", its message).
    An allocated prompt counts as computed at once: its full blocks are cached."""
    manager, out = PrefixCachingBlockManager(num_blocks, block_size), []
    for op, *args in ops:
        try:
            if op == "num_free_blocks":
                out.append(manager.num_free_blocks)
            elif op == "allocate":
                out.append(manager.allocate(*args))
                manager.cache_full_blocks(args[0], len(args[1]))
            else:
                out.append(getattr(manager, op)(*args))
        except ValueError as error:
            out.append(("ValueError", str(error)))
    return out
