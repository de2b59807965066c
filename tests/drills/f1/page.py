"""Drill F1's page checks: every number content/f1.md shows, recomputed; PAGE_CHECKS
at the bottom, in the order the grade runs them.
"""
import re

import torch

from _pages import section
from _traffic import check_page_line

from .bench import _bench_case, append_bytes
from .cases import WORKED_EXAMPLE
from .reference import ref_batch_indices_positions, ref_block_table_to_csr, ref_page_entry
from .traffic import TRAFFIC_CASE, traffic

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
        assert _ints(re.search(rf"{name} = (\[[\d, ]+\])", q1.split("</summary>", 1)[1]).group(1)) == w.tolist(), name

    q2 = s9[s9.index("**自测 2**"):s9.index("**自测 3**")]
    ps, npages, last = map(int, re.search(r"page_size = (\d+).*?(\d+) 页.*?last_page_len = (\d+)", q2, re.S).groups())
    seq_len = int(re.search(r"seq_len = .*?= (\d+)", q2.split("</summary>", 1)[1]).group(1))
    assert seq_len == (npages - 1) * ps + last

    q3 = s9[s9.index("**自测 3**"):s9.index("**自测 4**")]
    ind = _ints(re.search(r"kv_indices = (\[[\d, ]+\])", q3).group(1))
    ptr = _ints(re.search(r"kv_indptr = (\[[\d, ]+\])", q3).group(1))
    ps = int(re.search(r"page_size = (\d+)", q3).group(1))
    b, pos = map(int, re.search(r"序列 (\d+) 的 position (\d+)", q3).groups())
    page, entry = map(int, re.search(r"page (\d+)、entry (\d+)", q3.split("</summary>", 1)[1]).groups())
    assert (page, entry) == (ind[ptr[b] + pos // ps], pos % ps)

    q4 = s9[s9.index("**自测 4**"):s9.index("**自测 5**")]
    h, d, ps = map(int, re.search(r"H = (\d+)、D = (\d+)、page_size = (\d+)", q4).groups())
    page, entry, head = map(int, re.search(r"page (\d+)、entry (\d+)、head (\d+)", q4).groups())
    nhd, hnd = map(int, re.search(r"NHD：[^=]*= (\d+).*?HND：[^=]*= (\d+)", q4.split("</summary>", 1)[1], re.S).groups())
    assert torch.empty(page + 1, ps, h, d)[page, entry, head, 0].storage_offset() == nhd
    assert torch.empty(page + 1, h, ps, d)[page, head, entry, 0].storage_offset() == hnd

    q5 = s9[s9.index("**自测 5**"):]
    total = int(re.search(r"合计 (\d+) 字节", q5).group(1))
    assert total == append_bytes(**_bench_case("NHD").params)


def _swapped_offsets(kv_layout, page_size, num_heads, head_size):
    """Every in-page element offset the kernel writes when the entry and head strides are
    swapped (pitfall layout_swapped), from the strides of one contiguous page of kv_layout."""
    shape = (page_size, num_heads, head_size) if kv_layout == "NHD" else (num_heads, page_size, head_size)
    strides = torch.empty(shape).stride()
    entry, head = (strides[0], strides[1]) if kv_layout == "NHD" else (strides[1], strides[0])
    entry, head = head, entry  # the mistake
    return {e * entry + h * head + f for e in range(page_size) for h in range(num_heads) for f in range(head_size)}


def check_layout_swapped(text):
    """§6 and §9: with the strides swapped, NHD leaves the page when H > page_size and HND
    when page_size > H; equal, both only transpose inside it. The test and bench shapes."""
    d = 2
    for ps in range(1, 7):
        for h in range(1, 7):
            size = ps * h * d
            nhd, hnd = (max(_swapped_offsets(lay, ps, h, d)) >= size for lay in ("NHD", "HND"))
            assert nhd == (h > ps) and hnd == (ps > h), (ps, h)
            assert max(_swapped_offsets("NHD", ps, h, d)) // d == ps - 1 + (h - 1) * h
            assert max(_swapped_offsets("HND", ps, h, d)) // d == (ps - 1) * ps + h - 1
            if h == ps:
                assert _swapped_offsets("NHD", ps, h, d) == _swapped_offsets("HND", ps, h, d) == set(range(size))
    s6 = section(text, 6)
    for needle in ("`entry · D + head · H·D`", "`(page_size − 1 + (H − 1) · H) · D`", "**H > page_size**",
                   "`entry · page_size·D + head · D`", "`((page_size − 1) · page_size + H − 1) · D`",
                   "**page_size > H**", "H = 3、page_size = 4", "H = 8、page_size 16"):
        assert needle in s6, f"content/f1.md §6 should say {needle}"
    bench = _bench_case("HND").params
    for ps, h in ((4, 3), (bench["page_size"], bench["num_heads"])):  # the test's shape, the bench's
        assert max(_swapped_offsets("HND", ps, h, 1)) >= ps * h > max(_swapped_offsets("NHD", ps, h, 1))
    assert "NHD 在 H > page_size 时越界，HND 在 page_size > H 时越界" in section(text, 9)


def check_traffic_line(text):
    """The traffic line the page shows is what the reference's traffic case gives (run here,
    in the CPU interpreter; on a GPU there is nothing to count)."""
    from _tree import load_drill
    p = TRAFFIC_CASE
    assert (p["num_requests"], p["new_tokens"], p["num_heads"], p["head_size"]) == (4, 8, 2, 32)
    assert "4 个请求各追加 8 个 token，H=2、D=32" in text
    check_page_line(text, "f1", traffic(load_drill("solutions", "f1_csr_page_table")))


PAGE_CHECKS = (check_traffic_line, check_page_example, check_layout_swapped, check_self_tests)
