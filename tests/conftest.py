"""Shared test setup.

On a machine without a GPU the Triton kernels run in Triton's interpreter, which must be
chosen before triton is imported: set it here, before any test module imports a kernel.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
