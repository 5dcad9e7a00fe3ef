"""A layer written twice, one version chosen once: `CustomOp` (vLLM's
`vllm/model_executor/custom_op.py`).

    forward_native   plain PyTorch: the readable spec, what runs on a CPU
    forward_triton   one fused Triton kernel (`kernels/fused_ops.py`, `kernels/sampling.py`)

`forward` is bound to one of them at construction, by the attention backend ("torch" or
"triton"): no flag is read per call.
"""

from __future__ import annotations

from torch import nn

from minivllm.kernels import available_backends


class CustomOp(nn.Module):
    """Subclasses implement `forward_native` and, where a kernel exists, `forward_triton`."""

    def __init__(self, backend: str = "torch") -> None:
        super().__init__()
        self.use_backend(backend)

    def use_backend(self, backend: str) -> None:
        """Bind `forward` to the backend's version (a benchmark may rebind before graph capture)."""
        if backend not in available_backends():  # a registered attention backend runs native ops
            raise ValueError(f"unknown backend {backend!r}; choose one of {available_backends()}.")
        self.backend = backend
        self._forward = self.forward_triton if backend == "triton" else self.forward_native

    def forward(self, *args, **kwargs):
        return self._forward(*args, **kwargs)

    def forward_native(self, *args, **kwargs):
        raise NotImplementedError

    def forward_triton(self, *args, **kwargs):
        """The fused kernel; by default (no kernel written) the PyTorch version."""
        return self.forward_native(*args, **kwargs)
