"""L2's page checks: every number content/l2.md works out, recomputed, ending in
`PAGE_CHECKS`."""
import ast
import math
import re

import pytest
import torch

import _env
from _pages import section, self_test
from _traffic import check_page_line
from _tree import load_drill

from .bench import BENCH, decode_bytes, decode_flops
from .cases import DECODE_EXAMPLE, decode_example_case, paged_decode_case
from .checks import check_paged_decode
from .reference import online_softmax
from .traffic import TRAFFIC_CASE, traffic


def check_worked_example(text):
    """§3: the token table, every number of the step table, and the output, against the
    example the tests run (DECODE_EXAMPLE), the reference and the solution's kernel."""
    ex = DECODE_EXAMPLE
    assert ast.literal_eval(re.search(r"`block_table = (\[\[[\d, ]+\]\])`", text).group(1)) == ex["block_table"]
    assert int(re.search(r"block_size = (\d+)。为了", text).group(1)) == ex["block_size"]
    row = {name: [int(n) for n in re.findall(r"\d+", cells)]
           for name, cells in re.findall(r"^\| (物理块|分数 s|值 v) \|(.*)\|$", text, re.M)}
    table, bs = ex["block_table"][0], ex["block_size"]
    assert row["物理块"] == [table[pos // bs] for pos in range(len(ex["scores"]))]
    assert row["分数 s"] == ex["scores"] and row["值 v"] == ex["values"]

    steps = re.findall(r"^\| 物理块 (\d+) \| ([\d, ]+) \| (\d+) \| ([\d.]+) \| ([\d., ]+) \| ([\d.]+) \| ([\d.]+) \|$",
                       text, re.M)
    want = online_softmax(torch.tensor([ex["scores"]]), torch.tensor([ex["values"]])[..., None], tile=bs)
    assert len(steps) == len(want) == len(table)
    for i, ((block, shown, m_new, alpha, p, l, acc), (m2, alpha2, p2, l2, acc2)) in enumerate(zip(steps, want)):
        assert int(block) == table[i] and [float(s) for s in shown.split(",")] == ex["scores"][i * bs:(i + 1) * bs]
        assert float(m_new) == float(m2)
        assert float(alpha) == pytest.approx(float(alpha2), abs=1e-4)
        assert [float(x) for x in p.split(",")] == pytest.approx(p2[0].tolist(), abs=1e-4)
        assert (float(l), float(acc)) == pytest.approx((float(l2), float(acc2)), abs=1e-4)

    # The log-sum-exp L4 needs: m + log l, which is log of the sum of exp(score).
    m, l, lse = re.search(r"lse = m \+ log l = (\d+) \+ ln ([\d.]+) ≈ ([\d.]+)", text).groups()
    assert (float(m), float(l)) == (float(want[-1][0]), pytest.approx(float(want[-1][3]), abs=1e-4))
    assert float(lse) == pytest.approx(math.log(sum(math.exp(s) for s in ex["scores"])), abs=1e-4)

    shown_out = float(re.search(r"≈ \*\*([\d.]+)\*\*", text).group(1))
    case = decode_example_case(device=_env.DEVICE)  # the solution's kernel runs where kernels run here
    assert shown_out == pytest.approx(float(case.reference()), abs=1e-4)
    assert shown_out == pytest.approx(float(want[-1][4] / want[-1][3]), abs=1e-4)
    out = load_drill("solutions", "l2_paged_decode").paged_decode_attention(*case.args(), **case.kwargs())
    check_paged_decode(case, out)


def check_bench_bytes_and_flops(text):
    """§2's totals are the manifest's, for the B=64 bench case."""
    section = text[text.index("## 2."):text.index("## 3.")]
    total = int(re.search(r"合计 (\d+) 字节", section).group(1))
    flops = int(re.search(r"FLOPs = [^\n]*?= (\d{5,})", section).group(1))
    params = next(c.params for c in BENCH if c.params["num_seqs"] == 64)
    assert total == decode_bytes(**params) and flops == decode_flops(**params)
    intensity = float(re.search(r"÷ \d+ ≈ ([\d.]+) FLOP/字节", section).group(1))
    assert intensity == pytest.approx(flops / total, abs=0.05)


def check_self_test_online_update(text):
    q = self_test(text, 1)
    m, l, acc = map(int, re.search(r"m = (\d+)、l = (\d+)、acc = (\d+)", q).groups())
    base, value = map(int, re.search(r"分数是 (\d+) \+ ln 2，值是 (\d+)", q).groups())
    l_new, acc_new = map(int, re.search(r"l = [^=]*= (\d+)，acc = [^=]*= (\d+)", q).groups())
    out = float(re.search(r"输出 = [^≈]*≈ ([\d.]+)", q).group(1))
    # A state (m, l, acc) is what a first tile of l tokens scoring m, whose values sum to acc, leaves behind.
    scores = torch.tensor([[float(m)] * l + [base + math.log(2)]], dtype=torch.float64)
    values = torch.tensor([[acc / l] * l + [float(value)]], dtype=torch.float64)[..., None]
    (_, _, _, l0, acc0), (_, _, _, l2, acc2) = online_softmax(scores, values, tile=l)
    assert (float(l0), float(acc0)) == pytest.approx((l, acc))
    assert (l_new, acc_new) == (pytest.approx(float(l2)), pytest.approx(float(acc2)))
    assert out == pytest.approx(float(acc2 / l2), abs=1e-4)


def check_self_test_small_batch_bytes(text):
    q = self_test(text, 2)
    kv = int(re.search(r"K/V：[^=]*= (\d+) 字节", q).group(1))
    total = int(re.search(r"合计 (\d+) 字节", q).group(1))
    flops = int(re.search(r"FLOPs = [^=]*= (\d+)", q).group(1))
    params = next(c.params for c in BENCH if c.params["num_seqs"] == 8)
    assert total == decode_bytes(**params) and flops == decode_flops(**params)
    assert kv == 2 * params["num_seqs"] * params["context"] * params["num_kv_heads"] * params["head_size"] * 2


def check_self_test_block_table_columns(text):
    q = self_test(text, 3)
    block_size, seq_len, width = map(int, re.search(r"block_size = (\d+)，某条序列 seq_len = (\d+)，.*?一行有 (\d+) 列",
                                                    q).groups())
    columns = [int(c) for c in re.search(r"只读第 ([\d、]+) 列", q).group(1).split("、")]
    live, masked = map(int, re.search(r"= (\d+) 个有效 token，其余 (\d+) 个 slot", q).groups())
    owned = -(-seq_len // block_size)
    assert columns == list(range(owned)) and owned <= width
    assert live == seq_len - (owned - 1) * block_size and masked == block_size - live


def check_self_test_gqa_mapping(text):
    q = self_test(text, 4)
    num_heads, num_kv_heads = map(int, re.search(r"H_q = (\d+)、H_kv = (\d+)", q).groups())
    head, its_kv = map(int, re.search(r"query head (\d+) 读 KV head \d+ // \d+ = (\d+)", q).group(1, 2))
    kv, heads = re.search(r"KV head (\d+) 的 program 负责 query head ([\d、]+)", q).groups()
    group = num_heads // num_kv_heads
    assert its_kv == head // group
    assert [int(h) for h in heads.split("、")] == [h for h in range(num_heads) if h // group == int(kv)]
    # The reference agrees: query head `head` attends with KV head `its_kv`'s keys.
    case = paged_decode_case([5], num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=4, block_size=4,
                             dtype=torch.float32)
    mapping = torch.full((num_heads,), its_kv)
    assert torch.allclose(case.reference()[0, head], case.reference(kv_head=mapping)[0, head])


def check_self_test_small_batch_grid(text):
    q = self_test(text, 6)
    programs, idle = map(int, re.search(r"= (\d+) 个 program，至少 \d+ − \d+ = (\d+) 个 SM", q).groups())
    params = next(c.params for c in BENCH if c.params["num_seqs"] == 8)
    assert programs == params["num_seqs"] * params["num_kv_heads"] and idle == 132 - programs


def check_self_test_split_lse(text):
    """Self-test 7: the lse of each half of §3's example, and their merge, which is the whole row's."""
    ex = DECODE_EXAMPLE
    q = self_test(text, 7)
    halves = re.findall(r"m = (\d+)、l = ([\d.]+)，lse = \d+ \+ ln [\d.]+ ≈ ([\d.]+)", q)
    merged = float(re.search(r"合并：ln\(e\^[\d.]+ \+ e\^[\d.]+\) ≈ ([\d.]+)", q).group(1))
    bs = ex["block_size"]
    parts = [ex["scores"][i:i + bs] for i in range(0, len(ex["scores"]), bs)]
    assert len(halves) == len(parts)
    for (m, l, lse), scores in zip(halves, parts):
        assert float(m) == max(scores)
        assert float(l) == pytest.approx(sum(math.exp(s - max(scores)) for s in scores), abs=1e-4)
        assert float(lse) == pytest.approx(math.log(sum(math.exp(s) for s in scores)), abs=1e-4)
    assert merged == pytest.approx(math.log(sum(math.exp(s) for s in ex["scores"])), abs=1e-4)
    assert "lse = m + log l" in section(text, 3)


def check_int32_boundary(text):
    """§4: the 2 GiB fp16 cache's block count (int32 offsets still fit there)."""
    blocks = int(re.search(r"2 GiB 的 fp16 cache 有 (\d+) 个物理块", section(text, 4)).group(1))
    assert blocks * 16 * 8 * 128 * 2 == 2 * 2**30


def check_traffic_line(text):
    """§1's traffic line is what the reference's traffic case gives (run here, in the
    CPU interpreter; on a GPU there is nothing to count), and the case is the one described."""
    p = TRAFFIC_CASE
    assert p["num_heads"] // p["num_kv_heads"] == 4 and "H_q = 8、H_kv = 2" in text and "D = 32" in text
    assert (p["num_heads"], p["num_kv_heads"], p["head_size"], p["block_size"]) == (8, 2, 32, 16)
    check_page_line(text, "l2", traffic(load_drill("solutions", "l2_paged_decode")))


PAGE_CHECKS = (check_traffic_line, check_worked_example, check_bench_bytes_and_flops, check_self_test_online_update,
               check_self_test_small_batch_bytes, check_self_test_block_table_columns, check_self_test_gqa_mapping,
               check_self_test_small_batch_grid, check_self_test_split_lse, check_int32_boundary)
