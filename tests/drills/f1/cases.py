"""Drill F1's cases: TEST_SHAPES, the page's worked example, the AppendCase and its
builders, the hypothesis strategy, and (at the bottom) the fixture checks of the builders.

Caches are built the way L1 builds them: pages come from one shuffled pool
(`allocate_blocks`), so a logical page number is almost never the physical one;
the block table is then turned into CSR by the reference. Every cache sits in a
guarded allocation of noise and is compared bit for bit, guards included.
"""
from dataclasses import dataclass

import torch
from hypothesis import strategies as st

from _paged import DTYPES, allocate_blocks, followed_by, guarded, noise

from .reference import ref_batch_indices_positions, ref_block_table_to_csr, ref_page_entry, ref_write

TEST_SHAPES = dict(max_seqs=4, max_context=40, max_append=6, max_heads=4, head_sizes=(1, 3, 8, 16, 24, 40),
                   page_sizes=(1, 2, 3, 4, 8, 16), max_padding=2)


# ---------------------------------------------------------------------------
# The worked example of content/f1.md §2 and §5: L1's block table, three sequences
# (a partial last page, a full last page, an empty sequence), then one append.

WORKED_EXAMPLE = dict(
    page_size=4,
    block_table=[[9, 3, 7], [2, 5, 0], [6, 6, 6]],   # row 2's columns are garbage: it owns no page
    seq_lens=[9, 8, 0],                              # after the append
    kv_indptr=[0, 3, 5, 5],
    kv_indices=[9, 3, 7, 2, 5],
    kv_last_page_len=[1, 4, 0],
    append_indptr=[0, 3, 4, 4],                      # 3 new tokens for sequence 0, 1 for sequence 1
    batch_indices=[0, 0, 0, 1],
    positions=[6, 7, 8, 7],
    page_iter=[1, 1, 2, 4],                          # kv_indptr[b] + pos // page_size
    pages=[3, 3, 7, 5],                              # kv_indices[page_iter]
    entries=[2, 3, 0, 3],                            # pos % page_size
    num_pages=10,
)


# ---------------------------------------------------------------------------
# The case


GUARD = 64  # kv_indices is followed by this many ids of pages no sequence owns


@dataclass
class AppendCase:
    """One call of append_paged_kv_cache, with what is needed to check and explain it."""

    key: torch.Tensor            # [nnz, H, D], possibly a row-strided view
    value: torch.Tensor
    batch_indices: torch.Tensor  # [nnz] int32, -1 for padding
    positions: torch.Tensor
    storages: list               # Guarded: (k, v) for a tuple cache, one for a 5-D cache
    cache_form: str              # "tuple" or "5d"
    kv_layout: str
    kv_indices: torch.Tensor     # followed in memory by GUARD spare page ids
    kv_indptr: torch.Tensor
    kv_last_page_len: torch.Tensor
    page_size: int
    block_table: torch.Tensor
    seq_lens: torch.Tensor       # after the append
    append_indptr: torch.Tensor
    spare_pages: list            # pages no sequence owns
    inputs: torch.Tensor         # the storage key/value are views of ...
    inputs_initial: torch.Tensor  # ... and its contents before the call
    indices_initial: tuple = ()  # copies of the five index arrays (kv_indices with its guard)

    def __post_init__(self):
        self.indices_initial = tuple(t.clone() for t in self.index_arrays())

    def index_arrays(self):
        guarded_indices = self.kv_indices.new_empty(0).set_(self.kv_indices.untyped_storage())
        return (self.batch_indices, self.positions, guarded_indices, self.kv_indptr, self.kv_last_page_len)

    @staticmethod
    def _view(guard, storage):
        return storage[guard.margin:guard.margin + guard.view.numel()].view(guard.view.shape)

    def caches(self, which="view"):
        """(k, v) 4-D views of the current storages, or of `initial`/a list of storages."""
        if which == "view":
            storages = [g.storage for g in self.storages]
        elif which == "initial":
            storages = [g.initial for g in self.storages]
        else:
            storages = which
        views = [self._view(g, s) for g, s in zip(self.storages, storages)]
        return (views[0][:, 0], views[0][:, 1]) if self.cache_form == "5d" else tuple(views)

    def paged_kv_cache(self, storages=None):
        views = [self._view(g, s) for g, s in zip(self.storages, storages or [g.storage for g in self.storages])]
        return views[0] if self.cache_form == "5d" else tuple(views)

    def args(self, storages=None):
        return (self.key, self.value, self.batch_indices, self.positions, self.paged_kv_cache(storages),
                self.kv_indices, self.kv_indptr, self.kv_last_page_len, self.kv_layout)

    def places(self):
        return ref_page_entry(self.batch_indices, self.positions, self.kv_indices, self.kv_indptr, self.page_size)

    def expected(self):
        """Every storage as it should be after the call, guards included."""
        storages = [g.initial.cpu().clone() for g in self.storages]
        k, v = self.caches(storages)
        places = self.places()
        ref_write(self.key.cpu(), k, places, self.kv_layout)
        ref_write(self.value.cpu(), v, places, self.kv_layout)
        return storages

    def rerun(self, module):
        """module.append_paged_kv_cache on this case's inputs, into fresh copies of its storages."""
        storages = [g.initial.clone() for g in self.storages]
        module.append_paged_kv_cache(*self.args(storages))
        return storages

    def describe(self):
        nnz, h, d = self.key.shape
        return (f"case: nnz={nnz} appended tokens ({int((self.batch_indices < 0).sum())} padding), H={h}, D={d}, "
                f"page_size={self.page_size}, kv_layout={self.kv_layout}, cache={self.cache_form}, "
                f"dtype={str(self.key.dtype).replace('torch.', '')}, seq_lens={self.seq_lens.tolist()}, "
                f"kv_indptr={self.kv_indptr.tolist()}, kv_indices={self.kv_indices.tolist()}, "
                f"kv_last_page_len={self.kv_last_page_len.tolist()}")


