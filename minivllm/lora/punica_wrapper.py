"""Which slot each row of the step uses, and the two kernel calls that apply it.

vLLM's `vllm/lora/punica_wrapper/`: ONE object shared by every LoRA layer of the model. The
model runner updates it once per step (`update`: the slot of every token); each layer then
calls `add_lora_linear`, which runs ONE shrink and ONE expand for all the layer's output
slices (q, k, v of the fused qkv_proj; gate, up of gate_up_proj; one slice elsewhere): their
A tensors are stacked along the rank, their B tensors along the output.

The mapping lives in tensors allocated once (`max_num_tokens` rows) and rewritten in place,
so a CUDA graph captured with them replays any later step's mix of adapters. The kernels are
picked once, from the engine's backend ("torch": `kernels/lora_reference.py`, "triton":
`kernels/lora_ops.py`), as `CustomOp` does for the other layers.
"""

from __future__ import annotations

import torch

from minivllm.kernels.lora_reference import NO_LORA, LoRAMapping


class PunicaWrapper:
    """Args: max_num_tokens (rows a forward pass may have), max_loras (slots), device,
    backend ("torch" or "triton")."""

    def __init__(self, max_num_tokens: int, max_loras: int, device: torch.device, backend: str) -> None:
        self.max_loras = max_loras
        self.device = torch.device(device)
        if backend == "triton":
            from minivllm.kernels import lora_ops as ops  # imports triton: only when asked
        else:
            from minivllm.kernels import lora_reference as ops
        self.shrink, self.expand = ops.lora_shrink, ops.lora_expand

        def buffer(n: int, fill: int) -> torch.Tensor:
            return torch.full((n,), fill, dtype=torch.int32, device=self.device)

        self.mapping = LoRAMapping(buffer(max_num_tokens, NO_LORA), buffer(max_num_tokens, 0),
                                   buffer(max_loras, 0), buffer(max_loras, 0))

    def update(self, token_lora_indices: list[int]) -> None:
        """Set this step's slot per token (`NO_LORA` for the base model), built on the host and
        copied into the fixed buffers."""
        n = len(token_lora_indices)
        if n > self.mapping.token_lora_indices.shape[0]:
            raise ValueError(f"{n} tokens in a step, but the LoRA buffers hold {self.mapping.token_lora_indices.shape[0]}.")
        host = LoRAMapping.build(torch.tensor(token_lora_indices, dtype=torch.int32), self.max_loras)
        m = self.mapping
        m.token_lora_indices.fill_(NO_LORA)  # rows past n (CUDA-graph padding) run the base model
        m.token_lora_indices[:n].copy_(host.token_lora_indices, non_blocking=True)
        m.sorted_token_ids[:n].copy_(host.sorted_token_ids, non_blocking=True)
        m.num_tokens_per_slot.copy_(host.num_tokens_per_slot, non_blocking=True)
        m.slot_start.copy_(host.slot_start, non_blocking=True)

    def add_lora_linear(self, y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                        slice_bounds: tuple[int, ...]) -> None:
        """y `[T, N]` += per slice s: (x @ A_s[slot].T) @ B_s[slot].T, in place, in two launches.

        x `[T, K]`; lora_a `[L, S*R, K]` (the slices' A stacked); lora_b `[L, N, R]` (the
        slices' B stacked, already scaled; slice s is rows slice_bounds[s]:slice_bounds[s+1]).
        Always launched, even when no row has an adapter: the kernels return at once then,
        and a captured CUDA graph must contain them for the steps that do."""
        h = self.shrink(x, lora_a, self.mapping)  # [T, K] -> [P, T, S*R] (P split-K planes)
        self.expand(h, lora_b, y, slice_bounds, self.mapping)  # -> y [T, N]
