"""Drill F1's checks: each answer compared with the reference, the first difference
explained (wrong page, wrong entry, NHD/HND swapped, a stray write) and the pitfalls it matches named.
"""
import torch

from _diagnose import Mismatch, describe_mistakes, known_mistakes
from _paged import bits

from .mistakes import PLANTED
from .reference import as_nhd, ref_batch_indices_positions, ref_block_table_to_csr


def name_pitfalls(error, names, undecided=()):
    """The Mismatch with 'looks like' lines for the matched pitfalls, naming them; `undecided`:
    pitfalls whose planted variant races on this input (no evidence either way)."""
    return Mismatch(str(error) + describe_mistakes(PLANTED, names), names, undecided)


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

    names, undecided = known_mistakes(PLANTED, outcome, tuple(t.cpu() for t in got))
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

    names, undecided = known_mistakes(PLANTED, outcome, (gb, gp))
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
    names, undecided = known_mistakes(PLANTED, case.rerun, tuple(g.storage for g in case.storages))
    raise name_pitfalls(error, names, undecided)
