"""RMSNorm (Zhang & Sennrich, 2019), the normalization of every Llama-family model.

    y = x / sqrt(mean(x^2) + eps) * weight

No mean subtraction and no bias, unlike LayerNorm. The statistics are taken in fp32 even for
bf16/fp16 activations (a sum of squares over 4096 features overflows fp16's range).
"""

from __future__ import annotations

import torch
from torch import nn

from minivllm.model_executor.custom_op import CustomOp


class RMSNorm(CustomOp):
    """RMSNorm over the last dimension, with vLLM's fused residual add.

    `forward(x)` returns the normalized x. `forward(x, residual)` first adds the residual
    stream, `residual = x + residual`, and returns `(norm(residual), residual)`: each decoder
    layer hands its output and the running residual to the next layer's input norm, which
    does the add, so the add and the norm are one step (one kernel in vLLM).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, backend: str = "torch") -> None:
        super().__init__(backend)
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        # Cast back before scaling, as Hugging Face does, so logits match bit for bit in fp32
        # and closely in bf16.
        return self.weight * x32.to(x.dtype)

    def forward_native(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"

    def forward_triton(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """One kernel for the add and the norm (`kernels/fused_ops.py`), for the layouts it reads."""
        if x.stride(-1) != 1 or (residual is not None and not (x.dim() == 2 and residual.is_contiguous())):
            return self.forward_native(x, residual)
        from minivllm.kernels import fused_ops  # imports triton: only when this backend is chosen

        return fused_ops.rms_norm(x, self.weight, self.eps, residual)
