"""L1's checks and their diagnosis: slot_mapping's answer and both caches against the
reference, and the sentences that say which token and which slot went wrong."""
import os

import torch

from _diagnose import Mismatch, describe_mistakes, known_mistakes
from _paged import bits, same_bits

from .mistakes import PLANTED
from .reference import ref_slot_mapping


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
    names, undecided = known_mistakes(PLANTED, lambda module: (
        module.slot_mapping(block_table, seq_idx, positions, block_size).cpu().long(),), (got.cpu().long(),))
    first_block_right = all(int(positions[i]) >= block_size for i in wrong)
    error = Mismatch(
        f"slot_mapping: token {t} (sequence {b}, position {p}) should get slot {int(want[t])}, got {int(got[t])}\n"
        f"  logical block = {p} // {block_size} = {logical}; physical block = block_table[{b}][{logical}] = {physical}; "
        f"offset = {p} % {block_size} = {offset}; slot = {physical}·{block_size} + {offset} = {int(want[t])}\n"
        f"  {len(wrong)} of {len(want)} tokens wrong"
        f"{'; every token in its sequence’s first block is right' if first_block_right else ''} (content/l1.md §4)"
        + describe_mistakes(PLANTED, names))
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
        names, undecided = known_mistakes(PLANTED, lambda module: _rerun_kv_write(module, case),
                                          (case.k_cache.storage, case.v_cache.storage))
        raise Mismatch(str(error) + describe_mistakes(PLANTED, names), names, undecided) from None


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
