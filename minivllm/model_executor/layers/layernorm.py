"""RMSNorm (vLLM's `vllm/model_executor/layers/layernorm.py`): y = x / sqrt(mean(x^2) + eps)
* weight, the statistics in fp32 (a sum of squares of 4096 features overflows fp16)."""

from __future__ import annotations

import torch
from torch import nn

from minivllm.kernels.reference import rms_norm
from minivllm.model_executor.custom_op import CustomOp


class RMSNorm(CustomOp):
    """RMSNorm over the last dimension, with vLLM's fused residual add: `forward(x)` -> norm(x);
    `forward(x, residual)` -> (norm(x + residual), x + residual), one kernel on "triton"."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, backend: str = "torch") -> None:
        super().__init__(backend)
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward_native(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        residual = x + residual
        return rms_norm(residual, self.weight, self.eps), residual

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"

    def forward_triton(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """One kernel for the add and the norm (`kernels/fused_ops.py`), for the layouts it reads."""
        if x.stride(-1) != 1 or (residual is not None and not (x.dim() == 2 and residual.is_contiguous())):
            return self.forward_native(x, residual)
        from minivllm.kernels import fused_ops  # imports triton: only when this backend is chosen

        return fused_ops.rms_norm(x, self.weight, self.eps, residual)
