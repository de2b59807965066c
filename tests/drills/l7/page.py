"""Drill L7's page checks: every number content/l7.md works out, recomputed (PAGE_CHECKS,
in the order the grade runs them). The page's own numbers live here, beside the code that
checks them: the hand-worked absorption example, DeepSeek's shapes and scale, the H200's
roofline, the self-tests."""
import math
import re

import torch

import _env
from _pages import hints, section, self_test, walkthrough
from _traffic import check_page_line
from _tree import ROOT, load_drill

from .bench import BENCH, mla_bytes
from .cases import WORKED_EXAMPLE, worked_example_decode_case, worked_example_numbers
from .traffic import TRAFFIC_CASE, traffic


def _on_page(text, value, digits, what, where="content/l7.md"):
    shown = f"{value:.{digits}f}"
    assert shown in text, f"{where} should show {what} = {shown}"


def _lines(text, *lines):
    for line in lines:
        assert line in text, f"content/l7.md should say {line!r}"


# ---------------------------------------------------------------------------
# §1: the bench's lower bounds, and the traffic line

def check_bench_bounds(text):
    """§1: the B = 64, 4096-token cases' bytes and FLOPs (the bench's own counts) and the
    times they take at the copy ceiling, the datasheet's peak and the measured matmul rate."""
    from _bench import COMPUTE_BOUND  # here: _bench imports Triton, which make doctor must run without
    sec = section(text, 1)
    cases = {(c.params["num_seqs"], c.params["num_heads"], c.params["context"]): c for c in BENCH}
    small, big = cases[(64, 16, 4096)], cases[(64, 128, 4096)]
    assert all(c.params["rank"] == R and c.params["rope"] == P and c.params["dtype"] == "bfloat16" for c in BENCH)
    us = lambda n, rate: n / rate * 1e6  # noqa: E731
    _lines(sec, f"最少要搬 {small.bytes} 字节", f"至少 {us(small.bytes, COPY_TBPS * 1e12):.1f} µs",
           f"运算只有 {small.flops} 次", f"字节只多到 {big.bytes}（{us(big.bytes, COPY_TBPS * 1e12):.1f} µs）",
           f"运算却涨到 {big.flops} 次", f"要 {us(big.flops, DATASHEET_TFLOPS * 1e12):.1f} µs",
           f"要 {us(big.flops, MEASURED_TFLOPS * 1e12):.1f} µs")
    assert us(small.flops, DATASHEET_TFLOPS * 1e12) < 9.3 and "不到 9.3 µs" in sec
    assert us(big.flops, MEASURED_TFLOPS * 1e12) > us(big.bytes, COPY_TBPS * 1e12)
    # the grade's split between GB/s and TFLOP/s (tests/_bench.py): H = 16 under it, H = 128 over
    assert small.flops < COMPUTE_BOUND * small.bytes and big.flops > COMPUTE_BOUND * big.bytes
    _lines(sec, f"每字节超过 {COMPUTE_BOUND} 次运算的用例当作受算力限制")


def check_traffic_line(text):
    """§1's traffic line is what the reference's traffic case gives (run here, in the CPU
    interpreter; on a GPU there is nothing to count), and the case is the one described."""
    p = TRAFFIC_CASE
    assert (p["num_seqs"], p["context"], p["num_heads"], p["rank"], p["rope"], p["block_size"], p["num_splits"]) == \
        (2, 200, 16, R, P, 64, 2)
    _lines(section(text, 1), "两条序列、上下文 200、H = 16、R = 512、P = 64、block_size = 64、分 2 段")
    check_page_line(text, "l7", traffic(load_drill("solutions", "l7_mla_decode")))


# ---------------------------------------------------------------------------
# §2: bytes per token (DeepSeek-V2's table; the V2/V3 shapes; L1's Llama-3-8B)

R, P = 512, 64                       # kv_lora_rank, qk_rope_head_dim (DeepSeek-V2 and V3)
NOPE, V_DIM, HEADS = 128, 128, 128   # qk_nope_head_dim, v_head_dim, num heads (V3's config_671B.json)
V3_LAYERS = 61


