"""L1, the paged KV-cache write (content/l1.md): everything the tests, the grader,
the bench and the pictures know about this drill, top to bottom in this order:
the page's worked example, the case builder and its reference, the hypothesis
strategy, the checks and their diagnosis, the pitfalls, the bench work, the
picture, the page checks, and the manifest entry `DRILL`.
"""
import ast
import os
import re
from dataclasses import dataclass

import _env
import torch
from hypothesis import strategies as st
from rich.columns import Columns
from rich.table import Table
from rich.text import Text

from _diagnose import Mismatch, describe_mistakes, known_mistakes
from _drill import ELEMENT_SIZE, BenchCase, Drill, Mistake, Pitfall
from _paged import DTYPES, Guarded, allocate_blocks, bits, guarded, noise, same_bits
from _pages import section
from _traffic import Part, check_page_line, measure, report, was_read
from _tree import load_drill

TEST_SHAPES = dict(max_seqs=4, max_new_tokens=6, max_context=40, max_heads=4, head_sizes=(1, 3, 8, 16, 24, 40),
                   block_sizes=(1, 2, 3, 4, 8, 16, 32), max_padding=3)

# ---------------------------------------------------------------------------
# L1: paged KV-cache write

# The example content/l1.md §4 works by hand (tests/test_content.py checks the page against it).
WORKED_EXAMPLE = dict(block_size=4, block_table=[[9, 3, 7], [2, 5, 0]], num_blocks=10,
                      seq_idx=[0, 0, 1], positions=[5, 9, 2], slots=[13, 29, 10])


