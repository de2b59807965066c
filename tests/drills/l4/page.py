"""L4's page checks: every number content/l4.md states that code can compute, and its
traffic line; PAGE_CHECKS in the order the drill runs them."""
import dataclasses
import math
import re

import torch

import _env
from _pages import section, walkthrough
from _traffic import check_page_line
from _tree import load_drill
from _wrong import folder, plant_edits

from .cases import MERGE_EXAMPLE, SELF_TEST_MERGE, merge_example_case, merge_example_numbers
from .mistakes import PITFALLS, PLANTED
from .reference import LN2, chunk_bounds, ref_merge
from .traffic import TRAFFIC_CASE, traffic


# ---------------------------------------------------------------------------
# Page checks: every number the page states that code can compute


def _on_page(text, value, digits, what):
    shown = f"{value:.{digits}f}"
    assert shown in text, f"content/l4.md should show {what} = {shown}"


def check_worked_example(text):
    """§3: the two chunks' (v, s), the weights, the merged (v, s), L2's whole-row answer
    (the same), and what the base-2 mistake gives instead."""
    n = merge_example_numbers()
    for key, what in (("s_a", "chunk A's LSE"), ("v_a", "chunk A's output"), ("s_b", "chunk B's LSE"),
                      ("v_b", "chunk B's output"), ("w_a", "chunk A's weight"), ("w_b", "chunk B's weight"),
                      ("s", "the merged LSE"), ("v", "the merged output"), ("base2_v", "the base-2 mistake")):
        _on_page(text, n[key], 4, what)
    assert abs(n["v"] - n["whole"]) < 1e-12


