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
    """key and value [T, H, D] in one of three layouts, as views of one noise buffer."""
    hd = num_heads * head_size
    if layout == "contiguous":  # key and value are separate tensors
        buf = noise((2, num_tokens, num_heads, head_size), dtype, device, gen)
        return buf, buf[0], buf[1]
    if layout == "fused_qkv":  # key = qkv[:, 1], value = qkv[:, 2]: row stride 3*H*D
        buf = noise((num_tokens, 3, num_heads, head_size), dtype, device, gen)
        return buf, buf[:, 1], buf[:, 2]
    if layout == "padded_rows":  # rows padded to an odd stride: no alignment to lean on
        stride = 2 * hd + 5
        buf = noise((max(num_tokens, 1) * stride,), dtype, device, gen)
        key = buf.as_strided((num_tokens, num_heads, head_size), (stride, head_size, 1))
        value = buf.as_strided((num_tokens, num_heads, head_size), (stride, head_size, 1), hd + 3)
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
