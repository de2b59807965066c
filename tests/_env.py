"""Where the kernels run. Import this before any drill module is loaded.

Triton decides when a kernel is decorated with @triton.jit (that is, when the
module defining it is imported) whether it will be compiled for the GPU or run
by its CPU interpreter, by reading TRITON_INTERPRET. Without a CUDA device we
set it, so a learner with no GPU can finish every drill on the CPU. Setting
TRITON_INTERPRET=1 yourself forces the interpreter on a GPU machine too.
`python grader.py doctor` checks that this worked.
"""
import os


def _cuda_available():
    import torch  # importing torch does not import Triton

    return torch.cuda.is_available()


if "TRITON_INTERPRET" not in os.environ and not _cuda_available():
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