def _rows(nnz, num_heads, head_size, rows, dtype, device, gen):
    """key and value [nnz, H, D] as views of one noise buffer that runs one token past the end."""
    hd = num_heads * head_size
    if rows == "contiguous":
        buf = noise((2 * nnz * hd + hd,), dtype, device, gen)
        return buf, buf[:nnz * hd].view(nnz, num_heads, head_size), buf[nnz * hd:2 * nnz * hd].view(nnz, num_heads,
                                                                                                     head_size)
    if rows == "fused_qkv":  # key = qkv[:, 1], value = qkv[:, 2]: row stride 3*H*D
        buf = noise((nnz * 3 * hd + hd,), dtype, device, gen)
        qkv = buf[:nnz * 3 * hd].view(nnz, 3, num_heads, head_size)
        return buf, qkv[:, 1], qkv[:, 2]
    if rows == "mixed":  # value: its own rows (stride H*D), then key = qkv[:, 1] (stride 3*H*D)
        buf = noise((nnz * 4 * hd + hd,), dtype, device, gen)
        qkv = buf[nnz * hd:nnz * 4 * hd].view(nnz, 3, num_heads, head_size)
        return buf, qkv[:, 1], buf[:nnz * hd].view(nnz, num_heads, head_size)
    raise ValueError(f"unknown rows {rows!r}")


def append_case(context_lens, append_lens, page_size, *, num_heads, head_size, dtype=torch.float16,
                kv_layout="NHD", cache_form="tuple", rows="contiguous", padding=0, spare_pages=2,
                extra_columns=1, block_table=None, num_pages=None, device="cpu", seed=0):
    """Sequence b holds context_lens[b] tokens and appends append_lens[b] more; `padding`
    padding tokens follow the real ones (batch index -1, as batch_indices_positions gives
    for nnz > append_indptr[-1]). Pages come from L1's shuffled pool unless `block_table`
    (with `num_pages`) is given; the CSR table is the reference's conversion of it."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = torch.tensor([c + a for c, a in zip(context_lens, append_lens)], dtype=torch.int32)
    if block_table is None:
        table, num_pages = allocate_blocks(seq_lens.tolist(), page_size, gen, max(spare_pages, 1), extra_columns)
    else:
        table = torch.tensor(block_table, dtype=torch.int32)
    kv_indptr, kv_indices, kv_last_page_len = ref_block_table_to_csr(table, seq_lens, page_size)
    spare = sorted(set(range(num_pages)) - set(kv_indices.tolist())) or list(range(num_pages))
    guard = torch.tensor(spare, dtype=torch.int32)[torch.randint(len(spare), (GUARD,), generator=gen)]

    append_indptr = torch.zeros(len(append_lens) + 1, dtype=torch.int32)
    append_indptr[1:] = torch.tensor(append_lens, dtype=torch.int64).cumsum(0)
    nnz = int(append_indptr[-1]) + padding
    batch_indices, positions = ref_batch_indices_positions(append_indptr, seq_lens, nnz)

    inputs, key, value = _rows(nnz, num_heads, head_size, rows, dtype, device, gen)
    per_page = (page_size, num_heads, head_size) if kv_layout == "NHD" else (num_heads, page_size, head_size)
    page_elems = page_size * num_heads * head_size
    # A page plus (H*H + S*S)*D each side: a kernel that swaps the entry and head strides
    # reaches up to that far past the last page, and must hit the guard, not other memory.
    margin = page_elems + (num_heads ** 2 + page_size ** 2) * head_size
    if cache_form == "5d":
        storages = [guarded((num_pages, 2, *per_page), dtype, device, gen, margin)]
    else:
        storages = [guarded((num_pages, *per_page), dtype, device, gen, margin) for _ in range(2)]
    to = lambda t: t.to(device)  # noqa: E731
    return AppendCase(
        key=key, value=value, batch_indices=to(batch_indices), positions=to(positions), storages=storages,
        cache_form=cache_form, kv_layout=kv_layout, kv_indices=followed_by(kv_indices, guard, device),
        kv_indptr=to(kv_indptr), kv_last_page_len=to(kv_last_page_len), page_size=page_size,
        block_table=to(table), seq_lens=to(seq_lens), append_indptr=to(append_indptr), spare_pages=spare,
        inputs=inputs, inputs_initial=inputs.clone(),
    )


def worked_example_case(device="cpu", kv_layout="NHD", cache_form="tuple", num_heads=2, head_size=4, **kwargs):
    """§5's append as an AppendCase: context 6 and 7, three and one new tokens, an empty sequence."""
    ex = WORKED_EXAMPLE
    append = [ex["append_indptr"][b + 1] - ex["append_indptr"][b] for b in range(3)]
    context = [n - a for n, a in zip(ex["seq_lens"], append)]
    return append_case(context, append, ex["page_size"], num_heads=num_heads, head_size=head_size,
                       kv_layout=kv_layout, cache_form=cache_form, block_table=ex["block_table"],
                       num_pages=ex["num_pages"], device=device, **kwargs)


