"""The gated activation of the Llama MLP (SwiGLU, Shazeer 2020)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """x [..., 2 * d] -> silu(x[..., :d]) * x[..., d:]   [..., d]

    The gate and up projections are fused into one matmul (`gate_up_proj`) whose output
    holds the gate half then the up half; this splits and combines them.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
