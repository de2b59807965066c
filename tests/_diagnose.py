"""Turn a wrong answer into sentences a learner can act on.

Tests compare a tree's output with the reference through the `check_*` functions
here. When they differ, the function raises `Mismatch` whose first line says
what is wrong in the drill's own terms (which token, which slot, which guard) and
whose later lines give the evidence. The grader shows that message instead of a
traceback.
"""
import math
import os
import re
from contextlib import contextmanager

import torch

import _wrong
from _paged import bits, online_softmax, ref_paged_decode, ref_slot_mapping


class Mismatch(AssertionError):
    """A wrong answer, explained. First line: the finding; then the evidence."""


@contextmanager
def expect_value_error(what, section, pitfall=None):
    """The block must raise ValueError; anything else is explained. `pitfall` names
    the page's pitfall that accepting this input is (the evidence is the acceptance)."""
    try:
        yield
    except ValueError:
        return
    except NotImplementedError:
        raise
    except Exception as error:  # a crash instead of a clear refusal
        raise Mismatch(f"{what} should raise ValueError naming the argument, but it raised "
                       f"{type(error).__name__}: {error} ({section})") from error
    error = Mismatch(f"{what} was accepted; it must be refused with a ValueError that names the argument and "
                     f"the fix ({section})")
    error.pitfalls = [pitfall] if pitfall else []
    raise error


# Error messages learners meet, and what they mean. Matched against an
# exception's text when a test fails with an error rather than a wrong answer.
KNOWN_ERRORS = (
    (r"mask has unsupported dtype",
     "a mask built with `&` from a vector and a scalar condition (e.g. `(cols < HD) & (slot >= 0)`): the CPU "
     "interpreter rejects it; choose the bound with a scalar tl.where first (content/l1.md §5)"),
    (r"arange's range must be a power of 2|arange.*power of 2",
     "tl.arange needs a power-of-two length: round H*D (or D) up with triton.next_power_of_2 and mask the tail "
     "(content/l1.md §5)"),
    (r"invalid operands of type pointer<\w+> and triton\.language\.float",
     "a pointer was offset by a float: an index tensor (slot_mapping, block_table, seq_lens) of a float dtype, or an "
     "offset computed in floating point"),
)


def explain_error(text):
    """What a known error message means, or None."""
    return next((meaning for pattern, meaning in KNOWN_ERRORS if re.search(pattern, text)), None)


def known_mistakes(stem, outcome, got):
    """The pitfalls whose known-wrong variant (tests/wrong/<stem>.py), run on the same
    input, produces exactly `got`: `outcome(module)` runs a module on that input and
    returns what is compared (a tuple of tensors, bit for bit)."""
    found = []
    for name in _wrong.pitfalls(stem):
        try:
            theirs = outcome(_wrong.variant(stem, name))
        except Exception:  # a variant that cannot run on this input is no evidence either way
            continue
        if all(_same(a, b) for a, b in zip(theirs, got, strict=True)):
            found.append(name)
    return found


def _name_mistakes(stem, names):
    """One line per matched pitfall, for the Mismatch message."""
    pitfalls = _wrong.pitfalls(stem)
    return "".join(f"\n  looks like: {pitfalls[n]['says']} (pitfall:{n}, {_wrong.section(stem)})" for n in names)


def _same(a, b):
    return a.shape == b.shape and bool((bits(a) == bits(b)).all())


def _fmt_token(case, t):
    if int(case.slot_mapping[t]) < 0:
        return f"token {t} (padding, slot -1)"
    return f"token {t} (sequence {int(case.seq_idx[t])}, position {int(case.positions[t])})"


def _describe(case):
    t, h, d = case.key.shape
    return (f"case: T={t} tokens ({int((case.slot_mapping < 0).sum())} padding), H={h}, D={d}, "
            f"block_size={case.block_size}, dtype={str(case.key.dtype).replace('torch.', '')}, "
            f"key row stride={case.key.stride(0)}, slots={case.slot_mapping.tolist()}")


# ---------------------------------------------------------------------------
# L1


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
    names = known_mistakes("l1_paged_kv_write", lambda module: (
        module.slot_mapping(block_table, seq_idx, positions, block_size).cpu().long(),), (got.cpu().long(),))
    first_block_right = all(int(positions[i]) >= block_size for i in wrong)
    error = Mismatch(
        f"slot_mapping: token {t} (sequence {b}, position {p}) should get slot {int(want[t])}, got {int(got[t])}\n"
        f"  logical block = {p} // {block_size} = {logical}; physical block = block_table[{b}][{logical}] = {physical}; "
        f"offset = {p} % {block_size} = {offset}; slot = {physical}·{block_size} + {offset} = {int(want[t])}\n"
        f"  {len(wrong)} of {len(want)} tokens wrong"
        f"{'; every token in its sequence’s first block is right' if first_block_right else ''} (content/l1.md §4)"
        + _name_mistakes("l1_paged_kv_write", names))
    error.pitfalls = names
    raise error


