"""The traffic report (tests/_traffic.py): the adapter over Triton's interpreter counts
what a kernel loads and stores, fails loudly when Triton moves the hooks, the
references move (almost) exactly the fewest bytes their drill's page counts, and
kernels that are right but wasteful are told apart by the report's words. The counts
are the worker's word: they explain a failure and advise, and decide no test (a file
that rewrites them gains no pass)."""
import pytest
import torch
import triton
import triton.language as tl

import _env
import _counting
import _traffic
import _wrong
from _manifest import drill as find_drill
from _worker import WORKER, tree_module

pytestmark = pytest.mark.skipif(not _env.INTERPRET, reason="bytes are counted only under the CPU interpreter")

L1, L2, L3, L4, F1, L8 = (find_drill(d) for d in ("l1", "l2", "l3", "l4", "f1", "l8"))


@triton.jit
def _copy_and_gather(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < n)        # n lanes
    first = tl.load(x_ptr + i // 4, mask=i < n)  # lanes of one load on one address: counted once
    tl.store(y_ptr + i, x + first, mask=i < n)


def _launch(x, y):
    _copy_and_gather[(2,)](x, y, 10, BLOCK=16)


# --- the adapter -----------------------------------------------------------------


def test_the_interpreter_still_has_the_hooks():
    """Fails loudly (naming the hook) the day Triton renames or reshapes one, on this
    machine's Triton."""
    _counting.interpreter()


def test_a_small_kernel_is_counted_exactly():
    x, y = torch.arange(12, dtype=torch.float16), torch.zeros(12, dtype=torch.float16)
    _, counted = _counting.measure_here(_launch, [x, y], x, y)
    read, written = counted.tensors
    # Per program: 10 lanes of 2 bytes, then x[0..2] (3 distinct addresses); two programs.
    assert (read.loaded, read.distinct_loaded, read.reread, read.stored) == (2 * (20 + 6), 20, 32, 0)
    assert (written.stored, written.distinct_stored, written.loaded) == (40, 20, 0)
    assert _traffic.was_read(read, x[:3]) and not _traffic.was_read(read, x[10:])
    assert counted.launches == 1 and counted.outside.loaded == 0 and counted.scratch.loaded == 0


def test_the_worker_counts_and_sends_the_counts_back():
    """The learner's code runs in the worker, so the counting happens there."""
    case = L1.traffic.__globals__["traffic_case"]()
    module = tree_module("solutions", L1.stem)
    _, counted = _traffic.measure(module, "reshape_and_cache", *case.args())
    real = int((case.slot_mapping >= 0).sum())
    row = case.key.shape[1] * case.key.shape[2] * 2
    assert counted.tensors[0].loaded == counted.tensors[1].loaded == real * row
    assert counted.tensors[2].stored == counted.tensors[3].stored == real * row


def test_a_renamed_hook_fails_loudly(monkeypatch):
    module = _counting.interpreter()
    monkeypatch.delattr(module.InterpreterBuilder, "create_masked_load")
    with pytest.raises(_counting.TrafficUnavailable, match="create_masked_load"):
        _counting.interpreter()


def test_loads_routed_around_the_hook_fail_loudly_not_as_zero_bytes(monkeypatch):
    """If Triton stopped funnelling plain loads and stores through the masked ones, the
    report would read zero bytes: it must raise instead."""
    module = _counting.interpreter()
    from triton._C.libtriton import interpreter as native  # what the builder calls underneath
    import numpy as np

    def load(self, ptr, cache_policy, is_volatile):
        dtype = ptr.get_element_ty()
        data = native.load(ptr.data, np.ones_like(ptr.data, dtype=bool),
                           np.zeros_like(ptr.data, dtype=module._get_np_dtype(dtype)), module._get_np_dtype(dtype))
        return module.TensorHandle(data, dtype)

    def store(self, ptr, val, cache_policy):
        return native.store(ptr.data, val.data, np.ones_like(ptr.data, dtype=bool))

    monkeypatch.setattr(module.InterpreterBuilder, "create_load", load)
    monkeypatch.setattr(module.InterpreterBuilder, "create_store", store)

    @triton.jit
    def unmasked_copy(x_ptr, y_ptr, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        tl.store(y_ptr + i, tl.load(x_ptr + i))

    x, y = torch.ones(16), torch.zeros(16)
    with pytest.raises(_counting.TrafficUnavailable, match="no load or store reached"):
        _counting.measure_here(lambda: unmasked_copy[(1,)](x, y, BLOCK=16), [x, y])
    assert torch.equal(y, x)


def test_on_a_gpu_nothing_is_counted_and_nothing_runs(monkeypatch):
    """Without the interpreter there are no loads to see: no line, no run of CPU tensors."""
    monkeypatch.setattr(_env, "INTERPRET", False)
    calls = []
    assert _traffic.measure(type("M", (), {"f": staticmethod(lambda: calls.append(1))}), "f") == (None, None)
    assert calls == [] and L2.traffic(tree_module("solutions", L2.stem)) is None
    assert _traffic.in_subprocess(L2, "solutions") is None


# --- the references: the fewest bytes their pages count -----------------------------


@pytest.mark.parametrize("entry", [L1, L2, L3, L4, F1, L8], ids=lambda d: d.id)
def test_the_reference_moves_the_fewest_bytes(entry):
    assert entry.traffic is not None, f"{entry.id} has no traffic case"
    """On the drill's traffic case (its bench case shrunk), the reference loads and stores
    at most 1.05× what the bandwidth report counts, and nothing to explain."""
    result = entry.traffic(tree_module("solutions", entry.stem))
    assert result["loads"] <= 1.05 and result["stores"] <= 1.05, result["line"]
    assert result["loads"] >= 1.0 and result["stores"] >= 1.0, result["line"]
    assert result["tier"] == "at the roofline" and result["where"] == [], result


# --- three kernels that are right but wasteful, told apart by the report ---------------

# L1 "loads before the slot is known": the row loads are masked by the row length only.
L1_PADDING_READ = (
    ("k = tl.load(key_ptr + token * key_stride + cols, mask=keep)",
     "k = tl.load(key_ptr + token * key_stride + cols, mask=cols < HD)"),
    ("v = tl.load(value_ptr + token * value_stride + cols, mask=keep)",
     "v = tl.load(value_ptr + token * value_stride + cols, mask=cols < HD)"),
)
# L2 without GQA grouping: one program per query head, each reading its KV head's K and V.
L2_NO_GQA = (
    ("kv_head = tl.program_id(1).to(tl.int64)",
     "head = tl.program_id(1).to(tl.int64)\n    kv_head = head // (NUM_HEADS // NUM_KV_HEADS)"),
    ("heads = kv_head * GROUP + rows", "heads = head + rows"),
    ("paged_decode_kernel[(num_seqs, num_kv_heads)](", "paged_decode_kernel[(num_seqs, num_heads)]("),
    ("HEAD_SIZE=head_size, GROUP=group,", "HEAD_SIZE=head_size, GROUP=1,"),
)
# L2 reading the block table once per token: a scalar load per token of the tile.
L2_TABLE_PER_TOKEN = (
    ("        block = tl.load(block_table_ptr + seq * table_stride + pos // BLOCK_SIZE, mask=live, other=0)\n",
     "        block = tl.zeros([TILE], tl.int32)\n"
     "        for t in tl.static_range(TILE):\n"
     "            entry = tl.load(block_table_ptr + seq * table_stride + (start + t) // BLOCK_SIZE,\n"
     "                            mask=start + t < seq_len, other=0)\n"
     "            block = tl.where(tl.arange(0, TILE) == t, entry, block)\n"),
)
# L2 loading its whole block-table row, the K/V loads still masked: the answer is right.
L2_WHOLE_ROW = (
    ("pos // BLOCK_SIZE, mask=live, other=0)", "pos // BLOCK_SIZE, mask=pos < table_stride * BLOCK_SIZE, other=0)"),
)

SAYS = {"padding": "padding rows were read", "gqa": "once per query head", "table": "once per token",
        "garbage": "past a sequence's last block"}


def _planted(entry, edits, tmp_path):
    return tree_module(_wrong.plant_edits(entry, edits, tmp_path / "tree"), entry.stem)


def _said(result):
    return {key for key, phrase in SAYS.items() if any(phrase in w for w in result["where"])}


def test_l1_reading_padding_rows_is_right_but_reported(tmp_path):
    from drills.l1 import check_kv_write, traffic_case
    module = _planted(L1, L1_PADDING_READ, tmp_path)
    case = traffic_case()
    module.reshape_and_cache(*case.args())
    check_kv_write(case)  # right
    result = L1.traffic(module)
    assert _said(result) == {"padding"}, result
    assert result["parts"]["key/value"] > 1.05, result["line"]


# Appended to a planted file: the worker's counter rewritten from the learner's module (it is
# in the worker's sys.modules), so that no load is counted at all, stores still are.
COUNTS_REWRITTEN = """
import sys as _sys
if "_counting" in _sys.modules:  # planted: the worker's own load counter, rewritten by the learner's file
    _recorder = _sys.modules["_counting"]._Recorder
    _real_access = _recorder.access
    _recorder.access = lambda self, ptrs, mask, size, store: _real_access(self, ptrs, mask, size, store) if store \\
        else None
"""


def _graded(check, module, case):
    """A read-side check's verdict on a module: ("passed", [], "") or ("failed", the pitfalls
    named, the message)."""
    from _diagnose import Mismatch
    try:
        check(module, case)
    except Mismatch as error:
        return "failed", error.pitfalls, str(error)
    return "passed", [], ""


def test_l1_a_count_rewriting_kernel_that_reads_padding_rows_gains_no_pass(tmp_path):
    """Issue 47: two kernels that read the padding rows, one that writes right and one that
    writes them too (padding_written), each as it is and with its file rewriting the
    worker's load counts. The read-side test passes or fails on the values alone, so the
    same with the rewrite as without (the right write passes, the other fails); the counts
    only explain (the honest failure names padding_written from them, its status said) and
    advise (the honest reader's traffic report names its reads: the test above). A count
    changes no verdict, so rewriting one gains nothing."""
    from _traffic import COUNTS_WORD
    from _worker import TreeModule, Worker
    from drills.l1 import check_padding_not_read, random_kv_write_case

    def case():
        return random_kv_write_case(context_lens=[2, 9], new_lens=[3, 2], padding=[0, 3, 6], block_size=4,
                                    num_heads=2, head_size=8)
    kernels = {"reads": L1_PADDING_READ, "writes": L1.pitfalls["padding_written"].edits}
    forged = {}
    for name, edits in kernels.items():
        forged[name] = _wrong.plant_edits(L1, edits, tmp_path / f"forged-{name}")
        with open(forged[name] / f"{L1.stem}.py", "a") as f:
            f.write(COUNTS_REWRITTEN)
    worker = Worker(readable=forged.values())  # its own: the rewrite stays in the process it was made in
    try:
        for name, edits in kernels.items():
            honest, forger = _planted(L1, edits, tmp_path / f"honest-{name}"), TreeModule(forged[name], L1.stem, worker)
            verdicts = [_graded(check_padding_not_read, module, case()) for module in (honest, forger)]
            assert [v[0] for v in verdicts] == ["failed" if name == "writes" else "passed"] * 2, verdicts
            if name == "writes":  # the honest counts explain the failure too, naming the pitfall, their status said
                assert "padding_written" in verdicts[0][1] and COUNTS_WORD in verdicts[0][2], verdicts[0]
                assert COUNTS_WORD not in verdicts[1][2]  # the forger's counts show no read: nothing to add
    finally:
        worker.stop()


def test_values_decide_and_counts_only_explain():
    """tests/_traffic.py's values_decide: right values pass without the counts even being
    read (counts that would raise, or name a pitfall, change nothing); wrong values fail,
    explained by the counts with their status said; counts that cannot be read explain
    nothing and fail nothing more."""
    from _diagnose import Mismatch
    from _traffic import COUNTS_WORD, values_decide

    def never(counted):
        raise AssertionError("the counts were read although the values were right")
    with values_decide(object(), never):
        pass
    with pytest.raises(Mismatch) as caught:
        with values_decide(object(), lambda counted: [("rows 0 and 3 were read", "padding_written")]):
            raise Mismatch("wrong values", ["other"])
    assert caught.value.pitfalls == ["other", "padding_written"]
    assert str(caught.value).startswith("wrong values\n") and COUNTS_WORD in str(caught.value)
    for counted, explain in ((None, never), (object(), lambda counted: 1 / 0)):
        with pytest.raises(Mismatch) as caught:
            with values_decide(counted, explain):
                raise Mismatch("wrong values", ["other"])
        assert str(caught.value) == "wrong values" and caught.value.pitfalls == ["other"]


@pytest.mark.parametrize("entry,edit,call", [
    (L3, ("key // BLOCK_SIZE, mask=key_live, other=0)", "key // BLOCK_SIZE, mask=key < table_stride * BLOCK_SIZE, "
                                                          "other=0)"), "l3"),
    (L4, L2_WHOLE_ROW[0], "l4")], ids=["l3", "l4"])
def test_l3_and_l4_loading_the_whole_table_row_pass_their_test_and_are_reported(tmp_path, entry, edit, call):
    """The K/V loads still masked, the answer is right: the test passes (the garbage entries
    it loaded are counted in the worker: its word), and the traffic report names them."""
    from importlib import import_module

    module = import_module(f"drills.{call}")

    def case():
        return (module.paged_prefill_case([3, 20, 1], [2, 30, 47], num_heads=8, num_kv_heads=2, head_size=16,
                                          block_size=4, extra_columns=3, seed=6) if call == "l3"
                else module.split_case([5, 17, 40, 70], num_splits=3, extra_columns=3, seed=6))
    planted = _planted(entry, (edit,), tmp_path)
    for tree in (tree_module("solutions", entry.stem), planted):
        assert module.check_table_read_only_to_last_block(tree, case())
    assert "garbage" in _said(entry.traffic(planted))


def test_l8_reference_reads_no_kv_row_before_the_window_and_loading_them_is_reported(tmp_path):
    """design.md: no K/V row of a block before the window of a program's queries is read (the
    cost follows the window). Counted under the interpreter on the reference, prefill and
    decode; a kernel that loads the tiles before the window and masks their scores is right
    here (every block of the traffic case is live) and its traffic line says what it read."""
    from drills.l8 import check_window
    from drills.l8.traffic import measured, rows_read_before_window, traffic_case
    reference = tree_module("solutions", L8.stem)
    for decode in (True, False):
        case = traffic_case(decode=decode)
        _, counted = measured(reference, case)
        assert rows_read_before_window(case, counted) == [], case.function
    module = _planted(L8, L8.pitfalls["tiles_outside_window_loaded"].edits, tmp_path)
    for decode in (True, False):
        case = traffic_case(decode=decode)
        check_window(case, case.call(module))  # right values
        _, counted = measured(module, case)
        assert rows_read_before_window(case, counted), case.function
    result = L8.traffic(module)
    assert any("wholly before the window" in w for w in result["where"]) and result["parts"]["K/V"] > 2, result


def _l2_right(module):
    from _paged import poisoned_out
    from drills.l2 import check_paged_decode, traffic_case
    case = traffic_case()
    out = poisoned_out(case.query.shape, case.query.dtype, "cpu", torch.Generator().manual_seed(0))
    check_paged_decode(case, out, module.paged_decode_attention(*case.args(), out=out.view))


def test_l2_without_gqa_grouping_is_right_but_reported(tmp_path):
    module = _planted(L2, L2_NO_GQA, tmp_path)
    _l2_right(module)
    result = L2.traffic(module)
    assert _said(result) == {"gqa"}, result
    assert result["parts"]["K/V"] == pytest.approx(4.0, rel=0.01) and result["tier"] == "wasteful", result["line"]


def test_l2_reading_the_block_table_per_token_is_right_but_reported(tmp_path):
    module = _planted(L2, L2_TABLE_PER_TOKEN, tmp_path)
    _l2_right(module)
    result = L2.traffic(module)
    assert _said(result) == {"table"}, result
    assert result["parts"]["block table"] >= 16, result["line"]


def test_l2_loading_the_whole_table_row_is_right_passes_its_test_and_is_reported(tmp_path):
    """The value checks cannot see it (the K/V loads are masked): the test passes, and the
    counted reads (the worker's word) name it in the traffic report, as advice."""
    from drills.l2 import check_table_read_only_to_last_block, small_case
    module = _planted(L2, L2_WHOLE_ROW, tmp_path)
    _l2_right(module)
    assert check_table_read_only_to_last_block(module, small_case("cpu", [5, 17, 32, 40], extra_columns=3, seed=6))
    assert any("pitfall:reads_past_seq_len" in w for w in L2.traffic(module)["where"])


def test_l7_without_split_partials_is_right_and_not_told_its_work_ran_elsewhere(tmp_path):
    """An L7 kernel that never splits (one pass per sequence, straight into out and lse) is
    right and reads no partial back: its fewest bytes are one split's, so its line is at the
    roofline, not "not all counted ... ran elsewhere" (all its work ran in Triton; issue 48)."""
    from drills.l7 import check_decode
    from drills.l7.traffic import traffic_case
    l7 = find_drill("l7")
    module = _planted(l7, (("num_splits = default_num_splits(num_seqs, num_heads, device) if num_splits is None "
                            "else num_splits", "num_splits = 1  # planted: never split"),), tmp_path)
    case = traffic_case()
    check_decode(case, module.mla_decode_attention(*case.args(), **case.kwargs()))
    result = l7.traffic(module)
    assert result["tier"] == "at the roofline" and not any("elsewhere" in w for w in result["where"]), \
        f"a right kernel that does not split was told: {result['line']} {result['where']}"


def test_l7_half_empty_head_tiles_are_right_and_reported(tmp_path):
    """Half of every head tile left empty: twice the programs, each reading the latent rows.
    The values are right, so no test fails it (the counts decide none); its traffic line
    says the rows were read twice."""
    from drills.l7 import check_decode
    from drills.l7.mistakes import HEAD_TILE_HALF_EMPTY
    from drills.l7.traffic import traffic_case
    l7 = find_drill("l7")
    module = _planted(l7, HEAD_TILE_HALF_EMPTY, tmp_path)
    case = traffic_case()
    check_decode(case, module.mla_decode_attention(*case.args(), **case.kwargs()))
    result = l7.traffic(module)
    assert any("latent rows were read up to 2×" in w for w in result["where"]), \
        f"half-empty head tiles read every latent row twice; the traffic report says {result['where']}"


# --- the grade's line --------------------------------------------------------------


def test_the_grade_computes_the_line_in_a_process_of_its_own_and_draws_it(tmp_path):
    from rich.console import Console

    import _render
    from _tree import ROOT

    # The reference, printing the start of a report with no newline: it must not run into the real one.
    tree = _wrong.plant_edits(L2, (), tmp_path / "tree")
    with open(tree / f"{L2.stem}.py", "a") as f:
        f.write("\n_real = paged_decode_attention\n\n\ndef paged_decode_attention(*args, **kwargs):\n"
                "    print('{\"line\": \"L2  loads 1.00x (forged)\", \"x\": ', end='')\n"
                "    return _real(*args, **kwargs)\n")
    result = _traffic.in_subprocess(L2, tree)
    assert result["tier"] == "at the roofline" and result["line"].startswith("L2  loads 1.00× the fewest bytes")
    stub = _traffic.in_subprocess(L2, ROOT / "mine")  # raises NotImplementedError: said, not a crash of the grade
    assert "did not run" in stub["error"] and "NotImplementedError" in stub["error"]
    wasteful = dict(result, tier="wasteful", line=result["line"].replace("at the roofline", "wasteful"),
                    where=["K and V are read 4× — once per query head"])
    console = Console(record=True, width=200)
    _render._traffic_lines(console, dict(drills=[dict(id="l2", traffic=wasteful), dict(id="l1", traffic=None)]))
    text = console.export_text()
    assert text.count("loads ") == 1 and "· wasteful" in text and "once per query head" in text


def test_the_grade_prints_the_references_line_beside_the_learners_and_says_what_sets_the_total(tmp_path):
    """A learner's L3 that reads the lengths differently: their ratio beside the
    reference's (the page's), and the sentence that the lengths barely move the total."""
    from rich.console import Console

    import _render
    from _tree import ROOT

    tree = _wrong.plant_edits(L3, (), tmp_path / "tree")  # the reference, as a learner's tree elsewhere
    result = _traffic.with_reference(L3, tree, ROOT / "solutions")
    assert result["reference"] == result["line"] and result["line"].startswith("L3  loads")
    assert abs(sum(result["shares"].values()) - 1) < 1e-9 and result["shares"]["lengths"] < 0.05
    assert "reference" not in _traffic.with_reference(L3, ROOT / "solutions", ROOT / "solutions")
    learner = dict(result, line=result["line"].replace("lengths 9.43×", "lengths 4.29×"))
    console = Console(record=True, width=300)
    _render._traffic_lines(console, dict(drills=[dict(id="l3", traffic=learner)]))
    text = console.export_text()
    assert "lengths 4.29×" in text and "reference: loads 1.00× the fewest bytes (" in text and "lengths 9.43×" in text
    assert "the total is set by K/V" in text and "lengths under 5% each, so their ratios barely move the total" in text


def teardown_module():
    WORKER.stop()
