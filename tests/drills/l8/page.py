"""Drill L8's page checks: every number content/l8.md works out, recomputed (the worked
example through the float64 reference, the savings of gpt-oss's and Gemma 3's windows, the
tile-pruning example by the rule the reference kernel follows, the roofline's bytes against
the bench's count, the self-tests' answers); PAGE_CHECKS in the order the drill runs them."""
import math

from _pages import section
from _traffic import check_page_line
from _tree import ROOT, load_drill
from _wrong import folder, plant_edits

from .bench import BENCH, window_keys
from .cases import WINDOW_EXAMPLE, example_case, example_outputs
from .mistakes import PLANTED
from .traffic import traffic


def _shows(text, *values):
    for v in values:
        assert str(v) in text, f"content/l8.md should show {v}"


def check_worked_example(text):
    """§4: the outputs with the sink, without it, with a window one key short; the dead block;
    and the float64 reference gives the same on the example's paged case."""
    right = example_outputs()
    assert [round(x, 4) for x in right] == [6.0, 6.8]
    assert [round(x, 4) for x in example_outputs(sink=False)] == [7.5, 8.5]
    assert [round(x, 4) for x in example_outputs(window_left=2)] == [6.0, 6.75]
    ref = example_case().reference().flatten().tolist()
    assert [round(x, 9) for x in ref] == [round(x, 9) for x in right]
    assert example_case(decode=True).reference().flatten().tolist() == [6.8]
    body = section(text, 4)
    _shows(body, "(6 + 7 + 8 + 9) / 5 = 6.0", "(7 + 8 + 9 + 10) / 5 = 6.8", "7.5 和 8.5", "(8 + 9 + 10) / 4 = 6.75",
           "[-1, 4, 1]", "10 − 2 = 8", "8 − 3 = 5", "10 − 1 − 3 = 6")
    ex = WINDOW_EXAMPLE
    first_window = ex["seq_len"] - ex["q_len"] - ex["window_left"]
    dead = [b for b in range(3) if (b + 1) * ex["block_size"] <= first_window]
    assert dead == [0] and ex["block_table"][0][0] == -1


def check_window_savings(text):
    """§2: gpt-oss's bytes per token and layer, at 32768 and at the window; the model's
    total; the prefill's keys; Gemma 3's 5:1 at a window of 1024."""
    per_token = 8 * 64 * 2 * 2
    full, window = per_token * 32768, per_token * 128
    assert (per_token, full, window, full // window) == (2048, 67108864, 262144, 256)
    all_full, half = 36 * full, 18 * full + 18 * window
    keys_full, keys_window = window_keys(32768, 0, -1), window_keys(32768, 0, 127)
    gemma = (5 * 1024 + 32768) / (6 * 32768)
    body = section(text, 2)
    _shows(body, per_token, full, window, "少 256 倍", all_full, half, f"{100 * half / all_full:.1f} %",
           keys_full, keys_window, f"少 {keys_full / keys_window:.2f} 倍", 5 * 1024 + 32768, 6 * 32768,
           f"{100 * gemma:.1f} %")


def check_tile_pruning(text):
    """§5's example by the reference's rule: TILE 16, window_left 40, queries at 100-103."""
    tile, w, p0, p1 = 16, 40, 100, 103
    lo = p0 - w
    skipped = lo // tile
    free_lo, free_hi = -(-(p1 - w) // tile) * tile, (p0 + 1) // tile * tile
    assert (lo, skipped, lo // tile * tile, free_lo, free_hi) == (60, 3, 48, 64, 96)
    _shows(section(text, 5), "[60, 103]", "3 个 tile", "48–59 不加载", "[103 − 40, 100] = [63, 100]",
           "tile 64–79、80–95", "tile 96–111")


def check_roofline(text):
    """§7: the window's bytes are the bench's count; the copy ceiling and times quoted are
    BENCHMARKS.md's."""
    decode = BENCH[0].params
    kv = 2 * decode["num_seqs"] * (decode["window_left"] + 1) * decode["num_kv_heads"] * decode["head_size"] * 2
    rows = decode["num_seqs"] * decode["num_heads"] * decode["head_size"] * 2
    assert kv + 2 * rows == BENCH[0].bytes == 17825792
    whole = 2 * decode["num_seqs"] * (decode["context"] + 1) * decode["num_kv_heads"] * decode["head_size"] * 2
    body = section(text, 7)
    _shows(body, kv, rows, BENCH[0].bytes, whole, "3023 GB/s", f"{BENCH[0].bytes / 3023e9 * 1e6:.1f} µs")
    measured = (ROOT / "BENCHMARKS.md").read_text()
    for quoted in ("3023", "10.23 µs", "57.6 %", "1425.25 µs", "139×"):
        assert quoted in measured and quoted in body, f"{quoted} should stand in BENCHMARKS.md and in §7"
    check_page_line(body, "l8", traffic(load_drill("solutions", "l8_sliding_window")))
    if traffic(load_drill("solutions", "l8_sliding_window")) is not None:  # counted under the interpreter only
        tree = plant_edits(PLANTED, PLANTED.pitfalls["tiles_outside_window_loaded"].edits, folder() / "l8-page")
        wasteful = traffic(load_drill(tree, PLANTED.stem))
        assert f"K/V 一项会到 {wasteful['parts']['K/V']:.2f}×" in body, wasteful["line"]


def check_self_tests(text):
    """§11: each answer recomputed."""
    body = section(text, 11)
    ex = WINDOW_EXAMPLE
    short = example_outputs(window_left=1)
    _shows(body, f"{short[0]:.3f}", f"{short[1]:.3f}", f"{math.exp(30):.3g}".replace("e+13", " × 10¹³"),
           "32640 = 510 × 64", f"{1 + math.log(4):.3f}")
    assert ex["seq_len"] - ex["q_len"] - 1 == 7  # self-test 1's window start
    assert 32767 - 127 == 32640 and 32640 % 64 == 0


PAGE_CHECKS = (check_worked_example, check_window_savings, check_tile_pruning, check_roofline, check_self_tests)
