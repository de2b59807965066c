"""Drill E1's page checks: the worked example's table (content/e1.md §3) is what the
page's scheduling rule gives (reference.simulate), and the self-test answers."""
import re
from types import SimpleNamespace

from _tree import load_drill

from .cases import WORKED_EXAMPLE
from .reference import eos_ids, simulate, step_tensors


def _table_rows(text):
    """The worked example's table: one row per step, its cells as text."""
    part = text.split("<!-- worked-example -->")[1].split("<!-- /worked-example -->")[0]
    rows = [line.strip().strip("|").split("|") for line in part.splitlines() if line.startswith("| ")]
    return [[c.strip().strip("`") for c in row] for row in rows[1:] if not set(row[0]) <= set("- ")]  # no header


def check_worked_example_table(text):
    ex = WORKED_EXAMPLE
    steps = simulate(ex["prompt_lens"], ex["max_new"], ex["block_size"], None, ex["budget"])
    rows = _table_rows(text)
    assert len(rows) == len(steps), f"§3's table has {len(rows)} steps; the schedule has {len(steps)}"
    names = "ABC"
    for s, (row, step) in enumerate(zip(rows, steps)):
        starts, lens, slots = step_tensors(step, ex["block_size"])
        batch = " ".join(f"{names[r]}{n}" for r, _, n in step["rows"])
        want = [str(s), batch, str(starts), str(lens), str(step["block_table"]), str(slots)]
        got = [re.sub(r"\s+", " ", c) for c in row[:6]]
        assert [g.replace(" ", "") for g in got] == [w.replace(" ", "") for w in want], \
            f"§3, step {s}: the page says {got}, the schedule gives {want}"


def check_free_blocks_before_the_last_step(text):
    """§3, step 4: the free blocks before it (all of num_blocks = None's cache but those the
    live requests hold after step 3), and the lowest of them is the one C gets."""
    ex = WORKED_EXAMPLE
    steps = simulate(ex["prompt_lens"], ex["max_new"], ex["block_size"], None, ex["budget"])
    num_blocks = sum(-(-(p + n - 1) // ex["block_size"]) for p, n in zip(ex["prompt_lens"], ex["max_new"]))
    live = [r for r, _, _ in steps[4]["rows"]]
    held = {b for (r, _, _), row in zip(steps[3]["rows"], steps[3]["block_table"]) if r in live for b in row}
    free = sorted(set(range(num_blocks)) - held)
    said = re.search(r"空闲的是 ([\d、和 ]+)（cache 一共 (\d+) 块", text.split("<!-- /worked-example -->")[1])
    assert [int(b) for b in re.findall(r"\d+", said.group(1))] == free and int(said.group(2)) == num_blocks
    taken = steps[4]["block_table"][0][-1]
    assert taken == free[0] and f"给编号最小的 {taken}" in text


def check_padded_block_tables(text):
    """§3: the block tables L3 gets are -1-padded to the widest row; the page shows steps 0
    and 1, and the reference's BlockManager gives the same tensors."""
    ex = WORKED_EXAMPLE
    steps = simulate(ex["prompt_lens"], ex["max_new"], ex["block_size"], None, ex["budget"])
    shown = []
    for step in steps[:2]:
        width = max(len(row) for row in step["block_table"])
        shown.append([row + [-1] * (width - len(row)) for row in step["block_table"]])
    said = "".join(f"步 {s} 是 `{str(t).replace(' ', '').replace(',', ', ')}`" + ("，" if s == 0 else "")
                   for s, t in enumerate(shown))
    assert said in text, f"§3 should say {said}"
    manager = load_drill("solutions", "e1_paged_engine").BlockManager(6, ex["block_size"])
    manager.allocate("A", 5), manager.allocate("B", 3)
    assert manager.block_table(["A", "B"]).tolist() == shown[0]


def check_eos_rule(text):
    """§5: the EOS ids are generation_config.eos_token_id (an int or a list); the tests'
    reference reads only it, the reference solution falls back to config.eos_token_id."""
    part = text[text.index("**请求什么时候结束。**"):text.index("一个请求最多占多少块")]
    for needle in ("`model.generation_config.eos_token_id`", "`model.config.eos_token_id`", "列表", "`eos_ids`", "`_eos_ids`"):
        assert needle in part, f"§5's EOS paragraph should name {needle}"
    solution = load_drill("solutions", "e1_paged_engine")

    def model(generation, config):
        return SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=generation),
                               config=SimpleNamespace(eos_token_id=config))
    assert solution._eos_ids(model([3, 4], 9)) == eos_ids(model([3, 4], 9)) == {3, 4}
    assert solution._eos_ids(model(7, 7)) == eos_ids(model(7, 7)) == {7}
    assert solution._eos_ids(model(None, 7)) == {7} and eos_ids(model(None, 7)) == set()
    assert solution._eos_ids(model(None, None)) == eos_ids(model(None, None)) == set()


def check_self_test_blocks(text):
    """§10 question 1: a 1000-token prompt with 200 new tokens in blocks of 16 needs
    ceil(1199 / 16) = 75 blocks at most (the last new token never enters the cache)."""
    assert "**75**" in text.split("## 10")[1], "§10's first answer is 75 blocks"
    assert -(-(1000 + 200 - 1) // 16) == 75


def check_self_test_budget(text):
    """§10 question 2: the worked example under a budget of 16 takes 4 steps."""
    ex = WORKED_EXAMPLE
    assert len(simulate(ex["prompt_lens"], ex["max_new"], ex["block_size"], None, 16)) == 4
    assert "一共 4 步" in text.split("## 10")[1]


# SmolLM2-135M-Instruct's shape (tests/drills/e1/cases.py): layers, query heads, KV heads, head size.
SMOLLM2 = dict(layers=30, heads=9, kv_heads=3, head_size=64)


def check_chat_numbers(text):
    """The chat section's arithmetic (§7, 让它开口): the hidden size is the query heads times
    their size (not the other way round), the GQA group, and a token's fp32 K/V bytes with 3
    KV heads and with 9."""
    part = text.split("### 让它开口")[1].split("\n## ")[0]
    m = SMOLLM2
    assert f"{m['heads']} / {m['kv_heads']} = {m['heads'] // m['kv_heads']}" in part
    assert (f"有 {m['heads']} 个 query head，每个 {m['head_size']} 维，拼起来 {m['heads']} × {m['head_size']} = "
            f"{m['heads'] * m['head_size']} 正好是 hidden") in part
    assert f"{m['heads'] * m['head_size']} = {m['heads']} × {m['head_size']}，所以" not in part  # cause and effect
    per_token = 2 * m["layers"] * m["kv_heads"] * m["head_size"] * 4
    stated = re.search(r"2 × 30 层 × 3 × 64 × 4 字节 ≈ (\d+) KB，而不是 (\d+) KB", part)
    assert stated, "§7's chat part no longer states a token's K/V bytes as the check expects"
    assert int(stated[1]) == round(per_token / 1000) and int(stated[2]) == round(per_token * 3 / 1000)


PAGE_CHECKS = (check_worked_example_table, check_free_blocks_before_the_last_step, check_padded_block_tables,
               check_eos_rule, check_self_test_blocks, check_self_test_budget, check_chat_numbers)
