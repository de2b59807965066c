"""Drill E2's page checks: the worked example's numbers (content/e2.md §4) are what the
block-manager model and the reference give, the reuse rule's numbers (§1, self-test 1),
and the bench arithmetic (§5, self-test 4) from the bench's own parameters."""
import re

from _tree import load_drill

from .bench import PARAMS
from .cases import SYSTEM, WORKED_EXAMPLE
from .reference import BlockManagerModel


def _results():
    ex = WORKED_EXAMPLE
    model = BlockManagerModel(ex["num_blocks"], ex["block_size"])
    return [model.apply(op) for op in ex["ops"]]


def check_worked_example_table(text):
    """§4's table: each allocate's reuse, then the free blocks and the stats after it."""
    part = text.split("<!-- worked-example -->")[1].split("<!-- /worked-example -->")[0]
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in part.splitlines()
            if re.match(r"\| \d", line)]
    results, ops = _results(), WORKED_EXAMPLE["ops"]
    allocs = [(op, r) for op, r in zip(ops, results) if op[0] == "allocate"]
    said = [int(row[2]) for row in rows if row[2] != "—"]
    assert said == [r for _, r in allocs], f"§4 says reuse {said}; the model gives {[r for _, r in allocs]}"
    assert [len(op[2]) for op, _ in allocs] == [int(re.search(r"(\d+) 个 token", row[1]).group(1))
                                               for row in rows if row[2] != "—"]
    assert f"`S = {SYSTEM}`" in text
    free, stats = results[-2], results[-1]
    after = text.split("<!-- /worked-example -->")[1]
    assert f"`num_free_blocks` 是 {free}" in after and f"`stats()` 是 `{stats}`" in after, (free, stats)


def check_worked_example_block_tables(text):
    """§4: the reference's block tables for B and C, block 0 shared."""
    ex = WORKED_EXAMPLE
    ops = ex["ops"][:4] + [("block_table", ["B", "C"])]
    got = load_drill("solutions", "e2_prefix_cache").replay_prefix_cache(ex["num_blocks"], ex["block_size"], ops)
    b, c = ([x for x in row if x >= 0] for row in got[-1].tolist())
    assert f"B `{b}`、C `{c}`" in text and b[0] == c[0] == 0, (b, c)


def check_reuse_rule(text):
    """§1: two identical 64-token prompts in blocks of 16, the second reuses 48; self-test 1."""
    def reuse(n, bs):
        model = BlockManagerModel(64, bs)
        model.apply(("allocate", 0, list(range(n))))
        return model.apply(("allocate", 1, list(range(n))))
    assert reuse(64, 16) == 48 and "复用 **48** 个 token" in text
    assert f"复用 {reuse(100, 16)}。96 个 token" in text and f"复用 {reuse(96, 16)}——" in text


def check_bench_arithmetic(text):
    """§5: the shared-prompt workload's prompt tokens, computed tokens with caching, the KV
    read per decode step; self-test 4's cascade prefix."""
    p = PARAMS
    prompt = p["system"] + p["own"]
    total = p["num_seqs"] * prompt
    computed = prompt + (p["num_seqs"] - 1) * p["own"]
    assert f"64 × {prompt} = {total}" in text and f"{prompt} + {(p['num_seqs'] - 1) * p['own']} = {computed}" in text
    assert f"{computed} / {total} = {100 * computed / total:.1f} %" in text
    assert f"{p['num_seqs']} × {p['system']} = {p['num_seqs'] * p['system']}" in text
    assert f"{p['system'] // 16} × 16 = {p['system']}" in text


PAGE_CHECKS = (check_worked_example_table, check_worked_example_block_tables, check_reuse_rule,
               check_bench_arithmetic)