def check_bytes_per_token(text):
    """§2: MLA's d_c + d_h^R = 4.5 d_h (= GQA with 2.25 groups); MHA's 32768 elements and the
    ratio; bytes per layer and per token of DeepSeek-V3 against Llama-3-8B's (L1 §2)."""
    sec = section(text, 2)
    d_h = 128
    assert 4 * d_h == R and d_h // 2 == P and R + P == 4.5 * d_h == 2 * 2.25 * d_h
    _lines(sec, "d_c = 4 · d_h = 512", "d_h^R = d_h / 2 = 64", "512 + 64 = 576", "4.5 · d_h", "2.25 组")
    mha = 2 * HEADS * d_h
    _lines(sec, f"2 × 128 × 128 = {mha}", f"是 MLA 的 {mha / (R + P):.1f} 倍")
    row = (R + P) * 2
    _lines(sec, f"576 × 2 = {row} 字节", f"61 × {row} = {V3_LAYERS * row} 字节",
           f"约 {V3_LAYERS * row / 1024:.1f} KiB")
    llama = 32 * 8 * 128 * 2 * 2  # L1 §2: layers, KV heads, head size, K and V, fp16
    assert llama == 131072 and f"是 {llama} 字节（128 KiB）" in sec


# ---------------------------------------------------------------------------
# §3: the absorption, worked by hand on the drill's worked example (cases.py), and §5: its write

# The page's un-absorbed view of the example's two heads: per head W_UK and W_UV (R x 1
# columns, written as rows) and the query before absorption (1 wide). q_n W_UK^T must be
# the example's q_nope.
EXAMPLE_HEADS = dict(w_uk=[[1.0, 1.0], [1.0, 0.0]], w_uv=[[1.0, 0.0], [1.0, 1.0]], q_n=[[1.0], [2.0]])


def example_numbers(scale=None, rope=True):
    """The worked example both ways round: the un-absorbed heads (keys and values expanded
    per head through W_UK and W_UV) and the absorbed ones (the kernel's: one latent row per
    token), float64. `scale` and `rope` plant the page's two illustrated mistakes."""
    ex = WORKED_EXAMPLE
    f64 = dict(dtype=torch.float64)
    c, k_pe = torch.tensor(ex["kv_c"], **f64), torch.tensor(ex["k_pe"], **f64)
    q_nope, q_pe = torch.tensor(ex["q_nope"], **f64), torch.tensor(ex["q_pe"], **f64)
    w_uk, w_uv = torch.tensor(EXAMPLE_HEADS["w_uk"], **f64), torch.tensor(EXAMPLE_HEADS["w_uv"], **f64)
    q_n = torch.tensor(EXAMPLE_HEADS["q_n"], **f64)
    assert torch.equal(q_n * w_uk, q_nope)                       # q_nope = q_n W_UK^T, head by head
    rope_term = q_pe @ k_pe.T if rope else torch.zeros(2, len(c), **f64)
    k_nope, v = w_uk @ c.T, w_uv @ c.T                           # [H, T]: each head's expanded key and value
    naive = q_n * k_nope + rope_term
    absorbed = q_nope @ c.T + rope_term
    assert torch.equal(naive, absorbed)
    scale = ex["scale"] if scale is None else scale
    n = worked_example_numbers(scale=scale, rope=rope)           # the drill's own numbers (cases.py)
    assert torch.allclose(n["scores"], absorbed * scale)
    p, latent = n["weights"], n["out"]
    up, expanded = (latent * w_uv).sum(-1), (p * v).sum(-1)      # W_UV after the kernel; the un-absorbed output
    assert torch.allclose(up, expanded)
    return dict(raw=absorbed.tolist(), scores=n["scores"].tolist(), p=p.tolist(), lse=n["lse"].tolist(),
                out=latent.tolist(), up=up.tolist(), k_nope=k_nope.tolist(), v=v.tolist())


def _shown(xs):
    """A vector as the page writes it: [1, 0, −2]."""
    return "[" + ", ".join(f"{x:g}".replace("-", "−") for x in xs) + "]"


