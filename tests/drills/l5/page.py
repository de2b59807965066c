"""L5's page checks: every number content/l5.md works out, recomputed (tests/test_content.py)."""
import re

import torch
import triton
import triton.language as tl

import _env
from _pages import section
from _traffic import check_page_line
from _tree import load_drill

from .bench import write_bytes
from .cases import WORKED_EXAMPLE, decode_case, worked_example_numbers, write_case
from .reference import FP8_MAX, quantise
from .traffic import TRAFFIC_CASE, traffic


def check_worked_example_table(text):
    """§3's table: each value through both formats, and each byte, from torch (clamped, then cast)."""
    part = section(text, 3)
    numbers = worked_example_numbers()
    rows = re.findall(r"^\| ([\d.]+) \| ([\d.]+)(?:（饱和）)? \| 0x([0-9A-F]{2}) \| ([\d.]+) \| 0x([0-9A-F]{2}) \|$", part,
                      re.M)
    assert [float(r[0]) for r in rows] == WORKED_EXAMPLE["values"]
    for i, (_, e4, b4, e5, b5) in enumerate(rows):
        assert float(e4) == numbers["e4m3fn"][i] and int(b4, 16) == numbers["bytes"]["e4m3fn"][i]
        assert float(e5) == numbers["e5m2"][i] and int(b5, 16) == numbers["bytes"]["e5m2"][i]
    assert numbers["bare_e5m2"] == float("inf") and "对 1e5 给出 inf" in part


