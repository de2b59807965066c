"""Where the kernels run. Import this before anything imports Triton.

Triton decides when a kernel is decorated with @triton.jit whether it will be
compiled for the GPU or run by its CPU interpreter, by reading TRITON_INTERPRET.
Without a CUDA device we set it, so a learner with no GPU can finish every drill
on the CPU. Setting TRITON_INTERPRET=1 yourself forces the interpreter on a GPU
machine too.
"""
import os
import sys


def _cuda_available():
    import torch  # importing torch does not import Triton

    return torch.cuda.is_available()


if "TRITON_INTERPRET" not in os.environ and not _cuda_available():
    if "triton" in sys.modules:
        raise RuntimeError(
            "Triton was imported before tests/_env.py could set TRITON_INTERPRET=1; "
            "import _env first, or run with TRITON_INTERPRET=1 in the environment"
        )
    os.environ["TRITON_INTERPRET"] = "1"

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
DEVICE = "cpu" if INTERPRET else "cuda"


def describe():
    """One line for reports: where kernels run here."""
    import torch
    import triton

    versions = f"torch {torch.__version__}, triton {triton.__version__}"
    if INTERPRET:
        return f"CPU, Triton interpreter ({versions})"
    return f"{torch.cuda.get_device_name()} ({versions})"
