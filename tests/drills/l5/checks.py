"""L5's checks and their diagnosis: the write's caches bit for bit (guards, untouched
slots and padding included) and the decode within tolerance of the float64 reference on
the dequantised cache, with the format's own error reported beside it. A pitfall is named
only when its replay reproduces the learner's output (content/l5.md §10)."""
import torch

import _env
from _diagnose import Mismatch, output_of, reproduces

from .mistakes import SECTION
from .reference import FORMAT_TOLERANCE, FP8_MAX, TOLERANCE, dequantised_attention, fp8_bytes

# ---------------------------------------------------------------------------
# The write

_TWICE = "rounded twice: divide in fp32 and convert that quotient straight to fp8"
_CUT = " (Triton's interpreter rounds fp32 to bfloat16 by dropping bits)"
_REPLAYS = (("multiplied", "scale_multiplied_on_write",
             "every byte is what x · scale gives: the write must divide (the cache holds x / scale)"),
            ("source_dtype", "source_dtype_division",
             f"every byte is what x / scale gives computed in the input's own dtype (rounded to 16 bits, then to "
             f"fp8): {_TWICE}"),
            ("source_dtype_scale", "source_dtype_division",
             "every byte is what x / scale gives with the scale rounded to the input's own dtype (a division "
             "written in that dtype, as Triton's interpreter runs it): divide in fp32"),
            ("source_dtype_scale_cut", "source_dtype_division",
             f"every byte is what x / scale gives with the scale rounded to the input's own dtype{_CUT} (a division "
             f"written in that dtype): divide in fp32"),
            ("source_dtype_quotient", "source_dtype_division",
             f"every byte is what the fp32 quotient x / scale gives once rounded to the input's own dtype and then "
             f"to fp8: {_TWICE}"),
            ("source_dtype_quotient_cut", "source_dtype_division",
             f"every byte is what the fp32 quotient x / scale gives once rounded to the input's own dtype{_CUT} and "
             f"then to fp8: {_TWICE}"))


def _fmt(case):
    t, h, d = case.key.shape
    return (f"case: T={t} ({int((case.slot_mapping < 0).sum())} padding), H={h}, D={d}, block_size={case.block_size}, "
            f"{str(case.key.dtype).replace('torch.', '')} -> {str(case.k_cache.view.dtype).replace('torch.', '')}, "
            f"scales {'per KV head' if case.k_scale.numel() > 1 else 'per tensor'}, key row stride "
            f"{case.key.stride(0)}, slots={case.slot_mapping.tolist()}")


def check_fp8_write(case):
    """Both caches' bytes, guards included, against the reference write."""
    want_k, want_v = case.expected()
    for name, cache, want, rows, scale in (("k_cache", case.k_cache, want_k, case.key, case.k_scale),
                                           ("v_cache", case.v_cache, want_v, case.value, case.v_scale)):
        got = fp8_bytes(cache.storage).cpu()
        if torch.equal(got, fp8_bytes(want).cpu()):
            continue
        raise _explain_write(name, case, cache, got, fp8_bytes(want).cpu(), rows, scale)


def _explain_write(name, case, cache, got, want, rows, scale):
    num_tokens, num_heads, head_size = rows.shape
    hd, margin, size = num_heads * head_size, cache.margin, cache.view.numel()
    initial = fp8_bytes(cache.initial).cpu()
    dtype = cache.view.dtype
    lines, pitfalls = [], []
    for how, tag, text in _REPLAYS:
        alt = case.expected(how)[0 if name == "k_cache" else 1]
        if tag not in pitfalls and not torch.equal(fp8_bytes(alt).cpu(), want) and \
                torch.equal(fp8_bytes(alt).cpu(), got):
            lines.append(f"{name}: {text} (pitfall:{tag}, {SECTION})")
            pitfalls.append(tag)
    front = (got[:margin] != initial[:margin]).nonzero().flatten()
    back = (got[margin + size:] != initial[margin + size:]).nonzero().flatten()
    if front.numel():
        pads = [t for t in range(num_tokens) if int(case.slot_mapping[t]) < 0]
        row_before = got[margin - hd:margin]
        culprit = next((t for t in pads if bool((front >= margin - hd).all()) and torch.equal(
            row_before, fp8_bytes(_quantised(rows[t], scale, dtype)).reshape(-1))), None)
        if culprit is not None and not bool((got[margin:margin + size] != want[margin:margin + size]).any()):
            lines.append(f"{name}: padding token {culprit} (slot -1) was quantised into slot -1, just before the "
                         f"cache: a padding token reads and writes nothing (pitfall:padding_written, {SECTION})")
            pitfalls.append("padding_written")
        else:
            lines.append(f"{name}: {front.numel()} bytes before the start of the cache were written")
    if back.numel():
        lines.append(f"{name}: {back.numel()} bytes past the end of the cache were written")
    inside_got, inside_want = got[margin:margin + size].view(-1, hd), want[margin:margin + size].view(-1, hd)
    bad_slots = (inside_got != inside_want).any(dim=1).nonzero().flatten().tolist()
    owner = {int(s): t for t, s in enumerate(case.slot_mapping.tolist()) if s >= 0}
    stray = [s for s in bad_slots if s not in owner]
    if stray:
        lines.append(f"{name}: slot {stray[0]} belongs to no new token and must keep its old bytes, but it was "
                     f"written ({len(stray)} such slots)")
    owned_bad = [s for s in bad_slots if s in owner]
    if owned_bad:
        direct = not pitfalls and _converted_by_triton(owner, inside_got, rows, scale, dtype)
        lines.append(_explain_slot(name, case, owned_bad, owner, inside_got, inside_want, rows, scale, dtype,
                                   pitfalls, direct))
    return Mismatch("\n  ".join(lines) + f"\n  {_fmt(case)}", pitfalls)


