"""The embedding and the LM head split over tensor-parallel ranks by vocabulary rows
(vLLM's `vllm/model_executor/layers/vocab_parallel_embedding.py`).

Rank r holds rows [r * V/tp, (r + 1) * V/tp) of the `[vocab, hidden]` table, the vocabulary
padded to a multiple of tp (vLLM: of 64 too). The embedding looks up the ids in its rows,
zeros for the others, and an all-reduce sums the ranks; the LM head's logit slices are
gathered on rank 0, which samples. With one rank: a plain lookup and matmul.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.distributed import (get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size,
                                  tensor_model_parallel_all_reduce, tensor_model_parallel_gather)
from minivllm.model_executor.weight_utils import check_shape, loaded_parameter


class VocabParallelEmbedding(nn.Module):
    """ids `[num_tokens]` -> `[num_tokens, embedding_dim]`, identical on every TP rank."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.tp_rank = get_tensor_model_parallel_rank()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.num_embeddings_padded = -(-num_embeddings // self.tp_size) * self.tp_size  # a multiple of tp
        self.num_embeddings_per_partition = self.num_embeddings_padded // self.tp_size
        # This rank's real rows: [start, end); the last rank may own padding rows past end.
        self.vocab_start_index = self.tp_rank * self.num_embeddings_per_partition
        self.vocab_end_index = min(self.vocab_start_index + self.num_embeddings_per_partition, num_embeddings)
        self.weight = loaded_parameter(self.num_embeddings_per_partition, embedding_dim,
                                       weight_loader=self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        check_shape(loaded_weight.shape, (self.num_embeddings, self.embedding_dim))
        rows = self.vocab_end_index - self.vocab_start_index
        param.data[:rows].copy_(loaded_weight[self.vocab_start_index : self.vocab_end_index])
        param.data[rows:].zero_()  # padding rows: never looked up, logits trimmed

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        outside = (input_ids < self.vocab_start_index) | (input_ids >= self.vocab_end_index)
        local_ids = (input_ids - self.vocab_start_index).masked_fill(outside, 0)
        output = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return tensor_model_parallel_all_reduce(output)

    def extra_repr(self) -> str:
        return (f"num_embeddings={self.num_embeddings_per_partition}, embedding_dim={self.embedding_dim}, "
                f"num_embeddings_padded={self.num_embeddings_padded}, tp_size={self.tp_size}")


class ParallelLMHead(VocabParallelEmbedding):
    """hidden `[n, hidden]` -> logits `[n, vocab]` on TP rank 0, None on the others (vLLM's
    `LogitsProcessor` does this). Tied to the embedding by sharing its weight."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        logits = F.linear(hidden_states, self.weight)  # [n, vocab / tp]
        if self.tp_size == 1:
            return logits
        logits = tensor_model_parallel_gather(logits, dst=0, dim=-1)
        return None if logits is None else logits[..., : self.num_embeddings]
