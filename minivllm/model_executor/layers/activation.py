"""The gated activation of the Llama MLP (SwiGLU, Shazeer 2020)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.model_executor.layers.fused import fused_ops


class SiluAndMul(nn.Module):
    """x [..., 2 * d] -> silu(x[..., :d]) * x[..., d:]   [..., d]

    The gate and up projections are fused into one matmul (`gate_up_proj`) whose output
    holds the gate half then the up half; this splits and combines them.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = fused_ops(x)
        if ops is not None and x.dim() == 2 and x.stride(-1) == 1:
            return ops.silu_and_mul(x)  # one kernel (see layers.fused)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