def check_format_table(text):
    """§2: the largest finite values and e4m3fn's NaN bytes, from torch."""
    part = section(text, 2)
    for dtype, shown in ((torch.float8_e4m3fn, "448"), (torch.float8_e5m2, "57344")):
        assert float(torch.finfo(dtype).max) == FP8_MAX[dtype] == float(shown)
    nan = torch.tensor([0x7F, 0xFF], dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    assert bool(torch.isnan(nan).all()) and "`0x7F`、`0xFF`" in part
    assert float(torch.tensor([0x7C], dtype=torch.uint8).view(torch.float8_e5m2).float()) == float("inf")


def check_interpreter_counts(text):
    """§5 quotes what was measured on Triton 3.9's interpreter; the sentence names the counts."""
    assert "e4m3 错 2434 个、e5m2 错 4661 个" in section(text, 5)


def check_source_dtype_division(text):
    """§5: torch's promotion (a [1] fp32 divisor gives fp32, a 0-dim one or a float keeps
    bf16) and the bytes that dividing in the 16-bit dtype changes in test_write_divides_in_fp32's
    case (K and V, e5m2, divisor 300, seed 4)."""
    part = section(text, 5)
    x = torch.ones(2, dtype=torch.bfloat16)
    assert (x / torch.ones(1)).dtype == torch.float32 and "`[1]` 形状的 fp32 张量，类型提升给出 fp32" in part
    assert (x / torch.tensor(1.0)).dtype == (x / 1.0).dtype == torch.bfloat16
    wrong = {}
    for dtype in (torch.bfloat16, torch.float16):
        case = write_case(num_tokens=12, num_heads=2, head_size=64, fp8="e5m2", dtype=dtype, divisor=300.0, seed=4)
        assert case.key.numel() == 1536
        wrong[dtype] = sum(int((quantise(x, s, torch.float8_e5m2).view(torch.uint8)
                                != quantise(x, s, torch.float8_e5m2, "source_dtype").view(torch.uint8)).sum())
                           for x, s in ((case.key, case.k_scale), (case.value, case.v_scale)))
    said = f"在 bf16 里除有 {wrong[torch.bfloat16]} 个字节和正确的不同，在 fp16 里除有 {wrong[torch.float16]} 个"
    assert said in part, f"§5 should say: {said}"


def check_contract_details(text):
    """§1: L5's merge_states_kernel is L4's without the merged LSE (no out_lse_ptr), and
    key and value share one dtype (§8): a mixed pair is refused."""
    import inspect
    l4, l5 = load_drill("solutions", "l4_split_kv_decode"), load_drill("solutions", "l5_fp8_kv_cache")
    params = {m: list(inspect.signature(getattr(m.merge_states_kernel, "fn", m.merge_states_kernel)).parameters)
              for m in (l4, l5)}
    assert "out_lse_ptr" in params[l4] and "out_lse_ptr" not in params[l5]
    assert params[l5] == [p for p in params[l4] if p != "out_lse_ptr"]
    assert "签名里没有 L4 的 `out_lse_ptr`" in section(text, 1) and "原样" not in section(text, 1)
    case = write_case(num_tokens=2, num_heads=2, head_size=16, seed=1)
    try:
        l5.reshape_and_cache_fp8(case.key, case.value.to(torch.float16), *case.args()[2:])
    except ValueError:
        pass
    else:
        raise AssertionError("the reference accepted key and value of different dtypes")
    assert "写入的 key 和 value 是同一种 dtype" in section(text, 1) and "写入的 key、value 是同一种 dtype" in section(text, 8)


def check_self_test_quantise(text):
    q = re.search(r"自测 1.*?k_scale = ([\d.]+).*?K 值是 ([\d.]+).*?存 \*\*(\d+)\*\*.*?得 \*\*([\d.]+)\*\*", text, re.S)
    scale, x, stored, back = float(q.group(1)), float(q.group(2)), float(q.group(3)), float(q.group(4))
    got = quantise(torch.tensor([[[x]]]), torch.tensor([scale]), torch.float8_e4m3fn).float().item()
    assert got == stored and abs(got * scale - back) < 1e-6


def check_self_test_saturation(text):
    q = re.search(r"自测 2.*?e5m2 里，(\d+) 除以.*?存 \*\*(\d+)\*\*（字节 0x([0-9A-F]{2})）.*?给 \*\*inf\*\*", text, re.S)
    x, stored, byte = float(q.group(1)), float(q.group(2)), int(q.group(3), 16)
    fp8 = quantise(torch.tensor([[[x]]]), torch.ones(1), torch.float8_e5m2)
    assert fp8.float().item() == stored and int(fp8.view(torch.uint8)) == byte
    assert torch.tensor([x]).to(torch.float8_e5m2).float().item() == float("inf")


def check_self_test_write_bytes(text):
    total = int(re.search(r"自测 4.*?共 \*\*(\d+)\*\* 字节", text, re.S).group(1))
    assert total == write_bytes(num_tokens=65536, num_heads=8, head_size=128, dtype="bfloat16")


def check_bytes_saved(text):
    """§7: fp16 and fp8 K+V of the B=8, ctx 32768 bench case."""
    part = section(text, 7)
    fp16, fp8 = (int(n) for n in re.findall(r"= (\d+) 字节", part)[:2])
    elements = 2 * 8 * 32768 * 8 * 128
    assert (fp16, fp8) == (2 * elements, elements)


def check_traffic_line(text):
    p = TRAFFIC_CASE
    assert (p["num_seqs"], p["context"], p["num_heads"], p["num_kv_heads"], p["head_size"], p["num_splits"]) == \
        (2, 200, 8, 2, 32, 4) and "H_q = 8、H_kv = 2、D = 32、分 4 段" in text
    result = traffic(load_drill("solutions", "l5_fp8_kv_cache"))
    check_page_line(text, "l5", result)
    # The scales: each (sequence, KV head, split) program loads its KV head's two fp32 scales.
    programs, fewest = p["num_seqs"] * p["num_kv_heads"] * p["num_splits"], 2 * 4 * p["num_kv_heads"]
    assert f"{programs} 个 program 各读 8 字节，合起来 {programs * 8} 字节，最少只要 {fewest} 字节" in section(text, 1)
    assert result is None or result["parts"]["scales"] * fewest == programs * 8


def check_torch_saturation(text):
    """§3: torch's own e4m3fn cast above 448 differs between the two runs the page names, which
    differ in version and in device both (so the page blames neither): what torch 2.13's CPU
    wheel gives, this check sees when it runs there."""
    part = section(text, 3)
    assert "torch 2.11 的 `.to(float8_e4m3fn)` 在 464 以上给 NaN（在 H200 上试的）" in part
    assert "torch 2.13 却给 448（CPU 版的 wheel" in part and "版本和设备都不一样" in part
    if torch.__version__.startswith("2.13") and "+cpu" in torch.__version__:
        assert float(torch.tensor([464.0, 500.0]).to(torch.float8_e4m3fn).float().max()) == 448.0


@triton.jit
def _divide(x_ptr, s_ptr, out_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(out_ptr + i, tl.load(x_ptr + i) / tl.load(s_ptr + i))


def check_division_told_only_on_a_gpu(text):
    """§5 and §10: a plain `/` is told about ("one fp8 step") only on a GPU. The interpreter's
    `/` is numpy's, correctly rounded (bit for bit torch's fp32 division, checked here when
    the interpreter runs), so there the grade plants no such mistake and says nothing."""
    from .mistakes import MISTAKES
    assert ("quotient_not_correctly_rounded" in MISTAKES) == (not _env.INTERPRET)
    msg = section(text, 10)
    assert "在 GPU 上，用 `/` 的 kernel 会被告知" in section(text, 5) and "在 CPU 解释器里不会" in section(text, 5)
    assert "只在 GPU 上" in msg and "那里它通过，不会被告知" in msg
    if _env.INTERPRET:
        g = torch.Generator().manual_seed(5)
        x = torch.randn(1 << 14, generator=g) * 1000
        s = torch.rand(1 << 14, generator=g) * 3 + 1e-3
        out = torch.empty_like(x)
        _divide[(1,)](x, s, out, N=1 << 14)
        assert torch.equal(out.view(torch.int32), (x / s).view(torch.int32))


def check_seq_len_zero_refused(text):
    """§1: every seq_len is at least 1, a 0 is refused on the CPU (as in L4), and the page says
    L7 differs."""
    assert "每个 `seq_len` 至少是 1（新 token 本身），`seq_lens` 里的 0 在 CPU 上报 `ValueError`" in section(text, 1)
    assert "L7 在这一点上不一样：那里长度 0 的序列合法" in section(text, 1)
    case = decode_case([5, 3])
    args = list(case.args())
    args[4] = torch.tensor([5, 0], dtype=case.seq_lens.dtype)
    try:
        load_drill("solutions", "l5_fp8_kv_cache").paged_decode_attention_fp8(*args, **case.kwargs())
    except ValueError as error:
        assert "at least 1" in str(error)
    else:
        raise AssertionError("solutions/l5_fp8_kv_cache.py accepts a length-0 sequence on the CPU")


PAGE_CHECKS = (check_traffic_line, check_worked_example_table, check_format_table, check_interpreter_counts,
               check_source_dtype_division, check_torch_saturation, check_division_told_only_on_a_gpu,
               check_contract_details, check_seq_len_zero_refused,
               check_self_test_quantise, check_self_test_saturation, check_self_test_write_bytes, check_bytes_saved)
