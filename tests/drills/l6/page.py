"""Drill L6's page checks: every number content/l6.md works out, recomputed (PAGE_CHECKS)."""
import math
import re

import torch

from _pages import section, self_test
from _traffic import check_page_line
from _tree import ROOT, load_drill

from .bench import BENCH, CROSSOVER_BATCHES, CROSSOVER_PREFIXES, cascade_bytes, cascade_flops, pass1_flops
from .cases import EXAMPLE, example_case, example_outputs, example_tables
from .reference import prefix_len_rule
from .traffic import TRAFFIC_CASE, traffic


def check_worked_example(text):
    """§3: vLLM's two requests, the prefix for block sizes 1 and 2 (capped and not), the
    outputs, the merge of request 1's D and the uncapped D."""
    sec = section(text, 3)
    for bs, capped, uncapped in ((1, 3, 5), (2, 2, 4)):
        case = example_case(bs)
        args = (example_tables(bs)[0], case.query_start_loc, case.seq_lens, bs)
        assert (prefix_len_rule(*args), prefix_len_rule(*args, cap=False)) == (capped, uncapped)
    assert "不封顶的前缀是 A B C D E = 5 个 token" in sec and "封顶：min(3, 4) = 3" in sec
    assert "不封顶是 4 个 token；封顶 min(4, 3) = 3；再向下取整到 2 的倍数：2" in sec
    values = EXAMPLE["values"]
    assert "、".join(f"{k} = {v:g}" for k, v in values.items()) in sec
    want = example_case(1).reference().flatten().tolist()
    shown = [float(x) for x in re.findall(r"([\d.]+)", re.search(r"是 ([\d.、]+)；请求 2 的 E、Y 是 ([\d.、]+)", sec)
                                                       .group(0).replace("请求 2", ""))]
    assert [round(x, 4) for x in shown] == [round(x, 4) for x in example_outputs()] == [round(x, 4) for x in want]
    # Request 1's D: prefix A B C (mean 2, lse 1 + ln 3), suffix D (4, lse 1), weights 3 : 1.
    pre, suf = [values[x] for x in "ABC"], values["D"]
    w_p, w_s = math.exp(1 + math.log(3)), math.exp(1)
    assert round(w_p / w_s) == 3 and "(3 · 2 + 1 · 4) / 4 = 2.5" in sec
    assert (w_p * sum(pre) / 3 + w_s * suf) / (w_p + w_s) == example_outputs()[0] == 2.5
    uncapped = sum(values[x] for x in "ABCDE") / 5  # pass 1 over A..E, pass 2 empty
    assert f"部分结果 {uncapped:.1f}" in sec and f"输出变成 {uncapped:.1f}，不是 2.5" in sec


def check_bytes_and_flops(text):
    """§2: the target case's bytes with and without cascade, their ratio, pass 1's FLOPs."""
    sec = section(text, 2)
    target = BENCH[0].params
    assert (target["num_seqs"], target["prefix"], target["suffix"]) == (64, 4096, 256)
    assert f"合计 {cascade_bytes(**target)} 字节" in sec
    l4 = 64 * (4096 + 256) * 4096 + 2 * 64 * 32 * 128 * 2
    assert f"合计 {l4} 字节" in sec and f"约是 cascade 的 {l4 / cascade_bytes(**target):.1f} 倍" in sec
    assert f"pass 1 的 FLOPs = 4 × 64 × 32 × 128 × 4096 = {pass1_flops(**target)}" in sec
    assert f"约 {pass1_flops(**target) // (4096 * 4096)} FLOP/字节" in sec
    # §1's roofline counts both passes' FLOPs (the bench's, and BENCHMARKS.md's roofline).
    assert f"目标形状两遍共 {cascade_flops(**target)} FLOPs" in section(text, 1)


