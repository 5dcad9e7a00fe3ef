"""The Llama-family decoder: Llama 2/3, Mistral, Qwen2 and Qwen3 in one file.

Read it top down, like nanoGPT's model.py: attention, MLP, decoder layer, the stack, the
causal-LM head, then the weight loader. What sets the families apart is small:

    Llama 2/3, Mistral   the base design (Llama 3.1 adds rope scaling, a config matter)
    Qwen2                biases on the q/k/v projections
    Qwen3                an RMSNorm on each query and key head, before RoPE

Unlike Hugging Face's model, this one takes ONE flattened batch: every sequence's new tokens
back to back (prompt chunks first, then one token per decoding sequence), their positions,
and the metadata that tells the attention layer where each sequence's keys live in the
paged KV cache. There is no [batch, seq_len] padding anywhere.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from minivllm.attention import Attention, AttentionMetadata
from minivllm.model_executor.layers.activation import SiluAndMul
from minivllm.model_executor.layers.layernorm import RMSNorm
from minivllm.model_executor.layers.rotary_embedding import RotaryEmbedding, get_rope_parameters


class MergedLinear(nn.Linear):
    """Several linear layers with the same input, fused into one matmul.

    `output_sizes` names the parts in output order, e.g. {"q": 512, "k": 128, "v": 128}: the
    output is their concatenation, and `load_shard` copies a checkpoint's separate q_proj /
    k_proj / v_proj weight into its rows. One big matmul beats three small ones on a GPU.
    """

    def __init__(self, in_features: int, output_sizes: dict[str, int], bias: bool) -> None:
        super().__init__(in_features, sum(output_sizes.values()), bias=bias)
        self.output_sizes = output_sizes
        self.shard_offsets, offset = {}, 0
        for name, size in output_sizes.items():
            self.shard_offsets[name] = (offset, size)
            offset += size

    def load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str) -> None:
        """Copy one part (weight rows or bias entries) into the fused parameter."""
        offset, size = self.shard_offsets[shard_id]
        expected = (size, *param.shape[1:])
        if tuple(loaded.shape) != expected:
            raise ValueError(f"shard {shard_id!r} has shape {tuple(loaded.shape)}, expected {expected}.")
        param.data[offset : offset + size].copy_(loaded)


class LlamaAttention(nn.Module):
    """Project to q/k/v (one fused matmul), rotate q and k, attend over the paged cache."""

    def __init__(self, config: Any, rotary_emb: RotaryEmbedding, attn_backend: str,
                 qkv_bias: bool, qk_norm: bool) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = MergedLinear(
            config.hidden_size, {"q": self.q_size, "k": self.kv_size, "v": self.kv_size}, bias=qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size,
                                bias=getattr(config, "attention_bias", False))
        # Qwen3 normalizes each head's query and key: it keeps attention logits in range
        # without the q/k biases Qwen2 used.
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, attn_backend) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, attn_backend) if qk_norm else None
        self.rotary_emb = rotary_emb  # one module shared by all layers: same positions, same angles
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim**-0.5,
                              self.num_kv_heads, backend=attn_backend)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        """hidden_states [num_tokens, hidden] -> [num_tokens, hidden]."""
        num_tokens = hidden_states.shape[0]
        q, k, v = self.qkv_proj(hidden_states).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        out = self.attn(q, k, v, kv_cache, attn_metadata)  # [num_tokens, num_heads, head_dim]
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class LlamaMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), with gate and up fused into one matmul."""

    def __init__(self, config: Any, backend: str) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"only hidden_act='silu' is supported, got {config.hidden_act!r}.")
        bias = getattr(config, "mlp_bias", False)
        size = config.intermediate_size
        self.gate_up_proj = MergedLinear(config.hidden_size, {"gate": size, "up": size}, bias=bias)
        self.act_fn = SiluAndMul(backend)
        self.down_proj = nn.Linear(size, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)).

    The residual add is folded into the next norm (see RMSNorm): the layer takes and returns
    the pair (hidden_states, residual), where the true stream is their sum.
    """

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
    """Embedding, the decoder layers, the final norm."""

    def __init__(self, config: Any, attn_backend: str, qkv_bias: bool, qk_norm: bool) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        rotary_emb = RotaryEmbedding(head_dim, config.max_position_embeddings, get_rope_parameters(config),
                                     attn_backend)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, rotary_emb, attn_backend, qkv_bias, qk_norm)
            for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, attn_backend)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"need one kv_cache per layer ({len(self.layers)}), got {len(kv_caches)}.")
        hidden_states, residual = self.embed_tokens(input_ids), None
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden_states, residual = layer(positions, hidden_states, kv_cache, attn_metadata, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    """The decoder plus the LM head (tied to the embedding when the config says so).

    forward(input_ids [num_tokens], positions [num_tokens], kv_caches (one
    [2, num_blocks, block_size, num_kv_heads, head_dim] tensor per layer), attn_metadata)
    -> hidden_states [num_tokens, hidden]; compute_logits(hidden_states [n, hidden]) ->
    fp32 logits [n, vocab]. The model runner picks the rows it samples from before the
    LM head, so the vocab-sized matmul runs only for them.
    """

    # Family switches; subclasses below flip them. None = read the config's attention_bias.
    qkv_bias: bool | None = None
    qk_norm: bool = False

    # Checkpoint name -> (our fused module, shard). vLLM calls this stacked_params_mapping.
    stacked_params_mapping = [
        ("qkv_proj", "q_proj", "q"),
        ("qkv_proj", "k_proj", "k"),
        ("qkv_proj", "v_proj", "v"),
        ("gate_up_proj", "gate_proj", "gate"),
        ("gate_up_proj", "up_proj", "up"),
    ]

    def __init__(self, config: Any, attn_backend: str = "torch") -> None:
        super().__init__()
        self.config = config
        qkv_bias = getattr(config, "attention_bias", False) if self.qkv_bias is None else self.qkv_bias
        self.model = LlamaModel(config, attn_backend, qkv_bias, self.qk_norm)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight  # one matrix, read both ways

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """`[n, vocab]` logits, in fp32 for the sampler (a softmax over 150k bf16 logits loses
        the small probabilities). `upcast=False` keeps the model's dtype, for readers that
        accumulate in fp32 themselves (the greedy kernel: the copy costs ~0.1 ms a step)."""
        logits = self.lm_head(hidden_states)
        return logits.float() if upcast else logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy (name, tensor) pairs from a Hugging Face checkpoint into the model.

        Names match ours except the fused projections: `...self_attn.q_proj.weight` goes into
        rows of `...self_attn.qkv_proj.weight` (see stacked_params_mapping). Returns the names
        of our parameters that were fully loaded (a fused one once all its parts arrived);
        raises on a name we do not know.
        """
        params = dict(self.named_parameters())
        loaded, shards_seen = set(), defaultdict(set)
        for name, tensor in weights:
            if _is_ignored(name, self.config):
                continue
            target, shard_id = self.map_weight_name(name)
            param = _lookup(params, target)
            if shard_id is None:
                if param.shape != tensor.shape:
                    raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)}, "
                                     f"model {tuple(param.shape)}.")
                param.data.copy_(tensor)
                loaded.add(target)
                continue
            fused = self.get_submodule(target.rsplit(".", 1)[0])
            fused.load_shard(param, tensor, shard_id)
            shards_seen[target].add(shard_id)
            if shards_seen[target] == set(fused.output_sizes):
                loaded.add(target)
        return loaded

    def map_weight_name(self, name: str) -> tuple[str, str | None]:
        """Checkpoint name -> (our parameter name, shard id or None if not fused)."""
        for fused, part, shard_id in self.stacked_params_mapping:
            if f".{part}." in name:
                return name.replace(f".{part}.", f".{fused}."), shard_id
        return name, None


def _is_ignored(name: str, config: Any) -> bool:
    """Checkpoint entries with no parameter here: precomputed rotary tables (old Llama
    checkpoints), and the LM head when it is tied to the embedding."""
    if "rotary_emb.inv_freq" in name or "rotary_emb.cos_cached" in name:
        return True
    return name == "lm_head.weight" and getattr(config, "tie_word_embeddings", False)


def _lookup(params: dict[str, nn.Parameter], name: str) -> nn.Parameter:
    if name not in params:
        raise ValueError(f"checkpoint weight {name!r} has no parameter in this model.")
    return params[name]


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral's weights and layers are Llama's. Its sliding window (4096 tokens, Mistral 7B
    v0.1 only) is not implemented: attention is full, exact for sequences up to the window."""


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 / Qwen2.5: Llama with biases on the q, k and v projections (not on o_proj)."""

    qkv_bias = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3: Llama with an RMSNorm on every query and key head (applied before RoPE)."""

    qk_norm = True