def ref_slot_mapping(block_table, seq_idx, positions, block_size):
    """Slot of each token: block_table[seq, pos // block_size] * block_size + pos % block_size."""
    positions = positions.long()
    physical = block_table[seq_idx.long(), positions // block_size].long()
    return physical * block_size + positions % block_size


def ref_cache_write(rows, cache, slot_mapping):
    """Plain PyTorch: copy each real token's [H, D] row into its slot; skip slot -1."""
    real = slot_mapping >= 0
    hd = rows.shape[1] * rows.shape[2]
    cache.view(-1, hd)[slot_mapping[real].long()] = rows[real].reshape(-1, hd)


def ref_reshape_and_cache(key, value, k_cache, v_cache, slot_mapping):
    """The reference of L1's reshape_and_cache (caches must be contiguous)."""
    ref_cache_write(key, k_cache, slot_mapping)
    ref_cache_write(value, v_cache, slot_mapping)


@dataclass
class KVWriteCase:
    """One call of reshape_and_cache, with everything needed to check and explain it."""

    key: torch.Tensor          # [T, H, D], possibly a row-strided view
    value: torch.Tensor
    k_cache: Guarded           # view: [num_blocks, block_size, H, D]
    v_cache: Guarded
    slot_mapping: torch.Tensor  # [T], -1 for padding tokens
    block_table: torch.Tensor
    seq_idx: torch.Tensor      # [T] sequence of each token (0 for padding)
    positions: torch.Tensor    # [T] position inside its sequence (0 for padding)
    block_size: int
    inputs: torch.Tensor       # the storage key/value are views of ...
    inputs_initial: torch.Tensor  # ... and its contents before the call: it must not change

    def args(self):
        return self.key, self.value, self.k_cache.view, self.v_cache.view, self.slot_mapping

    def expected(self):
        """(expected k storage, expected v storage), guards included."""
        return (self.k_cache.expected(lambda cache: ref_cache_write(self.key, cache, self.slot_mapping)),
                self.v_cache.expected(lambda cache: ref_cache_write(self.value, cache, self.slot_mapping)))


def _token_rows(num_tokens, num_heads, head_size, layout, dtype, device, gen):
    """key and value [T, H, D] in one of three layouts, as views of one noise buffer.

    The buffer runs one row (H*D values) past the last token, so a kernel whose
    tile reads past a row's end reads known noise, not whatever memory follows:
    its wrong answer is then the same every time, and can be diagnosed.
    """
    hd = num_heads * head_size
    shape = (num_tokens, num_heads, head_size)
    if layout == "contiguous":  # key and value are separate [T, H, D] tensors
        buf = noise((2 * num_tokens * hd + hd,), dtype, device, gen)
        return buf, buf[:num_tokens * hd].view(shape), buf[num_tokens * hd:2 * num_tokens * hd].view(shape)
    if layout == "fused_qkv":  # key = qkv[:, 1], value = qkv[:, 2]: row stride 3*H*D
        buf = noise((num_tokens * 3 * hd + hd,), dtype, device, gen)
        qkv = buf[:num_tokens * 3 * hd].view(num_tokens, 3, num_heads, head_size)
        return buf, qkv[:, 1], qkv[:, 2]
    if layout in ("key_in_qkv", "value_in_qkv", "unequal_strides"):
        # key and value with different row strides, so reading one with the other's
        # stride goes wrong: one of them is a fused-QKV view, the other is not
        # ("unequal_strides": both are views, 3*H*D and 2*H*D + 5 apart).
        stride = 2 * hd + 5
        buf = noise((num_tokens * 3 * hd + num_tokens * stride + hd,), dtype, device, gen)
        qkv = buf[:num_tokens * 3 * hd].view(num_tokens, 3, num_heads, head_size)
        rest = buf[num_tokens * 3 * hd:]
        other = (rest[:num_tokens * hd].view(shape) if layout != "unequal_strides"
                 else rest.as_strided(shape, (stride, head_size, 1), 3))
        return (buf, qkv[:, 1], other) if layout != "value_in_qkv" else (buf, other, qkv[:, 2])
    if layout == "padded_rows":  # rows padded to an odd stride: no alignment to lean on
        stride = 2 * hd + 5
        buf = noise((num_tokens * stride + hd,), dtype, device, gen)
        key = buf.as_strided(shape, (stride, head_size, 1))
        value = buf.as_strided(shape, (stride, head_size, 1), hd + 3)
        return buf, key, value
    raise ValueError(f"unknown layout {layout!r}")


LAYOUTS = ("contiguous", "fused_qkv", "padded_rows", "key_in_qkv", "value_in_qkv", "unequal_strides")


def kv_write_case(block_table, num_blocks, seq_idx, positions, block_size, *, num_heads, head_size,
                  dtype=torch.float16, padding=(), layout="contiguous", slot_dtype=torch.int64,
                  device="cpu", seed=0):
    """A write of len(seq_idx) real tokens, with padding tokens inserted at the
    indices `padding` of the final token list (so T = real + len(padding)).

    Slots come from `ref_slot_mapping`; padding tokens get slot -1.
    """
    gen = torch.Generator().manual_seed(seed)
    num_tokens = len(seq_idx) + len(padding)
    is_pad = torch.zeros(num_tokens, dtype=torch.bool)
    is_pad[list(padding)] = True
    full_seq = torch.zeros(num_tokens, dtype=torch.int32)
    full_pos = torch.zeros(num_tokens, dtype=torch.int32)
    full_seq[~is_pad] = torch.as_tensor(seq_idx, dtype=torch.int32)
    full_pos[~is_pad] = torch.as_tensor(positions, dtype=torch.int32)
    block_table = torch.as_tensor(block_table, dtype=torch.int32)
    slots = ref_slot_mapping(block_table, full_seq, full_pos, block_size)
    slots[is_pad] = -1

    inputs, key, value = _token_rows(num_tokens, num_heads, head_size, layout, dtype, device, gen)
    shape = (num_blocks, block_size, num_heads, head_size)
    margin = block_size * num_heads * head_size  # one whole block each side
    return KVWriteCase(
        key=key, value=value,
        k_cache=guarded(shape, dtype, device, gen, margin),
        v_cache=guarded(shape, dtype, device, gen, margin),
        slot_mapping=slots.to(device=device, dtype=slot_dtype),
        block_table=block_table.to(device), seq_idx=full_seq.to(device), positions=full_pos.to(device),
        block_size=block_size, inputs=inputs, inputs_initial=inputs.clone(),
    )


def random_kv_write_case(*, context_lens, new_lens, block_size, spare_blocks=2, seed=0, **kwargs):
    """Sequences that already hold `context_lens` tokens each append `new_lens` more.

    The tokens of sequence 0 come first, then those of sequence 1, and so on;
    a token's position is its index in its own sequence, not in the batch.
    """
    gen = torch.Generator().manual_seed(seed + 1)
    total = [c + n for c, n in zip(context_lens, new_lens)]
    table, num_blocks = allocate_blocks(total, block_size, gen, spare_blocks)
    seq_idx = [b for b, n in enumerate(new_lens) for _ in range(n)]
    positions = [c + i for c, n in zip(context_lens, new_lens) for i in range(n)]
    return kv_write_case(table, num_blocks, seq_idx, positions, block_size, seed=seed, **kwargs)


@st.composite
def kv_write_params(draw, dtypes=tuple(DTYPES)):
    """Keyword arguments for random_kv_write_case, within L1's test shapes."""
    shapes = TEST_SHAPES
    num_seqs = draw(st.integers(1, shapes["max_seqs"]))
    new_lens = draw(st.lists(st.integers(0, shapes["max_new_tokens"]), min_size=num_seqs, max_size=num_seqs))
    context_lens = draw(st.lists(st.integers(0, shapes["max_context"]), min_size=num_seqs, max_size=num_seqs))
    num_padding = draw(st.integers(0, shapes["max_padding"]))
    order = draw(st.permutations(range(sum(new_lens) + num_padding)))
    padding = sorted(order[:num_padding])  # padding may sit anywhere in the batch
    return dict(
        context_lens=context_lens, new_lens=new_lens, padding=padding,
        block_size=draw(st.sampled_from(shapes["block_sizes"])),
        num_heads=draw(st.integers(1, shapes["max_heads"])),
        head_size=draw(st.sampled_from(shapes["head_sizes"])),
        dtype=DTYPES[draw(st.sampled_from(dtypes))],
        layout=draw(st.sampled_from(LAYOUTS)),
        slot_dtype=draw(st.sampled_from([torch.int64, torch.int32])),
        spare_blocks=draw(st.integers(0, 3)),
        seed=draw(st.integers(0, 2**31 - 1)),
    )



# ---------------------------------------------------------------------------
# Checks and their diagnosis


def _fmt_token(case, t):
    if int(case.slot_mapping[t]) < 0:
        return f"token {t} (padding, slot -1)"
    return f"token {t} (sequence {int(case.seq_idx[t])}, position {int(case.positions[t])})"


def _describe(case):
    t, h, d = case.key.shape
    return (f"case: T={t} tokens ({int((case.slot_mapping < 0).sum())} padding), H={h}, D={d}, "
            f"block_size={case.block_size}, dtype={str(case.key.dtype).replace('torch.', '')}, "
            f"key row stride={case.key.stride(0)}, value row stride={case.value.stride(0)}, slots={case.slot_mapping.tolist()}")



def check_slot_mapping(block_table, seq_idx, positions, block_size, got):
    """slot_mapping's answer against the formula, token by token."""
    want = ref_slot_mapping(block_table, seq_idx, positions, block_size)
    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
        raise Mismatch(f"slot_mapping should return a tensor of shape {tuple(want.shape)}, got "
                       f"{type(got).__name__} {tuple(getattr(got, 'shape', ()))}")
    if got.dtype != torch.int64:
        raise Mismatch(f"slot_mapping should return int64 slots (slot * H * D passes 2**31 in a large cache), "
                       f"got {got.dtype} (content/l1.md §4)")
    wrong = (got.cpu() != want.cpu()).nonzero().flatten().tolist()
    if not wrong:
        return
    t = wrong[0]
    b, p = int(seq_idx[t]), int(positions[t])
    logical, offset = p // block_size, p % block_size
    physical = int(block_table[b, logical])
    names, undecided = known_mistakes(DRILL, lambda module: (
        module.slot_mapping(block_table, seq_idx, positions, block_size).cpu().long(),), (got.cpu().long(),))
    first_block_right = all(int(positions[i]) >= block_size for i in wrong)
    error = Mismatch(
        f"slot_mapping: token {t} (sequence {b}, position {p}) should get slot {int(want[t])}, got {int(got[t])}\n"
        f"  logical block = {p} // {block_size} = {logical}; physical block = block_table[{b}][{logical}] = {physical}; "
        f"offset = {p} % {block_size} = {offset}; slot = {physical}·{block_size} + {offset} = {int(want[t])}\n"
        f"  {len(wrong)} of {len(want)} tokens wrong"
        f"{'; every token in its sequence’s first block is right' if first_block_right else ''} (content/l1.md §4)"
        + describe_mistakes(DRILL, names))
    error.pitfalls, error.undecided = names, undecided
    raise error


def check_kv_write(case):
    """Both caches, guards included, bit for bit; key/value left untouched."""
    want_k, want_v = case.expected()
    try:
        _explain_cache("k_cache", case, case.k_cache, want_k, case.key)
        _explain_cache("v_cache", case, case.v_cache, want_v, case.value)
        if not same_bits(case.inputs, case.inputs_initial):
            raise Mismatch("key/value were modified: reshape_and_cache must only read them\n  " + _describe(case))
    except Mismatch as error:
        _keep_for_picture(case)
        names, undecided = known_mistakes(DRILL, lambda module: _rerun_kv_write(module, case),
                                          (case.k_cache.storage, case.v_cache.storage))
        raise Mismatch(str(error) + describe_mistakes(DRILL, names), names, undecided) from None


def _keep_for_picture(case):
    """Save the first failing case small enough to draw where the grader asked
    (DRILLS_CASE_DUMP), so `grader.py show` can draw exactly what went wrong."""
    path = os.environ.get("DRILLS_CASE_DUMP")
    if path and not os.path.exists(path) and case.k_cache.view.numel() <= 64 * 64 and case.key.shape[0] <= 16:
        torch.save(case, path)


def _rerun_kv_write(module, case):
    """module.reshape_and_cache on the case's inputs, into fresh copies of its caches."""
    fresh = []
    for cache in (case.k_cache, case.v_cache):
        storage = cache.initial.clone()
        fresh.append((storage, storage[cache.margin:cache.margin + cache.view.numel()].view(cache.view.shape)))
    module.reshape_and_cache(case.key, case.value, fresh[0][1], fresh[1][1], case.slot_mapping)
    return fresh[0][0], fresh[1][0]


def _explain_cache(name, case, cache, want, rows):
    got = cache.storage
    diff = bits(got) != bits(want)
    if not diff.any():
        return
    num_tokens, num_heads, head_size = rows.shape
    hd = num_heads * head_size
    margin, size = cache.margin, cache.view.numel()
    findings = []

    front = diff[:margin].nonzero().flatten()
    if front.numel():
        reach = margin - int(front[0])
        pads = [t for t in range(num_tokens) if int(case.slot_mapping[t]) < 0]
        slot_minus_one = got[margin - hd:margin] if reach <= hd else None
        culprit = next((t for t in pads if slot_minus_one is not None and same_bits(slot_minus_one, rows[t].flatten())), None)
        if culprit is not None:
            findings.append(f"{name}: {_fmt_token(case, culprit)} was written to slot -1, just before the cache: "
                            f"padding tokens must read and write nothing (content/l1.md §8)")
        else:
            findings.append(f"{name}: {int(front.numel())} values were written before the start of the cache "
                            f"(up to {reach} elements before slot 0): an offset went negative (content/l1.md §8)")
    back = diff[margin + size:].nonzero().flatten()
    if back.numel():
        findings.append(f"{name}: {int(back.numel())} values were written past the end of the cache "
                        f"(up to {int(back[-1]) + 1} elements after its last slot)")

    slots_got = got[margin:margin + size].view(-1, hd)
    slots_before = cache.initial[margin:margin + size].view(-1, hd)
    bad_slots = diff[margin:margin + size].view(-1, hd).any(dim=1).nonzero().flatten().tolist()
    owner = {int(s): t for t, s in enumerate(case.slot_mapping.tolist()) if s >= 0}
    token_rows = rows.reshape(num_tokens, hd)

    def whose(row):
        return next((u for u in range(num_tokens) if same_bits(row, token_rows[u])), None)

    wrong_tokens, stray_slots = [], []
    for s in bad_slots:
        (wrong_tokens if s in owner else stray_slots).append(s)
    for s in wrong_tokens[:1]:
        t = owner[s]
        row = slots_got[s]
        where = f"slot {s} (block {s // case.block_size}, offset {s % case.block_size})"
        if same_bits(row, slots_before[s]):
            found = [x for x in range(slots_got.shape[0]) if x != s and same_bits(slots_got[x], token_rows[t])]
            seen = f"; its values were found in slot {found[0]}" if found else ""
            findings.append(f"{name}: {_fmt_token(case, t)} belongs in {where}, but that slot was never written{seen}")
        else:
            other = whose(row)
            if other is not None:
                findings.append(f"{name}: {where} should hold {_fmt_token(case, t)} but holds {_fmt_token(case, other)}'s values")
            else:
                cols = (bits(row) != bits(token_rows[t])).nonzero().flatten()
                first = int(cols[0])
                findings.append(
                    f"{name}: {where} should hold {_fmt_token(case, t)}; {cols.numel()} of its {hd} values are wrong, "
                    f"first at head {first // head_size}, element {first % head_size}: "
                    f"expected {float(token_rows[t][first])}, found {float(row[first])}")
    for s in stray_slots[:1]:
        other = whose(slots_got[s])
        what = f"{_fmt_token(case, other)}'s values" if other is not None else "values that match no token"
        cols = (bits(slots_got[s]) != bits(slots_before[s])).nonzero().flatten()
        part = "" if cols.numel() == hd else f" (elements {int(cols[0])}..{int(cols[-1])} of {hd})"
        findings.append(f"{name}: slot {s} belongs to no new token and must keep its old contents, but it now holds "
                        f"{what}{part}")
    real = sum(1 for s in case.slot_mapping.tolist() if s >= 0)
    summary = (f"  {len(wrong_tokens)} of {real} real tokens wrong, {len(stray_slots)} slots written that no token maps to"
               f"{', guard regions damaged' if front.numel() or back.numel() else ''}")
    raise Mismatch("\n  ".join(findings) + "\n" + summary + "\n  " + _describe(case))



# ---------------------------------------------------------------------------
# The pitfalls of content/l1.md §8, as edits that plant each in the reference

PITFALLS = {
    "int32_offsets": Pitfall(says="offsets are computed in int32 and wrap around once slot * H * D passes 2**31", edits=[
        ("token = tl.program_id(axis=0).to(tl.int64)", "token = tl.program_id(axis=0)"),
        ("slot = tl.load(slot_mapping_ptr + token).to(tl.int64)", "slot = tl.load(slot_mapping_ptr + token).to(tl.int32)"),
    ], crashes=True),
    "padding_written": Pitfall(says="padding tokens (slot -1) are not skipped: their rows are read, or written to just "
                                    "before the cache", edits=[
        ("keep = cols < tl.where(slot >= 0, HD, 0)", "keep = cols < HD"),
    ], races=True),  # every padding token writes the one row before the cache
    "position_as_slot": Pitfall(says="the position is used as the slot: the block table is never consulted", edits=[
        ("return positions % block_size + block * block_size", "return positions.long()"),
    ], races=True),  # tokens of different sequences at one position share a slot
    "token_index_as_position": Pitfall(says="the token's index in the batch is used as its position in its sequence", edits=[
        ("    page = positions // block_size",
         "    positions = torch.arange(len(positions), device=positions.device)\n"
         "    page = positions // block_size"),
    ]),
    "logical_as_physical": Pitfall(says="the logical block number is used as the physical block: the block table is never consulted", edits=[
        ("block = block_table[seq_idx, page].long()", "block = page.long()"),
    ], races=True),  # sequences share logical block numbers, so they share slots
    "row_stride_ignored": Pitfall(says="key/value rows are read H*D apart instead of key_stride apart, so fused-QKV views read the wrong rows", edits=[
        ("key_ptr + token * key_stride + cols", "key_ptr + token * HD + cols"),
        ("value_ptr + token * value_stride + cols", "value_ptr + token * HD + cols"),
    ]),
    "unmasked_tail": Pitfall(says="the tile's tail past H*D is not masked and spills into the next slot", edits=[
        ("keep = cols < tl.where(slot >= 0, HD, 0)", "keep = cols < tl.where(slot >= 0, BLOCK, 0)"),
    ], races=True),  # the spill lands on the next slot's row, which its own program writes
    "offset_without_heads": Pitfall(says="a slot's offset is computed as slot * D instead of slot * H * D", edits=[
        ("    HD,                        # num_kv_heads * head_size: one slot's length", "    HD, D,"),
        ("key.stride(0), value.stride(0), hd,", "key.stride(0), value.stride(0), hd, head_size,"),
        ("row = slot * HD + cols", "row = slot * D + cols"),
    ], races=True),  # with H > 1, neighbouring slots' rows overlap
    "noncontiguous_cache_accepted": Pitfall(says="a non-contiguous cache is accepted instead of refused", edits=[
        ("        if not cache.is_contiguous():", "        if False:"),
    ]),
}

# Wrong kernels that are none of the page's pitfalls: the grade must fail each and
# name nothing, describing what went wrong instead (issue: a grade that tells the truth).
MISTAKES = {
    "slot_from_position_minus_one": Mistake(shows="should get slot 13, got 12", edits=(
        ("    page = positions // block_size", "    positions = positions - 1\n    page = positions // block_size"),
    )),
    "value_read_with_key_stride": Mistake(shows="v_cache", edits=(
        ("value_ptr + token * value_stride + cols", "value_ptr + token * key_stride + cols"),
    )),
    "crashes_on_five_heads": Mistake(shows="killed by SIGSEGV", edits=(
        ("    if num_tokens == 0:\n        return",
         "    if num_heads == 5:  # planted: the process dies (a stand-in for a wild write)\n"
         "        import os, signal\n        os.kill(os.getpid(), signal.SIGSEGV)\n"
         "    if num_tokens == 0:\n        return"),
    )),
}
if _env.INTERPRET:  # on a GPU this mask compiles, and is right
    MISTAKES["scalar_in_mask"] = Mistake(shows="choose the bound with a scalar tl.where", edits=(
        ("keep = cols < tl.where(slot >= 0, HD, 0)", "keep = (cols < HD) & (slot >= 0)"),
    ))


# ---------------------------------------------------------------------------
# The bench


def kv_write_bytes(num_tokens, num_heads, head_size, dtype, num_padding=0, **_):
    """Each real token's K and V read once and written once, plus its slot."""
    real = num_tokens - num_padding
    return 2 * 2 * real * num_heads * head_size * ELEMENT_SIZE[dtype] + 8 * num_tokens


def _bench_case(num_tokens, graph):
    params = dict(num_tokens=num_tokens, num_heads=8, head_size=128, block_size=16,
                  num_blocks=65536, dtype="float16")  # 2 GiB per cache
    return BenchCase(f"T={num_tokens}", params, kv_write_bytes(**params), graph=graph)


def bench_work(module, params, device, n_sets):
    """`n_sets` independent writes into one pair of caches, for the bandwidth report.

    Each set scatters its tokens over different random slots of a multi-GB cache,
    so the L2 cache holds neither the inputs nor the lines being written.
    Returns (ours, {name: (baseline, graph_safe)}): callables that each run all sets once.
    """
    num_tokens, block_size, num_blocks = params["num_tokens"], params["block_size"], params["num_blocks"]
    num_heads, head_size, dtype = params["num_heads"], params["head_size"], DTYPES[params["dtype"]]
    k_cache = torch.empty((num_blocks, block_size, num_heads, head_size), dtype=dtype, device=device)
    v_cache = torch.empty_like(k_cache)
    slots = torch.randperm(num_blocks * block_size, device=device)[:n_sets * num_tokens].view(n_sets, num_tokens)
    sets = [(torch.randn(num_tokens, num_heads, head_size, dtype=dtype, device=device),
             torch.randn(num_tokens, num_heads, head_size, dtype=dtype, device=device),
             slots[i].contiguous()) for i in range(n_sets)]

    def ours():
        for key, value, slot in sets:
            module.reshape_and_cache(key, value, k_cache, v_cache, slot)

    def index_copy():
        # What you would write without a kernel: mask out padding, then one
        # index_copy_ per cache into the flattened [slots, H*D] view.
        hd = num_heads * head_size
        for key, value, slot in sets:
            real = slot >= 0
            slot = slot[real]
            k_cache.view(-1, hd).index_copy_(0, slot, key[real].view(-1, hd))
            v_cache.view(-1, hd).index_copy_(0, slot, value[real].view(-1, hd))

    # Boolean-mask indexing syncs with the host, so this baseline cannot be captured in a CUDA graph.
    return ours, {"torch index_copy_": (index_copy, False)}



# ---------------------------------------------------------------------------
# The picture: the cache as it should be and as the learner's code left it

SEQ_STYLE = ("bold blue", "bold magenta", "bold cyan", "bold yellow")


def _label_slots(case, cache, storage, rows):
    """One label per slot (and per guard) of a cache's storage: whose values are there."""
    num_tokens = rows.shape[0]
    hd = rows[0].numel() if num_tokens else 1
    margin, size = cache.margin, cache.view.numel()
    before = cache.initial
    token_rows = [bits(rows[t].reshape(-1)) for t in range(num_tokens)]

    def label(now, was):
        if bool((bits(now) == bits(was)).all()):
            return Text("·", style="dim")
        for t, row in enumerate(token_rows):
            if bool((bits(now) == row).all()):
                seq = int(case.seq_idx[t])
                if int(case.slot_mapping[t]) < 0:
                    return Text(f"t{t}!", style="bold white on red")  # a padding token's values
                return Text(f"t{t}", style=SEQ_STYLE[seq % len(SEQ_STYLE)])
        return Text("?", style="bold white on red")  # changed, but to no token's values

    slots = [label(storage[margin + s * hd:margin + (s + 1) * hd], before[margin + s * hd:margin + (s + 1) * hd])
             for s in range(size // hd)]
    front = label(storage[margin - hd:margin], before[margin - hd:margin])
    back = label(storage[margin + size:margin + size + hd], before[margin + size:margin + size + hd])
    return slots, front, back


def _cache_table(title, case, labels, front, back, shown):
    block_size = case.block_size
    table = Table(title=title, show_header=True, header_style="bold", box=None, padding=(0, 1))
    table.add_column("block", justify="right")
    for i in range(block_size):
        table.add_column(f"+{i}", justify="center")
    table.add_row("slot -1", front, *[""] * (block_size - 1))
    for block in range(len(labels) // block_size):
        row = labels[block * block_size:(block + 1) * block_size]
        if block in shown:
            table.add_row(str(block), *row)
        elif block - 1 in shown or block == 0:
            table.add_row("⋮", *[""] * block_size)  # a run of untouched blocks
    table.add_row("past end", back, *[""] * (block_size - 1))
    return table


def draw_case(case, console):
    """A case that already ran (saved by the tests when it failed): draw the cache that
    is wrong (k_cache unless only v_cache is), expected beside yours."""
    want_k, want_v = case.expected()
    name, cache, expected, rows = "k_cache", case.k_cache, want_k, case.key
    if same_bits(case.k_cache.storage, want_k) and not same_bits(case.v_cache.storage, want_v):
        name, cache, expected, rows = "v_cache", case.v_cache, want_v, case.value
    want, got = _label_slots(case, cache, expected, rows), _label_slots(case, cache, cache.storage, rows)
    # Draw every block either side touched, and the page's small examples whole.
    num_blocks = len(want[0]) // case.block_size
    shown = {s // case.block_size for labels in (want[0], got[0]) for s, cell in enumerate(labels) if cell.plain != "·"}
    shown = set(range(num_blocks)) if num_blocks <= 12 else shown
    want = _cache_table(f"{name}, expected", case, *want, shown)
    got = _cache_table(f"{name}, yours", case, *got, shown)
    console.print(f"[dim]slot_mapping = {case.slot_mapping.tolist()}; tokens' sequences = {case.seq_idx.tolist()}, "
                  f"positions = {case.positions.tolist()}[/]")
    console.print(Columns([want, got], padding=(0, 6)))
    console.print("[dim]tN: token N's values (colour = its sequence)   ·: untouched   "
                  "tN!: a padding token's values   ?: overwritten with values of no token[/]")


def picture(module, console):
    """§4's worked example plus one padding token, with H=2, D=3 (H*D is not a
    power of two) read from a fused-QKV view: small enough to draw, rich enough
    that every pitfall on the page shows."""
    ex = WORKED_EXAMPLE
    case = kv_write_case(ex["block_table"], ex["num_blocks"], ex["seq_idx"], ex["positions"], ex["block_size"],
                         num_heads=2, head_size=3, padding=[3], layout="fused_qkv", device=_env.DEVICE, seed=7)
    real = case.slot_mapping >= 0
    try:
        slots = module.slot_mapping(case.block_table, case.seq_idx[real], case.positions[real], case.block_size)
        yours = [str(s) for s in slots.tolist()]
    except Exception as error:  # the picture must draw whatever the learner's code does
        yours = [type(error).__name__] * int(real.sum())
    slot_table = Table(title="slot_mapping", header_style="bold", box=None, padding=(0, 1))
    for column in ("token", "seq", "position", "expected slot", "yours"):
        slot_table.add_column(column, justify="right")
    mine = iter(yours)
    for t in range(len(case.slot_mapping)):
        if not real[t]:
            slot_table.add_row(f"t{t}", "pad", "-", "-1", Text("(padding)", style="dim"))
            continue
        want, got = str(int(case.slot_mapping[t])), next(mine)
        slot_table.add_row(Text(f"t{t}", style=SEQ_STYLE[int(case.seq_idx[t])]), str(int(case.seq_idx[t])),
                           str(int(case.positions[t])), want, Text(got, style="green" if got == want else "bold red"))
    console.print(slot_table)

    try:
        module.reshape_and_cache(*case.args())
    except Exception as error:
        console.print(f"[red]reshape_and_cache raised {type(error).__name__}: {error}[/]")
    draw_case(case, console)


# ---------------------------------------------------------------------------
# The traffic report (tests/_traffic.py): bytes moved under the CPU interpreter

# The bench's shape (H=8, D=128, blocks of 16) shrunk to interpreter size, with padding
# tokens among the real ones, as a batch padded for a CUDA graph has.
TRAFFIC_CASE = dict(context_lens=[5, 30], new_lens=[4, 6], padding=[0, 7, 12], block_size=16, num_heads=2,
                    head_size=32, dtype=torch.float16, slot_dtype=torch.int64)


def traffic_case(device="cpu"):
    return random_kv_write_case(**TRAFFIC_CASE, device=device, seed=3)


def padding_rows_read(case, traffic):
    """The padding tokens whose key or value row was loaded (L1 promises they read nothing)."""
    pads = (case.slot_mapping < 0).nonzero().flatten().tolist()
    return [t for t in pads if was_read(traffic.tensors[0], case.key[t]) or was_read(traffic.tensors[1], case.value[t])]


def check_padding_not_read(module, case):
    """Run reshape_and_cache on `case` with its loads counted: no padding token's key or
    value row may be read (content/l1.md §8). Returns False where nothing can be counted
    (a GPU), True when checked."""
    _, counted = measure(module, "reshape_and_cache", *case.args())
    if counted is None:
        return False
    # The counted reads are evidence of their own, whatever the values: checked first.
    pads = padding_rows_read(case, counted)
    if pads:
        raise Mismatch(f"the key/value rows of padding token(s) {pads} (slot -1) were read: a padding token must "
                       f"read nothing, so its loads must be masked by the slot, not only by the row length "
                       f"(content/l1.md §8)\n  {_describe(case)}", ["padding_written"])
    check_kv_write(case)
    return True


def traffic(module):
    """reshape_and_cache on TRAFFIC_CASE, its bytes against kv_write_bytes (the bandwidth
    report's count), with where the extra bytes went in L1's words."""
    case = traffic_case()
    _, counted = measure(module, "reshape_and_cache", *case.args())
    if counted is None:
        return None
    num_tokens, num_heads, head_size = case.key.shape
    real = int((case.slot_mapping >= 0).sum())
    row = num_heads * head_size * case.key.element_size()
    parts = [Part("key/value", (0, 1), fewest_loaded=2 * real * row),
             Part("slot_mapping", (4,), fewest_loaded=8 * num_tokens),
             Part("caches", (2, 3), fewest_stored=2 * real * row)]
    fewest = kv_write_bytes(num_tokens, num_heads, head_size, "float16", num_padding=num_tokens - real)
    assert sum(p.fewest_loaded + p.fewest_stored for p in parts) == fewest  # the GPU report's bytes
    where = []
    pads = padding_rows_read(case, counted)
    if pads:
        where.append(f"padding rows were read (tokens {pads}): L1 promises that a padding token reads nothing, "
                     f"so load a row only once its slot is known to be >= 0 ({DRILL.section}, pitfall:padding_written)")
    result = report(DRILL.id, counted, parts, where)
    rows = result["parts"]["key/value"]
    if rows > 1.05 and not pads:
        result["where"].append(f"key/value rows were loaded {rows:.2f}× their size: each real token's row once "
                               f"is enough")
    if result["stores"] > 1.05:
        result["where"].append(f"the caches were written {result['stores']:.2f}× what the new tokens fill")
    return result


# ---------------------------------------------------------------------------
# Page checks: every number content/l1.md works out



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
        DRILL.bench[-1].params["num_blocks"]  # the bench cache the page calls 2 GiB
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


# ---------------------------------------------------------------------------
# Fixture checks: the builders make the cases the tests say they make (tests/test_fixtures.py)


def check_worked_example_gets_the_pages_slots(device):
    ex = WORKED_EXAMPLE
    case = kv_write_case(ex["block_table"], ex["num_blocks"], ex["seq_idx"], ex["positions"], ex["block_size"],
                            num_heads=2, head_size=4, device=device)
    assert case.slot_mapping.tolist() == ex["slots"]


def check_layouts_give_key_and_value_their_own_row_strides(device):
    for layout in ("fused_qkv", "key_in_qkv", "value_in_qkv", "unequal_strides"):
        case = random_kv_write_case(context_lens=[1, 6], new_lens=[3, 2], block_size=4, num_heads=2, head_size=8,
                                       layout=layout, device=device)
        strides = case.key.stride(0), case.value.stride(0)
        assert strides != (16, 16), layout
        assert (strides[0] != strides[1]) == (layout != "fused_qkv"), layout


# ---------------------------------------------------------------------------

DRILL = Drill(
    id="l1",
    stem="l1_paged_kv_write",
    title="Paged KV-cache write",
    mirrors="vLLM reshape_and_cache_flash",
    api=("slot_mapping", "reshape_and_cache_kernel", "reshape_and_cache"),
    section="content/l1.md §8",
    test_shapes=TEST_SHAPES,
    pitfalls=PITFALLS,
    mistakes=MISTAKES,
    bench=(_bench_case(4096, graph=True), _bench_case(65536, graph=False)),
    bench_work=bench_work,
    picture=picture,
    draw_case=draw_case,
    traffic=traffic,
    page_checks=(check_traffic_line, check_worked_example_table, check_self_test_slot, check_self_test_waste, check_paging_numbers,
                 check_self_test_offset, check_self_test_bytes_moved, check_int32_boundary),
    fixture_checks=(check_worked_example_gets_the_pages_slots,
                    check_layouts_give_key_and_value_their_own_row_strides),
)