def check_kv_write(case):
    """Both caches, guards included, bit for bit; key/value left untouched."""
    want_k, want_v = case.expected()
    try:
        _explain_cache("k_cache", case, case.k_cache, want_k, case.key)
        _explain_cache("v_cache", case, case.v_cache, want_v, case.value)
        if not _same(case.inputs, case.inputs_initial):
            raise Mismatch("key/value were modified: reshape_and_cache must only read them\n  " + _describe(case))
    except Mismatch as error:
        _keep_for_picture(case)
        names = known_mistakes("l1_paged_kv_write", lambda module: _rerun_kv_write(module, case),
                               (case.k_cache.storage, case.v_cache.storage))
        mismatch = Mismatch(str(error) + _name_mistakes("l1_paged_kv_write", names))
        mismatch.pitfalls = names
        raise mismatch from None


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
        culprit = next((t for t in pads if slot_minus_one is not None and _same(slot_minus_one, rows[t].flatten())), None)
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
        return next((u for u in range(num_tokens) if _same(row, token_rows[u])), None)

    wrong_tokens, stray_slots = [], []
    for s in bad_slots:
        (wrong_tokens if s in owner else stray_slots).append(s)
    for s in wrong_tokens[:1]:
        t = owner[s]
        row = slots_got[s]
        where = f"slot {s} (block {s // case.block_size}, offset {s % case.block_size})"
        if _same(row, slots_before[s]):
            found = [x for x in range(slots_got.shape[0]) if x != s and _same(slots_got[x], token_rows[t])]
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
# L2

# (atol, rtol) against the fp32 reference. 16-bit runs round p to the value
# dtype before p·V (as the tensor cores want) and round the output once; fp32
# runs compute in fp32 throughout ("ieee" dot products, no TF32).
DECODE_TOLERANCE = {torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.5e-2, 1.5e-2), torch.float32: (1e-4, 1e-4)}
_TILES = (16, 32, 64, 128, 256)  # tile sizes a kernel may use: mistakes that depend on it are tried with each


def check_paged_decode(case, out):
    """paged_decode_attention's output against the reference, (sequence, query head) by
    (sequence, query head); a wrong one is explained by the mistake that reproduces it."""
    query = case.query
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(query.shape):
        raise Mismatch(f"paged_decode_attention should return a new tensor [B, H_q, D] = {tuple(query.shape)}, got "
                       f"{type(out).__name__} {tuple(getattr(out, 'shape', ()))}")
    if out.dtype != query.dtype or out.device != query.device:
        raise Mismatch(f"the output must have the query's dtype and device ({query.dtype}, {query.device}); got "
                       f"{out.dtype}, {out.device} (content/l2.md §1)")
    got, want = out.float().cpu(), case.reference()
    atol, rtol = DECODE_TOLERANCE[query.dtype]
    wrong = ~_close(got, want, atol, rtol)  # [B, H_q]; NaN counts as wrong
    if not wrong.any():
        return
    b, h = (int(i) for i in wrong.nonzero()[0])
    if torch.isfinite(got[b, h]).all():
        finding, pitfall = _explain_wrong(case, got, want, wrong, b, h, atol, rtol)
    else:
        finding, pitfall = _explain_non_finite(case, got, b, h)
    err = torch.nan_to_num((got[b, h] - want[b, h]).abs(), nan=float("inf"))
    d = int(err.argmax())
    rows = ", ".join(f"({int(i)}, {int(j)})" for i, j in wrong.nonzero()[:6])
    error = Mismatch(
        f"{finding}\n"
        f"  sequence {b}, query head {h}, element {d}: expected {float(want[b, h, d]):.5g}, got {float(got[b, h, d]):.5g} "
        f"(tolerance {atol} + {rtol}·|expected|)\n"
        f"  {int(wrong.sum())} of {wrong.numel()} (sequence, query head) outputs wrong: {rows}"
        f"{', ...' if int(wrong.sum()) > 6 else ''}\n  {_describe_decode(case)}")
    error.pitfalls = [pitfall] if pitfall else []  # named only when the evidence singles one out
    raise error


def _close(a, b, atol, rtol):
    return torch.isclose(a, b, rtol=rtol, atol=atol).all(dim=-1)


