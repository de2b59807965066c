"""A tiny kernel with a known answer, for `python grader.py doctor`.

Learners most often get stuck on a set-up in which kernels silently return
zeros. This one writes y = 2x + 1 on the first 5 of 8 lanes: every value is
non-zero and the masked tail must stay untouched.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _affine(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(y_ptr + offs, 2 * x + 1, mask=offs < n)


def run(device):
    """None when the kernel is right, else what went wrong."""
    x = torch.arange(1, 9, dtype=torch.float32, device=device)
    y = torch.full((8,), float("nan"), device=device)
    _affine[(1,)](x, y, 5, BLOCK=8)
    y = y.cpu()
    if bool((y[:5] == 0).all()):
        return "the kernel returned zeros: Triton did not run it (interpreter not active or broken)"
    if y[:5].tolist() != [3.0, 5.0, 7.0, 9.0, 11.0]:
        return f"wrong values {y[:5].tolist()} (expected [3, 5, 7, 9, 11])"
    if not bool(y[5:].isnan().all()):
        return "the masked tail was written: masks are not honoured"
    return None
