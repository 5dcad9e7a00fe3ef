"""Tensor parallelism's all-reduces moved into the norms that follow them (vLLM's all-reduce
fusion, `vllm/compilation/collective_fusion.py`, which rewrites the compiled graph; here the
loaded decoder is rewired once, and its code reads as it did).

A decoder layer with TP ranks runs, twice (after o_proj and after down_proj):

    row-parallel matmul -> all-reduce -> + residual -> RMSNorm          three kernels apart
    row-parallel matmul -> AllReduceRMSNorm                             one (small batches, GPUs)

`fuse_all_reduce_into_norms` sets the two row-parallel layers to leave each rank's partial sum
and swaps every norm that follows one (each layer's post-attention norm, the next layer's input
norm, the final norm) for an `AllReduceRMSNorm`, which sums the ranks first. The first layer's
input norm stays: the embedding reduces its own lookup. It rewires only where the kernel can
run, a TP group with symmetric memory (GPUs), and only the package's own layers (a lab's run as
written). There, a batch that fits half the symmetric buffer (decoding's batches) runs the three
steps as one Triton kernel (`kernels/custom_all_reduce.py`); a bigger one (a long prefill) runs
the same all-reduce and norm apart.
"""

from __future__ import annotations

import torch
from torch import nn

from minivllm.distributed import get_pp_group, get_tp_group
from minivllm.distributed import tensor_model_parallel_all_reduce
from minivllm.model_executor.layers.layernorm import RMSNorm
from minivllm.model_executor.layers.linear import RowParallelLinear
from minivllm.model_executor.models.llama import LlamaModel


class AllReduceRMSNorm(RMSNorm):
    """The norm after a row-parallel layer, whose x is this rank's partial sum:
    `forward(x, residual)` -> (norm(s + residual), s + residual), s = x summed over the ranks."""

    def forward_native(self, x: torch.Tensor, residual: torch.Tensor):
        return super().forward_native(tensor_model_parallel_all_reduce(x), residual)

    def forward_triton(self, x: torch.Tensor, residual: torch.Tensor):
        from minivllm.kernels import custom_all_reduce  # imports triton: only on this backend

        peers = get_tp_group().fused_peers(x)  # the ranks' symmetric buffers, when x fits them
        if peers is None:
            return super().forward_triton(tensor_model_parallel_all_reduce(x), residual)
        *addresses, two_shot = peers
        return custom_all_reduce.all_reduce_add_rms_norm(x, residual, self.weight, self.eps, *addresses,
                                                         two_shot=two_shot)


def fuse_all_reduce_into_norms(model: nn.Module) -> int:
    """Rewire a loaded Llama-family model as above, with a TP group of several ranks on
    symmetric memory and one pipeline stage (a stage boundary would pass partial sums on);
    returns how many norms now reduce."""
    decoder, symm_mem = getattr(model, "model", None), get_tp_group().symm_mem
    # A single rank's group has no symmetric memory, so TP=1 is left alone here too.
    if symm_mem is None or symm_mem.disabled or get_pp_group().world_size > 1 or not _package_layers(decoder):
        return 0
    swapped = 0
    for i, layer in enumerate(decoder.layers):
        for row_parallel in (layer.self_attn.o_proj, layer.mlp.down_proj):
            row_parallel.reduce_results = False
        norms = [(layer, "post_attention_layernorm")] + ([(layer, "input_layernorm")] if i > 0 else [])
        for owner, name in norms:
            setattr(owner, name, _reducing(getattr(owner, name)))
            swapped += 1
    decoder.norm = _reducing(decoder.norm)
    return swapped + 1


def _package_layers(decoder) -> bool:
    """A LlamaModel whose row-parallel layers and norms are this package's own classes."""
    if not isinstance(decoder, LlamaModel):
        return False
    layers = [(layer.self_attn.o_proj, layer.mlp.down_proj) for layer in decoder.layers]
    return all(type(linear) is RowParallelLinear for pair in layers for linear in pair)


def _reducing(norm: RMSNorm) -> AllReduceRMSNorm:
    """An AllReduceRMSNorm sharing `norm`'s weight (already loaded) and backend."""
    fused = AllReduceRMSNorm(norm.weight.shape[0], norm.eps, norm.backend)
    fused.weight = norm.weight
    return fused
