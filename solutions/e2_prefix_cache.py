"""E2: automatic prefix caching on top of E1's engine (content/e2.md).

A full block of K/V is named by a hash chained over every token before it; a cache
maps those hashes to physical blocks, so a request whose prompt starts like an
earlier one takes its blocks instead of computing them again. Blocks are shared by
reference count; a block nobody references stays cached until a new block is needed
(least recently freed first). Underneath, a batch whose block tables start with the
same blocks reads that shared prefix once, through L6's cascade attention.

E1 is not written again: its model runner (_forward, _prepare, the decode graphs),
its request and its scheduler come from E1's file in this same folder; what
changes is the block manager, admission (a prompt starts at its reused length),
registration of full blocks, and the choice of attention per step.
"""
import importlib.util
import os
import sys

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))


def _sibling(stem):
    """<stem>.py of this folder, loaded by path (as E1 loads L1 and L3), registered in
    sys.modules because Triton looks a kernel's globals up through its module."""
    name = f"{__name__}_{stem}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, os.path.join(_HERE, f"{stem}.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


_e1 = _sibling("e1_paged_engine")


def _tree_kernels():
    """The default `kernels=`: L1, L3 and L6 of the same tree."""
    l1, l3, l6 = (_sibling(s) for s in ("l1_paged_kv_write", "l3_paged_prefill", "l6_cascade_attention"))
    return _e1._Namespace(slot_mapping=l1.slot_mapping, reshape_and_cache=l1.reshape_and_cache,
                          paged_prefill_attention=l3.paged_prefill_attention,
                          cascade_prefix_len=l6.cascade_prefix_len, cascade_attention=l6.cascade_attention)


# ---------------------------------------------------------------------------
# The hash

_MASK = 2**64 - 1
NONE_HASH = 0x6A09E667F3BCC908  # the parent of a sequence's first block (vLLM's NONE_HASH): any fixed value