_CONVERT = []  # the kernel below, made on first use (Triton is imported only then)


def _triton_fp8(q, dtype):
    """fp32 `q` converted to fp8 by Triton's own conversion, as a kernel that stores fp32
    into an fp8 pointer (or calls .to()) runs here: under the CPU interpreter that conversion
    is wrong (content/l5.md §5), which is why the page's kernel computes the byte itself."""
    import triton
    import triton.language as tl
    if not _CONVERT:
        @triton.jit
        def convert(q_ptr, out_ptr, n, BLOCK: tl.constexpr):
            i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            tl.store(out_ptr + i, tl.load(q_ptr + i, mask=i < n).to(out_ptr.dtype.element_ty), mask=i < n)
        _CONVERT.append(convert)
    q = q.float().contiguous().view(-1)
    out = torch.empty(q.shape, dtype=dtype)
    if q.numel():
        _CONVERT[0][(triton.cdiv(q.numel(), 1024),)](q, out, q.numel(), BLOCK=1024)
    return fp8_bytes(out)


def _converted_by_triton(owner, inside_got, rows, scale, dtype):
    """Under the interpreter: every real token's bytes are exactly what Triton's own fp32 ->
    fp8 conversion gives for the right (fp32, correctly rounded) quotient, clamped or not,
    where the page's byte (_fp8_bits) differs. The evidence for the interpreter's hint."""
    if not _env.INTERPRET or not owner:
        return False
    slots = torch.tensor(sorted(owner))
    tokens = torch.tensor([owner[int(s)] for s in slots])
    quotient = rows.cpu()[tokens].float() / scale.cpu().float().view(-1, 1)
    got = inside_got[slots].reshape(-1)
    try:
        return any(torch.equal(_triton_fp8(q, dtype), got)
                   for q in (quotient.clamp(-FP8_MAX[dtype], FP8_MAX[dtype]), quotient))
    except Exception:  # Triton could not run the conversion here: no evidence either way
        return False


def check_the_interpreters_hint_needs_its_evidence(device):
    """The diagnosis sends a learner to _fp8_bits only when their bytes are Triton's own
    conversion of the right quotient; a wrong write that already computes the byte the
    page's way (here: K quantised with twice its scale, by the reference) is not told to."""
    from .cases import write_case
    from .reference import ref_cache_write

    def said(write_k):
        case = write_case(num_tokens=4, num_heads=2, head_size=8, dtype=torch.float32, device=device, seed=7)
        want_k, want_v = case.expected()
        case.k_cache.storage.copy_(case.k_cache.expected(lambda view: write_k(case, view)).to(device))
        case.v_cache.storage.copy_(want_v.to(device))
        try:
            check_fp8_write(case)
        except Mismatch as error:
            return str(error)
        raise AssertionError("a wrong k_cache passed check_fp8_write")

    assert "_fp8_bits" not in said(lambda c, view: ref_cache_write(c.key, view, c.slot_mapping, c.k_scale * 2))
    if _env.INTERPRET:
        def triton_bytes(c, view):
            real = c.slot_mapping.cpu() >= 0
            slots = c.slot_mapping.cpu()[real].long()
            q = (c.key.cpu()[real].float() / c.k_scale.cpu().view(-1, 1)).clamp(-FP8_MAX[view.dtype],
                                                                                   FP8_MAX[view.dtype])
            hd = view.shape[-2] * view.shape[-1]
            view.view(torch.uint8).view(-1, hd)[slots] = _triton_fp8(q, view.dtype).view(-1, hd)
        assert "_fp8_bits" in said(triton_bytes)


