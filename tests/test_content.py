"""The content pages cannot rot: every number the code can check is checked here.

Conventions every page follows (content/README.md in words, here in code):
- numbered sections are `## N. title`; "content/<id>.md §N" anywhere in the code
  must name one of them;
- a citation of the reference is a link `[solutions/<stem>.py:A-B](../solutions/<stem>.py#LA-LB)`
  followed by a ```python block that reproduces exactly lines A..B;
- the reference is quoted only inside `<details>` blocks whose summary says 先做题 (do the
  drill first): a learner reads the problem, the concepts and the hints before any answer;
- each pitfall is tagged `pitfall:<name>`;
- a number quoted from BENCHMARKS.md stands on a line that says so, and is in BENCHMARKS.md.
Then, per page, the worked examples and self-test answers against the references.
"""
import ast
import math
import re

import pytest
import torch

from _env import DEVICE
from _manifest import DRILLS
from _paged import WORKED_EXAMPLE
from _tree import ROOT, load_drill

PAGES = {d.id: ROOT / d.page for d in DRILLS}
CITATION = re.compile(r"\[(solutions/\w+\.py):(\d+)-(\d+)\]\(\.\./\1#L\2-L\3\)\s*\n```python\n(.*?)```", re.S)


def page(drill_id):
    return PAGES[drill_id].read_text()


def sections(text):
    return {int(n) for n in re.findall(r"^## (\d+)\. ", text, re.M)}


def section(text, number):
    """The text of `## number. ...` up to the next numbered or unnumbered `## ` heading."""
    start = re.search(rf"^## {number}\. ", text, re.M).start()
    end = re.search(r"^## ", text[start + 3:], re.M)
    return text[start:start + 3 + end.start()] if end else text[start:]


DETAILS = re.compile(r"<details>\s*<summary>(.*?)</summary>(.*?)</details>", re.S)


def outside_details(text):
    return DETAILS.sub("", text)


def answer_lines(stem):
    """The reference's lines that give an answer away: longer than 25 characters, not an import,
    a comment or a docstring, and not also in the stub (signatures and parameter lists are)."""
    source = (ROOT / "solutions" / f"{stem}.py").read_text()
    stub = {line.strip() for line in (ROOT / "mine" / f"{stem}.py").read_text().splitlines()}
    docstrings = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef)) and ast.get_docstring(node) is not None:
            doc = node.body[0]
            docstrings.update(range(doc.lineno, doc.end_lineno + 1))
    return [line.strip() for number, line in enumerate(source.splitlines(), 1)
            if len(line.strip()) > 25 and number not in docstrings and line.strip() not in stub
            and not line.strip().startswith(("import ", "from ", "#"))]


@pytest.mark.parametrize("drill_id", list(PAGES))
def test_citations_reproduce_the_cited_lines(drill_id):
    text = page(drill_id)
    cited = CITATION.findall(text)
    assert cited, f"{PAGES[drill_id]} cites no line range of its solution"
    assert len(cited) == text.count("](../solutions/"), "a citation link is not followed by its ```python block"
    for path, first, last, shown in cited:
        lines = (ROOT / path).read_text().splitlines()[int(first) - 1:int(last)]
        assert shown.rstrip("\n").splitlines() == lines, (
            f"{PAGES[drill_id].name} cites {path}:{first}-{last}, but the block it shows is not those lines now")


@pytest.mark.parametrize("drill_id", list(PAGES))
def test_no_solution_line_outside_details(drill_id):
    """The page teaches before it answers: no line of the reference stands outside a folded block."""
    text = page(drill_id)
    assert text.count("<details>") == text.count("</details>") == len(DETAILS.findall(text)) > 0
    for summary, _ in DETAILS.findall(text):
        assert "先做题" in summary, f"{drill_id}.md has a <details> block whose summary does not say 先做题"
    outside = outside_details(text)
    stem = next(d.stem for d in DRILLS if d.id == drill_id)
    quoted = [line for line in answer_lines(stem) if line in outside]
    assert not quoted, f"{drill_id}.md quotes solutions/{stem}.py outside <details>: {quoted}"


