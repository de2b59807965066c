"""L4's plain-PyTorch reference (float64, on the CPU): the merge of two attention states,
plain attention for the split decode, the chunks a kernel would make and their merge,
and the tolerances against the reference."""
import math

import torch

LN2 = math.log(2)


# ---------------------------------------------------------------------------
# The reference (float64, CPU)


def ref_merge(v_a, s_a, v_b, s_b, base=math.e):
    """(v, s) of the union of two disjoint key sets, in float64. Works on floats or on
    tensors [n, H, D] / [n, H]. `base` is the base the LSEs are *read* in (the diagnosis
    replays a merge that reads them in the wrong base)."""
    scalar = not isinstance(v_a, torch.Tensor)
    t = (lambda x: torch.tensor(x, dtype=torch.float64)) if scalar else (lambda x: x.cpu().double())
    v_a, s_a, v_b, s_b = t(v_a), t(s_a), t(v_b), t(s_b)
    s_a, s_b = s_a * math.log(base), s_b * math.log(base)
    s = torch.logaddexp(s_a, s_b)  # -inf when both are empty
    shift = torch.where(torch.isinf(s), torch.zeros_like(s), s)
    w_a, w_b = torch.exp(s_a - shift), torch.exp(s_b - shift)
    part = (lambda w, v: torch.where(w[..., None] > 0, w[..., None] * v.nan_to_num(), 0.0)) if not scalar else \
        (lambda w, v: w * v if w > 0 else torch.zeros(()))
    total = w_a + w_b
    denominator = torch.where(total > 0, total, torch.ones_like(total))
    v = (part(w_a, v_a) + part(w_b, v_b)) / (denominator if scalar else denominator[..., None])
    s = s / math.log(base)
    return (float(v), float(s)) if scalar else (v, s)


def ref_split_decode(case):
    """Plain attention, softmax(q·K^T · scale) · V per sequence and query head, float64:
    the split count does not change the answer. Returns [B, H_q, D]."""
    return torch.stack([torch.einsum("hn,hnd->hd", s.softmax(-1), v) for s, v in case.scores_values()]) \
        if case.query.shape[0] else torch.zeros(case.query.shape, dtype=torch.float64)


def chunk_bounds(n, num_splits, align):
    """The [start, end) of each of num_splits chunks of n tokens, each ceil(n / num_splits)
    rounded up to a multiple of `align` long (the reference aligns to its tile)."""
    per_split = -(-n // num_splits)            # ceil(n / num_splits)
    chunk = -(-per_split // align) * align      # rounded up to a multiple of align
    return [(min(i * chunk, n), min((i + 1) * chunk, n)) for i in range(num_splits)]


def chunk_states(scores, values, bounds):
    """Per chunk, (v [H, D], lse [H], l [H]) as phase 1 writes them (l: the chunk's sum
    of exp(score - its own max)); an empty chunk gives v = 0, lse = -inf, l = 0."""
    heads, head_size = values.shape[0], values.shape[2]
    states = []
    for start, end in bounds:
        if end <= start:
            states.append((torch.zeros(heads, head_size, dtype=torch.float64),
                           torch.full((heads,), float("-inf"), dtype=torch.float64), torch.zeros(heads)))
            continue
        s = scores[:, start:end]
        m = s.max(dim=1).values
        p = torch.exp(s - m[:, None])
        l = p.sum(dim=1)
        states.append((torch.einsum("hn,hnd->hd", p, values[:, start:end]) / l[:, None], m + torch.log(l), l))
    return states


def merge_all(states):
    """Phase 2: fold the chunks' (v, lse, l) with ref_merge; returns (v [H, D], lse [H])."""
    v, s = states[0][0], states[0][1]
    for v_i, s_i, _ in states[1:]:
        v, s = ref_merge(v[None], s[None], v_i[None], s_i[None])
        v, s = v[0], s[0]
    return v, s


# ---------------------------------------------------------------------------
# Tolerances

# (atol, rtol) against the float64 reference; the partials are fp32 whatever the input.
TOLERANCE = {torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.5e-2, 1.5e-2), torch.float32: (1e-4, 1e-4)}
