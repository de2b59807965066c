"""E1: a paged serving engine (the shape of vLLM V1's and nano-vllm's) that runs a
`transformers` Llama-family model on L1's reshape_and_cache and L3's
paged_prefill_attention (content/e1.md).

Three parts, in the order the page explains them: the block manager (which
physical block holds which tokens), the scheduler (which tokens run this step),
and the model runner (one flattened forward over every token of the step).
"""
import importlib.util
import os
import sys
import weakref

import torch


class _Namespace:
    """Attributes from keywords (the step's tensors, the default kernels)."""

    def __init__(self, **values):
        self.__dict__.update(values)


def _sibling(stem):
    """<stem>.py of this file's own folder, loaded by path (the trees never import each
    other by name), registered in sys.modules because Triton looks a kernel's globals up
    through its module."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{stem}.py")
    name = f"{__name__}_{stem}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _tree_kernels():
    """The default `kernels=`: L1 and L3 of the same tree."""
    return _Namespace(reshape_and_cache=_sibling("l1_paged_kv_write").reshape_and_cache,
                           paged_prefill_attention=_sibling("l3_paged_prefill").paged_prefill_attention)


# ---------------------------------------------------------------------------
# The block manager


class BlockManager:
    """A free list of physical blocks and a block list per sequence. A sequence of n
    tokens owns exactly ceil(n / block_size) blocks; no block is owned twice."""

    def __init__(self, num_blocks, block_size):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1; got {num_blocks}, {block_size}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks))  # kept sorted: the lowest free block is taken first
        self._blocks = {}                      # seq_id -> its blocks, in token order
        self._tokens = {}                      # seq_id -> tokens it holds

    @property
    def num_free_blocks(self):
        return len(self._free)

    def blocks_needed(self, seq_id, num_tokens):
        """New blocks that `num_tokens` more tokens of seq_id (new or not) would take."""
        have = self._tokens.get(seq_id, 0)
        return -(-(have + num_tokens) // self.block_size) - len(self._blocks.get(seq_id, ()))

    def allocate(self, seq_id, num_tokens):
        if seq_id in self._blocks:
            raise ValueError(f"sequence {seq_id!r} already holds blocks; use append() or free() it first")
        self._blocks[seq_id], self._tokens[seq_id] = [], 0
        try:
            self.append(seq_id, num_tokens)
        except ValueError:
            del self._blocks[seq_id], self._tokens[seq_id]
            raise

    def append(self, seq_id, num_tokens):
        need = self.blocks_needed(seq_id, num_tokens)
        if self._tokens[seq_id] + num_tokens > self.num_blocks * self.block_size:
            raise ValueError(f"sequence {seq_id!r} would hold {self._tokens[seq_id] + num_tokens} tokens, more than "
                             f"the whole cache ({self.num_blocks} blocks of {self.block_size})")
        if need > len(self._free):
            raise ValueError(f"sequence {seq_id!r} needs {need} more blocks, {len(self._free)} are free: "
                             f"free or preempt a sequence first")
        self._blocks[seq_id] += self._free[:need]
        del self._free[:need]
        self._tokens[seq_id] += num_tokens

    def free(self, seq_id):
        """Return seq_id's blocks (on finish or preemption)."""
        self._free = sorted(self._free + self._blocks.pop(seq_id))
        del self._tokens[seq_id]

    def block_table(self, seq_ids):
        """int32 [len(seq_ids), max_blocks]: row b lists seq_ids[b]'s blocks, then -1."""
        rows = [self._blocks[s] for s in seq_ids]
        width = max([len(r) for r in rows] + [1])
        return torch.tensor([r + [-1] * (width - len(r)) for r in rows], dtype=torch.int32).view(len(rows), width)

    def owned(self, seq_id):
        """seq_id's blocks, in token order."""
        return list(self._blocks[seq_id])

    def slot(self, seq_id, position):
        """A token's slot: its block * block_size + its offset in the block."""
        return self._blocks[seq_id][position // self.block_size] * self.block_size + position % self.block_size

    def slot_mapping(self, seq_id, positions):
        """int64 slots of `positions` of seq_id."""
        return torch.tensor([self.slot(seq_id, p) for p in map(int, positions)], dtype=torch.int64)


# ---------------------------------------------------------------------------
# The scheduler


class Request:
    def __init__(self, id, prompt, max_new):
        self.id = id
        self.tokens = list(prompt)    # the prompt, then every token generated so far
        self.prompt_len = len(prompt)
        self.max_new = max_new
        self.computed = 0             # tokens whose K/V are in the cache

    @property
    def new(self):
        return self.tokens[self.prompt_len:]


class Scheduler:
    """vLLM V1's rule, made small: the running requests first, in the order they were
    admitted, each given the tokens it has not computed yet (a decode: 1) within the
    budget; then waiting requests, first come first served, in chunks. Only the newest
    running request can be part-way through its prompt, so decodes always fit."""

    def __init__(self, blocks, budget, requests):
        self.blocks, self.budget = blocks, budget
        self.waiting = list(requests)  # first come, first served
        self.running = []              # in the order they were admitted

    def schedule(self):
        """[(request, number of tokens)] for this step."""
        batch, left, preempted = [], self.budget, False
        for req in list(self.running):
            if req not in self.running:  # preempted by an older request of this step
                continue
            n = min(len(req.tokens) - req.computed, left)
            while self.blocks.blocks_needed(req.id, n) > self.blocks.num_free_blocks:
                victim = self.running.pop()  # the newest: recomputed later, as in vLLM V1
                self.blocks.free(victim.id)
                victim.computed = 0
                self.waiting.insert(0, victim)
                preempted = True
                if victim is req:
                    break
            else:
                self.blocks.append(req.id, n)
                batch.append((req, n))
                left -= n
        while self.waiting and left > 0 and not preempted:
            req = self.waiting[0]
            n = min(len(req.tokens), left)
            if self.blocks.blocks_needed(req.id, n) > self.blocks.num_free_blocks:
                break
            self.blocks.allocate(req.id, n)
            self.running.append(self.waiting.pop(0))
            batch.append((req, n))
            left -= n
        return batch

    def finish(self, req):
        self.running.remove(req)
        self.blocks.free(req.id)  # at once: the next waiting request may need them this step


# ---------------------------------------------------------------------------
# The model runner


def _prepare(blocks, batch, device):
    """The step's flat tensors: token ids, positions, slots, and L3's metadata, built on
    the host and moved to the model's device in one go."""
    ids, positions, slots, q_lens, seq_lens = [], [], [], [], []
    for req, n in batch:
        pos = range(req.computed, req.computed + n)
        ids += req.tokens[req.computed:req.computed + n]
        positions += pos
        slots.append(blocks.slot_mapping(req.id, list(pos)))
        q_lens.append(n)
        seq_lens.append(req.computed + n)  # the whole context, this step's tokens included
    starts = torch.tensor([0] + q_lens).cumsum(0)
    step = dict(ids=torch.tensor(ids), positions=torch.tensor(positions), slot_mapping=torch.cat(slots),
                query_start_loc=starts.to(torch.int32), seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                block_table=blocks.block_table([req.id for req, _ in batch]),
                last=starts[1:] - 1)  # each sequence's last row: the only one sampled from
    return _Namespace(**{name: t.to(device, non_blocking=True) for name, t in step.items()})


def _rotate(x, cos, sin):
    """transformers' RoPE (rotate_half form) on [T, H, D], cos/sin [T, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


@torch.no_grad()
def _forward(model, caches, step, kernels):
    """Logits at each sequence's last row: the model's own modules, applied to the flat
    [T, hidden] batch; attention through L1 (write K/V) and L3 (attend), one call each
    per layer for the whole batch."""
    inner = model.model
    h = inner.embed_tokens(step.ids)
    cos, sin = (t[0] for t in inner.rotary_emb(h, step.positions[None]))  # at each token's position
    for layer, (k_cache, v_cache) in zip(inner.layers, caches):
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        q = attn.q_proj(x).view(len(x), -1, attn.head_dim)
        k = attn.k_proj(x).view(len(x), -1, attn.head_dim)
        v = attn.v_proj(x).view(len(x), -1, attn.head_dim)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        kernels.reshape_and_cache(k, v, k_cache, v_cache, step.slot_mapping)
        o = kernels.paged_prefill_attention(q, k_cache, v_cache, step.block_table, step.query_start_loc,
                                            step.seq_lens, scale=attn.scaling)
        h = h + attn.o_proj(o.reshape(len(x), -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return model.lm_head(inner.norm(h[step.last]))


class DecodeGraphs:
    """Decode steps replayed as CUDA graphs, on a GPU (nano-vllm's `capture_cudagraph`,
    vLLM's CUDA-graph mode). A decode step launches a few hundred small kernels; sent one
    by one from Python they take longer than the GPU takes to run them. A graph records
    one step's launches once per batch size and replays them all with one call.

    A replay reads its inputs where the capture found them, so each step is copied into
    fixed buffers; the batch is padded up to the next captured size with rows that write
    nothing (slot -1) and attend to one cached token, and their logits are dropped."""

    def __init__(self, caches, kernels, max_seqs, max_blocks):
        self.caches, self.kernels = caches, kernels  # not the model: see _ENGINES
        self.sizes = [s for s in (1, 2, 4, 8, *range(16, max_seqs, 16)) if s < max_seqs] + [max_seqs]
        n, device = max_seqs, caches[0][0].device
        # Every input in one int64 buffer (L1 and L3 take int64 indices), so that a
        # step's inputs reach the GPU in one copy: ids, positions, slots, seq_lens and
        # the block table, n rows each. The host keeps a pinned twin, written in place.
        self.packed = torch.zeros(n * (4 + max_blocks), dtype=torch.int64, device=device)
        self.host = torch.zeros_like(self.packed, device="cpu").pin_memory()
        ids, positions, slots, seq_lens, table = self.packed.split([n, n, n, n, n * max_blocks])
        self.inputs = dict(ids=ids, positions=positions, slot_mapping=slots, seq_lens=seq_lens,
                           block_table=table.view(n, max_blocks), last=torch.arange(n, device=device),
                           query_start_loc=torch.arange(n + 1, device=device))  # one token a row
        self.rows = self.host.numpy()[:4 * n].reshape(4, n)          # ids, positions, slots, seq_lens
        self.table = self.host.numpy()[4 * n:].reshape(n, max_blocks)
        self.written = [[] for _ in range(n)]  # the blocks each table row holds now
        self.graphs, self.pool = {}, None

    def __call__(self, model, blocks, batch):
        """Logits of a step in which every request brings one token."""
        # Building every input from Python ints took longer than the replay. A row's
        # table is written only when its blocks changed (a block every block_size steps,
        # or another request in that row); rows past the batch are padding: token 0 at
        # position 0, slot -1, one cached token (in whatever valid block the row lists).
        n = len(batch)
        self.rows[:, n:] = [[0], [0], [-1], [1]]
        for i, (req, _) in enumerate(batch):
            p, owned = req.computed, blocks.owned(req.id)
            self.rows[:, i] = req.tokens[p], p, blocks.slot(req.id, p), p + 1
            if owned != self.written[i]:
                self.table[i, :len(owned)] = self.written[i] = owned
        # From pinned memory the copy is queued behind the last step's work; the host
        # writes the buffer again only after that step's logits were read (a sync).
        self.packed.copy_(self.host, non_blocking=True)
        size = next(s for s in self.sizes if s >= n)
        if size not in self.graphs:
            self.graphs[size] = self._capture(model, size)
        graph, logits = self.graphs[size]
        graph.replay()
        return logits[:n]

    def _step(self, size):
        """The first `size` rows of the input buffers: what a graph of that size reads."""
        return _Namespace(**{name: t[:size + 1 if name == "query_start_loc" else size]
                             for name, t in self.inputs.items()})

    def _capture(self, model, size):
        step = self._step(size)
        # Run it once first: Triton compiles a kernel at its first launch, which a
        # capture must not see. Both runs write the same K/V into the same slots.
        _forward(model, self.caches, step, self.kernels)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):  # one memory pool for every size
            logits = _forward(model, self.caches, step, self.kernels)
        self.pool = graph.pool()
        return graph, logits


# Where decode steps replay as CUDA graphs: a GPU (tests/test_meta.py checks this path on
# the CPU with a stand-in for the graph).
_GRAPH_DEVICES = ("cuda",)

# On a GPU a model's engine outlives one generate, as a server's does: the cache and the
# decode graphs its first generate made serve every later call that fits in them (vLLM and
# nano-vllm allocate the cache and capture their graphs once, at start-up). Capturing costs
# two forward passes per batch size, which would otherwise come back with every call. The
# graphs read the weights where they were captured: like a server's, they must stay there.
# Kept by a weak reference: the entry goes when the model does (nothing in it refers to it).
_ENGINES = weakref.WeakKeyDictionary()  # model -> (caches, DecodeGraphs)


def _caches(model, shape, like):
    """A zeroed (K cache, V cache) pair per layer."""
    return [(torch.zeros(shape, **like), torch.zeros(shape, **like)) for _ in model.model.layers]


def _engine(model, shape, like, kernels, max_seqs, max_blocks):
    """The model's kept caches and graphs if this call fits in them, else new ones, kept."""
    caches, graphs = _ENGINES.get(model, (None, None))
    if caches is None or caches[0][0].dtype != like["dtype"] or caches[0][0].device != like["device"] or \
            caches[0][0].shape[1:] != shape[1:] or len(caches[0][0]) < shape[0] or \
            graphs.table.shape[0] < max_seqs or graphs.table.shape[1] < max_blocks:
        _ENGINES.pop(model, None)  # its graphs' memory goes before the new cache is made
        caches = _caches(model, shape, like)
        graphs = DecodeGraphs(caches, kernels, max_seqs, max_blocks)
        _ENGINES[model] = caches, graphs
    return caches, graphs


def _eos_ids(model):
    eos = getattr(model.generation_config, "eos_token_id", None)
    eos = model.config.eos_token_id if eos is None else eos
    return set() if eos is None else set(eos if isinstance(eos, (list, tuple)) else [eos])


def generate(model, prompts, max_new_tokens, *, block_size=16, num_blocks=None, max_num_batched_tokens=256,
             kernels=None):
    """Greedy decoding of every prompt through the paged engine; per prompt, the new
    tokens only (what model.generate(..., do_sample=False) gives, EOS included)."""
    own_kernels, kernels = kernels is None, kernels or _tree_kernels()
    counts = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    if len(counts) != len(prompts) or any(n < 1 for n in counts) or any(len(p) < 1 for p in prompts):
        raise ValueError("prompts must be non-empty lists of token ids and max_new_tokens an int >= 1 or one "
                         "per prompt")
    if not prompts:
        return []
    if max_num_batched_tokens < 1:
        raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
    # The most tokens a request ever holds in the cache: its last new token is never fed back.
    need = [-(-(len(p) + n - 1) // block_size) for p, n in zip(prompts, counts)]
    num_blocks = sum(need) if num_blocks is None else num_blocks
    for i, blocks in enumerate(need):
        if blocks > num_blocks:
            raise ValueError(f"request {i} needs {blocks} blocks of {block_size} tokens ({len(prompts[i])} of prompt "
                             f"+ {counts[i]} new), but the cache has num_blocks = {num_blocks}: it could never run")
    config = model.config
    head_dim = model.model.layers[0].self_attn.head_dim
    like = dict(dtype=model.lm_head.weight.dtype, device=model.lm_head.weight.device)
    shape = (num_blocks, block_size, config.num_key_value_heads, head_dim)
    # Graphs only on a GPU and with the tree's own kernels: kernels handed in may look at
    # their arguments on the host (a tracer, a checker), which a replay would skip.
    if own_kernels and like["device"].type in _GRAPH_DEVICES:
        caches, graphs = _engine(model, shape, like, kernels, len(prompts), max(need))
    else:
        caches, graphs = _caches(model, shape, like), None
    blocks, eos = BlockManager(num_blocks, block_size), _eos_ids(model)
    requests = [Request(i, p, n) for i, (p, n) in enumerate(zip(prompts, counts))]
    sched = Scheduler(blocks, max_num_batched_tokens, requests)
    while sched.waiting or sched.running:
        batch = sched.schedule()
        if not batch:
            raise RuntimeError(f"the scheduler made no progress: {blocks.num_free_blocks} of {num_blocks} blocks "
                               f"free, {len(sched.waiting)} waiting, {len(sched.running)} running")
        if graphs and all(n == 1 for _, n in batch):  # a decode step (or prompts' 1-token chunks)
            logits = graphs(model, blocks, batch)
        else:
            logits = _forward(model, caches, _prepare(blocks, batch, like["device"]), kernels)
        next_ids = logits.argmax(dim=-1).tolist()
        for (req, n), token in zip(batch, next_ids):
            req.computed += n
            if req.computed < len(req.tokens):
                continue  # a prompt chunk that is not its last: nothing to sample yet
            req.tokens.append(token)
            if token in eos or len(req.new) == req.max_new:
                sched.finish(req)
    return [req.new for req in requests]


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
