"""L5's planted mistakes: the page's pitfalls (content/l5.md §10) and the other wrong
kernels, as edits of solutions/l5_fp8_kv_cache.py, and PLANTED, what the diagnosis reads."""
import _env
from _drill import Mistake, Pitfall, Planted

SECTION = "content/l5.md §10"
_DIVIDE = "q = _divide(x.to(tl.float32), scale, INT_ENCODE)"
_PART = "part = acc / tl.where(l > 0, l, 1.0)[:, None] * v_scale"
_K_LOAD = "k = tl.load(k_cache_ptr + kv_offs, mask=kv_mask, other=0.0).to(tl.float32).to(q.dtype)"
_V_LOAD = "v = tl.load(v_cache_ptr + kv_offs, mask=kv_mask, other=0.0).to(tl.float32).to(q.dtype)"

PITFALLS = {
    "scale_multiplied_on_write": Pitfall(
        says="the write multiplies by the scale instead of dividing: vLLM's scale is the dequantisation factor, "
             "so the cache holds x / scale",
        edits=((_DIVIDE, "q = x.to(tl.float32) * scale"),)),
    "no_saturation": Pitfall(
        says="the quotient is not clamped to the format's largest finite value before the conversion, so large "
             "values become NaN, inf or garbage bytes",
        edits=(("    q = tl.minimum(tl.maximum(q, -FP8_MAX), FP8_MAX)  # saturate: never NaN or inf in the cache\n",
                ""),),
        # On a GPU Triton's fp8 conversion saturates by itself (cvt ... satfinite), so the
        # missing clamp changes nothing there; the interpreter's integer conversion needs it.
        interpreter_only=True),
    "source_dtype_division": Pitfall(
        says="x / scale is computed in the input's 16-bit dtype, which rounds the quotient once to 16 bits and "
             "again to fp8 (double rounding)",
        edits=((_DIVIDE, "q = (x / scale.to(x.dtype)).to(tl.float32)"),)),
    "padding_written": Pitfall(
        says="padding tokens (slot -1) are not skipped: their row is quantised into slot -1, just before the cache",
        edits=(("tl.where(slot >= 0, NUM_HEADS, 0)", "NUM_HEADS"),), races=True),
    "scale_by_query_head": Pitfall(
        says="the per-KV-head scale is indexed by the query head (scale[h_q]) instead of its KV head "
             "(scale[h_q // group])",
        edits=(("k_scale = tl.load(k_scale_ptr + kv_head * SCALE_STRIDE)",
                "k_scale = tl.load(k_scale_ptr + heads * SCALE_STRIDE)[:, None]"),
               ("v_scale = tl.load(v_scale_ptr + kv_head * SCALE_STRIDE)",
                "v_scale = tl.load(v_scale_ptr + heads * SCALE_STRIDE)[:, None]"))),
    "v_not_dequantised": Pitfall(
        says="K is dequantised but V is not: the output is missing its factor v_scale",
        edits=((_PART, "part = acc / tl.where(l > 0, l, 1.0)[:, None]"),)),
    "scale_applied_twice": Pitfall(
        says="the scales are applied twice: folded into the scores' scale and the output, and also per element "
             "on load",
        edits=((_K_LOAD, "k = (tl.load(k_cache_ptr + kv_offs, mask=kv_mask, other=0.0).to(tl.float32) * "
                         "k_scale).to(q.dtype)"),
               (_V_LOAD, "v = (tl.load(v_cache_ptr + kv_offs, mask=kv_mask, other=0.0).to(tl.float32) * "
                         "v_scale).to(q.dtype)"))),
    "empty_split_nan": Pitfall(
        says="an empty chunk (past a short sequence's end) produces NaN: 0/0 in phase 1, 0 · garbage or 0/0 in "
             "the merge (L4's pitfall)",
        edits=((_PART, "part = acc / l[:, None] * v_scale"),
               ("    v = tl.where(w[:, None] > 0, v, 0.0)  # an empty part's v may be garbage, and 0 * NaN = NaN\n",
                ""),
               ("/ tl.where(total > 0, total, 1.0)", "/ total"))),
}

# Wrong kernels that are none of the page's pitfalls: the grade must fail each and
# name nothing, saying what is wrong instead.
MISTAKES = {
    "v_written_with_k_scale": Mistake(shows="v_cache", edits=(
        ("_quantise_store(v_cache_ptr + row, v, v_scale,", "_quantise_store(v_cache_ptr + row, v, k_scale,"),
    )),
    "chunks_overlap": Mistake(shows="is off", edits=(
        ("end = tl.minimum(start + chunk, seq_len)", "end = tl.minimum(start + chunk + TILE, seq_len)"),
    )),
}
if _env.INTERPRET:  # on a GPU Triton's own conversion is right: there this is the reference
    MISTAKES["fp8_converted_by_triton_in_the_interpreter"] = Mistake(shows="_fp8_bits", edits=(
        ("INT_ENCODE=_INTERPRET,", "INT_ENCODE=False,"),
        ("if _INTERPRET:  # the byte is computed in the kernel", "if False:  # the byte is computed in the kernel"),
    ))
if not _env.INTERPRET:  # the interpreter's `/` is numpy's, correctly rounded: there this is right
    MISTAKES["quotient_not_correctly_rounded"] = Mistake(shows="one fp8 step", edits=(
        (_DIVIDE, "q = x.to(tl.float32) / scale"),
    ))


PLANTED = Planted(id="l5", stem="l5_fp8_kv_cache", section=SECTION, pitfalls=PITFALLS, mistakes=MISTAKES)
