"""The gated activation of the Llama MLP (SwiGLU, Shazeer 2020)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from minivllm.model_executor.custom_op import CustomOp


class SiluAndMul(CustomOp):
    """x [..., 2 * d] -> silu(x[..., :d]) * x[..., d:]   [..., d]

    The gate and up projections are fused into one matmul (`gate_up_proj`) whose output
    holds the gate half then the up half; this splits and combines them.
    """

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def forward_triton(self, x: torch.Tensor) -> torch.Tensor:
        """One kernel (`kernels/fused_ops.py`) for a 2-D input with unit stride."""
        if x.dim() != 2 or x.stride(-1) != 1:
            return self.forward_native(x)
        from minivllm.kernels import fused_ops  # imports triton: only when this backend is chosen

        return fused_ops.silu_and_mul(x)
