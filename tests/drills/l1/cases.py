"""L1's cases: the test shapes, the page's worked example, the case a call of
reshape_and_cache is checked on and its builders, the hypothesis strategy, and at the
bottom the fixture checks of those builders (tests/test_fixtures.py)."""
from dataclasses import dataclass

import torch
from hypothesis import strategies as st

from _paged import DTYPES, Guarded, allocate_blocks, guarded, noise

from .reference import ref_cache_write, ref_slot_mapping

TEST_SHAPES = dict(max_seqs=4, max_new_tokens=6, max_context=40, max_heads=4, head_sizes=(1, 3, 8, 16, 24, 40),
                   block_sizes=(1, 2, 3, 4, 8, 16, 32), max_padding=3)

# The example content/l1.md §4 works by hand (tests/test_content.py checks the page against it).
WORKED_EXAMPLE = dict(block_size=4, block_table=[[9, 3, 7], [2, 5, 0]], num_blocks=10,
                      seq_idx=[0, 0, 1], positions=[5, 9, 2], slots=[13, 29, 10])


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
    if layout in ("key_in_qkv", "value_in_qkv", "unequal_strides"):
        # key and value with different row strides, so reading one with the other's
        # stride goes wrong: one of them is a fused-QKV view, the other is not
        # ("unequal_strides": both are views, 3*H*D and 2*H*D + 5 apart).
        stride = 2 * hd + 5
        buf = noise((num_tokens * 3 * hd + num_tokens * stride + hd,), dtype, device, gen)
        qkv = buf[:num_tokens * 3 * hd].view(num_tokens, 3, num_heads, head_size)
        rest = buf[num_tokens * 3 * hd:]
        other = (rest[:num_tokens * hd].view(shape) if layout != "unequal_strides"
                 else rest.as_strided(shape, (stride, head_size, 1), 3))
        return (buf, qkv[:, 1], other) if layout != "value_in_qkv" else (buf, other, qkv[:, 2])
    if layout == "padded_rows":  # rows padded to an odd stride: no alignment to lean on
        stride = 2 * hd + 5
        buf = noise((num_tokens * stride + hd,), dtype, device, gen)
        key = buf.as_strided(shape, (stride, head_size, 1))
        value = buf.as_strided(shape, (stride, head_size, 1), hd + 3)
        return buf, key, value
    raise ValueError(f"unknown layout {layout!r}")


LAYOUTS = ("contiguous", "fused_qkv", "padded_rows", "key_in_qkv", "value_in_qkv", "unequal_strides")


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
    shapes = TEST_SHAPES
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
        layout=draw(st.sampled_from(LAYOUTS)),
        slot_dtype=draw(st.sampled_from([torch.int64, torch.int32])),
        spare_blocks=draw(st.integers(0, 3)),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


# ---------------------------------------------------------------------------
# Fixture checks: the builders make the cases the tests say they make (tests/test_fixtures.py)


def check_worked_example_gets_the_pages_slots(device):
    ex = WORKED_EXAMPLE
    case = kv_write_case(ex["block_table"], ex["num_blocks"], ex["seq_idx"], ex["positions"], ex["block_size"],
                            num_heads=2, head_size=4, device=device)
    assert case.slot_mapping.tolist() == ex["slots"]


def check_layouts_give_key_and_value_their_own_row_strides(device):
    for layout in ("fused_qkv", "key_in_qkv", "value_in_qkv", "unequal_strides"):
        case = random_kv_write_case(context_lens=[1, 6], new_lens=[3, 2], block_size=4, num_heads=2, head_size=8,
                                       layout=layout, device=device)
        strides = case.key.stride(0), case.value.stride(0)
        assert strides != (16, 16), layout
        assert (strides[0] != strides[1]) == (layout != "fused_qkv"), layout


FIXTURE_CHECKS = (check_worked_example_gets_the_pages_slots,
                  check_layouts_give_key_and_value_their_own_row_strides)