def _where(case, b, h):
    """'sequence b (seq_len n: k blocks, the last holding r of block_size), query head h (KV head kv)'."""
    n, bs = int(case.seq_lens[b]), case.block_size
    group = case.query.shape[1] // case.k_cache.shape[2]
    blocks = math.ceil(n / bs)
    return (f"sequence {b} (seq_len {n}: {blocks} block{'s' * (blocks > 1)}, the last holding {n - (blocks - 1) * bs} "
            f"of {bs}), query head {h} (KV head {h // group})")


def _explain_non_finite(case, got, b, h):
    """NaN/inf in the output: name the NaN this case planted that could have produced it."""
    num_seqs, num_heads = case.query.shape[:2]
    bs, width = case.block_size, case.block_table.shape[1]
    # 16-bit kernels round p = exp(score - max) to the value dtype before p·V.
    limit = math.log(torch.finfo(case.query.dtype).max)
    scores = [s for s, _ in case.scores_values()]
    bad = ~torch.isfinite(got).all(dim=-1)  # [B, H_q]
    num_q = case.query.numel()
    head_size = case.query.shape[2]
    lanes = max(16, 1 << (head_size - 1).bit_length())  # a padded D tile: tl.dot wants 16 or more

    def rows(test):
        return torch.tensor([[test(i, j) for j in range(num_heads)] for i in range(num_seqs)])

    sources = [  # (which outputs it could reach, pitfall, what it is)
        (rows(lambda i, j: case.tail == "nan" and int(case.seq_lens[i]) % bs != 0), "unmasked_loads",
         "the unused end of the last block holds NaN here, and 0 · NaN = NaN: were K/V loaded there without a mask? "
         "(masking the scores alone is not enough)"),
        (rows(lambda i, j: float(scores[i][j].max()) > limit or float(torch.logsumexp(scores[i][j], 0)) > 88.72),
         "no_running_max",
         f"its largest logit is {float(scores[b][h].max()):.1f}: exp() of it overflows "
         f"{str(case.query.dtype).replace('torch.', '')} (past {limit:.1f}) unless the running max is subtracted "
         f"first"),
        (rows(lambda i, j: case.guarded and (i * num_heads + j) * head_size + lanes > num_q), "unmasked_head_size",
         "NaN follows the query in memory here, within a padded tile's reach of this head: were the lanes past D "
         "loaded without a mask?"),
        (rows(lambda i, j: width > math.ceil(int(case.seq_lens[i]) / bs) or (case.guarded and i == num_seqs - 1)),
         "reads_past_seq_len",
         "NaN fills every block no sequence owns, and the block-table entries past ceil(seq_len / block_size) name "
         "such blocks: were they read, or was a made-up block number (a masked load's `other`) used for a token "
         "past seq_len?"),
    ]
    # Sources that reach every bad output, the most specific first: the fewer good outputs a
    # source could also have reached, the less the evidence contradicts it.
    fits = sorted(((int((reach & ~bad).sum()), tag, f"{text} (pitfall:{tag})") for reach, tag, text in sources
                  if bool(reach[bad].all())), key=lambda fit: fit[0])
    head = f"{_where(case, b, h)}: the output holds NaN or inf"
    if not fits:
        return (f"{head}, yet no NaN this case planted can reach every bad output and exp() cannot overflow: an "
                f"element never written (the output memory starts as NaN), a division by zero, or a read outside "
                f"the inputs (content/l2.md §5)"), None
    exact = [tag for spare, tag, _ in fits if spare == 0]
    if len(exact) == 1:  # one source reaches exactly the bad outputs; every other one would have spoilt good ones too
        which = "the one NaN source this case planted that reaches exactly the bad outputs"
    else:
        which = "the NaN this case planted that reaches" if len(fits) == 1 else "these could reach"
    return (f"{head}; {which}: " + "; or ".join(text for _, _, text in fits)
            + " (content/l2.md §7; failing that, the kernel read outside its inputs)"), \
        (exact[0] if len(exact) == 1 else None)


def _tiled(case, **mistake):
    """The output of an online softmax over tiles (of a size given later) with `mistake` switched on."""
    def compute(tile):
        last = [online_softmax(s, v, tile, **mistake)[-1] for s, v in case.scores_values()]
        return torch.stack([acc / l[:, None] for _, _, _, l, acc in last])
    return compute


def _with_query(case, query):
    return ref_paged_decode(query, case.k_cache, case.v_cache, case.block_table, case.seq_lens, case.scale)