def check_occupancy(text):
    """§2: the program counts, for the bench shapes on an H200 (132 SMs), and the split
    counts default_num_splits gives (4 · SMs // (B · H_kv), at most 32, at least 1: the
    reference's rule, in the walkthrough's §5)."""
    text += walkthrough("l4")
    sms = 132
    for num_seqs, splits in ((8, 8), (64, 1), (16, 4), (1, 32)):
        assert max(1, min(32, 4 * sms // (num_seqs * 8))) == splits
    for line in ("8 × 8 = 64", "64 × 8 = 512", "4 × 132 ÷ 64", "4 × 132 ÷ 512"):
        assert line in text, f"content/l4.md §2 should show {line}"


def check_numbers_in_prose(text):
    """§2, §3, §5.1 and §8: the bytes per program and of the partials, the chunks of the
    §5.1 example (the walkthrough's §5), the weights of the base-2 mistake and of the float16 merge."""
    text += walkthrough("l4")
    assert 4096 * 128 * 2 * 2 == 2 * 2**20 and "共 2 MiB" in text  # K and V of one KV head of one sequence
    partials = 8 * 32 * 8 * (128 + 1) * 4
    assert abs(partials / 2**20 - 1) < 0.01 and "约 1 MiB" in text
    assert chunk_bounds(200, 4, 64) == [(0, 64), (64, 128), (128, 192), (192, 200)]
    assert "⌈200 / 4⌉ = 50" in text and "[0, 64)、[64, 128)、[128, 192)、[192, 200)" in text
    assert [end > start for start, end in chunk_bounds(5, 4, 64)] == [True, False, False, False]
    _on_page(text, 1 / LN2, 4, "1 / ln 2")
    w_a = 1 / (1 + math.exp(1 / LN2))  # the chunks' LSEs differ by 1; read in base 2 the gap is 1 / ln 2
    _on_page(text, w_a, 4, "chunk A's weight under the base-2 mistake")
    _on_page(text, 1 - w_a, 4, "chunk B's weight under the base-2 mistake")
    w_b = 1 / (1 + math.exp(-0.25))  # s = 1000 and 1000.25
    _on_page(text, w_b, 4, "the float16 test's right weight of side b")
    _on_page(text, 1 - w_b, 4, "the float16 test's right weight of side a")
    assert torch.tensor(1000.25, dtype=torch.float16).item() == 1000.0  # float16 spacing near 1000 is 0.5
    assert math.isinf(torch.tensor(60000.0, dtype=torch.float16) + torch.tensor(60000.0, dtype=torch.float16))


def check_self_tests(text):
    """§9's answers (the self-tests)."""
    t = SELF_TEST_MERGE
    v, s = ref_merge(t["v_a"], t["s_a"], t["v_b"], t["s_b"])
    assert abs(v - 4.0) < 1e-12 and abs(s - math.log(9)) < 1e-12
    _on_page(text, s, 4, "self-test 1's merged LSE (ln 9)")
    _on_page(text, 3 * LN2, 4, "self-test 2's FlashInfer LSE 3 in natural log")
    assert max(1, min(32, 4 * 132 // (16 * 8))) == 4 and "4 × 132 ÷ 128" in text
    assert re.search(r"v = 0.*s = −?-?inf", text)


def _planted(name):
    """The reference with pitfall `name` planted, imported here (a page check runs trusted code)."""
    where = plant_edits(PLANTED, PITFALLS[name].edits, folder() / "l4-page" / name, name)
    return load_drill(str(where), PLANTED.stem)


def check_one_split(text):
    """§3 and §8: at one split, lse_base2 hides (nobody reads the LSE) and unnormalised_partial
    does not: it writes acc = l · v, with l = Σ exp(x − max x). Both planted and run on §3's row."""
    scores = torch.tensor(MERGE_EXAMPLE["scores"], dtype=torch.float64)
    l_sum = float(torch.exp(scores - scores.max()).sum())
    v = merge_example_numbers()["whole"]
    _on_page(text, l_sum, 4, "l of §3's whole row")
    _on_page(text, l_sum * v, 4, "what unnormalised_partial writes at one split")
    assert f"{l_sum:.4f} × {v:.4f} = {l_sum * v:.4f}" in text
    case = dataclasses.replace(merge_example_case("cpu" if _env.INTERPRET else "cuda"), num_splits=1)
    for name, want in (("unnormalised_partial", l_sum * v), ("lse_base2", v)):
        out = _planted(name).paged_decode_attention_split(*case.args(), **case.kwargs())
        assert abs(float(out) - want) < 1e-4, f"{name} at one split gives {float(out)}, not {want}"


def _fa2_num_splits(n, slots, n_blocks, max_splits=128):
    """FlashAttention-2's num_splits_heuristic (csrc/flash_attn/flash_api.cpp at the commit the
    page pins): (splits, efficiency per split count), efficiency = waves / ceil(waves)."""
    if n >= 0.8 * slots:
        return 1, []
    max_splits = min(max_splits, slots, n_blocks)
    eligible = [s == 1 or -(-n_blocks // s) != -(-n_blocks // (s - 1)) for s in range(1, max_splits + 1)]
    eff = [(n * s / slots) / math.ceil(n * s / slots) if ok else 0.0 for s, ok in zip(range(1, max_splits + 1), eligible)]
    best = max(eff)
    return next(s for s, e in zip(range(1, max_splits + 1), eff) if e >= 0.85 * best), eff


def check_fa2_heuristic(text):
    """§5.3 (its reference part, in the walkthrough's §5): FA2's rule on the B = 8 bench (64
    programs, 2 x 132 slots, 4096 / 128 key blocks) picks 4 splits at 0.9697; 5 splits make a
    nearly empty second wave (0.6061); this drill's 4-per-SM rule (528 slots) scores 8 and 10
    splits the same way."""
    text = walkthrough("l4")
    sec = text[text.index("### 参考解的段数规则"):text.index("## 10. ")]
    assert "num_splits_heuristic" in sec and "00979f57acf503b0b080ff08ada0007080074649" in sec
    splits, eff = _fa2_num_splits(8 * 8, 2 * 132, 4096 // 128)
    assert splits == 4 and "选 4 段" in sec
    for value in (eff[3], eff[4]):
        _on_page(sec, value, 4, "FA2's efficiency at 4 and 5 splits")
    ours = [(64 * s / 528) / math.ceil(64 * s / 528) for s in (8, 10)]
    assert f"{ours[0]:.4f}" == f"{eff[3]:.4f}" and f"{ours[1]:.4f}" == f"{eff[4]:.4f}"
    for line in ("8 × 8 = 64", "2 × 132 = 264"):
        assert line in sec


def check_contract_on_this_page(text):
    """§1 and §6 state the contract and the input checks themselves, not by pointing at L2;
    §5.2 says the merge serves cascade (shared-prefix) attention."""
    s1, s6 = section(text, 1), section(text, 6)
    assert "完全一样" not in s1 + s6, "content/l4.md should state L2's contract, not point at it"
    for needle in ("[B, H_q, D]", "[num_blocks, block_size, H_kv, D]", "h // group", "[B, max_blocks]",
                   "int32 或 int64", "float16、bfloat16 或 float32", "`scale=None`"):
        assert needle in s1, f"content/l4.md §1 should state {needle}"
    for needle in ("num_splits", "H_q % H_kv == 0", "int32 或 int64", "同一个 device", "out[b]", "整体连续",
                   "max_blocks · block_size", "[0, num_blocks)"):
        assert needle in s6, f"content/l4.md §6 should list {needle}"
    assert "cascade" in text[text.index("### 5.2"):text.index("### 5.3")]


# ---------------------------------------------------------------------------

def check_traffic_line(text):
    """§1's traffic line is what the reference's traffic case gives (run here, in the
    CPU interpreter; on a GPU there is nothing to count), and the case is the one described."""
    p = TRAFFIC_CASE
    assert (p["num_seqs"], p["context"], p["num_splits"]) == (2, 200, 4) and "两条序列、上下文 200、分 4 段" in text
    check_page_line(text, "l4", traffic(load_drill("solutions", "l4_split_kv_decode")))


PAGE_CHECKS = (check_traffic_line, check_worked_example, check_occupancy, check_numbers_in_prose, check_one_split,
               check_self_tests, check_fa2_heuristic, check_contract_on_this_page)