def check_vllm_model(text):
    """§5: vLLM's use_cascade_attention wave model on the target shape (132 SMs)."""
    sec = section(text, 5)
    sms, tile, b, h, h_kv, prefix = 132, 128, 64, 32, 8, 4096
    tiles = -(-prefix // tile)
    cascade = -(-(h * -(-b // tile)) // sms) * tiles
    fd = -(-(b * h_kv * -(-(h // h_kv) // tile) * tiles) // sms)
    assert f"前缀 tile 数 ⌈4096 / 128⌉ = {tiles}" in sec and f"时间 {cascade}；" in sec
    assert f"时间 ⌈{b * h_kv * tiles} / 132⌉ = {fd}" in sec and cascade < fd


def vllm_uses_cascade(num_seqs, prefix, num_heads=32, num_kv_heads=8, sms=132):
    """vLLM's use_cascade_attention on a decode batch (flash_attn.py, content/l6.md §11):
    at least 256 shared tokens and 8 requests, then the wave model, compared with a strict <."""
    if prefix < 256 or num_seqs < 8:
        return False
    tiles = -(-prefix // 128)
    cascade = -(-(num_heads * -(-num_seqs // 128)) // sms) * tiles
    flash_decoding = -(-(num_seqs * num_kv_heads * -(-(num_heads // num_kv_heads) // 128) * tiles) // sms)
    return cascade < flash_decoding


def check_vllm_rule_on_the_table(text):
    """§5: vLLM's rule on the crossover table: off for every B <= 16, on from B = 32, so it
    is wrong only on the cautious side, by at most the largest speed-up it leaves (a cell > 1
    where it is off); nowhere does it turn cascade on where ours is slower."""
    sec = section(text, 5)
    rows = {int(b): [float(c[:-1]) for c in cells.split(" | ")]
            for b, cells in re.findall(r"^\| (\d+) \| (.*) \|$", sec, re.M)}
    on = {(b, p): vllm_uses_cascade(b, p) for b in rows for p in CROSSOVER_PREFIXES}
    assert not any(on[b, p] for b in rows if b <= 16 for p in CROSSOVER_PREFIXES)
    assert all(on[b, p] for b in rows if b >= 32 for p in CROSSOVER_PREFIXES)
    cells = {(b, p): x for b, xs in rows.items() for p, x in zip(CROSSOVER_PREFIXES, xs)}
    assert not any(on[k] and x < 1 for k, x in cells.items())
    missed = max((x, k) for k, x in cells.items() if not on[k] and x > 1)
    b, p = missed[1]
    assert f"最多少拿 {missed[0]:.2f} 倍（B = {b}、前缀 {p}）" in sec
    assert "B ≤ 16 的每一格它都不开 cascade" in sec and "B = 32 起每一格它都开" in sec


def check_crossover_table(text):
    """§5's table is BENCHMARKS.md's L6 crossover table, cell by cell; before the GPU run
    every cell reads 待测."""
    rows = re.findall(r"^\| (\d+) \| (.*) \|$", section(text, 5), re.M)
    assert [int(b) for b, _ in rows] == list(CROSSOVER_BATCHES)
    header = re.search(r"^\| B \\ prefix \| (.*) \|$", section(text, 5), re.M).group(1)
    assert [int(p) for p in header.split(" | ")] == list(CROSSOVER_PREFIXES)
    bench = (ROOT / "BENCHMARKS.md").read_text()
    start = bench.find("## L6")
    measured = re.findall(r"^\| (\d+) \| (.*) \|$", bench[start:bench.find("\n## ", start + 4)], re.M) \
        if start >= 0 else []
    if measured:
        assert rows == measured, "content/l6.md §5's crossover table is not BENCHMARKS.md's"
        # The sentence under it: the shortest prefix at which cascade pays, per batch.
        pays = {int(b): next((p for p, c in zip(CROSSOVER_PREFIXES, cells.split(" | ")) if float(c[:-1]) > 1), None)
                for b, cells in rows}
        said = ("B = 1 和 2 时表里没有一格划算，B = 4 时 4096，B = 8 时 2048，B = 16 时 512，"
                "B = 32、64 和 128 时 256。")
        assert said in section(text, 5)
        assert pays == {1: None, 2: None, 4: 4096, 8: 2048, 16: 512, 32: 256, 64: 256, 128: 256}
    else:
        assert all(cell == "待测" for _, cells in rows for cell in cells.split(" | "))


def check_self_tests(text):
    q = self_test(text, 1)
    table = torch.tensor([[7] * 6 + [1], [7] * 6 + [1], [7] * 6 + [2]])
    starts, lens = torch.tensor([0, 1, 2, 42]), torch.tensor([200, 180, 120])
    assert "返回 80" in q and prefix_len_rule(table, starts, lens, 16) == 80
    q = self_test(text, 2)
    assert f"≈ {1 / (1 + math.exp(-2)):.4f}" in q and f"≈ {math.exp(1) / (math.exp(3) + math.exp(1)):.4f}" in q
    q = self_test(text, 3)
    params = dict(num_seqs=128, prefix=8192, suffix=256, num_heads=32, num_kv_heads=8, head_size=128,
                  dtype="float16")
    kv = cascade_bytes(**params) - 2 * 128 * 32 * 128 * 2
    assert f"合计 {kv} 字节" in q and f"约 {128 * 8448 * 4096 / kv:.1f} 倍" in q
    q = self_test(text, 4)  # the reference's four caps on pass 1's chunks (solutions/, cascade_attention)
    reference = load_drill("solutions", "l6_cascade_attention")
    min_keys, max_splits = reference.MIN_SPLIT_KEYS, reference.MAX_SPLITS
    blocks = -(-64 // (64 // 4))
    fit = 2 * 132 // (8 * blocks)
    prefix_bytes, part_bytes = 4096 * 8 * 128 * 2 * 2, 2 * 64 * 32 * 128 * 2
    cap = prefix_bytes // (4 * part_bytes)
    assert f"= {blocks} 个行块" in q and f"⌊(2 · 132) / (8 · {blocks})⌋ = {fit} 段" in q
    assert f"最多 {max_splits} 段" in q and f"4096 / {min_keys} = {4096 // min_keys} 段" in q
    assert f"前缀 K/V 是 {prefix_bytes} 字节" in q and f"2 × 64 × 32 × 128 × 2 = {part_bytes} 字节" in q
    assert f"⌊{prefix_bytes} / (4 · {part_bytes})⌋ = {cap} 段" in q
    assert f"取最小，{min(fit, max_splits, 4096 // min_keys, cap)} 段" in q


def check_traffic_line(text):
    """The traffic line the page shows is what the reference's traffic case gives."""
    from _tree import load_drill
    p = TRAFFIC_CASE
    assert (p["num_seqs"], p["prefix"], p["suffix"]) == (4, 64, 20) and "4 条 decode 序列共享 64 个 token" in text
    check_page_line(text, "l6", traffic(load_drill("solutions", "l6_cascade_attention")))


PAGE_CHECKS = (check_traffic_line, check_worked_example, check_bytes_and_flops, check_vllm_model,
               check_vllm_rule_on_the_table, check_crossover_table, check_self_tests)