def _row(h, n):
    cells = [f"{h}", ", ".join(f"{x:g}" for x in n["scores"][h]), *(f"{x:.4f}" for x in n["p"][h]),
             f"{n['lse'][h]:.4f}", "[" + ", ".join(f"{x:.4f}" for x in n["out"][h]) + "]", f"{n['up'][h]:.4f}",
             f"{n['up'][h]:.4f}"]
    return "| " + " | ".join(cells) + " |"


def check_absorption_example(text):
    """§3's hand-worked example: the cache rows and the heads as the page shows them, the
    expanded keys and values, the absorbed queries, the scores both ways, and the table."""
    sec = section(text, 3)
    ex, n = WORKED_EXAMPLE, example_numbers()
    for pos, (c, pe) in enumerate(zip(ex["kv_c"], ex["k_pe"])):
        row = [*c, *pe]
        assert f"| {pos} | {_shown(c)} | {_shown(pe)} | {_shown(row)} |" in sec, f"§3 should show position {pos}"
    for h in range(2):
        cells = [_shown(EXAMPLE_HEADS[k][h]) for k in ("w_uk", "w_uv", "q_n")] + [_shown(ex["q_pe"][h])]
        assert f"| {h} | " + " | ".join(cells) + " |" in sec, f"§3 should show head {h}'s weights"
    assert n["k_nope"] == [[1, 2, 4], [1, 0, 2]] and n["v"] == [[1, 0, 2], [1, 2, 4]]
    assert n["raw"] == [[3, 2, 2], [2, 0, 4]]
    _lines(sec, "三个位置分别是 1、2、4", "1 · 1 + 1 · 2 = 3，1 · 2 + 1 · 0 = 2，1 · 4 + 1 · (−2) = 2",
           "`c · W_UV`：1、0、2", "head 1 的 key 主体是 1、0、2，分数是 2 · 1 = 2、2 · 0 = 0、2 · 2 = 4",
           "value 是 1、2、4",
           "`q_nope⁽⁰⁾ = q_n W_UKᵀ = 1 · [1, 1] = [1, 1]`", "`q_nope⁽¹⁾ = 2 · [1, 0] = [2, 0]`",
           "`[1, 1] · [2, 2] + 1 · (−2) = 2`", "`[2, 0] · [2, 2] + 0 · (−2) = 4`")
    for h in range(2):
        assert _row(h, n) in sec, f"content/l7.md §3's table should have the row {_row(h, n)}"


