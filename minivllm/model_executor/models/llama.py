"""The Llama-family decoder (vLLM's `vllm/model_executor/models/llama.py`), read top down;
Mistral, Qwen2 and Qwen3 are the subclasses at the end (Llama 3.1's rope scaling is config).

The input is one flattened batch with no padding: prefill chunks, then one token per decode.
With one rank the parallel layers are plain ones; a pipeline stage builds only its layers.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from minivllm.attention import Attention, AttentionMetadata
from minivllm.distributed import get_pp_group
from minivllm.model_executor.custom_op import CustomOp
from minivllm.model_executor.layers.activation import SiluAndMul
from minivllm.model_executor.layers.layernorm import RMSNorm
from minivllm.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from minivllm.model_executor.layers.rotary_embedding import RotaryEmbedding, get_rope_parameters
from minivllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from minivllm.model_executor.models.utils import (IntermediateTensors, PPMissingLayer, make_layers,
                                                  missing_layer_prefixes)
from minivllm.model_executor.weight_utils import default_weight_loader


class LlamaAttention(CustomOp):
    """qkv_proj (one matmul), rotate q and k, attend over the paged cache, o_proj.
    `num_heads` and `num_kv_heads` are this tensor-parallel rank's."""

    def __init__(self, config: Any, rotary_emb: RotaryEmbedding, attn_backend: str,
                 qkv_bias: bool, qk_norm: bool) -> None:
        super().__init__(attn_backend)
        total_num_heads = config.num_attention_heads
        total_num_kv_heads = getattr(config, "num_key_value_heads", None) or total_num_heads
        self.head_dim = rotary_emb.head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, total_num_heads, total_num_kv_heads,
                                          bias=qkv_bias, backend=attn_backend)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(total_num_heads * self.head_dim, config.hidden_size,
                                        bias=getattr(config, "attention_bias", False), backend=attn_backend)
        # Qwen3's per-head q/k norms keep the attention logits in range without q/k biases.
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, attn_backend) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, attn_backend) if qk_norm else None
        self.rotary_emb = rotary_emb  # one module shared by all layers: same positions, same angles
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim**-0.5,
                              self.num_kv_heads, backend=attn_backend)

    def _project(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """hidden_states [num_tokens, hidden] -> q [num_tokens, num_heads, head_dim], k and v
        [num_tokens, num_kv_heads, head_dim]: views of one qkv output, no copies."""
        qkv = self.qkv_proj(hidden_states).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return tuple(t.unflatten(-1, (-1, self.head_dim)) for t in qkv)

    def forward_native(self, positions: torch.Tensor, hidden_states: torch.Tensor, kv_cache: torch.Tensor,
                       attn_metadata: AttentionMetadata) -> torch.Tensor:
        """hidden_states [num_tokens, hidden] -> [num_tokens, hidden]."""
        q, k, v = self._project(hidden_states)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        out = self.attn(q, k, v, kv_cache, attn_metadata)  # writes k, v to the cache, then attends
        return self.o_proj(out.reshape(hidden_states.shape[0], self.q_size))

    def forward_triton(self, positions: torch.Tensor, hidden_states: torch.Tensor, kv_cache: torch.Tensor,
                       attn_metadata: AttentionMetadata) -> torch.Tensor:
        """forward_native with the q/k norms, rotary and the cache write in one kernel (in a CUDA
        graph at batch 1 a step's time is mostly its launches); the profile run (no cache) and
        layouts `fused_ops.qk_norm_rope_and_cache` does not read take forward_native."""
        from minivllm.kernels import fused_ops  # imports triton: only when this backend is chosen

        q, k, v = self._project(hidden_states)
        cos_sin_cache = self.rotary_emb.cos_sin_cache
        if kv_cache.numel() == 0 or not fused_ops.qk_norm_rope_and_cache_supported(q, k, v, kv_cache[0],
                                                                                    cos_sin_cache):
            return self.forward_native(positions, hidden_states, kv_cache, attn_metadata)
        norms = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if self.q_norm is not None else ()
        q = fused_ops.qk_norm_rope_and_cache(q, k, v, kv_cache[0], kv_cache[1], attn_metadata.slot_mapping,
                                             positions, cos_sin_cache, *norms)
        out = self.attn(q, None, None, kv_cache, attn_metadata)  # k, v are in the cache already
        return self.o_proj(out.reshape(hidden_states.shape[0], self.q_size))


class LlamaMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up fused into one matmul."""

    def __init__(self, config: Any, backend: str = "torch") -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"only hidden_act='silu' is supported, got {config.hidden_act!r}.")
        bias = getattr(config, "mlp_bias", False)
        size = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [size, size], bias=bias, backend=backend)
        self.act_fn = SiluAndMul(backend)
        self.down_proj = RowParallelLinear(size, config.hidden_size, bias=bias, backend=backend)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)). The residual add is folded
    into the next norm: (hidden_states, residual) in and out, the stream being their sum."""

    def __init__(self, config: Any, rotary_emb: RotaryEmbedding, attn_backend: str,
                 qkv_bias: bool, qk_norm: bool) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, rotary_emb, attn_backend, qkv_bias, qk_norm)
        self.mlp = LlamaMLP(config, attn_backend)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, attn_backend)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, attn_backend)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: AttentionMetadata, residual: torch.Tensor | None):
        if residual is None:  # first layer: the stream is just the embeddings
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, kv_cache, attn_metadata)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class LlamaModel(nn.Module):
    """Embedding, decoder layers, final norm. A pipeline stage builds layers [start_layer,
    end_layer); the first the embedding, the last the norm (and the embedding if tied)."""

    def __init__(self, config: Any, attn_backend: str, qkv_bias: bool, qk_norm: bool) -> None:
        super().__init__()
        pp_group = get_pp_group()
        self.is_first_stage, self.is_last_stage = pp_group.is_first_rank, pp_group.is_last_rank
        tied = getattr(config, "tie_word_embeddings", False)
        self.embed_tokens = (VocabParallelEmbedding(config.vocab_size, config.hidden_size)
                             if self.is_first_stage or (tied and self.is_last_stage) else PPMissingLayer())
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        rotary_emb = RotaryEmbedding(head_dim, config.max_position_embeddings, get_rope_parameters(config),
                                     attn_backend)
        self.start_layer, self.end_layer, self.layers = make_layers(
            config.num_hidden_layers,
            lambda: LlamaDecoderLayer(config, rotary_emb, attn_backend, qkv_bias, qk_norm))
        self.norm = (RMSNorm(config.hidden_size, config.rms_norm_eps, attn_backend) if self.is_last_stage
                     else PPMissingLayer())

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: AttentionMetadata,
                intermediate_tensors: IntermediateTensors | None = None) -> torch.Tensor | IntermediateTensors:
        num_layers = self.end_layer - self.start_layer
        if len(kv_caches) != num_layers:
            raise ValueError(f"need one kv_cache per layer ({num_layers}), got {len(kv_caches)}.")
        if self.is_first_stage:
            hidden_states, residual = self.embed_tokens(input_ids), None
        else:  # the previous stage's residual stream
            hidden_states, residual = intermediate_tensors["hidden_states"], intermediate_tensors["residual"]
        for i, kv_cache in zip(range(self.start_layer, self.end_layer), kv_caches):
            hidden_states, residual = self.layers[i](positions, hidden_states, kv_cache, attn_metadata, residual)
        if not self.is_last_stage:
            return IntermediateTensors({"hidden_states": hidden_states, "residual": residual})
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    """The decoder plus the LM head (tied to the embedding when the config says so).

    forward: input_ids, positions `[num_tokens]`, kv_caches (one `[2, num_blocks, block_size,
    num_kv_heads, head_dim]` per layer of this stage) -> `[num_tokens, hidden]` (or
    `IntermediateTensors` on a pipeline stage but the last). compute_logits: `[n, hidden]`
    -> `[n, vocab]`, only for the rows the runner samples from.
    """

    # Family switches, flipped by the subclasses below. None: the config's attention_bias.
    qkv_bias: bool | None = None
    qk_norm: bool = False

    # (our fused module, checkpoint name, shard id)
    stacked_params_mapping = [
        ("qkv_proj", "q_proj", "q"),
        ("qkv_proj", "k_proj", "k"),
        ("qkv_proj", "v_proj", "v"),
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", 1),
    ]
    # Precomputed rotary tables in old Llama checkpoints: RotaryEmbedding builds its own.
    _rope_tables = ("rotary_emb.inv_freq", "rotary_emb.cos_cached")

    def __init__(self, config: Any, attn_backend: str = "torch") -> None:
        super().__init__()
        self.config = config
        qkv_bias = getattr(config, "attention_bias", False) if self.qkv_bias is None else self.qkv_bias
        self.model = LlamaModel(config, attn_backend, qkv_bias, self.qk_norm)
        tied, last_stage = getattr(config, "tie_word_embeddings", False), self.model.is_last_stage
        self.lm_head = (ParallelLMHead(config.vocab_size, config.hidden_size) if last_stage
                        else PPMissingLayer())
        if last_stage and tied:
            self.lm_head.weight = self.model.embed_tokens.weight  # one matrix, read both ways
        # Checkpoint names with no parameter here: other stages' modules, a tied LM head.
        self._skip_prefixes = missing_layer_prefixes(self) + (("lm_head.weight",) if tied else ())

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: AttentionMetadata,
                intermediate_tensors: IntermediateTensors | None = None) -> torch.Tensor | IntermediateTensors:
        return self.model(input_ids, positions, kv_caches, attn_metadata, intermediate_tensors)

    def compute_logits(self, hidden_states: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """`[n, vocab]` logits in fp32 (a softmax over 150k bf16 logits loses the small
        probabilities); `upcast=False` keeps the dtype for a reader that accumulates in fp32."""
        logits = self.lm_head(hidden_states)
        if logits is None:  # a TP rank other than 0: rank 0 gathered the logits and samples
            return None
        return logits.float() if upcast else logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy a Hugging Face checkpoint's (name, tensor) pairs in through each parameter's
        `weight_loader` (this rank's slice; other stages' layers skipped). Returns the names of
        the parameters fully loaded (a fused one once all its shards arrived); ValueError on a
        name with no parameter here."""
        params = dict(self.named_parameters())
        loaded, shards_seen = set(), defaultdict(set)
        for name, tensor in weights:
            if name.startswith(self._skip_prefixes) or any(t in name for t in self._rope_tables):
                continue
            target, shard_id = self.map_weight_name(name)
            if target not in params:
                raise ValueError(f"checkpoint weight {target!r} has no parameter in this model.")
            param = params[target]
            weight_loader = getattr(param, "weight_loader", default_weight_loader)
            try:
                weight_loader(param, tensor, *(() if shard_id is None else (shard_id,)))
            except ValueError as err:
                raise ValueError(f"{name}: {err}") from err
            if shard_id is not None:
                shards_seen[target].add(shard_id)
                if shards_seen[target] != set(self.get_submodule(target.rsplit(".", 1)[0]).shard_ids):
                    continue
            loaded.add(target)
        return loaded

    def map_weight_name(self, name: str) -> tuple[str, str | None]:
        """`...self_attn.q_proj.weight` -> (`...self_attn.qkv_proj.weight`, "q"); unfused: None."""
        for fused, part, shard_id in self.stacked_params_mapping:
            if f".{part}." in name:
                return name.replace(f".{part}.", f".{fused}."), shard_id
        return name, None


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral's weights and layers are Llama's. Its sliding window (4096 tokens, Mistral 7B
    v0.1 only) is not implemented: attention is full, exact for sequences up to the window."""


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 / Qwen2.5: Llama with biases on the q, k and v projections (not on o_proj)."""

    qkv_bias = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3: Llama with an RMSNorm on every query and key head (applied before RoPE)."""

    qk_norm = True
