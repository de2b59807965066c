"""Drill L3's page checks: every number content/l3.md works out, recomputed (PAGE_CHECKS)."""
import re

import torch

from _pages import hints, section, self_test
from _traffic import check_page_line

from .bench import BENCH
from .cases import PREFILL_EXAMPLE, example_case, example_outputs
from .traffic import TRAFFIC_CASE, traffic


def check_worked_example(text):
    """§3: the example's layout, the mask table and the three outputs (right, no offset,
    prefix ignored), against PREFILL_EXAMPLE and the reference."""
    ex = PREFILL_EXAMPLE
    sec = section(text, 3)
    assert eval(re.search(r"`block_table = (\[\[[\d, ]+\]\])`", sec).group(1)) == ex["block_table"]
    assert int(re.search(r"block_size = (\d+)", sec).group(1)) == ex["block_size"]
    assert [int(x) for x in re.search(r"seq_len = (\d+)，q_len = (\d+)", sec).groups()] == [ex["seq_len"], ex["q_len"]]
    rows = re.findall(r"^\| 查询 (\d+) \| 位置 (\d+) \| ([✓· ]+) \|", sec, re.M)
    context = ex["seq_len"] - ex["q_len"]
    assert len(rows) == ex["q_len"]
    for i, pos, marks in rows:
        i, pos = int(i), int(pos)
        assert pos == context + i
        assert marks.split() == ["✓" if k <= pos else "·" for k in range(ex["seq_len"])]
    case = example_case()
    want = case.reference().flatten().tolist()
    for mask, label in (("bottom_right", "正确"), ("top_left", "不加偏移"), ("chunk_only", "忽略前缀")):
        shown = [float(x) for x in re.search(rf"{label}：([\d.、]+)", sec).group(1).split("、")]
        assert shown == example_outputs(mask)
    assert example_outputs("bottom_right") == want


def check_bench_flops_and_bytes(text):
    """§2: the FLOPs and bytes of the 4x2048 prefill and the decode step, and their ratios."""
    sec = section(text, 2)
    prefill, _, decode, _ = BENCH
    flops = int(re.search(r"预填充的 FLOPs = [^\n]*?= (\d{6,})", sec).group(1))
    nbytes = int(re.search(r"预填充至少搬 [^\n]*?= (\d{6,}) 字节", sec).group(1))
    assert flops == prefill.flops and nbytes == prefill.bytes
    dflops = int(re.search(r"decode 的 FLOPs = [^\n]*?= (\d{6,})", sec).group(1))
    dbytes = int(re.search(r"decode 至少搬 [^\n]*?= (\d{6,}) 字节", sec).group(1))
    assert dflops == decode.flops and dbytes == decode.bytes
    ratios = [float(x) for x in re.findall(r"≈ ([\d.]+) FLOP/字节", sec)]
    assert ratios[0] == round(flops / nbytes) or abs(ratios[0] - flops / nbytes) < 0.5
    assert abs(ratios[1] - dflops / dbytes) < 0.05


def check_self_test_positions(text):
    """Self-test 1: the positions of a chunk's queries and what each sees."""
    q = self_test(text, 1)
    seq_len, q_len = map(int, re.search(r"seq_len = (\d+)、q_len = (\d+)", q).groups())
    first, last = map(int, re.search(r"第一个查询在位置 (\d+)，最后一个在位置 (\d+)", q).groups())
    assert first == seq_len - q_len and last == seq_len - 1
    seen = int(re.search(r"第一个查询看见 (\d+) 个 key", q).group(1))
    assert seen == first + 1


