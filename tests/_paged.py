"""Every paged input the tests, the grader and the bench use, and the plain-PyTorch
reference of each drill.

Layout of this file: shared pieces first (noise, guarded buffers, the block pool),
then one section per drill (its case builder, its reference, its hypothesis
strategy and its bench work). A new drill adds a section; it should not need a
new mechanism.

House rules every builder follows:
- Outputs and caches start as random noise, never zeros, so an element nobody
  wrote is visible.
- Caches live inside a guarded allocation: a larger buffer whose margins are
  noise too and are compared after the call, so a write to slot -1 or past the
  end of the cache is caught.
- Physical blocks come from a shuffled pool, so a kernel that mixes up logical
  and physical block numbers writes to the wrong place.
"""
import math
from dataclasses import dataclass

import torch
from hypothesis import strategies as st

from _manifest import ELEMENT_SIZE, BY_ID

DTYPES = {name: getattr(torch, name) for name in ELEMENT_SIZE}
_SAME_WIDTH_INT = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t):
    """The raw bits of a float tensor, for bit-exact comparisons (NaN == NaN, -0 != +0)."""
    return t.view(_SAME_WIDTH_INT[t.element_size()])


def noise(shape, dtype, device, gen):
    """Standard normal values: never zero, never the same twice."""
    return torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype=dtype, device=device)


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


def guarded(shape, dtype, device, gen, margin):
    numel = math.prod(shape)
    storage = noise(margin + numel + margin, dtype, device, gen)
    view = storage[margin:margin + numel].view(shape)
    return Guarded(storage, view, margin, storage.clone())


def caches_past_int32(block_size, num_kv_heads, head_size, device, dtype=torch.float16):
    """k/v caches [num_blocks, block_size, H_kv, D] of just over 2**31 elements each
    (4 GiB in fp16), for the int64-offset tests. Allocated, never filled: on the CPU
    the pages nobody touches cost no memory. Skips the test where they do not fit."""
    import pytest

    num_blocks = 2**31 // (block_size * num_kv_heads * head_size) + 4
    try:
        k_cache = torch.empty(num_blocks, block_size, num_kv_heads, head_size, dtype=dtype, device=device)
        return k_cache, torch.empty_like(k_cache)
    except RuntimeError as error:
        pytest.skip(f"cannot reserve the 8 GiB this test maps: {error}")


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


# ---------------------------------------------------------------------------
# L1: paged KV-cache write

# The example content/l1.md §4 works by hand (tests/test_content.py checks the page against it).
WORKED_EXAMPLE = dict(block_size=4, block_table=[[9, 3, 7], [2, 5, 0]], num_blocks=10,
                      seq_idx=[0, 0, 1], positions=[5, 9, 2], slots=[13, 29, 10])