def _mix(x):
    """splitmix64's finaliser: every input bit moves about half of the output bits."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def hash_block_tokens(parent_hash, token_ids):
    """The hash of one full block: an int in [0, 2**64), a function of the parent block's
    hash (None for a sequence's first block) and this block's token ids only, the same
    in every process (never Python's salted hash())."""
    h = NONE_HASH if parent_hash is None else parent_hash
    for t in token_ids:
        h = _mix(h ^ (t & _MASK))
    return _mix(h ^ len(token_ids))  # the length too: [1, 2] and [1, 2, 0] differ


# ---------------------------------------------------------------------------
# The block manager


class PrefixCachingBlockManager:
    """E1's block manager with reference counts and a cache of full blocks by hash.

    A free block is either fresh (it holds no cached block: handed out first) or
    evictable (cached, unreferenced: handed out least recently freed first, and then
    its hash is forgotten). Both kinds count in num_free_blocks."""

    def __init__(self, num_blocks, block_size, caching=True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1; got {num_blocks}, {block_size}")
        self.num_blocks, self.block_size, self.caching = num_blocks, block_size, caching
        self._ref = [0] * num_blocks
        self._hash = [None] * num_blocks     # a cached block's hash, else None
        self._content = [None] * num_blocks  # its tokens, checked on every hit
        self._cached = {}                    # hash -> block; may be stale (see _lookup)
        self._fresh = dict.fromkeys(range(num_blocks))  # dicts as ordered sets: oldest first
        self._evictable = {}
        self._blocks, self._tokens, self._hashes, self._num_cached = {}, {}, {}, {}  # per sequence
        self._stats = dict(queried_tokens=0, reused_tokens=0, evictions=0)

    @property
    def num_free_blocks(self):
        return len(self._fresh) + len(self._evictable)

    def stats(self):
        return dict(self._stats)

    def _chain(self, tokens, hashes):
        """`hashes` (those of tokens' first full blocks) extended to every full block of tokens:
        each block's hash chained from its parent's, a trailing partial block left out."""
        for k in range(len(hashes), len(tokens) // self.block_size):
            block = tokens[k * self.block_size:(k + 1) * self.block_size]
            hashes.append(hash_block_tokens(hashes[-1] if hashes else None, block))
        return hashes

    def _lookup(self, h, tokens):
        """The cached block holding exactly these tokens under hash h, or None. The map is
        not cleaned on eviction (nano-vllm's way): the block's own record must agree."""
        b = self._cached.get(h)
        if b is not None and self._hash[b] == h and self._content[b] == tuple(tokens):
            return b
        return None

    def _take(self):
        """A block for new tokens: a fresh one, else the least recently freed cached one."""
        if self._fresh:
            b = next(iter(self._fresh))
            del self._fresh[b]
        else:
            b = next(iter(self._evictable))
            del self._evictable[b]
            self._hash[b] = self._content[b] = None  # evicted: its hash forgotten
            self._stats["evictions"] += 1
        self._ref[b] = 1
        return b

    def blocks_needed(self, seq_id, num_tokens):
        """New blocks that `num_tokens` more tokens of the live seq_id would take."""
        return -(-(len(self._tokens[seq_id]) + num_tokens) // self.block_size) - len(self._blocks[seq_id])

    def allocate(self, seq_id, token_ids):
        """A new sequence holding token_ids; returns how many leading tokens it reused."""
        n, bs = len(token_ids), self.block_size
        if seq_id in self._blocks:
            raise ValueError(f"sequence {seq_id!r} already holds blocks; use append() or free() it first")
        if n > self.num_blocks * bs:
            raise ValueError(f"sequence {seq_id!r} would hold {n} tokens, more than the whole cache "
                             f"({self.num_blocks} blocks of {bs})")
        hashes, hits = self._chain(list(token_ids), []) if self.caching else [], []
        for k, h in enumerate(hashes[:(n - 1) // bs]):  # never the whole prompt: its last token is computed
            b = self._lookup(h, token_ids[k * bs:(k + 1) * bs])
            if b is None:
                break
            hits.append(b)
        need = -(-n // bs) - len(hits)
        if need > self.num_free_blocks - sum(self._ref[b] == 0 for b in hits):
            raise ValueError(f"sequence {seq_id!r} needs {need} more blocks, {self.num_free_blocks} are free")
        for b in hits:  # a hit is referenced once more; an unreferenced one leaves the free queue
            if self._ref[b] == 0:
                del self._evictable[b]
            self._ref[b] += 1
        self._blocks[seq_id] = hits + [self._take() for _ in range(need)]
        self._tokens[seq_id], self._hashes[seq_id], self._num_cached[seq_id] = list(token_ids), hashes, len(hits)
        reused = len(hits) * bs
        self._stats["queried_tokens"] += n
        self._stats["reused_tokens"] += reused
        return reused

    def cache_full_blocks(self, seq_id, num_tokens):
        """The first num_tokens tokens of seq_id have (or get, this step) their K/V: cache
        its full blocks among them. A block whose hash is already cached is not cached again."""
        if not self.caching:
            return
        tokens, blocks, bs = self._tokens[seq_id], self._blocks[seq_id], self.block_size
        hashes = self._chain(tokens, self._hashes[seq_id])
        full = min(len(hashes), num_tokens // bs)
        for k in range(self._num_cached[seq_id], full):
            if self._lookup(hashes[k], tokens[k * bs:(k + 1) * bs]) is None:
                b = blocks[k]
                self._cached[hashes[k]], self._hash[b], self._content[b] = b, hashes[k], tuple(tokens[k * bs:(k + 1) * bs])
        self._num_cached[seq_id] = max(self._num_cached[seq_id], full)

    def append(self, seq_id, token_ids):
        """More tokens of the live seq_id; a block they fill enters the cache."""
        total = len(self._tokens[seq_id]) + len(token_ids)
        if total > self.num_blocks * self.block_size:
            raise ValueError(f"sequence {seq_id!r} would hold {total} tokens, more than the whole cache "
                             f"({self.num_blocks} blocks of {self.block_size})")
        need = self.blocks_needed(seq_id, len(token_ids))
        if need > self.num_free_blocks:
            raise ValueError(f"sequence {seq_id!r} needs {need} more blocks, {self.num_free_blocks} are free")
        self._blocks[seq_id] += [self._take() for _ in range(need)]
        self._tokens[seq_id] += list(token_ids)
        self.cache_full_blocks(seq_id, total)

    def free(self, seq_id):
        """Drop seq_id's references, its last block first (so its tail is evicted first)."""
        for b in reversed(self._blocks.pop(seq_id)):
            self._ref[b] -= 1
            if self._ref[b] == 0:
                (self._evictable if self._hash[b] is not None else self._fresh)[b] = None
        del self._tokens[seq_id], self._hashes[seq_id], self._num_cached[seq_id]

    def owned(self, seq_id):
        return list(self._blocks[seq_id])

    def block_table(self, seq_ids):
        """int32 [len(seq_ids), max_blocks]: row b lists seq_ids[b]'s blocks, then -1."""
        rows = [self._blocks[s] for s in seq_ids]
        table = torch.full((len(rows), max([len(r) for r in rows] + [1])), -1, dtype=torch.int32)
        for row, blocks in zip(table.numpy(), rows):  # through a numpy view, a row is filled from a list 5x
            row[:len(blocks)] = blocks                # faster than torch.tensor builds it (64 x 136: 0.12 ms)
        return table

    def slot(self, seq_id, position):
        return self._blocks[seq_id][position // self.block_size] * self.block_size + position % self.block_size

    def slot_mapping(self, seq_id, positions):
        return torch.tensor([self.slot(seq_id, p) for p in map(int, positions)], dtype=torch.int64)


# ---------------------------------------------------------------------------
# The scheduler: E1's, with admission at the reused length


class Scheduler(_e1.Scheduler):
    """E1's rule. A request is admitted with its whole prompt's blocks; its prefill starts
    at the reused length; blocks enter the cache as the tokens filling them are scheduled
    (a request admitted later in the same step may reuse them: L1 writes the whole
    batch's K/V before attention reads any). Preemption drops references, keeps the cache."""

    def __init__(self, blocks, budget, requests):
        super().__init__(blocks, budget, requests)
        self.stats = dict(prompt_tokens=sum(r.prompt_len for r in requests), computed_prompt_tokens=0,
                          reused_prompt_tokens=0, steps=0, cascade_steps=0, preemptions=0)
        self.admitted = set()

    def schedule(self):
        batch, left, preempted = [], self.budget, False
        for req in list(self.running):
            if req not in self.running:  # preempted by an older request of this step
                continue
            n = min(len(req.tokens) - req.computed, left)
            grow = max(0, req.computed + n - req.held)  # tokens the manager does not hold yet (a decode's)
            while self.blocks.blocks_needed(req.id, grow) > self.blocks.num_free_blocks:
                victim = self.running.pop()  # the newest, recomputed later
                self.blocks.free(victim.id)
                victim.computed = 0
                self.waiting.insert(0, victim)
                self.stats["preemptions"] += 1
                preempted = True
                if victim is req:
                    break
            else:
                if grow:
                    self.blocks.append(req.id, req.tokens[req.held:req.held + grow])
                    req.held += grow
                self.blocks.cache_full_blocks(req.id, req.computed + n)
                batch.append((req, n))
                left -= n
        while self.waiting and left > 0 and not preempted:
            req = self.waiting[0]
            try:
                reused = self.blocks.allocate(req.id, req.tokens)
            except ValueError:  # not enough free blocks now (never-fitting requests were refused up front)
                break
            req.computed, req.held = reused, len(req.tokens)
            if req.id not in self.admitted:  # a prompt's tokens count once, at its first admission
                self.admitted.add(req.id)
                self.stats["reused_prompt_tokens"] += reused
                self.stats["computed_prompt_tokens"] += req.prompt_len - reused
            n = min(len(req.tokens) - reused, left)
            self.blocks.cache_full_blocks(req.id, reused + n)
            self.running.append(self.waiting.pop(0))
            batch.append((req, n))
            left -= n
        return batch


# ---------------------------------------------------------------------------
# The model runner: E1's forward, attending through L6 when the batch shares a prefix


class _Cascade:
    """Kernels whose attention is L6's cascade over a fixed shared prefix: E1's forward
    (and its decode graphs) call paged_prefill_attention, and get cascade_attention."""

    def __init__(self, kernels, prefix_len):
        self.kernels, self.prefix_len = kernels, prefix_len
        self.reshape_and_cache = kernels.reshape_and_cache

    def paged_prefill_attention(self, query, k_cache, v_cache, block_table, query_start_loc, seq_lens, scale=None,
                                out=None):
        # E1's decode graphs hold their inputs as int64; L6's kernels take int32 (index tensors are). A
        # no-op on int32; in a graph, three small copies a layer that each replay repeats.
        table, starts, lens = (t.to(torch.int32) for t in (block_table, query_start_loc, seq_lens))
        return self.kernels.cascade_attention(query, k_cache, v_cache, table, starts, lens, self.prefix_len,
                                              scale=scale, out=out)


def _prefix_len(kernels, blocks, batch):
    """L6's rule for this step's batch, on the host tensors it reads."""
    lens = [req.computed + n for req, n in batch]
    starts = torch.tensor([0] + [n for _, n in batch]).cumsum(0).to(torch.int32)
    return kernels.cascade_prefix_len(blocks.block_table([req.id for req, _ in batch]), starts,
                                      torch.tensor(lens, dtype=torch.int32), blocks.block_size)


def generate(model, prompts, max_new_tokens, *, block_size=16, num_blocks=None, max_num_batched_tokens=256,
             enable_prefix_caching=True, kernels=None, return_stats=False):
    """E1's generate with automatic prefix caching: the same greedy tokens with caching on
    or off. With return_stats=True returns (tokens, stats)."""
    own_kernels, kernels = kernels is None, kernels or _tree_kernels()
    counts = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    if len(counts) != len(prompts) or any(n < 1 for n in counts) or any(len(p) < 1 for p in prompts):
        raise ValueError("prompts must be non-empty lists of token ids and max_new_tokens an int >= 1 or one "
                         "per prompt")
    if max_num_batched_tokens < 1:
        raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
    need = [-(-(len(p) + n - 1) // block_size) for p, n in zip(prompts, counts)]
    num_blocks = sum(need) if num_blocks is None else num_blocks
    for i, blocks in enumerate(need):
        if blocks > num_blocks:
            raise ValueError(f"request {i} needs {blocks} blocks of {block_size} tokens ({len(prompts[i])} of prompt "
                             f"+ {counts[i]} new), but the cache has num_blocks = {num_blocks}: it could never run")
    requests = [_e1.Request(i, p, n) for i, (p, n) in enumerate(zip(prompts, counts))]
    if not prompts:
        return ([], Scheduler(None, 1, []).stats) if return_stats else []
    blocks = PrefixCachingBlockManager(num_blocks, block_size, caching=enable_prefix_caching)
    sched = Scheduler(blocks, max_num_batched_tokens, requests)
    like = dict(dtype=model.lm_head.weight.dtype, device=model.lm_head.weight.device)
    shape = (num_blocks, block_size, model.config.num_key_value_heads, model.model.layers[0].self_attn.head_dim)
    if own_kernels and like["device"].type in _e1._GRAPH_DEVICES:  # E1's rule for decode graphs
        caches, graphs = _e1._engine(model, shape, like, kernels, len(prompts), max(need))
        cascade_graphs = graphs.__dict__.setdefault("cascade", {})  # one set per prefix length, on E1's
    else:
        caches, graphs = _e1._caches(model, shape, like), None
    eos = _e1._eos_ids(model)
    while sched.waiting or sched.running:
        batch = sched.schedule()
        if not batch:
            raise RuntimeError(f"the scheduler made no progress: {blocks.num_free_blocks} of {num_blocks} blocks "
                               f"free, {len(sched.waiting)} waiting, {len(sched.running)} running")
        prefix = _prefix_len(kernels, blocks, batch)
        attend = _Cascade(kernels, prefix) if prefix > 0 else kernels
        sched.stats["steps"] += 1
        sched.stats["cascade_steps"] += prefix > 0
        if graphs and all(n == 1 for _, n in batch):
            if prefix > 0 and prefix not in cascade_graphs:
                cascade_graphs[prefix] = _e1.DecodeGraphs(caches, attend, *graphs.table.shape)
            logits = (cascade_graphs[prefix] if prefix > 0 else graphs)(model, blocks, batch)
        else:
            logits = _e1._forward(model, caches, _e1._prepare(blocks, batch, like["device"]), attend)
        for (req, n), token in zip(batch, logits.argmax(dim=-1).tolist()):
            req.computed += n
            if req.computed < len(req.tokens):
                continue  # a prompt chunk that is not its last
            req.tokens.append(token)
            if token in eos or len(req.new) == req.max_new:
                sched.finish(req)
    tokens = [req.new for req in requests]
    return (tokens, sched.stats) if return_stats else tokens


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