def check_self_test_grid(text):
    """Self-test 2: the grid's upper bound and which query blocks each sequence owns."""
    q = self_test(text, 2)
    lens = [int(x) for x in re.search(r"q_len 依次是 ([\d、]+)", q).group(1).split("、")]
    block_q = int(re.search(r"BLOCK_Q = (\d+)", q).group(1))
    bound = int(re.search(r"上界 = [^=]*= (\d+)", q).group(1))
    starts = [0] + list(torch.tensor(lens).cumsum(0).tolist())
    assert bound == sum(lens) // block_q + len(lens)
    firsts = [int(x) for x in re.search(r"第一个查询块的编号依次是 ([\d、]+)", q).group(1).split("、")]
    assert firsts == [starts[b] // block_q + b for b in range(len(lens))]
    used = int(re.search(r"真正干活的 program 有 (\d+) 个", q).group(1))
    assert used == sum(-(-n // block_q) for n in lens)


def check_self_test_rows(text):
    """Self-test 3: which query and head tile row r holds."""
    q = self_test(text, 3)
    group, block_q, row = map(int, re.search(r"group = (\d+)、BLOCK_Q = (\d+).*?第 (\d+) 行", q, re.S).groups())
    i, head_in_group = map(int, re.search(r"查询 first \+ (\d+)、组内第 (\d+) 个 head", q).groups())
    assert (i, head_in_group) == (row // group, row % group)
    block_m = int(re.search(r"BLOCK_M = (\d+)", q).group(1))
    assert block_m == max(16, 1 << (block_q * group - 1).bit_length())


def check_self_test_tiles(text):
    """Self-test 4: the diagonal and mask-free tiles of one query block."""
    q = self_test(text, 4)
    context, first, block_q, tile, seq_len = map(int, re.search(
        r"context_len = (\d+)、first = (\d+)、BLOCK_Q = (\d+)、TILE = (\d+)、seq_len = (\d+)", q).groups())
    num_full = int(re.search(r"num_full = [^=]*= (\d+)", q).group(1))
    end = int(re.search(r"end = [^=]*= (\d+)", q).group(1))
    assert num_full == (context + first + 1) // tile and end == min(context + first + block_q, seq_len)
    diag = [int(x) for x in re.search(r"对角线 tile 从 key ([\d、]+) 开始", q).group(1).split("、")]
    assert diag == list(range(num_full * tile, end, tile))


# The formulas §4 asks for, which only the hints (§7) may give: the grid bound, the
# first query block of a sequence, the end of the mask-free tiles, vLLM's clamp line.
STAGED = ("total_q // BLOCK_Q + B", "query_start_loc[b] // BLOCK_Q + b", "(P + 1) // TILE",
          "base = where(m_new == −inf, 0, m_new)", "first + r // group")


def check_hints_stage_the_formulas(text):
    """§4 poses the problems and the hints (content/l3-hints.md, what `make hint DRILL=l3`
    prints) answer them: each formula is in a hint, and none stands on the page."""
    given = hints("l3")
    staged = "\n".join(given)
    assert "## 7. 提示" in text and text.index("## 7. 提示") < text.index("## 8. ") and len(given) >= 5
    for formula in STAGED:
        assert formula in staged, f"no hint of content/l3-hints.md gives {formula}"
        assert formula not in text, f"content/l3.md gives {formula}, which its hints stage"


# 块 alone means nothing on this page: the chunk is 新段, the kernel's rows a 查询块,
# the cache's unit a 物理块 (逻辑块 as in L1).
BARE_BLOCK = re.compile(r"(?<!物理|查询|逻辑)块")


def check_block_words(text):
    """Every 块 on the page is one of 物理块, 查询块, 逻辑块: 'the last block' must say which."""
    bare = [text[max(0, m.start() - 8):m.end() + 4] for m in BARE_BLOCK.finditer(text)]
    assert not bare, f"content/l3.md uses a bare 块 (say 物理块, 查询块 or 新段): {bare}"


def check_upstream_reasons(text):
    """§2 gives the reason for chunking (Sarathi-Serve's token budget, decodes ride along) and
    §3 says that SDPA's is_causal=True is aligned top-left, i.e. causal_offset_missing."""
    s2, s3 = section(text, 2), section(text, 3)
    assert "Sarathi-Serve" in s2 and "token 预算" in s2 and "decode" in s2
    assert "is_causal=True" in s3 and "causal_lower_right" in s3 and "pitfall:causal_offset_missing" in s3


# ---------------------------------------------------------------------------

def check_traffic_line(text):
    """The traffic line the page shows is what the reference's traffic case gives (run here,
    in the CPU interpreter; on a GPU there is nothing to count)."""
    from _tree import load_drill
    p = TRAFFIC_CASE
    assert (p["num_seqs"], p["q_len"], p["context"]) == (3, 4, 68) and "3 条序列各 4 个新 token，接在 68 个" in text
    check_page_line(text, "l3", traffic(load_drill("solutions", "l3_paged_prefill")))


PAGE_CHECKS = (check_traffic_line, check_worked_example, check_bench_flops_and_bytes, check_self_test_positions,
               check_self_test_grid, check_self_test_rows, check_self_test_tiles, check_hints_stage_the_formulas,
               check_block_words, check_upstream_reasons)
