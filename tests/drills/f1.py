"""Drill F1: FlashInfer's CSR page table and its append kernel. Everything that
knows this drill: the page's worked example, the case builder, the plain-PyTorch
reference, the hypothesis strategy, the checks that explain a wrong answer, the
pitfalls, the bench workload and the page checks. DRILL is at the bottom.

Caches are built the way L1 builds them: pages come from one shuffled pool
(`allocate_blocks`), so a logical page number is almost never the physical one;
the block table is then turned into CSR by the reference. Every cache sits in a
guarded allocation of noise and is compared bit for bit, guards included.
"""
import re
from dataclasses import dataclass

import torch
from hypothesis import strategies as st

from _diagnose import Mismatch, describe_mistakes, known_mistakes
from _drill import ELEMENT_SIZE, BenchCase, Drill, Mistake, Pitfall
from _pages import section
from _paged import DTYPES, allocate_blocks, bits, followed_by, guarded, noise
from _traffic import Part, check_page_line, measure, report
from _tree import ROOT

STEM = "f1_csr_page_table"
SECTION = "content/f1.md §9"


# ---------------------------------------------------------------------------


def name_pitfalls(error, names, undecided=()):
    """The Mismatch with 'looks like' lines for the matched pitfalls, naming them; `undecided`:
    pitfalls whose planted variant races on this input (no evidence either way)."""
    return Mismatch(str(error) + describe_mistakes(DRILL, names), names, undecided)


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
# The plain-PyTorch reference: loops over sequences and tokens, written apart
# from the solution so the two can disagree.