def test_track_map_links_every_drill_in_order():
    """content/README.md, the map a newcomer reads first: a picture, and every drill page in manifest order."""
    text = (ROOT / "content" / "README.md").read_text()
    assert "```mermaid" in text
    linked = re.findall(r"\]\((?:\./)?(\w+)\.md\)", text)
    first = {}
    for i, name in enumerate(linked):
        first.setdefault(name, i)
    ids = [d.id for d in DRILLS]
    assert all(i in first for i in ids), f"content/README.md does not link {[i for i in ids if i not in first]}"
    assert sorted(ids, key=first.get) == ids, "content/README.md links the drills out of the manifest's order"
    readme = (ROOT / "README.md").read_text()
    assert "(content/README.md)" in readme, "README.md does not link the track map"


def test_section_references_point_at_real_sections():
    sources = [*ROOT.glob("mine/*.py"), *ROOT.glob("solutions/*.py"), *ROOT.glob("tests/*.py"),
               *ROOT.glob("content/*.md")]
    for source in sources:
        for drill_id, number in re.findall(r"content/(\w+)\.md §(\d+)", source.read_text()):
            assert int(number) in sections(page(drill_id)), f"{source.name} points at {drill_id}.md §{number}"


@pytest.mark.parametrize("drill_id", list(PAGES))
def test_page_has_a_picture_pitfalls_and_self_tests(drill_id):
    text = page(drill_id)
    assert "```mermaid" in text
    assert re.search(r"`pitfall:\w+`", text)
    assert "自测" in text


@pytest.mark.parametrize("drill_id", list(PAGES))
def test_benchmark_numbers_are_the_measured_ones(drill_id):
    bench = (ROOT / "BENCHMARKS.md").read_text()
    quoted = [line for line in page(drill_id).splitlines() if "BENCHMARKS.md" in line]
    numbers = [n for line in quoted for n in re.findall(r"(\d[\d.,]*) ?(?:GB/s|µs|%|×)", line)]
    for number in numbers:
        assert number in bench, f"{drill_id}.md quotes {number} from BENCHMARKS.md, which does not hold it"


def test_readme_table_lists_every_drill_in_order():
    readme = (ROOT / "README.md").read_text()
    rows = re.findall(r"^\| (\w+) \| \[([^\]]+)\]\((content/\w+\.md)\) \| `(\w+)` \|", readme, re.M)
    assert rows == [(d.id.upper(), d.title, d.page, d.stem) for d in DRILLS]


# --- L1 ----------------------------------------------------------------------