@st.composite
def append_params(draw, dtypes=tuple(DTYPES)):
    """Keyword arguments for append_case, within TEST_SHAPES."""
    shapes = TEST_SHAPES
    page_size = draw(st.sampled_from(shapes["page_sizes"]))
    num_seqs = draw(st.integers(1, shapes["max_seqs"]))
    # Lengths where CSR goes wrong: empty, exactly full pages, one into a new page.
    special = st.sampled_from([0, 1, page_size, page_size + 1, 2 * page_size])
    context = draw(st.lists(special | st.integers(0, shapes["max_context"]), min_size=num_seqs, max_size=num_seqs))
    append = draw(st.lists(st.integers(0, shapes["max_append"]), min_size=num_seqs, max_size=num_seqs))
    return dict(
        context_lens=context, append_lens=append, page_size=page_size,
        num_heads=draw(st.integers(1, shapes["max_heads"])), head_size=draw(st.sampled_from(shapes["head_sizes"])),
        dtype=DTYPES[draw(st.sampled_from(dtypes))], kv_layout=draw(st.sampled_from(["NHD", "HND"])),
        cache_form=draw(st.sampled_from(["tuple", "5d"])),
        rows=draw(st.sampled_from(["contiguous", "fused_qkv", "mixed"])),
        padding=draw(st.integers(0, shapes["max_padding"])), spare_pages=draw(st.integers(1, 3)),
        extra_columns=draw(st.integers(0, 2)), seed=draw(st.integers(0, 2**31 - 1)),
    )


# ---------------------------------------------------------------------------
# Fixture checks: the builders make the cases the tests say they make (tests/test_fixtures.py)


def check_worked_example_puts_each_token_in_the_pages_place(device):
    ex = WORKED_EXAMPLE
    for layout in ("NHD", "HND"):
        case = worked_example_case(device, layout)
        assert case.places() == list(zip(ex["pages"], ex["entries"]))
        assert [case.kv_indptr.tolist(), case.kv_indices.tolist(), case.kv_last_page_len.tolist()] == [
            ex["kv_indptr"], ex["kv_indices"], ex["kv_last_page_len"]]


def check_padding_tokens_get_batch_index_minus_one(device):
    case = append_case([2, 5], [3, 1], 4, num_heads=2, head_size=8, padding=3, device=device)
    assert case.batch_indices.tolist()[-3:] == [-1, -1, -1] and int((case.batch_indices < 0).sum()) == 3


def check_fused_qkv_rows_are_strided_views(device):
    case = append_case([1, 6], [3, 2], 4, num_heads=2, head_size=8, rows="fused_qkv", device=device)
    assert case.key.stride(0) == case.value.stride(0) == 3 * 2 * 8


def check_mixed_rows_give_key_and_value_different_strides(device):
    case = append_case([1, 6], [3, 2], 4, num_heads=2, head_size=8, rows="mixed", device=device)
    assert (case.key.stride(0), case.value.stride(0)) == (3 * 2 * 8, 2 * 8)
    assert case.key.stride(1) == case.value.stride(1) == 8


def check_pages_come_from_a_shuffled_pool_and_kv_indices_is_guarded(device):
    case = append_case([9, 0, 13], [3, 2, 1], 4, num_heads=1, head_size=2, spare_pages=2, device=device)
    pages = case.kv_indices.tolist()
    assert pages != sorted(pages) or len(pages) < 3  # a logical page is not its physical page
    guard = case.kv_indices.new_empty(0).set_(case.kv_indices.untyped_storage()).tolist()[len(pages):]
    assert len(guard) == GUARD and set(guard) <= set(case.spare_pages)


FIXTURE_CHECKS = (check_worked_example_puts_each_token_in_the_pages_place,
                  check_padding_tokens_get_batch_index_minus_one, check_fused_qkv_rows_are_strided_views,
                  check_mixed_rows_give_key_and_value_different_strides,
                  check_pages_come_from_a_shuffled_pool_and_kv_indices_is_guarded)