def _quantised(row, scale, dtype):
    q = row.cpu().float() / scale.cpu().view(-1, 1)
    return q.clamp(-FP8_MAX[dtype], FP8_MAX[dtype]).to(dtype)


def _explain_slot(name, case, owned_bad, owner, inside_got, inside_want, rows, scale, dtype, pitfalls, direct):
    """Which elements of the owned slots are wrong, and what they have in common; `direct`:
    they are exactly Triton's own fp8 conversion of the right quotient, under the interpreter."""
    num_heads, head_size = rows.shape[1:]
    s = owned_bad[0]
    t = owner[s]
    wrong_cols = (inside_got[s] != inside_want[s]).nonzero().flatten()
    c = int(wrong_cols[0])
    x = rows[t].reshape(-1)[c].float().item()
    sc = scale.cpu().view(-1)[c // head_size if scale.numel() > 1 else 0].item()
    got_v = inside_got[s, c:c + 1].view(dtype).float().item()
    want_v = inside_want[s, c:c + 1].view(dtype).float().item()
    text = (f"{name}: slot {s} (token {t}): {wrong_cols.numel()} of {num_heads * head_size} bytes wrong, first at "
            f"head {c // head_size}, element {c % head_size}: x = {x:.6g}, scale = {sc:.6g}, x / scale = "
            f"{x / sc:.6g}; expected {want_v:.6g}, found {got_v:.6g}")
    # Every wrong element of every real token, against its quotient.
    quotient = torch.zeros(inside_got.shape)
    real = [(slot, tok) for slot, tok in owner.items()]
    for slot, tok in real:
        quotient[slot] = (rows[tok].cpu().float() / scale.cpu().view(-1, 1)).reshape(-1)
    wrong = inside_got != inside_want
    rows_of = torch.zeros(inside_got.shape[0], dtype=torch.bool)
    rows_of[[slot for slot, _ in real]] = True
    wrong &= rows_of[:, None]
    saturating = (quotient.abs() > FP8_MAX[dtype]) & rows_of[:, None]
    if not pitfalls and bool(saturating.any()) and torch.equal(wrong, saturating):
        pitfalls.append("no_saturation")
        return (f"{text}\n  exactly the {int(saturating.sum())} elements whose x / scale passes ±{FP8_MAX[dtype]:g} "
                f"are wrong: clamp the quotient before converting (pitfall:no_saturation, {SECTION})")
    if direct:
        return (f"{text}\n  every real token's bytes are exactly what Triton's own fp32 -> fp8 conversion (.to() or a "
                f"store of fp32 into the fp8 cache) gives for the right quotient: under the CPU interpreter that "
                f"conversion is wrong (it rounds ties away from zero and drops the carry into the exponent), so "
                f"compute the byte with _fp8_bits and store it through a uint8 view of the cache (content/l5.md §5)")
    step = (inside_got.long() - inside_want.long()).abs()
    same_sign = (inside_got ^ inside_want) < 0x80
    if not pitfalls and bool((step[wrong] == 1).all() & same_sign[wrong].all()):
        # The interpreter's `/` is numpy's, correctly rounded: there the step comes from a rounding on the way.
        why = ("Look for a rounding on the way (to a 16-bit dtype, or a conversion that does not round to nearest "
               "even)" if _env.INTERPRET else "Use tl.math.div_rn (Triton's `/` is not correctly rounded) and round to "
                                              "nearest even")
        return (f"{text}\n  every wrong byte ({int(wrong.sum())}) is one fp8 step from the right one: the quotient "
                f"was rounded differently. {why} (content/l5.md §5)")
    return text + f"\n  {int(wrong.sum())} wrong bytes in {len(owned_bad)} of {len(real)} real tokens' slots"


# ---------------------------------------------------------------------------
# The decode


def _close(a, b, atol, rtol):
    return torch.isclose(a.double(), b.double(), rtol=rtol, atol=atol).all(dim=-1)


def fp8_errors(case, out):
    """(the kernel's error: the largest |out - exact on the dequantised cache|, the format's
    error: the largest |exact on the dequantised cache - exact on the unquantised inputs|)."""
    want = dequantised_attention(case)
    return float((out.cpu().double() - want).abs().max()), \
        float((want - dequantised_attention(case, unquantised=True)).abs().max())


def _describe(case):
    num_seqs, num_heads, head_size = case.query.shape
    return (f"case: B={num_seqs}, H_q={num_heads}, H_kv={case.k_cache.shape[2]}, D={head_size}, block_size="
            f"{case.block_size}, {str(case.query.dtype).replace('torch.', '')} query over a "
            f"{str(case.k_cache.dtype).replace('torch.', '')} cache, scales "
            f"{'per KV head' if case.k_scale.numel() > 1 else 'per tensor'} (k {case.k_scale.tolist()}, v "
            f"{case.v_scale.tolist()}), num_splits={case.num_splits}, seq_lens={case.seq_lens.tolist()}, unused "
            f"end of each last block holds {case.tail}")


_DECODE_MISTAKES = (
    (dict(k_power=2, v_power=2), "scale_applied_twice",
     "it matches K and V dequantised with scale² (the scale folded into the scores and the output, and applied "
     "per element too)"),
    (dict(v_power=0), "v_not_dequantised", "it matches V read without its scale (K dequantised, V not)"),
    (dict(scale_of_query_head=True), "scale_by_query_head",
     "it matches query head h reading scale[h] (the query head) instead of scale[h // group] (its KV head)"),
)


def check_fp8_decode(case, got, returned=None):
    """paged_decode_attention_fp8's output against the float64 reference on the dequantised
    cache; a mismatch says how far fp8 itself is from the unquantised inputs too."""
    query = case.query
    got = output_of(got, returned, query, "paged_decode_attention_fp8", "content/l5.md §1")
    out = got.cpu().double()
    want = dequantised_attention(case)
    atol, rtol = TOLERANCE[query.dtype]
    bad = ~torch.isfinite(out).all(dim=-1)
    if bad.any():
        raise _non_finite(case, bad)
    wrong = ~_close(out, want, atol, rtol)
    if not wrong.any():
        return
    b, h = (int(i) for i in wrong.nonzero()[0])
    this = torch.zeros_like(wrong)
    this[b, h] = True
    found, text = [], ("it matches none of the scale mistakes (applied twice, V left quantised, indexed by the "
                       "query head); compare it with L4 on the dequantised cache (content/l5.md §6)")
    for knobs, tag, sentence in _DECODE_MISTAKES:
        alt = dequantised_attention(case, **knobs)
        if reproduces(out, want, alt, atol, rtol, this):
            if bool(_close(out, alt, atol, rtol).all()):
                found, text = [tag], f"{sentence}; so do all the other outputs (pitfall:{tag}, {SECTION})"
                break
            text = f"{sentence}, but other outputs do not fit that story ({SECTION})"
    d = int((out[b, h] - want[b, h]).abs().argmax())
    kernel_error, format_error = fp8_errors(case, got)
    group = query.shape[1] // case.k_cache.shape[2]
    raise Mismatch(f"sequence {b} (seq_len {int(case.seq_lens[b])}), query head {h} (KV head {h // group}) is off: "
                   f"{text}\n  element {d}: expected {float(want[b, h, d]):.5g} (exact on the fp8 cache), got "
                   f"{float(out[b, h, d]):.5g} (tolerance {atol} + {rtol}·|expected|); {int(wrong.sum())} of "
                   f"{wrong.numel()} (sequence, head) outputs wrong\n  your kernel is within {kernel_error:.3g} of "
                   f"exact on the fp8 cache; fp8 itself costs {format_error:.3g} against the unquantised inputs "
                   f"(vLLM allows {FORMAT_TOLERANCE} there)\n  {_describe(case)}", found)


def _non_finite(case, bad):
    """NaN/inf in the output: named empty_split_nan only when exactly the sequences shorter
    than num_splits (whose last chunks are empty however a kernel rounds) are bad, and some
    sequence no rounding leaves a chunk empty in is finite; otherwise described."""
    b, h = (int(i) for i in bad.nonzero()[0])
    lens = case.seq_lens.cpu().long()
    head = f"sequence {b}, query head {h}: the output holds NaN or inf ({int(bad.sum())} of {bad.numel()} outputs)"
    splits = case.num_splits
    if splits and splits > 1:
        surely_empty, never_empty = lens < splits, lens % (splits * 256) == 0
        rows_bad = bad.any(dim=1)
        if surely_empty.any() and never_empty.any() and torch.equal(rows_bad[surely_empty | never_empty],
                                                                     surely_empty[surely_empty | never_empty]) \
                and not bool(rows_bad[~surely_empty].any()):
            return Mismatch(f"{head}; exactly the sequences shorter than num_splits = {splits} are NaN: an empty "
                            f"chunk's 0/0, or its garbage times weight 0, reached the output (pitfall:empty_split_nan,"
                            f" {SECTION})\n  {_describe(case)}", ["empty_split_nan"])
    return Mismatch(f"{head}. Where it can come from: a NaN or inf byte read from a block no sequence owns or from "
                    f"the unused end of a last block (they hold fp8 NaN/inf here: mask the K/V loads), an empty "
                    f"chunk's 0/0 (content/l4.md §4), or a scale read from the wrong place\n  {_describe(case)}")