def check_example_on_the_reference(text):
    """§3's out and lse are what the reference kernel gives on the example (run here: in the
    CPU interpreter without a GPU), and §5's write puts the rows where the page says."""
    solution = load_drill("solutions", "l7_mla_decode")
    device = "cpu" if _env.INTERPRET else "cuda"
    case = worked_example_decode_case(device)
    out, lse = solution.mla_decode_attention(*case.args(), **case.kwargs())
    n = example_numbers()
    assert torch.allclose(out[0].double().cpu(), torch.tensor(n["out"], dtype=torch.float64), atol=1e-4)
    assert torch.allclose(lse[0].double().cpu(), torch.tensor(n["lse"], dtype=torch.float64), atol=1e-4)
    ex = WORKED_EXAMPLE
    table, block_size = ex["block_table"][0], ex["block_size"]
    slots = [table[pos // block_size] * block_size + pos % block_size for pos in range(len(ex["kv_c"]))]
    assert slots == ex["slots"] == [4, 5, 0]
    width = len(ex["kv_c"][0]) + len(ex["k_pe"][0])
    cache = torch.full((ex["num_blocks"], block_size, width), float("nan"), device=device)
    solution.concat_and_cache_mla(torch.tensor(ex["kv_c"], device=device), torch.tensor(ex["k_pe"], device=device),
                                  cache, torch.tensor(slots, device=device))
    flat = cache.flatten().cpu()
    sec = section(text, 5)
    _lines(sec, "block_size = 2", f"block table 是 `{table}`", "slot 是 4、5、0",
           "4 · 3 = 12、5 · 3 = 15 和 0", "物理块 1 这条序列没有用到")
    for first, (c, pe) in zip((12, 15, 0), zip(ex["kv_c"], ex["k_pe"])):
        assert flat[first:first + width].tolist() == [*c, *pe]
        _lines(sec, f"写进{'偏移 ' if first == 12 else ' '}{first}–{first + width - 1}")
    assert bool(torch.isnan(cache[1]).all())  # block 1 untouched


def check_example_mistakes(text):
    """§3 (and §10): what the row-width scale (1/sqrt(R + P) = 1/sqrt(3) here) and a missing
    rope term do to the example's weights; head 1's q_pe is 0, which hides the second."""
    sec = section(text, 3)
    s = 3 ** -0.5
    _on_page(sec, s, 4, "1/sqrt(3)")
    wrong = example_numbers(scale=s)
    _lines(sec, "、".join(f"{x:.4f}" for x in wrong["scores"][0]),
           f"p₀ 从 {example_numbers()['p'][0][0]:.4f} 变成 {wrong['p'][0][0]:.4f}")
    norope = example_numbers(rope=False)
    assert norope["raw"][0] == [1, 2, 4] and norope["p"][1] == example_numbers()["p"][1]
    _lines(sec, "head 0 的分数变成 1、2、4", "p 是 " + "、".join(f"{x:.4f}" for x in norope["p"][0]),
           "head 1 的 `q_pe` 恰好是 0")
    _lines(section(text, 10), f"head 0 的 p₀ 从 {example_numbers()['p'][0][0]:.4f} 变成 {norope['p'][0][0]:.4f}")


# ---------------------------------------------------------------------------
# §3: the model's scale (DeepSeek-V3's inference/model.py: softmax_scale and YaRN's mscale)

def deepseek_v3_scale():
    """qk_head_dim ** -0.5 times mscale², mscale = 0.1 * mscale_cfg * ln(rope_factor) + 1
    (rope_factor 40, mscale_cfg 1: DeepSeek-V3's inference/model.py at the commit §12 pins)."""
    mscale = 0.1 * 1.0 * math.log(40) + 1.0
    return (NOPE + P) ** -0.5, mscale, mscale * mscale, (NOPE + P) ** -0.5 * mscale * mscale


def check_scale(text):
    """§3: 192 ** -0.5, mscale, mscale², DeepSeek-V3's scale, the row-width 1/24 and the ratio."""
    sec = section(text, 3)
    base, mscale, msq, scale = deepseek_v3_scale()
    for value, what in ((base, "192 ** -0.5"), (mscale, "mscale"), (msq, "mscale²"), (scale, "V3's scale"),
                        ((R + P) ** -0.5, "1/sqrt(576)")):
        _on_page(sec, value, 4, what)
    assert (R + P) ** 0.5 == 24 and "1/24" in sec
    _lines(sec, f"小了 {scale * (R + P) ** 0.5:.2f} 倍", f"`{base:.4f} · {msq:.4f} = {scale:.4f}`")
    _lines(section(text, 10), f"DeepSeek-V3 的 scale 是 {scale:.4f}，行宽给的是 {(R + P) ** -0.5:.4f}，"
                              f"分数小了 {scale * (R + P) ** 0.5:.2f} 倍", f"用 V3 的 {scale:.4f}")


# ---------------------------------------------------------------------------
# §5: the value loaded a second time

def check_value_traffic(text):
    """§5 (and §1, §10): loading the value again reads R + P then R numbers per token: 1088 / 576."""
    sec = section(text, 5)
    assert R + P + R == 1088
    _lines(sec, "一共 1088 个", f"1088 / 576 = {1088 / 576:.2f} 倍")
    _lines(section(text, 10), f"该读的 {1088 / 576:.2f} 倍", f"从 1.00× 变成 {1088 / 576:.2f}×")
    _lines(section(text, 1), f"再读一遍就是 {1088 / 576:.2f}×")


# ---------------------------------------------------------------------------
# §4: the roofline on the H200

FLOP_PER_TOKEN_HEAD = 2 * (R + P) + 2 * R   # scores, then o += p * c
BYTES_PER_TOKEN = 2 * (R + P)               # bf16 row, read once for all heads
DATASHEET_TFLOPS = 989                      # H200 dense bf16 (the datasheet's 1979 is with sparsity)
MEASURED_TFLOPS = 656                       # 8192^3 fp16 torch.matmul on the project's H200
COPY_TBPS = 4.25                            # the H200's measured 1 GiB copy_ ceiling, rounded


def intensity(num_heads):
    return num_heads * FLOP_PER_TOKEN_HEAD / BYTES_PER_TOKEN


def check_roofline(text):
    """§4: FLOPs per token and head, bytes per row, the intensity for H = 16 and 128, both
    ridges and both crossover head counts; BLOCK_H = 64's fp32 accumulator in bytes."""
    sec = section(text, 4)
    assert (2 * (R + P), 2 * R, FLOP_PER_TOKEN_HEAD, BYTES_PER_TOKEN) == (1152, 1024, 2176, 1152)
    _lines(sec, "2 · (R + P) = 1152 次运算", "2 · R = 1024 次运算", "一共 2176 次",
           "2 · (R + P) = 1152 字节",
           f"H · 2176 / 1152 ≈ {intensity(1):.3f} · H")
    assert 1979 // 2 == DATASHEET_TFLOPS  # the datasheet's 1,979 is "with sparsity"; dense is half
    _lines(sec, "1979 TFLOP/s", "约 989 TFLOP/s", "656 TFLOP/s", "约 4.25 TB/s")
    for tflops in (DATASHEET_TFLOPS, MEASURED_TFLOPS):
        ridge = tflops / COPY_TBPS
        row = (f"| {tflops} TFLOP/s | {tflops} / 4.25 = {ridge:.1f} | "
               f"{ridge:.1f} / {intensity(1):.3f} = {round(ridge, 1) / round(intensity(1), 3):.1f} |")
        assert row in sec, f"content/l7.md §5's table should have {row}"
        assert abs(round(ridge, 1) / round(intensity(1), 3) - ridge / intensity(1)) < 0.05
    for h in (16, 128):
        _lines(sec, f"算术强度 {intensity(h):.2f}")
    assert intensity(16) < MEASURED_TFLOPS / COPY_TBPS < DATASHEET_TFLOPS / COPY_TBPS < intensity(128)
    assert intensity(128) / (MEASURED_TFLOPS / COPY_TBPS) > 1.5 and "高出一半" in sec
    _lines(sec, f"64 × 512 × 4 = {64 * 512 * 4} 字节", "256 KiB")
    assert 65536 * 4 == 256 * 1024  # an H100/H200 SM's 65536 32-bit registers


# ---------------------------------------------------------------------------
# §5 and §6: the int32 boundary, the split products, the head tile

def check_kernel_shape(text):
    """§5: a 576-wide row passes 2**31 elements at about 4 GiB of bf16. §6: R + P is no
    power of two but R and P are; H = 63 over tiles of 16 leaves 15 real heads in the last tile."""
    assert 2**31 * 2 == 4 * 2**30 and "约 4 GiB" in section(text, 5)  # 2**31 bf16 elements are 4 GiB
    sec = section(text, 6)
    assert R & (R - 1) == 0 and P & (P - 1) == 0 and (R + P) & (R + P - 1) and "512 和 64" in sec
    assert 63 - 16 * (63 // 16) == 15 and "H = 63、BLOCK_H = 16 时最后一块只有 15 个真 head" in sec


# ---------------------------------------------------------------------------
# §7: the reference's tiles and split rule on an H200 (132 SMs)

def check_split_rule(text):
    """§7's reference part (in the walkthrough): the reference's launch (its own constants and _launch, asked as if
    on a GPU) and default_num_splits's rule worked for the bench shapes on 132 SMs; §13's table agrees."""
    sol = load_drill("solutions", "l7_mla_decode")
    gpu = torch.device("cuda")  # only its type is read: no GPU needed
    assert sol._launch(16, torch.bfloat16, gpu) == (16, 64, 4, 3, 2)
    assert sol._launch(128, torch.bfloat16, gpu) == (64, 64, 8, 1, 1)
    assert sol._launch(128, torch.float32, gpu)[:2] == (16, 16) and sol.MERGE_BLOCK_H == 4
    assert (sol.MAX_SPLITS, sol.CPU_NUM_SPLITS) == (32, 4)
    sec = section(walkthrough("l7"), 7)
    _lines(sec, "H ≤ 16 时 BLOCK_H = 16、TILE = 64 个 token、4 个 warp、3 级流水，每个 SM 2 个 program",
           "H > 16 时 BLOCK_H = 64、TILE = 64、8 个 warp、1 级流水，每个 SM 1 个 program", "BLOCK_H = 16、TILE = 16",
           "`S = min(32, max(1, ⌊P · SM 数 / (B · ⌈H / BLOCK_H⌉)⌋))`", "CPU 上固定 4 段", "一个 program 合并 4 个 head")
    for num_seqs, num_heads, shown, splits in ((64, 16, "4.125", 4), (128, 16, "2.06", 2), (64, 128, "1.03", 1),
                                               (128, 128, "0.52", 1)):
        block_h, *_, per_sm = sol._launch(num_heads, torch.bfloat16, gpu)
        tiles = num_seqs * -(-num_heads // block_h)
        assert max(1, min(sol.MAX_SPLITS, per_sm * 132 // tiles)) == splits
        assert abs(float(shown) - per_sm * 132 / tiles) < 0.005
        _lines(sec, f"{per_sm} × 132 ÷ {tiles} = {shown}，取")
    # 16 heads is where the reference changes launch, not where the bottleneck changes (§4's roofline).
    low, high = (tflops / COPY_TBPS / intensity(1) for tflops in (MEASURED_TFLOPS, DATASHEET_TFLOPS))
    _lines(sec, "16 只是参考解换 launch 的地方，不是带宽和算力的分界", "自测 2 的 H = 32 仍受带宽限制",
           f"H ≈ {round(low)}（按实测的矩阵乘速度）到 {round(high)}（按数据表）")
    assert intensity(32) < MEASURED_TFLOPS / COPY_TBPS and "受 tensor core 限制" not in sec
    _lines(section(text, 13), "| 这道题 | 16 或 64（§7） | GPU 上 16 位的 query 64，fp32 16（§7 的参考解部分） |")


def check_vllm_comparison(text):
    """§1 against BENCHMARKS.md (B = 64): vLLM's PR #33529 path, its older (faster) one, our lead over each."""
    rows = [line.split("|")[2:9] for line in (ROOT / "BENCHMARKS.md").read_text().splitlines()
            if line.startswith(("| B=64 H=16 S=4096 |", "| B=64 H=128 S=4096 |"))]
    (ours16, best16, old16), (ours128, best128, old128) = ([float(r[i].split(" µs")[0]) for i in (0, 4, 5)] for r in rows)
    assert old16 < best16 and old128 < best128  # the older path is the faster one
    _lines(section(text, 1), f"{ours16} µs", f"{ours128} µs", f"是 {best16} µs 和 {best128} µs",
           f"反而更快，{old16} µs 和 {old128} µs", f"参考解快 {old16 / ours16:.2f} 倍和 {old128 / ours128:.2f} 倍",
           f"只和新路径比的 {best16 / ours16:.2f} 倍和 {best128 / ours128:.2f} 倍")


def check_empty_sequences_differ_from_l4_and_l5(text):
    """§1: a length-0 sequence is legal here; L4's and L5's references refuse it on the CPU."""
    _lines(section(text, 1), "`seq_lens[b] = 0`（空序列）合法", "那两题的每个 `seq_len` 至少是 1，0 在 CPU 上报 `ValueError`")
    assert all("lo < 1" in (ROOT / "solutions" / f"{s}.py").read_text() for s in ("l4_split_kv_decode", "l5_fp8_kv_cache"))


def check_row_address_hint(text):
    """Hint 4: the row address in two terms, and the Triton version the worked example's GPU skip names."""
    hint = hints("l7")[3]
    assert "`block · (block_size · (R + P)) + (pos % block_size) · (R + P)`，分成两项写" in hint
    skip = re.search(r"Triton before (3\.\d+)", (ROOT / "tests" / "test_l7_mla_decode.py").read_text()).group(1)
    assert f"Triton {skip} 以前" in hint and f"Triton {skip} 以前" in walkthrough("l7")


# ---------------------------------------------------------------------------
# §12: the walkthrough's prose names reference lines by number; they must still be those lines

WALKTHROUGH_LINES = {  # line: what the prose says is there
    45: "token = tl.program_id(0).to(tl.int64)", 46: "slot = tl.load(slot_mapping_ptr + token).to(tl.int64)",
    50: "keep_c = c_cols < tl.where(slot >= 0, R, 0)", 54: "row = kv_cache_ptr + slot * (R + P)",
    80: "head_tile = tl.program_id(0)", 86: "chunk = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), TILE) * TILE",
    95: "head_ok = heads < NUM_HEADS", 107: "acc = tl.zeros([BLOCK_H, R_PAD], tl.float32)",
    114: "row = block.to(tl.int64) * (BLOCK_SIZE * (R + P))", 116: "c = tl.load(kv_cache_ptr + row[:, None] + c_cols[None, :],",
    124: "s = tl.dot(q_nope, tl.trans(c)", 125: "acc=s", 131: "tl.dot(p.to(c.dtype), c,",
    169: "s_max = tl.where(s_max == float(\"-inf\"), 0.0, s_max)", 170: "tl.exp(s - s_max[:, None])",
    176: "acc += tl.where(w[:, None] > 0", 177: "out = acc / tl.where(total > 0, total, 1.0)",
    180: "s_max + tl.log(total)", 221: "_check_decode_inputs(",
    237: "mla_decode_kernel[(triton.cdiv(num_heads, block_h)",
    245: "if num_splits > 1:", 255: "def _check_write_inputs(",
}


def check_walkthrough_lines(text):
    """The walkthrough's prose (§12) says what stands on reference lines 45, 50, 114, 131, 169, ...: it still does."""
    lines = (ROOT / "solutions" / "l7_mla_decode.py").read_text().splitlines()
    for number, snippet in WALKTHROUGH_LINES.items():
        assert snippet in lines[number - 1], f"solutions/l7_mla_decode.py:{number} no longer holds {snippet!r}"
    sec = section(walkthrough("l7"), 12)
    for cited in ("第 45–46 行", "第 50–51 行", "第 80–83 行", "第 86–88 行", "第 92–100 行", "第 113–114 行",
                  "第 124–126 行", "第 131 行", "第 169 行", "第 176 行", "第 180 行", "第 255 行以后"):
        assert cited in sec


# ---------------------------------------------------------------------------
# §11: the self-tests (each answer recomputed)

def check_self_test_bytes(text):
    """Self-test 1: Llama-3-70B's bytes per token against DeepSeek-V3's."""
    t = self_test(text, 1)
    llama70 = 2 * 8 * 128 * 80 * 2
    v3 = V3_LAYERS * (R + P) * 2
    _lines(t, f"2 × 8 × 128 × 80 × 2 = {llama70} 字节（{llama70 // 1024} KiB）",
           f"DeepSeek-V3 是 {v3} 字节",
           f"是它的 {llama70 / v3:.2f} 倍")
    assert abs(70 / 671 - 0.1) < 0.01 and "十分之一左右" in t  # 70 B parameters against 671 B


def check_self_test_intensity(text):
    """Self-test 2: H = 32 sits under both ridges."""
    t = self_test(text, 2)
    assert intensity(32) < MEASURED_TFLOPS / COPY_TBPS < DATASHEET_TFLOPS / COPY_TBPS
    _lines(t, f"32 · 2176 / 1152 = {intensity(32):.2f}", f"实测的屋脊 {MEASURED_TFLOPS / COPY_TBPS:.1f}",
           f"数据表的 {DATASHEET_TFLOPS / COPY_TBPS:.1f}")


def check_self_test_scale(text):
    """Self-test 3: 192 ** -0.5 without YaRN, 1/sqrt(576), their ratio sqrt(3); V3's 3.25."""
    t = self_test(text, 3)
    base, _, _, scale = deepseek_v3_scale()
    assert abs(base / (R + P) ** -0.5 - 3 ** 0.5) < 1e-12
    _lines(t, f"192 ** −0.5 = {base:.4f}", f"`1/sqrt(576) = {(R + P) ** -0.5:.4f}`", f"sqrt(3) = {3 ** 0.5:.4f}",
           f"分数小了 {3 ** 0.5:.4f} 倍", f"{scale * (R + P) ** 0.5:.2f} 倍")


def check_self_test_int32(text):
    """Self-test 4: the first 576-wide slot with an element at offset 2**31, and its block."""
    t = self_test(text, 4)
    first = 2**31 // (R + P)
    col = 2**31 - first * (R + P)
    assert first * (R + P) <= 2**31 - 1 < first * (R + P) + (R + P) - 1 and 0 < col < R + P
    _lines(t, f"2³¹ / 576 = {2**31 / (R + P):.1f}", f"slot {first} 的起点是 {first} × 576 = {first * (R + P)}",
           f"第 {col} 列在 {first * (R + P)} + {col} = {2**31} = 2³¹", f"{first} // 64 = {first // 64}",
           f"块内第 {first % 64} 个 slot")


def check_self_test_head_tiles(text):
    """Self-test 5: H = 63 over tiles of 16; the spare row of sequence b is sequence b + 1's head 0."""
    t = self_test(text, 5)
    tiles = -(-63 // 16)
    last = list(range(16 * (tiles - 1), 16 * tiles))
    assert tiles == 4 and last[0] == 48 and last[-1] == 63 and sum(h >= 63 for h in last) == 1
    q = torch.arange(2 * 63 * 4).view(2, 63, 4)  # [B, H, R], contiguous
    assert q.flatten()[0 * 63 * 4 + 63 * 4] == q[1, 0, 0]  # "head 63" of sequence 0 is sequence 1's head 0
    _lines(t, "⌈63 / 16⌉ = 4 个 head tile", "head 48 到 63", "1 行要 mask", "序列 b + 1 的 head 0")


def check_self_test_fp8_row(text):
    """Self-test 6 and §12's aside: FlashMLA's 656-byte row against bf16's 1152."""
    t = self_test(text, 6)
    assert 512 * 1 + 4 * 4 + 64 * 2 == 656
    _lines(t, f"576 × 2 = 1152 字节，656 / 1152 = {100 * 656 / 1152:.1f} %", "在 656 里占 128 字节")
    aside = text[text.index("### FlashMLA 的 fp8 cache 行"):text.index("## 参考")]
    _lines(aside, "4 个 float32 是 16 字节，64 个 bf16 是 128 字节，一行 512 + 16 + 128 = 656 字节", "| 0 … 511 |",
           "| 512 … 527 |", "| 528 … 655 |", "每个管 128 个")


def check_self_test_bytes_moved(text):
    """Self-test 7: B = 64, 4096 tokens, H = 16: the bytes and the time at 4.25 TB/s."""
    t = self_test(text, 7)
    cache, query, out = 64 * 4096 * 576 * 2, 64 * 16 * 576 * 2, 64 * 16 * 512 * 2
    total = mla_bytes(64, 16, R, P, 4096, "bfloat16")
    assert cache + query + out == total
    _lines(t, f"= {cache} 字节", f"= {query} 字节", f"= {out} 字节", f"一共 {total} 字节",
           f"约 {total / (COPY_TBPS * 1e12) * 1e6:.1f} µs")
    assert cache / total > 0.99 and "99 % 以上" in t


PAGE_CHECKS = (check_traffic_line, check_bench_bounds, check_bytes_per_token, check_absorption_example,
               check_example_on_the_reference, check_example_mistakes, check_scale, check_value_traffic,
               check_roofline, check_kernel_shape, check_split_rule, check_vllm_comparison,
               check_empty_sequences_differ_from_l4_and_l5, check_row_address_hint, check_walkthrough_lines,
               check_self_test_bytes,
               check_self_test_intensity, check_self_test_scale, check_self_test_int32, check_self_test_head_tiles,
               check_self_test_fp8_row, check_self_test_bytes_moved)