def test_l1_worked_example_table():
    """§4's table: every column recomputed from the block table on the page."""
    text = section(page("l1"), 4)
    table = ast.literal_eval(re.search(r"block_table = (\[\[.*?\]\])", text, re.S).group(1))
    block_size = int(re.search(r"block_size = (\d+)", text).group(1))
    assert (table, block_size) == (WORKED_EXAMPLE["block_table"], WORKED_EXAMPLE["block_size"])
    rows = re.findall(r"^\| (\d+) \| (\d+) \| (\d+) \| (\d+) \| (\d+) \| (\d+) \| (\d+)·\d+ \+ \d+ = (\d+) \|", text, re.M)
    assert len(rows) == len(WORKED_EXAMPLE["slots"])
    solution = load_drill("solutions", "l1_paged_kv_write")
    for token, seq, pos, logical, physical, offset, _, slot in (map(int, r) for r in rows):
        assert (seq, pos) == (WORKED_EXAMPLE["seq_idx"][token], WORKED_EXAMPLE["positions"][token])
        assert (logical, offset) == (pos // block_size, pos % block_size)
        assert physical == table[seq][logical]
        got = solution.slot_mapping(torch.tensor(table), torch.tensor([seq]), torch.tensor([pos]), block_size)
        assert slot == int(got) == WORKED_EXAMPLE["slots"][token]


def test_l1_self_test_slot():
    text = page("l1")
    q = re.search(r"自测 1.*?block_size = (\d+).*?block_table = (\[[\d, ]+\]).*?position = (\d+).*?slot = .*?= (\d+)", text, re.S)
    block_size, table, position, answer = int(q.group(1)), ast.literal_eval(q.group(2)), int(q.group(3)), int(q.group(4))
    solution = load_drill("solutions", "l1_paged_kv_write")
    got = solution.slot_mapping(torch.tensor([table]), torch.tensor([0]), torch.tensor([position]), block_size)
    assert int(got) == answer


def test_l1_self_test_waste():
    text = page("l1")
    q = re.search(r"自测 2.*?长 (\d+) 个 token.*?block_size = (\d+).*?⌈.*?⌉ = (\d+) 个 block.*?浪费 (\d+) 个 slot"
                  r".*?预留 (\d+) .*?浪费 (\d+) 个", text, re.S)
    length, block_size, blocks, waste, reserved, waste_reserved = map(int, q.groups())
    assert blocks == -(-length // block_size)
    assert waste == blocks * block_size - length
    assert waste_reserved == reserved - length


def test_l1_paging_numbers():
    """§2: pages of 16 tokens for 600 tokens: 38 blocks, 608 slots."""
    blocks, slots = map(int, re.search(r"占 (\d+) 块、(\d+) 个 slot", page("l1")).groups())
    block_size, used = 16, 600
    assert blocks == -(-used // block_size) and slots == blocks * block_size


def test_l1_self_test_offset():
    """Self-test 3: the flat offset of (slot 13, head 3, element 5), read off a real cache tensor."""
    q = re.search(r"自测 3.*?H = (\d+)、D = (\d+).*?slot (\d+) 里 head (\d+) 的第 (\d+) 个元素.*?= (\d+) 个元素.*?是 (\d+) 字节",
                  page("l1"), re.S)
    num_heads, head_size, slot, head, element, offset, nbytes = map(int, q.groups())
    cache = torch.empty(8, 4, num_heads, head_size, dtype=torch.float16)
    assert cache[slot // 4, slot % 4, head, element].storage_offset() == offset
    assert offset * cache.element_size() == nbytes


def test_l1_self_test_bytes_moved():
    """Self-test 5 must agree with the manifest's byte count for the bench case."""
    from _manifest import kv_write_bytes

    q = re.search(r"自测 5.*?合计 (\d+) 字节.*?÷ (\d+) GB/s ≈ (\d+) µs", page("l1"), re.S)
    total, ceiling, micros = map(int, q.groups())
    assert total == kv_write_bytes(num_tokens=65536, num_heads=8, head_size=128, dtype="float16")
    assert round(total / ceiling / 1e3) == micros


def test_int32_boundary():
    """l1 §5, l1 self-test 6 and l2 §4: which fp16 caches still fit int32 offsets. A cache of exactly
    2**31 elements does (its largest offset is 2**31 - 1); only more elements overflow."""
    from _manifest import BY_ID

    gib = 2**30
    l1 = section(page("l1"), 5)
    row = 16 * 8 * 128  # elements per physical block at block_size 16, H 8, D 128
    caches = re.findall(r"(\d+) GiB (?:的 )?cache 是 (\d+) 个物理块", l1) + re.findall(r"(\d+) GiB、(\d+) 个物理块", l1)
    assert [size for size, _ in caches] == ["2", "4", "8"]
    for size, blocks in caches:
        assert int(blocks) * row * 2 == int(size) * gib, f"l1 §5: {blocks} blocks are not {size} GiB"
        fits = int(blocks) * row - 1 <= 2**31 - 1
        assert fits == (int(size) <= 4), f"l1 §5: a {size} GiB cache {'fits' if fits else 'overflows'} int32"
    assert int(re.search(r"fp16 的 2 GiB cache 是 (\d+) 个物理块", l1).group(1)) == \
        BY_ID["l1"].bench[-1].params["num_blocks"]  # the bench cache the page calls 2 GiB
    q = re.search(r"自测 6.*?有 (\d+) 个物理块.*?最后一个 slot 是 \d+ × (\d+) − 1 = (\d+)，它的最后一个元素偏移是 2³¹ − 1",
                  page("l1"), re.S)
    blocks, block_size, last_slot = map(int, q.groups())
    assert last_slot == blocks * block_size - 1 and (last_slot + 1) * 1024 - 1 == 2**31 - 1
    l2 = section(page("l2"), 4)
    blocks = int(re.search(r"2 GiB 的 fp16 cache 有 (\d+) 个物理块", l2).group(1))
    assert blocks * row * 2 == 2 * gib


@pytest.mark.parametrize("drill_id", list(PAGES))
def test_arithmetic_on_the_page(drill_id):
    """Every `a / b = c %` and every product `a × b × ... = c` written on a page."""
    text = page(drill_id)
    for a, b, c in re.findall(r"(\d+) / (\d+) = ([\d.]+) ?%", text):
        assert 100 * int(a) / int(b) == pytest.approx(float(c), abs=0.05), f"{a} / {b} = {c} %"
    for left, result in re.findall(r"((?:\d+[^\d×=+\n]*×\s*)+\d+)[^\d=+\n]*= (\d+)", text):
        factors = [int(n) for n in re.findall(r"\d+", left)]
        assert math.prod(factors) == int(result), f"{left} = {result}"


# --- L2 ----------------------------------------------------------------------


def test_l2_worked_example():
    """§3: the token table, every number of the step table, and the output, against the
    example the tests run (DECODE_EXAMPLE), the reference and the solution's kernel."""
    from _diagnose import check_paged_decode
    from _paged import DECODE_EXAMPLE, decode_example_case, online_softmax

    text = page("l2")
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
    case = decode_example_case(device=DEVICE)  # the solution's kernel runs where kernels run here
    assert shown_out == pytest.approx(float(case.reference()), abs=1e-4)
    assert shown_out == pytest.approx(float(want[-1][4] / want[-1][3]), abs=1e-4)
    out = load_drill("solutions", "l2_paged_decode").paged_decode_attention(*case.args(), **case.kwargs())
    check_paged_decode(case, out)


def test_l2_bench_bytes_and_flops():
    """§2's totals are the manifest's, for the B=64 bench case."""
    from _manifest import BY_ID, decode_bytes, decode_flops

    text = page("l2")
    section = text[text.index("## 2."):text.index("## 3.")]
    total = int(re.search(r"合计 (\d+) 字节", section).group(1))
    flops = int(re.search(r"FLOPs = [^\n]*?= (\d{5,})", section).group(1))
    params = next(c.params for c in BY_ID["l2"].bench if c.params["num_seqs"] == 64)
    assert total == decode_bytes(**params) and flops == decode_flops(**params)
    intensity = float(re.search(r"÷ \d+ ≈ ([\d.]+) FLOP/字节", section).group(1))
    assert intensity == pytest.approx(flops / total, abs=0.05)


def _l2_self_test(n):
    text = page("l2")
    start = text.index(f"**自测 {n}**")
    end = text.find("**自测", start + 5)
    return text[start:end if end > 0 else text.index("## 11.")]


def test_l2_self_test_online_update():
    import math

    from _paged import online_softmax

    q = _l2_self_test(1)
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


def test_l2_self_test_small_batch_bytes():
    from _manifest import BY_ID, decode_bytes, decode_flops

    q = _l2_self_test(2)
    kv = int(re.search(r"K/V：[^=]*= (\d+) 字节", q).group(1))
    total = int(re.search(r"合计 (\d+) 字节", q).group(1))
    flops = int(re.search(r"FLOPs = [^=]*= (\d+)", q).group(1))
    params = next(c.params for c in BY_ID["l2"].bench if c.params["num_seqs"] == 8)
    assert total == decode_bytes(**params) and flops == decode_flops(**params)
    assert kv == 2 * params["num_seqs"] * params["context"] * params["num_kv_heads"] * params["head_size"] * 2


def test_l2_self_test_block_table_columns():
    q = _l2_self_test(3)
    block_size, seq_len, width = map(int, re.search(r"block_size = (\d+)，某条序列 seq_len = (\d+)，.*?一行有 (\d+) 列",
                                                    q).groups())
    columns = [int(c) for c in re.search(r"只读第 ([\d、]+) 列", q).group(1).split("、")]
    live, masked = map(int, re.search(r"= (\d+) 个有效 token，其余 (\d+) 个 slot", q).groups())
    owned = -(-seq_len // block_size)
    assert columns == list(range(owned)) and owned <= width
    assert live == seq_len - (owned - 1) * block_size and masked == block_size - live


def test_l2_self_test_gqa_mapping():
    from _paged import paged_decode_case

    q = _l2_self_test(4)
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


def test_l2_self_test_split_lse():
    """Self-test 7: the lse of each half of §3's example, and their merge, which is the whole row's."""
    from _paged import DECODE_EXAMPLE as ex

    text = page("l2")
    q = _l2_self_test(7)
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


def test_l2_self_test_small_batch_grid():
    from _manifest import BY_ID

    q = _l2_self_test(6)
    programs, idle = map(int, re.search(r"= (\d+) 个 program，至少 \d+ − \d+ = (\d+) 个 SM", q).groups())
    params = next(c.params for c in BY_ID["l2"].bench if c.params["num_seqs"] == 8)
    assert programs == params["num_seqs"] * params["num_kv_heads"] and idle == 132 - programs
