"""L1's page checks: every number content/l1.md works out, recomputed (tests/test_content.py)."""
import ast
import re

import torch

from _pages import section
from _traffic import check_page_line
from _tree import load_drill

from .bench import BENCH, kv_write_bytes
from .cases import WORKED_EXAMPLE
from .traffic import TRAFFIC_CASE, traffic


def check_worked_example_table(text):
    """§4's table: every column recomputed from the block table on the page."""
    text = section(text, 4)
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


def check_self_test_slot(text):
    q = re.search(r"自测 1.*?block_size = (\d+).*?block_table = (\[[\d, ]+\]).*?position = (\d+).*?slot = .*?= (\d+)", text, re.S)
    block_size, table, position, answer = int(q.group(1)), ast.literal_eval(q.group(2)), int(q.group(3)), int(q.group(4))
    solution = load_drill("solutions", "l1_paged_kv_write")
    got = solution.slot_mapping(torch.tensor([table]), torch.tensor([0]), torch.tensor([position]), block_size)
    assert int(got) == answer


def check_self_test_waste(text):
    q = re.search(r"自测 2.*?长 (\d+) 个 token.*?block_size = (\d+).*?⌈.*?⌉ = (\d+) 个 block.*?浪费 (\d+) 个 slot"
                  r".*?预留 (\d+) .*?浪费 (\d+) 个", text, re.S)
    length, block_size, blocks, waste, reserved, waste_reserved = map(int, q.groups())
    assert blocks == -(-length // block_size)
    assert waste == blocks * block_size - length
    assert waste_reserved == reserved - length


def check_paging_numbers(text):
    """§2: pages of 16 tokens for 600 tokens: 38 blocks, 608 slots."""
    blocks, slots = map(int, re.search(r"占 (\d+) 块、(\d+) 个 slot", text).groups())
    block_size, used = 16, 600
    assert blocks == -(-used // block_size) and slots == blocks * block_size


def check_self_test_offset(text):
    """Self-test 3: the flat offset of (slot 13, head 3, element 5), read off a real cache tensor."""
    q = re.search(r"自测 3.*?H = (\d+)、D = (\d+).*?slot (\d+) 里 head (\d+) 的第 (\d+) 个元素.*?= (\d+) 个元素.*?是 (\d+) 字节",
                  text, re.S)
    num_heads, head_size, slot, head, element, offset, nbytes = map(int, q.groups())
    cache = torch.empty(8, 4, num_heads, head_size, dtype=torch.float16)
    assert cache[slot // 4, slot % 4, head, element].storage_offset() == offset
    assert offset * cache.element_size() == nbytes


def check_self_test_bytes_moved(text):
    """Self-test 5 must agree with the manifest's byte count for the bench case."""
    q = re.search(r"自测 5.*?合计 (\d+) 字节.*?÷ (\d+) GB/s ≈ (\d+) µs", text, re.S)
    total, ceiling, micros = map(int, q.groups())
    assert total == kv_write_bytes(num_tokens=65536, num_heads=8, head_size=128, dtype="float16")
    assert round(total / ceiling / 1e3) == micros


def check_int32_boundary(text):
    """§5 and self-test 6: which fp16 caches still fit int32 offsets. A cache of exactly
    2**31 elements does (its largest offset is 2**31 - 1); only more elements overflow."""
    gib = 2**30
    part = section(text, 5)
    row = 16 * 8 * 128  # elements per physical block at block_size 16, H 8, D 128
    caches = re.findall(r"(\d+) GiB (?:的 )?cache 是 (\d+) 个物理块", part) + re.findall(r"(\d+) GiB、(\d+) 个物理块", part)
    assert [size for size, _ in caches] == ["2", "4", "8"]
    for size, blocks in caches:
        assert int(blocks) * row * 2 == int(size) * gib, f"§5: {blocks} blocks are not {size} GiB"
        fits = int(blocks) * row - 1 <= 2**31 - 1
        assert fits == (int(size) <= 4), f"§5: a {size} GiB cache {'fits' if fits else 'overflows'} int32"
    assert int(re.search(r"fp16 的 2 GiB cache 是 (\d+) 个物理块", part).group(1)) == \
        BENCH[-1].params["num_blocks"]  # the bench cache the page calls 2 GiB
    q = re.search(r"自测 6.*?有 (\d+) 个物理块.*?最后一个 slot 是 \d+ × (\d+) − 1 = (\d+)，它的最后一个元素偏移是 2³¹ − 1",
                  text, re.S)
    blocks, block_size, last_slot = map(int, q.groups())
    assert last_slot == blocks * block_size - 1 and (last_slot + 1) * 1024 - 1 == 2**31 - 1


def check_traffic_line(text):
    """§1's traffic line is what the reference's traffic case gives (run here, in the
    CPU interpreter; on a GPU there is nothing to count), and the case is the one described."""
    p = TRAFFIC_CASE
    assert (p["num_heads"], p["head_size"], p["block_size"]) == (2, 32, 16) and "H=2、D=32、block_size=16" in text
    check_page_line(text, "l1", traffic(load_drill("solutions", "l1_paged_kv_write")))


PAGE_CHECKS = (check_traffic_line, check_worked_example_table, check_self_test_slot, check_self_test_waste,
               check_paging_numbers, check_self_test_offset, check_self_test_bytes_moved, check_int32_boundary)