def _explain_wrong(case, got, want, wrong, b, h, atol, rtol):
    """A finite wrong output: which plausible mistake reproduces it."""
    num_heads, head_size = case.query.shape[1:]
    num_kv_heads, bs = case.k_cache.shape[2], case.block_size
    lens = case.seq_lens.long().cpu()
    dropped = lens // bs * bs
    # (how to compute the wrong answer, tried once or once per tile size; the pitfall; what it means)
    mistakes = [
        (lambda: case.reference(seq_lens=(lens + bs - 1) // bs * bs), "no_last_block_mask",
         "it matches attention over the whole last block, unused slots included: the tokens past seq_len in the "
         "last block were not masked out of the softmax"),
        (lambda: case.reference(seq_lens=torch.where(dropped > 0, dropped, lens)), "no_last_block_mask",
         "it matches attention without the last, partly filled block: only full blocks were read"),
        (_tiled(case, zero_scores=True), "no_last_block_mask",
         "it matches a softmax in which the positions past seq_len in the last tile of {tile} tokens kept score 0 "
         "(their K/V loads were masked to 0, their scores were not set to -inf), so they still count in the sum"),
        (lambda: case.reference(seq_lens=torch.clamp(lens - 1, min=1)), "off_by_one",
         "it matches attention over seq_len - 1 tokens: seq_len already counts the new token, whose K/V is in the "
         "cache"),
        (lambda: case.reference(kv_head=torch.arange(num_heads) % num_kv_heads), "wrong_gqa_mapping",
         "it matches attention with KV head h % H_kv instead of h // (H_q / H_kv): the query heads of KV head kv "
         "are kv·group .. kv·group + group - 1"),
        (lambda: case.reference(kv_head=torch.zeros(num_heads, dtype=torch.long)), "wrong_gqa_mapping",
         "it matches attention with every query head reading KV head 0: the KV head's offset inside each slot "
         "(kv_head · D) is missing"),
        (lambda: case.reference(scale=1.0 / math.sqrt(case.query.shape[2])), "missing_scale",
         f"it matches attention with the default scale 1/sqrt(D): the scale={case.scale} passed in was ignored"),
        (lambda: case.reference(scale=1.0), "missing_scale",
         "it matches attention with scale = 1: the scores were not multiplied by scale"),
        (lambda: _with_query(case, case.query.as_strided(case.query.shape, (num_heads * head_size, head_size, 1))),
         "query_stride_ignored",
         "it matches attention with query rows read H_q·D apart: the query's row stride (query.stride(0)) was "
         "ignored, so a view of a fused QKV tensor reads the wrong rows"),
        (_tiled(case, rescale_sum=False, rescale_acc=False), "no_rescale",
         "it matches an online softmax over tiles of {tile} tokens that moves to the new max but never rescales the "
         "running sum and accumulator by exp(m_old - m_new)"),
        (_tiled(case, rescale_acc=False), "no_rescale",
         "it matches an online softmax over tiles of {tile} tokens that rescales the running sum but not the "
         "accumulator by exp(m_old - m_new)"),
        (_tiled(case, rescale_sum=False), "no_rescale",
         "it matches an online softmax over tiles of {tile} tokens that rescales the accumulator but not the "
         "running sum by exp(m_old - m_new)"),
    ]
    # Each mistake that reproduces this output (and differs from the right one there);
    # one that reproduces every wrong output beats one that reproduces only this one.
    matches = []
    for compute, tag, text in mistakes:
        for tile in (_TILES if "{tile}" in text else (None,)):
            alt = compute(tile) if tile else compute()
            same = _close(got, alt, atol, rtol)
            if same[b, h] and not _close(want, alt, atol, rtol)[b, h]:
                matches.append((not bool(same[wrong].all()), text.format(tile=tile), tag))
    if matches:
        partial, text, tag = min(matches, key=lambda match: match[0])  # stable: the list order breaks ties
        scope = "" if partial else "; so do all the other wrong outputs"
        return f"{_where(case, b, h)} is off: {text}{scope} (pitfall:{tag}, content/l2.md §7)", tag
    scope = "every output is wrong" if bool(wrong.all()) else "some outputs are right"
    return (f"{_where(case, b, h)} is off ({scope}); it matches none of the usual mistakes (last block unmasked or "
            f"dropped, another GQA head mapping, a missing scale, an online softmax that does not rescale) "
            f"(content/l2.md §5)"), None


def _describe_decode(case):
    num_seqs, num_heads, head_size = case.query.shape
    scale = "default 1/sqrt(D)" if case.scale is None else f"{case.scale:g}"
    return (f"case: B={num_seqs}, H_q={num_heads}, H_kv={case.k_cache.shape[2]}, D={head_size}, "
            f"block_size={case.block_size}, dtype={str(case.query.dtype).replace('torch.', '')}, scale={scale}, "
            f"seq_lens={case.seq_lens.tolist()}, block_table={case.block_table.tolist()}, "
            f"unused end of each last block holds {case.tail}")