def ref_slot_mapping(block_table, seq_idx, positions, block_size):
    """Slot of each token: block_table[seq, pos // block_size] * block_size + pos % block_size."""
    positions = positions.long()
    physical = block_table[seq_idx.long(), positions // block_size].long()
    return physical * block_size + positions % block_size


def ref_cache_write(rows, cache, slot_mapping):
    """Plain PyTorch: copy each real token's [H, D] row into its slot; skip slot -1."""
    real = slot_mapping >= 0
    hd = rows.shape[1] * rows.shape[2]
    cache.view(-1, hd)[slot_mapping[real].long()] = rows[real].reshape(-1, hd)


def ref_reshape_and_cache(key, value, k_cache, v_cache, slot_mapping):
    """The reference of L1's reshape_and_cache (caches must be contiguous)."""
    ref_cache_write(key, k_cache, slot_mapping)
    ref_cache_write(value, v_cache, slot_mapping)


@dataclass
class KVWriteCase:
    """One call of reshape_and_cache, with everything needed to check and explain it."""

    key: torch.Tensor          # [T, H, D], possibly a row-strided view
    value: torch.Tensor
    k_cache: Guarded           # view: [num_blocks, block_size, H, D]
    v_cache: Guarded
    slot_mapping: torch.Tensor  # [T], -1 for padding tokens
    block_table: torch.Tensor
    seq_idx: torch.Tensor      # [T] sequence of each token (0 for padding)
    positions: torch.Tensor    # [T] position inside its sequence (0 for padding)
    block_size: int
    inputs: torch.Tensor       # the storage key/value are views of ...
    inputs_initial: torch.Tensor  # ... and its contents before the call: it must not change

    def args(self):
        return self.key, self.value, self.k_cache.view, self.v_cache.view, self.slot_mapping

    def expected(self):
        """(expected k storage, expected v storage), guards included."""
        return (self.k_cache.expected(lambda cache: ref_cache_write(self.key, cache, self.slot_mapping)),
                self.v_cache.expected(lambda cache: ref_cache_write(self.value, cache, self.slot_mapping)))


def _token_rows(num_tokens, num_heads, head_size, layout, dtype, device, gen):
    """key and value [T, H, D] in one of three layouts, as views of one noise buffer.

    The buffer runs one row (H*D values) past the last token, so a kernel whose
    tile reads past a row's end reads known noise, not whatever memory follows:
    its wrong answer is then the same every time, and can be diagnosed.
    """
    hd = num_heads * head_size
    shape = (num_tokens, num_heads, head_size)
    if layout == "contiguous":  # key and value are separate [T, H, D] tensors
        buf = noise((2 * num_tokens * hd + hd,), dtype, device, gen)
        return buf, buf[:num_tokens * hd].view(shape), buf[num_tokens * hd:2 * num_tokens * hd].view(shape)
    if layout == "fused_qkv":  # key = qkv[:, 1], value = qkv[:, 2]: row stride 3*H*D
        buf = noise((num_tokens * 3 * hd + hd,), dtype, device, gen)
        qkv = buf[:num_tokens * 3 * hd].view(num_tokens, 3, num_heads, head_size)
        return buf, qkv[:, 1], qkv[:, 2]
    if layout == "padded_rows":  # rows padded to an odd stride: no alignment to lean on
        stride = 2 * hd + 5
        buf = noise((num_tokens * stride + hd,), dtype, device, gen)
        key = buf.as_strided(shape, (stride, head_size, 1))
        value = buf.as_strided(shape, (stride, head_size, 1), hd + 3)
        return buf, key, value
    raise ValueError(f"unknown layout {layout!r}")


def kv_write_case(block_table, num_blocks, seq_idx, positions, block_size, *, num_heads, head_size,
                  dtype=torch.float16, padding=(), layout="contiguous", slot_dtype=torch.int64,
                  device="cpu", seed=0):
    """A write of len(seq_idx) real tokens, with padding tokens inserted at the
    indices `padding` of the final token list (so T = real + len(padding)).

    Slots come from `ref_slot_mapping`; padding tokens get slot -1.
    """
    gen = torch.Generator().manual_seed(seed)
    num_tokens = len(seq_idx) + len(padding)
    is_pad = torch.zeros(num_tokens, dtype=torch.bool)
    is_pad[list(padding)] = True
    full_seq = torch.zeros(num_tokens, dtype=torch.int32)
    full_pos = torch.zeros(num_tokens, dtype=torch.int32)
    full_seq[~is_pad] = torch.as_tensor(seq_idx, dtype=torch.int32)
    full_pos[~is_pad] = torch.as_tensor(positions, dtype=torch.int32)
    block_table = torch.as_tensor(block_table, dtype=torch.int32)
    slots = ref_slot_mapping(block_table, full_seq, full_pos, block_size)
    slots[is_pad] = -1

    inputs, key, value = _token_rows(num_tokens, num_heads, head_size, layout, dtype, device, gen)
    shape = (num_blocks, block_size, num_heads, head_size)
    margin = block_size * num_heads * head_size  # one whole block each side
    return KVWriteCase(
        key=key, value=value,
        k_cache=guarded(shape, dtype, device, gen, margin),
        v_cache=guarded(shape, dtype, device, gen, margin),
        slot_mapping=slots.to(device=device, dtype=slot_dtype),
        block_table=block_table.to(device), seq_idx=full_seq.to(device), positions=full_pos.to(device),
        block_size=block_size, inputs=inputs, inputs_initial=inputs.clone(),
    )


def random_kv_write_case(*, context_lens, new_lens, block_size, spare_blocks=2, seed=0, **kwargs):
    """Sequences that already hold `context_lens` tokens each append `new_lens` more.

    The tokens of sequence 0 come first, then those of sequence 1, and so on;
    a token's position is its index in its own sequence, not in the batch.
    """
    gen = torch.Generator().manual_seed(seed + 1)
    total = [c + n for c, n in zip(context_lens, new_lens)]
    table, num_blocks = allocate_blocks(total, block_size, gen, spare_blocks)
    seq_idx = [b for b, n in enumerate(new_lens) for _ in range(n)]
    positions = [c + i for c, n in zip(context_lens, new_lens) for i in range(n)]
    return kv_write_case(table, num_blocks, seq_idx, positions, block_size, seed=seed, **kwargs)


@st.composite
def kv_write_params(draw, dtypes=tuple(DTYPES)):
    """Keyword arguments for random_kv_write_case, within L1's test shapes."""
    shapes = BY_ID["l1"].test_shapes
    num_seqs = draw(st.integers(1, shapes["max_seqs"]))
    new_lens = draw(st.lists(st.integers(0, shapes["max_new_tokens"]), min_size=num_seqs, max_size=num_seqs))
    context_lens = draw(st.lists(st.integers(0, shapes["max_context"]), min_size=num_seqs, max_size=num_seqs))
    num_padding = draw(st.integers(0, shapes["max_padding"]))
    order = draw(st.permutations(range(sum(new_lens) + num_padding)))
    padding = sorted(order[:num_padding])  # padding may sit anywhere in the batch
    return dict(
        context_lens=context_lens, new_lens=new_lens, padding=padding,
        block_size=draw(st.sampled_from(shapes["block_sizes"])),
        num_heads=draw(st.integers(1, shapes["max_heads"])),
        head_size=draw(st.sampled_from(shapes["head_sizes"])),
        dtype=DTYPES[draw(st.sampled_from(dtypes))],
        layout=draw(st.sampled_from(["contiguous", "fused_qkv", "padded_rows"])),
        slot_dtype=draw(st.sampled_from([torch.int64, torch.int32])),
        spare_blocks=draw(st.integers(0, 3)),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def l1_bench(module, params, device, n_sets):
    """`n_sets` independent writes into one pair of caches, for the bandwidth report.

    Each set scatters its tokens over different random slots of a multi-GB cache,
    so the L2 cache holds neither the inputs nor the lines being written.
    Returns (ours, {name: (baseline, graph_safe)}): callables that each run all sets once.
    """
    num_tokens, block_size, num_blocks = params["num_tokens"], params["block_size"], params["num_blocks"]
    num_heads, head_size, dtype = params["num_heads"], params["head_size"], DTYPES[params["dtype"]]
    k_cache = torch.empty((num_blocks, block_size, num_heads, head_size), dtype=dtype, device=device)
    v_cache = torch.empty_like(k_cache)
    slots = torch.randperm(num_blocks * block_size, device=device)[:n_sets * num_tokens].view(n_sets, num_tokens)
    sets = [(torch.randn(num_tokens, num_heads, head_size, dtype=dtype, device=device),
             torch.randn(num_tokens, num_heads, head_size, dtype=dtype, device=device),
             slots[i].contiguous()) for i in range(n_sets)]

    def ours():
        for key, value, slot in sets:
            module.reshape_and_cache(key, value, k_cache, v_cache, slot)

    def index_copy():
        # What you would write without a kernel: mask out padding, then one
        # index_copy_ per cache into the flattened [slots, H*D] view.
        hd = num_heads * head_size
        for key, value, slot in sets:
            real = slot >= 0
            slot = slot[real]
            k_cache.view(-1, hd).index_copy_(0, slot, key[real].view(-1, hd))
            v_cache.view(-1, hd).index_copy_(0, slot, value[real].view(-1, hd))

    # Boolean-mask indexing syncs with the host, so this baseline cannot be captured in a CUDA graph.
    return ours, {"torch index_copy_": (index_copy, False)}


# ---------------------------------------------------------------------------
# L2: paged decode attention

# The example content/l2.md §3 works by hand (tests/test_content.py checks the page
# against it): one sequence, one head, D = 1, scale = 1, so each token's key *is*
# its score. Block size 2: two blocks of two tokens, in physical blocks 3 and 1.
DECODE_EXAMPLE = dict(block_size=2, block_table=[[3, 1]], num_blocks=4,
                      scores=[1.0, 3.0, 4.0, 2.0], values=[1.0, 2.0, 3.0, 4.0])
GUARD = 256  # elements after the block table and the query, for kernels that read past their end


def _owned_columns(seq_lens, block_size, width):
    """[B, width] bool: which block-table columns each sequence's tokens use."""
    need = (seq_lens.long().cpu() + block_size - 1) // block_size
    return torch.arange(width) < need[:, None]


def decode_scores_values(query, k_cache, v_cache, block_table, seq_lens, scale=None, kv_head=None):
    """Per sequence, (scores [H_q, n] · scale, values [H_q, n, D]) in fp32 on the CPU:
    gather the sequence's blocks through the block table, keep its first n = seq_len
    tokens, give query head h the KV head kv_head[h] (default h // (H_q / H_kv)).
    """
    num_seqs, num_heads, head_size = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    scale = 1.0 / math.sqrt(head_size) if scale is None else scale
    kv_head = (torch.arange(num_heads) // (num_heads // num_kv_heads) if kv_head is None else kv_head).cpu()
    owned = _owned_columns(seq_lens, block_size, block_table.shape[1])
    result = []
    for b in range(num_seqs):
        n = int(seq_lens[b])
        blocks = block_table[b].cpu()[owned[b]].long().to(k_cache.device)
        k, v = (cache[blocks].flatten(0, 1)[:n].float().cpu()[:, kv_head] for cache in (k_cache, v_cache))
        scores = torch.einsum("hd,nhd->hn", query[b].float().cpu(), k) * scale
        result.append((scores, v.transpose(0, 1)))
    return result


def ref_paged_decode(query, k_cache, v_cache, block_table, seq_lens, scale=None, kv_head=None):
    """The reference of L2: softmax(q·K^T · scale) · V for each sequence and query head,
    in fp32, from the K/V gathered through the block table. Returns [B, H_q, D] fp32 (CPU).

    `kv_head` replaces the GQA mapping and other `seq_lens` than the true ones
    attend over more or fewer tokens: the diagnosis tries such mistakes.
    """
    out = torch.empty(query.shape)
    for b, (scores, values) in enumerate(decode_scores_values(query, k_cache, v_cache, block_table, seq_lens,
                                                             scale, kv_head)):
        out[b] = torch.einsum("hn,hnd->hd", scores.softmax(dim=-1), values)
    return out


def online_softmax(scores, values, tile, rescale_sum=True, rescale_acc=True, zero_scores=False):
    """content/l2.md §3's online softmax over tiles of `tile` tokens: scores [H, n], values
    [H, n, D] in fp32. Returns the state after each tile, [(m, alpha, p, l, acc)], so the
    page's worked example can be checked step by step; the output is acc / l of the last.

    The flags replay a kernel's mistakes for the diagnosis: no rescaling of the running
    sum and/or accumulator when the max grows, or the positions past n in the last tile
    left at score 0 (value 0) instead of -inf.
    """
    heads, n = scores.shape
    if zero_scores:
        pad = -n % tile
        scores = torch.cat([scores, scores.new_zeros(heads, pad)], dim=1)
        values = torch.cat([values, values.new_zeros(heads, pad, values.shape[2])], dim=1)
    m = torch.full((heads,), float("-inf"))
    l, acc, steps = torch.zeros(heads), torch.zeros(heads, values.shape[2]), []
    for start in range(0, scores.shape[1], tile):
        s, v = scores[:, start:start + tile], values[:, start:start + tile]
        m_new = torch.maximum(m, s.max(dim=1).values)
        alpha = torch.exp(m - m_new)
        p = torch.exp(s - m_new[:, None])
        l = (l * alpha if rescale_sum else l) + p.sum(dim=1)
        acc = (acc * alpha[:, None] if rescale_acc else acc) + torch.einsum("hn,hnd->hd", p, v)
        m = m_new
        steps.append((m, alpha, p, l, acc))
    return steps


@dataclass
class DecodeCase:
    """One call of paged_decode_attention, with what is needed to check and explain it."""

    query: torch.Tensor        # [B, H_q, D], possibly a row-strided view
    k_cache: torch.Tensor      # [num_blocks, block_size, H_kv, D]; unowned blocks hold NaN
    v_cache: torch.Tensor
    block_table: torch.Tensor  # [B, max_blocks] int32; garbage columns and the guard after it point at NaN blocks
    seq_lens: torch.Tensor     # [B] int32
    scale: float = None        # None: the function's default 1/sqrt(D)
    tail: str = "noise"        # what the unused end of each last block holds: "noise" or "nan"
    guarded: bool = False      # the query and the block table are followed in memory by NaN / NaN blocks

    @property
    def block_size(self):
        return self.k_cache.shape[1]

    def args(self):
        return self.query, self.k_cache, self.v_cache, self.block_table, self.seq_lens

    def kwargs(self):
        return {} if self.scale is None else {"scale": self.scale}

    def scores_values(self, seq_lens=None, scale=None, kv_head=None):
        return decode_scores_values(self.query, self.k_cache, self.v_cache, self.block_table,
                                    self.seq_lens if seq_lens is None else seq_lens,
                                    self.scale if scale is None else scale, kv_head)

    def reference(self, seq_lens=None, scale=None, kv_head=None):
        """ref_paged_decode on this case; the arguments replace the case's own."""
        return ref_paged_decode(self.query, self.k_cache, self.v_cache, self.block_table,
                                self.seq_lens if seq_lens is None else seq_lens,
                                self.scale if scale is None else scale, kv_head)


def _followed_by(t, guard, device):
    """t on `device` as the front of a longer buffer that continues with `guard`, so a
    kernel that reads past t's end reads the guard rather than memory outside any tensor."""
    return torch.cat([t.flatten().cpu(), guard.to(t.dtype)]).to(device)[:t.numel()].view(t.shape)


def _guarded_table(table, spare, gen, device):
    """The block table followed by GUARD numbers of spare (NaN) blocks."""
    return _followed_by(table, spare[torch.randint(len(spare), (GUARD,), generator=gen)], device)


def _guarded_query(query, device):
    """The query followed by GUARD NaN."""
    return _followed_by(query, torch.full((GUARD,), float("nan")), device)


def _nan_outside(cache, table, seq_lens, block_size, tail):
    """NaN in every block no sequence owns and, if tail == "nan", in each last block's unused slots."""
    owned = _owned_columns(torch.as_tensor(seq_lens), block_size, table.shape[1])
    unowned = torch.ones(cache.shape[0], dtype=torch.bool)
    unowned[table[owned].long()] = False
    cache[unowned] = float("nan")
    if tail == "nan":
        for b, n in enumerate(seq_lens):
            if n % block_size:
                cache[table[b, n // block_size].long(), n % block_size:] = float("nan")
    return unowned.nonzero().flatten()


def paged_decode_case(seq_lens, *, num_heads, num_kv_heads, head_size, block_size, dtype=torch.float16,
                      scale=None, spare_blocks=2, extra_columns=2, tail="noise", layout="contiguous",
                      device="cpu", seed=0):
    """A decode step of len(seq_lens) sequences over caches built by `allocate_blocks`.

    Owned blocks hold noise. Blocks no sequence owns hold NaN, and every garbage
    block-table column (and the guard after the table) points at one of them, so
    a kernel that reads past a sequence's last block returns NaN. A contiguous
    query is followed in memory by NaN too (`guarded`). The unused end
    of each last block holds `tail`: "noise" (stale tokens: reading them gives a
    finite, wrong answer) or "nan". `layout="fused_qkv"` makes the query a
    row-strided view of [B, (H_q + 2 H_kv) D], as vLLM's q split from qkv.
    """
    gen = torch.Generator().manual_seed(seed)
    table, num_blocks = allocate_blocks(seq_lens, block_size, gen, max(spare_blocks, 1), extra_columns)
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    k_cache, v_cache = noise(shape, torch.float32, "cpu", gen), noise(shape, torch.float32, "cpu", gen)
    spare = _nan_outside(k_cache, table, seq_lens, block_size, tail)
    _nan_outside(v_cache, table, seq_lens, block_size, tail)

    num_seqs, hd = len(seq_lens), num_heads * head_size
    if layout == "fused_qkv":  # query = qkv[:, :H_q*D]: row stride (H_q + 2 H_kv) * D
        qkv = noise((num_seqs, hd + 2 * num_kv_heads * head_size), dtype, device, gen)
        query = qkv[:, :hd].view(num_seqs, num_heads, head_size)
    elif layout == "contiguous":
        query = _guarded_query(noise((num_seqs, num_heads, head_size), dtype, "cpu", gen), device)
    else:
        raise ValueError(f"unknown layout {layout!r}")
    return DecodeCase(query=query, k_cache=k_cache.to(dtype=dtype, device=device),
                      v_cache=v_cache.to(dtype=dtype, device=device), block_table=_guarded_table(table, spare, gen, device),
                      seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device), scale=scale, tail=tail,
                      guarded=layout == "contiguous")


def decode_example_case(device="cpu"):
    """content/l2.md §3's example as a DecodeCase: keys are the scores (q = 1, D = 1, scale = 1)."""
    ex = DECODE_EXAMPLE
    table, block_size, n = torch.tensor(ex["block_table"], dtype=torch.int32), ex["block_size"], len(ex["scores"])
    k_cache, v_cache = torch.zeros(ex["num_blocks"], block_size, 1, 1), torch.zeros(ex["num_blocks"], block_size, 1, 1)
    for pos in range(n):
        k_cache[table[0, pos // block_size], pos % block_size] = ex["scores"][pos]
        v_cache[table[0, pos // block_size], pos % block_size] = ex["values"][pos]
    spare = _nan_outside(k_cache, table, [n], block_size, "noise")
    _nan_outside(v_cache, table, [n], block_size, "noise")
    return DecodeCase(query=_guarded_query(torch.ones(1, 1, 1), device), k_cache=k_cache.to(device),
                      v_cache=v_cache.to(device),
                      block_table=_guarded_table(table, spare, torch.Generator().manual_seed(0), device),
                      seq_lens=torch.tensor([n], dtype=torch.int32, device=device), scale=1.0, guarded=True)


@st.composite
def paged_decode_params(draw, dtypes=tuple(DTYPES)):
    """Keyword arguments for paged_decode_case, within L2's test shapes."""
    shapes = BY_ID["l2"].test_shapes
    block_size = draw(st.sampled_from(shapes["block_sizes"]))
    num_seqs = draw(st.integers(1, shapes["max_seqs"]))
    # The lengths where kernels go wrong: one token, exactly full blocks, one token
    # into a new block, and long enough for several iterations of any tile size.
    special = st.sampled_from([1, block_size, 2 * block_size, block_size + 1, shapes["max_context"]])
    seq_lens = draw(st.lists(special | st.integers(1, shapes["max_context"]), min_size=num_seqs, max_size=num_seqs))
    num_kv_heads = draw(st.integers(1, shapes["max_kv_heads"]))
    return dict(
        seq_lens=seq_lens, block_size=block_size, num_kv_heads=num_kv_heads,
        num_heads=num_kv_heads * draw(st.sampled_from(shapes["gqa_ratios"])),
        head_size=draw(st.sampled_from(shapes["head_sizes"])),
        dtype=DTYPES[draw(st.sampled_from(dtypes))],
        scale=draw(st.none() | st.floats(0.01, 1.0)),
        tail=draw(st.sampled_from(["noise", "nan"])),
        layout=draw(st.sampled_from(["contiguous", "fused_qkv"])),
        spare_blocks=draw(st.integers(1, 3)),
        extra_columns=draw(st.integers(0, 3)),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def l2_bench(module, params, device, n_sets):
    """`n_sets` independent decode steps over one block pool, for the bandwidth report.

    Every sequence holds `context` tokens in blocks scattered at random over a
    pool no smaller than n_sets * B * context tokens, so no two sets share a block
    and the L2 cache holds none of them. Returns (ours, {name: (baseline, graph_safe)}).
    """
    num_seqs, context, block_size = params["num_seqs"], params["context"], params["block_size"]
    num_heads, num_kv_heads, head_size = params["num_heads"], params["num_kv_heads"], params["head_size"]
    dtype = DTYPES[params["dtype"]]
    blocks_per_seq = math.ceil(context / block_size)
    num_blocks = n_sets * num_seqs * blocks_per_seq
    k_cache = torch.randn((num_blocks, block_size, num_kv_heads, head_size), dtype=dtype, device=device)
    v_cache = torch.randn_like(k_cache)
    pool = torch.randperm(num_blocks, device=device).to(torch.int32).view(n_sets, num_seqs, blocks_per_seq)
    seq_lens = torch.full((num_seqs,), context, dtype=torch.int32, device=device)
    sets = [(torch.randn(num_seqs, num_heads, head_size, dtype=dtype, device=device), pool[i].contiguous())
            for i in range(n_sets)]

    def gathered(cache, table):
        # [B, max_blocks, block_size, H_kv, D] -> [B, H_kv, context, D], as SDPA wants it
        return cache[table.long()].flatten(1, 2)[:, :context].transpose(1, 2)

    def sdpa(query, k, v):
        out = torch.nn.functional.scaled_dot_product_attention(query.unsqueeze(2), k, v, enable_gqa=True)
        return out.squeeze(2)

    # What paging should cost: nothing. The same K/V already contiguous per sequence.
    contiguous = [(q, gathered(k_cache, t).contiguous(), gathered(v_cache, t).contiguous()) for q, t in sets]

    def ours():
        for query, table in sets:
            module.paged_decode_attention(query, k_cache, v_cache, table, seq_lens)

    def gather_sdpa():
        # The naive paged baseline: copy each sequence's pages out, then attend.
        for query, table in sets:
            sdpa(query, gathered(k_cache, table), gathered(v_cache, table))

    def sdpa_contiguous():
        for query, k, v in contiguous:
            sdpa(query, k, v)

    return ours, {"gather + SDPA": (gather_sdpa, True), "SDPA, contiguous KV": (sdpa_contiguous, True)}