def ref_block_table_to_csr(block_table, seq_lens, page_size):
    """(kv_indptr, kv_indices, kv_last_page_len), int32 on the CPU."""
    indptr, indices, last = [0], [], []
    for row, n in zip(block_table.tolist(), seq_lens.tolist()):
        pages = -(-n // page_size)
        indices += row[:pages]
        indptr.append(indptr[-1] + pages)
        last.append(n - (pages - 1) * page_size if pages else 0)
    return tuple(torch.tensor(x, dtype=torch.int32) for x in (indptr, indices, last))


def ref_batch_indices_positions(append_indptr, seq_lens, nnz):
    """(batch_indices, positions) int32 on the CPU; tokens past append_indptr[-1] are padding (-1, 0)."""
    batch, positions = [-1] * nnz, [0] * nnz
    indptr, lens = append_indptr.tolist(), seq_lens.tolist()
    for b, n in enumerate(lens):
        start, end = indptr[b], indptr[b + 1]
        for t in range(start, end):
            batch[t], positions[t] = b, n - (end - start) + (t - start)
    return torch.tensor(batch, dtype=torch.int32), torch.tensor(positions, dtype=torch.int32)


def ref_page_entry(batch_indices, positions, kv_indices, kv_indptr, page_size):
    """[(page, entry)] of each token: kv_indices[kv_indptr[b] + pos // page_size], pos % page_size; None for padding."""
    indices, indptr = kv_indices.tolist(), kv_indptr.tolist()
    return [None if b < 0 else (indices[indptr[b] + p // page_size], p % page_size)
            for b, p in zip(batch_indices.tolist(), positions.tolist())]


def as_nhd(cache, layout):
    """A 4-D cache seen as [num_pages, page_size, H, D] whatever its layout (a view)."""
    return cache if layout == "NHD" else cache.transpose(1, 2)


def ref_write(rows, cache, places, layout):
    """Copy rows[t] ([H, D]) to each token's (page, entry) of one 4-D cache."""
    cache = as_nhd(cache, layout)
    for t, place in enumerate(places):
        if place is not None:
            cache[place] = rows[t]


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
    """Keyword arguments for append_case, within DRILL.test_shapes."""
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
        cache_form=draw(st.sampled_from(["tuple", "5d"])), rows=draw(st.sampled_from(["contiguous", "fused_qkv"])),
        padding=draw(st.integers(0, shapes["max_padding"])), spare_pages=draw(st.integers(1, 3)),
        extra_columns=draw(st.integers(0, 2)), seed=draw(st.integers(0, 2**31 - 1)),
    )


# ---------------------------------------------------------------------------
# Checks: compare with the reference, explain the first difference.


def check_csr(block_table, seq_lens, page_size, got, module_call=None):
    """block_table_to_csr's answer against the reference, array by array."""
    want = ref_block_table_to_csr(block_table.cpu(), seq_lens.cpu(), page_size)
    names = ("kv_indptr", "kv_indices", "kv_last_page_len")
    if not isinstance(got, tuple) or len(got) != 3:
        raise Mismatch(f"block_table_to_csr should return (kv_indptr, kv_indices, kv_last_page_len), got "
                       f"{type(got).__name__} (content/f1.md §2)")
    for name, g, w in zip(names, got, want):
        if g.dtype != torch.int32:
            raise Mismatch(f"{name} should be int32 (FlashInfer's index type), got {g.dtype} (content/f1.md §2)")
        if g.device != block_table.device:
            raise Mismatch(f"{name} should be on {block_table.device}, the block table's device, got {g.device}")
    lens, table = seq_lens.tolist(), block_table.tolist()
    pages = [-(-n // page_size) for n in lens]
    error = None
    for name, g, w in zip(names, got, want):
        g = g.cpu()
        if g.shape != w.shape or not torch.equal(g, w):
            if name == "kv_indptr":
                bad = next((i for i in range(min(len(g), len(w))) if int(g[i]) != int(w[i])), min(len(g), len(w)))
                error = Mismatch(
                    f"kv_indptr should be {w.tolist()}, got {g.tolist()}: kv_indptr[0] = 0 and kv_indptr[b+1] = "
                    f"kv_indptr[b] + ceil(seq_len[b] / {page_size}); first wrong entry {bad} (content/f1.md §2)")
            elif name == "kv_indices":
                error = Mismatch(
                    f"kv_indices should be {w.tolist()}, got {g.tolist()}: row b's first ceil(seq_len / page_size) "
                    f"block-table columns, row after row; pages per sequence {pages} (content/f1.md §2)")
            else:
                b = next((i for i in range(min(len(g), len(w))) if int(g[i]) != int(w[i])), 0)
                why = (f"sequence {b} has {lens[b]} tokens in {pages[b]} pages, so its last page holds "
                       f"{lens[b]} - {max(pages[b] - 1, 0)}·{page_size} = {int(w[b])}")
                if lens[b] == 0:
                    why = f"sequence {b} has no tokens and owns no page: its last_page_len is 0"
                elif int(w[b]) == page_size:
                    why += " (a full last page is page_size, never 0)"
                error = Mismatch(f"kv_last_page_len[{b}] should be {int(w[b])}, got {int(g[b])}: {why} "
                                 f"(content/f1.md §4)")
            break
    if error is None:
        return
    def outcome(module):
        return tuple(t.cpu() for t in module.block_table_to_csr(block_table, seq_lens, page_size))

    names, undecided = known_mistakes(DRILL, outcome, tuple(t.cpu() for t in got))
    error = Mismatch(f"{error}\n  block_table={table}, seq_lens={lens}, page_size={page_size}")
    raise name_pitfalls(error, names, undecided)


def check_batch_indices_positions(append_indptr, seq_lens, nnz, got):
    want = ref_batch_indices_positions(append_indptr.cpu(), seq_lens.cpu(), nnz)
    if not isinstance(got, tuple) or len(got) != 2:
        raise Mismatch(f"batch_indices_positions should return (batch_indices, positions), got {type(got).__name__}")
    for name, g in zip(("batch_indices", "positions"), got):
        if g.dtype != torch.int32 or g.shape != (nnz,):
            raise Mismatch(f"{name} should be int32 of shape ({nnz},), got {g.dtype} {tuple(g.shape)} "
                           f"(content/f1.md §5)")
    gb, gp = (g.cpu() for g in got)
    wrong = ((gb != want[0]) | (gp != want[1])).nonzero().flatten().tolist()
    if not wrong:
        return
    t = wrong[0]
    b = int(want[0][t])
    indptr, lens = append_indptr.tolist(), seq_lens.tolist()
    if b < 0:
        why = f"token {t} is past append_indptr[-1] = {indptr[-1]}: padding, batch index -1 and position 0"
    else:
        n_new = indptr[b + 1] - indptr[b]
        why = (f"token {t} is new token {t - indptr[b]} of sequence {b}, which is {lens[b]} long after appending "
               f"{n_new}: position = {lens[b]} - {n_new} + {t - indptr[b]} = {int(want[1][t])}")
    error = Mismatch(f"token {t} should get (batch index, position) = ({b}, {int(want[1][t])}), got "
                     f"({int(gb[t])}, {int(gp[t])}): {why} (content/f1.md §5)\n  {len(wrong)} of {nnz} tokens wrong; "
                     f"append_indptr={indptr}, seq_lens={lens}")
    def outcome(module):
        return tuple(x.cpu() for x in module.batch_indices_positions(append_indptr, seq_lens, nnz))

    names, undecided = known_mistakes(DRILL, outcome, (gb, gp))
    raise name_pitfalls(error, names, undecided)


def _token(case, t):
    return f"token {t} (sequence {int(case.batch_indices[t])}, position {int(case.positions[t])})"


def _whose_page(case, page):
    """Words for a physical page: which sequence's logical page it is, or spare."""
    indptr, indices = case.kv_indptr.tolist(), case.kv_indices.tolist()
    for b in range(len(indptr) - 1):
        if page in indices[indptr[b]:indptr[b + 1]]:
            j = indices[indptr[b]:indptr[b + 1]].index(page)
            return f"sequence {b}'s page {j} (kv_indices[{indptr[b] + j}])"
    return "a page no sequence owns"


def _explain_cache(case, name, got, before, want, rows):
    """Sentences for one 4-D cache (k or v): the first wrong token, the first stray write."""
    layout = case.kv_layout
    g, b0, w = (as_nhd(c, layout).cpu() for c in (got, before, want))  # [P, S, H, D]
    diff = bits(g) != bits(w)
    if not diff.any():
        return []
    findings = []
    places = case.places()
    owned = {p: t for t, p in enumerate(places) if p is not None}
    rows = rows.cpu()
    bad = diff.flatten(2).any(-1).nonzero().tolist()  # [(page, entry)] that differ
    wrong_tokens = [owned[tuple(p)] for p in bad if tuple(p) in owned]
    strays = [tuple(p) for p in bad if tuple(p) not in owned]
    for t in wrong_tokens[:1]:
        page, entry = places[t]
        b, pos = int(case.batch_indices[t]), int(case.positions[t])
        it = int(case.kv_indptr[b]) + pos // case.page_size
        where = (f"page {page} (kv_indices[kv_indptr[{b}] + {pos} // {case.page_size}] = kv_indices[{it}]), "
                 f"entry {entry} ({pos} % {case.page_size})")
        found = (bits(g) == bits(rows[t])).flatten(2).all(-1).nonzero().tolist()
        found = [tuple(p) for p in found if tuple(p) != (page, entry)]
        swapped = _found_swapped(case, got, page, entry, rows[t])
        if found:
            p2, e2 = found[0]
            if p2 == page:
                kind = f"wrong entry: it sits in the right page at entry {e2}"
                if e2 == int(case.kv_last_page_len[b]) - 1:
                    kind += f" = kv_last_page_len[{b}] - 1, where a decode step's one token would go"
            elif e2 == entry:
                kind = f"wrong page: it sits at the right entry of page {p2}, {_whose_page(case, p2)}"
            else:
                kind = f"wrong page and entry: it sits in page {p2} ({_whose_page(case, p2)}), entry {e2}"
            findings.append(f"{name}: {_token(case, t)} belongs in {where}; {kind}")
        elif swapped:
            other = "HND" if layout == "NHD" else "NHD"
            findings.append(f"{name}: {_token(case, t)} belongs in {where} of the {layout} cache, but its values sit "
                            f"where the {other} layout puts (page {page}, entry {entry}): NHD/HND swapped, the entry "
                            f"and head strides were exchanged")
        elif torch.equal(bits(g[page, entry]), bits(b0[page, entry])):
            findings.append(f"{name}: {_token(case, t)} belongs in {where}, but that entry was never written and "
                            f"its values are nowhere in the cache")
        else:
            other = next((u for u in range(len(places)) if places[u] is not None
                          and torch.equal(bits(g[page, entry]), bits(rows[u]))), None)
            if other is not None:
                findings.append(f"{name}: {where} should hold {_token(case, t)} but holds "
                                f"{_token(case, other)}'s values")
            else:
                cols = (bits(g[page, entry]) != bits(rows[t])).flatten().nonzero().flatten()
                first, hd = int(cols[0]), rows.shape[2]
                findings.append(f"{name}: {where} should hold {_token(case, t)}; {cols.numel()} of its values are "
                                f"wrong, first at head {first // hd}, element {first % hd}")
    for page, entry in strays[:1]:
        if page in case.spare_pages:
            whose = "a page no sequence owns"
        else:
            whose = _whose_page(case, page)
        heads = diff[page, entry].any(-1).nonzero().flatten().tolist()
        findings.append(f"{name}: page {page} ({whose}), entry {entry} belongs to no appended token and must keep its "
                        f"old contents, but {len(heads)} of its heads changed")
    real = sum(p is not None for p in places)
    findings.append(f"  {len(wrong_tokens)} of {real} appended tokens wrong, {len(strays)} (page, entry) pairs "
                    f"written that no token maps to")
    return findings


def _found_swapped(case, cache, page, entry, row):
    """True when `row` [H, D] sits at (page, entry) read with the entry and head strides exchanged."""
    s_page = cache.stride(0)
    nhd = case.kv_layout == "NHD"
    s_entry, s_head = (cache.stride(1), cache.stride(2)) if nhd else (cache.stride(2), cache.stride(1))
    storage = next(g.storage for g in case.storages if g.storage.untyped_storage().data_ptr()
                   == cache.untyped_storage().data_ptr())
    h, d = row.shape
    offs = (cache.storage_offset() + page * s_page + entry * s_head + torch.arange(h)[:, None] * s_entry
            + torch.arange(d)[None, :])
    if int(offs.max()) >= storage.numel():
        return False
    return torch.equal(bits(storage.cpu()[offs]), bits(row))


def check_append(case):
    """Every storage bit for bit, guards included; the inputs unchanged; the first
    difference explained as wrong page, wrong entry or NHD/HND swapped."""
    want = case.expected()
    findings = []
    for g, w in zip(case.storages, want):
        diff = bits(g.storage.cpu()) != bits(w)
        if diff[:g.margin].any():
            findings.append(f"values were written before the start of the cache ({int(diff[:g.margin].sum())} "
                            f"elements in the guard): an offset went negative (content/f1.md §9)")
        if diff[g.margin + g.view.numel():].any():
            findings.append(f"values were written past the end of the cache "
                            f"({int(diff[g.margin + g.view.numel():].sum())} elements in the guard)")
    got_k, got_v = case.caches()
    before_k, before_v = case.caches("initial")
    want_k, want_v = case.caches(want)
    findings += _explain_cache(case, "k_cache", got_k, before_k, want_k, case.key)
    findings += _explain_cache(case, "v_cache", got_v, before_v, want_v, case.value)
    if not torch.equal(bits(case.inputs), bits(case.inputs_initial)):
        findings.append("append_key/append_value were modified: they must only be read")
    names = ("batch_indices", "positions", "kv_indices", "kv_indptr", "kv_last_page_len")
    for name, now, before in zip(names, case.index_arrays(), case.indices_initial):
        if not torch.equal(now, before):
            findings.append(f"{name} was modified: the page table and the token indices must only be read")
    if not findings:
        return
    error = Mismatch("\n  ".join(findings) + "\n  " + case.describe())
    names, undecided = known_mistakes(DRILL, case.rerun, tuple(g.storage for g in case.storages))
    raise name_pitfalls(error, names, undecided)


# ---------------------------------------------------------------------------
# Pitfalls: (exact text, replacement) edits of solutions/f1_csr_page_table.py.

PITFALLS = {
    "indptr_off_by_one": Pitfall(
        says="the kernel starts sequence b's pages at kv_indptr[b + 1] instead of kv_indptr[b]: it writes into "
             "the next sequence's pages", edits=(
            ("page_iter = tl.load(kv_indptr_ptr + b) + pos // page_size",
             "page_iter = tl.load(kv_indptr_ptr + b + 1) + pos // page_size"),),
        races=True),  # two sequences' tokens land on the same pages
    "layout_swapped": Pitfall(
        says="NHD and HND are swapped: the entry and head strides are exchanged", edits=(
            ("page_size, stride_entry, stride_head = k_cache.shape[1], k_cache.stride(1), k_cache.stride(2)",
             "page_size, stride_entry, stride_head = k_cache.shape[1], k_cache.stride(2), k_cache.stride(1)"),
            ("page_size, stride_entry, stride_head = k_cache.shape[2], k_cache.stride(2), k_cache.stride(1)",
             "page_size, stride_entry, stride_head = k_cache.shape[2], k_cache.stride(1), k_cache.stride(2)"),)),
    "token_index_as_position": Pitfall(
        says="the token's global index in the batch is used as its position in its sequence", edits=(
            ("positions = seq_lens_[batch] - append_len_[batch] + (token - append_indptr[batch])",
             "positions = token"),)),
    "int32_offsets": Pitfall(
        says="page * stride_page is computed in int32 and wraps around once the cache passes 2**31 elements", edits=(
            ("token = tl.program_id(axis=0).to(tl.int64)", "token = tl.program_id(axis=0)"),
            ("page = tl.load(kv_indices_ptr + page_iter).to(tl.int64)",
             "page = tl.load(kv_indices_ptr + page_iter)"),),
        crashes=True),  # the wrapped offset lands far before the cache: usually a crash
    "last_page_len_as_position": Pitfall(
        says="every token is written at the end of the last page (kv_last_page_len - 1), where a decode step's "
             "single token goes, instead of at its own position", edits=(
            ("batch_indices_ptr, positions_ptr, kv_indices_ptr, kv_indptr_ptr,\n",
             "batch_indices_ptr, positions_ptr, kv_indices_ptr, kv_indptr_ptr, kv_last_page_len_ptr,\n"),
            ("page_iter = tl.load(kv_indptr_ptr + b) + pos // page_size",
             "page_iter = tl.load(kv_indptr_ptr + b + 1) - 1"),
            ("entry = pos % page_size", "entry = tl.load(kv_last_page_len_ptr + b) - 1"),
            ("batch_indices, positions, kv_indices, kv_indptr,\n",
             "batch_indices, positions, kv_indices, kv_indptr, kv_last_page_len,\n"),),
        races=True),  # every token of a sequence writes the same entry
    "full_last_page_as_zero": Pitfall(
        says="kv_last_page_len is seq_len % page_size, so a full last page gets 0 instead of page_size", edits=(
            ("torch.where(seq_lens > 0, (seq_lens - 1) % page_size + 1, 0)", "seq_lens % page_size"),)),
}


# Wrong kernels that are none of the page's pitfalls: the grade must fail them and
# name no pitfall; each first failure must show the phrase `shows`.
MISTAKES = {
    "entry_one_too_far": Mistake(shows="wrong entry", edits=(
        ("entry = pos % page_size", "entry = (pos + 1) % page_size"),)),
    "page_not_looked_up": Mistake(shows="wrong page", edits=(
        ("page = tl.load(kv_indices_ptr + page_iter).to(tl.int64)", "page = page_iter.to(tl.int64)"),)),
    "key_stored_as_value": Mistake(shows="v_cache", edits=(
        ("tl.store(v_cache_ptr + dst, v, mask=keep)", "tl.store(v_cache_ptr + dst, k, mask=keep)"),)),
}


# ---------------------------------------------------------------------------
# Bench: 65536 tokens appended by 512 requests into 2 GiB caches.


def bench_layout(num_requests, new_tokens, page_size, seed=0, max_context=1200):
    """(context_lens, pages per request) of the bench workload, the same every time."""
    gen = torch.Generator().manual_seed(seed)
    context = torch.randint(0, max_context, (num_requests,), generator=gen)
    return context, (context + new_tokens + page_size - 1) // page_size


def append_bytes(num_requests, new_tokens, num_heads, head_size, page_size, dtype, **_):
    """K and V read once and written once, a batch index and a position per token, a kv_indptr
    entry per request and a kv_indices entry per page that receives tokens."""
    context, _pages = bench_layout(num_requests, new_tokens, page_size)
    touched = int(((context + new_tokens - 1) // page_size - context // page_size + 1).sum())
    tokens = num_requests * new_tokens
    kv = 4 * tokens * num_heads * head_size * ELEMENT_SIZE[dtype]
    return kv + 8 * tokens + 4 * (num_requests + 1) + 4 * touched


# The traffic report (tests/_traffic.py): bytes moved under the CPU interpreter

# The bench's workload (requests with random contexts up to 1200 tokens each appending the
# same number of new tokens, pages of 16) shrunk to interpreter size: 4 requests of 8 new
# tokens, H=2, D=32. Its fewest bytes are append_bytes itself, the bench's formula.
TRAFFIC_CASE = dict(num_requests=4, new_tokens=8, num_heads=2, head_size=32, page_size=16, dtype="float16")


def traffic_case(device="cpu"):
    p = TRAFFIC_CASE
    context, _ = bench_layout(p["num_requests"], p["new_tokens"], p["page_size"])
    return append_case(context.tolist(), [p["new_tokens"]] * p["num_requests"], p["page_size"],
                       num_heads=p["num_heads"], head_size=p["head_size"], dtype=DTYPES[p["dtype"]], device=device,
                       seed=5)


def traffic_parts(p):
    """append_bytes tensor by tensor. Indices: places in the call (key, value, batch_indices,
    positions, k_cache, v_cache, kv_indices, kv_indptr, kv_last_page_len)."""
    context, _ = bench_layout(p["num_requests"], p["new_tokens"], p["page_size"])
    touched = int(((context + p["new_tokens"] - 1) // p["page_size"] - context // p["page_size"] + 1).sum())
    tokens = p["num_requests"] * p["new_tokens"]
    rows = tokens * p["num_heads"] * p["head_size"] * ELEMENT_SIZE[p["dtype"]]
    parts = [Part("key/value", (0, 1), fewest_loaded=2 * rows),
             Part("batch_indices/positions", (2, 3), fewest_loaded=8 * tokens),
             Part("kv_indptr", (7,), fewest_loaded=4 * (p["num_requests"] + 1)),
             Part("kv_indices", (6,), fewest_loaded=4 * touched),
             Part("caches", (4, 5), fewest_stored=2 * rows)]
    assert sum(x.fewest_loaded + x.fewest_stored for x in parts) == append_bytes(**p)
    return parts


def traffic(module):
    """append_paged_kv_cache on TRAFFIC_CASE, its bytes against append_bytes (the bench's
    count), with where the extra bytes went in F1's words."""
    case = traffic_case()
    _, counted = measure(module, "append_paged_kv_cache", *case.args())
    if counted is None:
        return None
    result = report(DRILL.id, counted, traffic_parts(TRAFFIC_CASE))
    where = []
    if result["parts"]["key/value"] > 1.05:
        where.append(f"the appended key/value rows were loaded {result['parts']['key/value']:.2f}× their size: "
                     f"each token's row once is enough")
    if result["stores"] > 1.05:
        where.append(f"the caches were written {result['stores']:.2f}× what the appended tokens fill")
    result["where"] = where + result["where"]
    return result


def _bench_case(kv_layout):
    params = dict(num_requests=512, new_tokens=128, num_heads=8, head_size=128, page_size=16, num_pages=65536,
                  dtype="float16", kv_layout=kv_layout)  # 2 GiB per cache
    return BenchCase(f"{kv_layout} nnz=65536", params, append_bytes(**params))


def bench_work(module, params, device, n_sets):
    """(ours, {name: (baseline, graph_safe)}): n_sets independent appends into one pair of caches."""
    page_size, layout, new = params["page_size"], params["kv_layout"], params["new_tokens"]
    num_requests, num_heads, head_size = params["num_requests"], params["num_heads"], params["head_size"]
    dtype = DTYPES[params["dtype"]]
    shape = ((params["num_pages"], page_size, num_heads, head_size) if layout == "NHD"
             else (params["num_pages"], num_heads, page_size, head_size))
    k_cache = torch.randn(shape, dtype=dtype, device=device)
    v_cache = torch.randn_like(k_cache)
    context, pages = bench_layout(num_requests, new, page_size)
    seq_lens = (context + new).int()
    nnz = num_requests * new
    pool = torch.randperm(params["num_pages"])
    sets = []
    for i in range(n_sets):
        gen = torch.Generator().manual_seed(i)
        table = pool[torch.randperm(params["num_pages"], generator=gen)[:int(pages.max()) * num_requests]]
        table = table.view(num_requests, -1).int()
        kv_indptr, kv_indices, kv_last_page_len = ref_block_table_to_csr(table, seq_lens, page_size)
        append_indptr = torch.arange(0, nnz + 1, new, dtype=torch.int32)
        batch_indices, positions = ref_batch_indices_positions(append_indptr, seq_lens, nnz)
        key, value = (torch.randn(nnz, num_heads, head_size, dtype=dtype, device=device) for _ in range(2))
        sets.append(tuple(t.to(device) for t in (key, value, batch_indices, positions, kv_indices, kv_indptr,
                                                 kv_last_page_len)))

    def ours():
        for key, value, bi, pos, indices, indptr, last in sets:
            module.append_paged_kv_cache(key, value, bi, pos, (k_cache, v_cache), indices, indptr, last, layout)

    def index_put():
        # The page look-up as gathers, then one index_put per cache (no padding in this workload).
        for key, value, bi, pos, indices, indptr, _ in sets:
            p = pos.long()
            page = indices[indptr[bi.long()].long() + p // page_size].long()
            entry = p % page_size
            if layout == "NHD":
                k_cache[page, entry], v_cache[page, entry] = key, value
            else:  # advanced indices around a slice: the indexed view is [nnz, H, D]
                k_cache[page, :, entry], v_cache[page, :, entry] = key, value

    return ours, {"torch gather + index_put": (index_put, True)}


# ---------------------------------------------------------------------------
# The picture: the K cache's pages as they should be and as the learner's code left them

SEQ_STYLE = ("bold blue", "bold magenta", "bold cyan", "bold yellow")


def _page_labels(case, storages):
    """{(page, entry): Text} for the K cache in `storages`: whose values sit there."""
    from rich.text import Text

    now = as_nhd(case.caches(storages)[0], case.kv_layout).cpu()
    before = as_nhd(case.caches("initial")[0], case.kv_layout).cpu()
    rows = [bits(case.key[t].cpu()) for t in range(case.key.shape[0])]
    labels = {}
    for page in range(now.shape[0]):
        for entry in range(now.shape[1]):
            cell = bits(now[page, entry])
            if torch.equal(cell, bits(before[page, entry])):
                labels[page, entry] = Text("·", style="dim")
                continue
            t = next((t for t, row in enumerate(rows) if torch.equal(cell, row)), None)
            if t is None:
                labels[page, entry] = Text("?", style="bold white on red")
            elif int(case.batch_indices[t]) < 0:
                labels[page, entry] = Text(f"t{t}!", style="bold white on red")
            else:
                labels[page, entry] = Text(f"t{t}", style=SEQ_STYLE[int(case.batch_indices[t]) % len(SEQ_STYLE)])
    return labels


def _guards_hit(case, storages):
    return any(bool((bits(s.cpu())[:g.margin] != bits(g.initial.cpu())[:g.margin]).any()
                    | (bits(s.cpu())[g.margin + g.view.numel():]
                       != bits(g.initial.cpu())[g.margin + g.view.numel():]).any())
               for g, s in zip(case.storages, storages))


def _pages_table(title, case, labels, shown):
    from rich.table import Table

    table = Table(title=title, header_style="bold", box=None, padding=(0, 1))
    table.add_column("page", justify="right")
    table.add_column("owner")
    for entry in range(case.page_size):
        table.add_column(f"+{entry}", justify="center")
    for page in shown:
        owner = _whose_page(case, page).split(" (")[0].replace("sequence ", "seq ")
        owner = "spare" if owner.startswith("a page") else owner
        table.add_row(str(page), owner, *[labels[page, e] for e in range(case.page_size)])
    return table


def draw_case(case, console):
    """A case that already ran: the K cache's pages, expected next to yours."""
    from rich.columns import Columns

    want = _page_labels(case, case.expected())
    got = _page_labels(case, [g.storage for g in case.storages])
    touched = sorted({p for labels in (want, got) for (p, _), cell in labels.items() if cell.plain != "·"})
    num_pages = case.caches()[0].shape[0]
    shown = list(range(num_pages)) if num_pages <= 12 else touched
    console.print(f"[dim]kv_layout={case.kv_layout}, kv_indptr={case.kv_indptr.tolist()}, "
                  f"kv_indices={case.kv_indices.tolist()}, batch_indices={case.batch_indices.tolist()}, "
                  f"positions={case.positions.tolist()}[/]")
    console.print(Columns([_pages_table("k_cache, expected", case, want, shown),
                           _pages_table("k_cache, yours", case, got, shown)], padding=(0, 6)))
    if _guards_hit(case, [g.storage for g in case.storages]):
        console.print("[bold red]values were written outside the cache (its guard regions changed)[/]")
    console.print("[dim]tN: token N's key (colour = its sequence)   ·: untouched   tN!: a padding token's values   "
                  "?: changed to values of no token (wrong layout, or a partial write)[/]")


def picture(module, console):
    """§2 and §5's example with H=2, D=3 (H*D not a power of two), key/value read from a
    fused-QKV view and one padding token: the CSR arrays, each token's (b, position), and the pages."""
    from rich.table import Table
    from rich.text import Text

    import _env

    ex = WORKED_EXAMPLE
    device = _env.DEVICE
    table = torch.tensor(ex["block_table"], dtype=torch.int32, device=device)
    lens = torch.tensor(ex["seq_lens"], dtype=torch.int32, device=device)
    rows = Table(title="block_table_to_csr and batch_indices_positions", header_style="bold", box=None,
                 padding=(0, 1))
    for column in ("array", "expected", "yours"):
        rows.add_column(column)

    def show(names, want, call):
        try:
            got = [t.tolist() for t in call()]
        except Exception as error:  # the picture draws whatever the learner's code does
            got = [type(error).__name__] * len(names)
        for name, w, g in zip(names, want, got):
            rows.add_row(name, str(w), Text(str(g), style="green" if g == w else "bold red"))

    show(("kv_indptr", "kv_indices", "kv_last_page_len"),
         (ex["kv_indptr"], ex["kv_indices"], ex["kv_last_page_len"]),
         lambda: module.block_table_to_csr(table, lens, ex["page_size"]))
    indptr = torch.tensor(ex["append_indptr"], dtype=torch.int32, device=device)
    show(("batch_indices", "positions"), (ex["batch_indices"] + [-1], ex["positions"] + [0]),
         lambda: module.batch_indices_positions(indptr, lens, ex["append_indptr"][-1] + 1))
    console.print(rows)

    case = worked_example_case(device, num_heads=2, head_size=3, rows="fused_qkv", padding=1)
    try:
        module.append_paged_kv_cache(*case.args())
    except Exception as error:
        console.print(f"[red]append_paged_kv_cache raised {type(error).__name__}: {error}[/]")
    draw_case(case, console)


# ---------------------------------------------------------------------------
# Page checks: every number content/f1.md shows, recomputed.


def _ints(s):
    return [int(x) for x in re.findall(r"-?\d+", s)]


def check_page_example(text):
    """§2: the block table and its CSR arrays; §5: the append table, row by row."""
    ex = WORKED_EXAMPLE
    s2 = section(text, 2)
    assert eval(re.search(r"block_table = (\[\[.*?\]\])", s2, re.S).group(1)) == ex["block_table"]
    assert _ints(re.search(r"seq_lens = (\[[-\d, ]+\])", s2).group(1)) == ex["seq_lens"]
    assert int(re.search(r"page_size = (\d+)", s2).group(1)) == ex["page_size"]
    csr = ref_block_table_to_csr(torch.tensor(ex["block_table"]), torch.tensor(ex["seq_lens"]), ex["page_size"])
    for name, want in zip(("kv_indptr", "kv_indices", "kv_last_page_len"), csr):
        shown = _ints(re.search(rf"{name}\s*= (\[[-\d, ]+\])", s2).group(1))
        assert shown == want.tolist() == ex[name], name
    s5 = section(text, 5)
    assert _ints(re.search(r"append_indptr = (\[[-\d, ]+\])", s5).group(1)) == ex["append_indptr"]
    bi, pos = ref_batch_indices_positions(torch.tensor(ex["append_indptr"]), torch.tensor(ex["seq_lens"]),
                                          ex["append_indptr"][-1])
    assert bi.tolist() == ex["batch_indices"] and pos.tolist() == ex["positions"]
    rows = re.findall(r"^\| (\d+) \| (\d+) \| (\d+) \| (\d+) \+ \d+ // \d+ = (\d+) \| kv_indices\[\d+\] = (\d+) \| "
                      r"\d+ % \d+ = (\d+) \| (\d+) \|$", s5, re.M)
    assert len(rows) == len(ex["positions"])
    places = ref_page_entry(bi, pos, torch.tensor(ex["kv_indices"]), torch.tensor(ex["kv_indptr"]), ex["page_size"])
    for t, b, p, start, it, page, entry, slot in (map(int, r) for r in rows):
        assert (b, p) == (ex["batch_indices"][t], ex["positions"][t])
        assert start == ex["kv_indptr"][b] and it == ex["page_iter"][t] == start + p // ex["page_size"]
        assert (page, entry) == places[t] == (ex["pages"][t], ex["entries"][t])
        assert slot == page * ex["page_size"] + entry  # L1's slot of the same place


def check_self_tests(text):
    """§10's answers, each recomputed."""
    s9 = section(text, 10)
    q1 = s9[s9.index("**自测 1**"):s9.index("**自测 2**")]
    table = eval(re.search(r"block_table = (\[\[.*?\]\])", q1).group(1))
    lens = _ints(re.search(r"seq_lens = (\[[\d, ]+\])", q1).group(1))
    ps = int(re.search(r"page_size = (\d+)", q1).group(1))
    want = ref_block_table_to_csr(torch.tensor(table), torch.tensor(lens), ps)
    for name, w in zip(("kv_indptr", "kv_indices", "kv_last_page_len"), want):
        assert _ints(re.search(rf"{name} = (\[[\d, ]+\])", q1.split("> ", 1)[1]).group(1)) == w.tolist(), name

    q2 = s9[s9.index("**自测 2**"):s9.index("**自测 3**")]
    ps, npages, last = map(int, re.search(r"page_size = (\d+).*?(\d+) 页.*?last_page_len = (\d+)", q2, re.S).groups())
    seq_len = int(re.search(r"seq_len = .*?= (\d+)", q2.split("> ", 1)[1]).group(1))
    assert seq_len == (npages - 1) * ps + last

    q3 = s9[s9.index("**自测 3**"):s9.index("**自测 4**")]
    ind = _ints(re.search(r"kv_indices = (\[[\d, ]+\])", q3).group(1))
    ptr = _ints(re.search(r"kv_indptr = (\[[\d, ]+\])", q3).group(1))
    ps = int(re.search(r"page_size = (\d+)", q3).group(1))
    b, pos = map(int, re.search(r"序列 (\d+) 的 position (\d+)", q3).groups())
    page, entry = map(int, re.search(r"page (\d+)、entry (\d+)", q3.split("> ", 1)[1]).groups())
    assert (page, entry) == (ind[ptr[b] + pos // ps], pos % ps)

    q4 = s9[s9.index("**自测 4**"):s9.index("**自测 5**")]
    h, d, ps = map(int, re.search(r"H = (\d+)、D = (\d+)、page_size = (\d+)", q4).groups())
    page, entry, head = map(int, re.search(r"page (\d+)、entry (\d+)、head (\d+)", q4).groups())
    nhd, hnd = map(int, re.search(r"NHD：[^=]*= (\d+).*?HND：[^=]*= (\d+)", q4.split("> ", 1)[1], re.S).groups())
    assert torch.empty(page + 1, ps, h, d)[page, entry, head, 0].storage_offset() == nhd
    assert torch.empty(page + 1, h, ps, d)[page, head, entry, 0].storage_offset() == hnd

    q5 = s9[s9.index("**自测 5**"):]
    total = int(re.search(r"合计 (\d+) 字节", q5).group(1))
    assert total == append_bytes(**_bench_case("NHD").params)


def check_bench_numbers(text):
    """Numbers quoted from BENCHMARKS.md stand in BENCHMARKS.md."""
    bench = (ROOT / "BENCHMARKS.md").read_text()
    for line in text.splitlines():
        if "BENCHMARKS.md" in line:
            for number in re.findall(r"(\d[\d.,]*) ?(?:GB/s|µs|%|×)", line):
                assert number in bench, f"content/f1.md quotes {number} from BENCHMARKS.md, which does not hold it"


TEST_SHAPES = dict(max_seqs=4, max_context=40, max_append=6, max_heads=4, head_sizes=(1, 3, 8, 16, 24, 40),
                   page_sizes=(1, 2, 3, 4, 8, 16), max_padding=2)

def check_traffic_line(text):
    """The traffic line the page shows is what the reference's traffic case gives (run here,
    in the CPU interpreter; on a GPU there is nothing to count)."""
    from _tree import load_drill
    p = TRAFFIC_CASE
    assert (p["num_requests"], p["new_tokens"], p["num_heads"], p["head_size"]) == (4, 8, 2, 32)
    assert "4 个请求各追加 8 个 token，H=2、D=32" in text
    check_page_line(text, "f1", traffic(load_drill("solutions", "f1_csr_page_table")))


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


def check_pages_come_from_a_shuffled_pool_and_kv_indices_is_guarded(device):
    case = append_case([9, 0, 13], [3, 2, 1], 4, num_heads=1, head_size=2, spare_pages=2, device=device)
    pages = case.kv_indices.tolist()
    assert pages != sorted(pages) or len(pages) < 3  # a logical page is not its physical page
    guard = case.kv_indices.new_empty(0).set_(case.kv_indices.untyped_storage()).tolist()[len(pages):]
    assert len(guard) == GUARD and set(guard) <= set(case.spare_pages)


DRILL = Drill(
    id="f1", stem=STEM, title="FlashInfer's CSR page table", mirrors="FlashInfer append_paged_kv_cache",
    api=("block_table_to_csr", "batch_indices_positions", "append_paged_kv_cache_kernel", "append_paged_kv_cache"),
    section=SECTION,
    test_shapes=TEST_SHAPES,
    pitfalls=PITFALLS,
    mistakes=MISTAKES,
    bench=(_bench_case("NHD"), _bench_case("HND")),
    bench_work=bench_work,
    traffic=traffic,
    picture=picture,
    draw_case=draw_case,
    page_checks=(check_traffic_line, check_page_example, check_self_tests, check_bench_numbers),
    fixture_checks=(check_worked_example_puts_each_token_in_the_pages_place,
                    check_padding_tokens_get_batch_index_minus_one, check_fused_qkv_rows_are_strided_views,
                    check_pages_come_from_a_shuffled_pool_and_kv_indices_is_guarded),
)
