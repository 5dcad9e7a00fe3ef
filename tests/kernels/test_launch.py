"""Programmatic dependent launch (`kernels/launch.py`): where it is on, and that it changes no bit.

With PDL every decoder kernel starts before the kernel it reads has finished, so a missing wait
would read a stale activation or cache slot. On the GPU (`-m gpu`) a batch-1 decoder stack of
the package's kernels is captured in a CUDA graph, and every replay, each on a new input, must
equal bit for bit the same kernels run eagerly one after the other without PDL.
"""

from __future__ import annotations

import pytest
import torch

from minivllm.kernels import launch
from minivllm.kernels.launch import pdl_options, programmatic_launch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER = 1024, 16, 8, 128, 3072  # Qwen3-0.6B's layer
BLOCK_SIZE, CONTEXT, MAX_BLOCKS = 16, 600, 64


def test_no_programmatic_launch_on_the_cpu():
    assert programmatic_launch(torch.device("cpu")) is False
    assert pdl_options(torch.zeros(1, 8)) == {"PDL": False}


@pytest.mark.gpu
def test_programmatic_launch_on_hopper_and_newer_for_one_token():
    device = torch.device("cuda")
    assert programmatic_launch(device) == (torch.cuda.get_device_capability()[0] >= 9)
    one_token, two_tokens = torch.zeros(1, 8, device=device), torch.zeros(2, 8, device=device)
    assert pdl_options(one_token).get("launch_pdl", False) == programmatic_launch(device)
    assert pdl_options(two_tokens) == {"PDL": False}


class DecoderStack:
    """`layers` Qwen3-shaped decoder layers of random bf16 weights, one token, each layer with
    its own paged cache holding CONTEXT - 1 earlier tokens. Even layers attend with the split-KV
    (v2) kernel, odd ones with the one-pass (v1) kernel."""

    def __init__(self, layers: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)

        def rand(*shape, scale=1.0):
            return (torch.randn(*shape, generator=g) * scale).to(DEVICE, torch.bfloat16)

        self.layers = [dict(
            qkv=rand((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN, scale=HIDDEN**-0.5),
            o=rand(HIDDEN, HEADS * HEAD_DIM, scale=(HEADS * HEAD_DIM) ** -0.5),
            gate_up=rand(2 * INTER, HIDDEN, scale=HIDDEN**-0.5), down=rand(HIDDEN, INTER, scale=INTER**-0.5),
            norms=[rand(n, scale=0.1) + 1 for n in (HIDDEN, HIDDEN, HEAD_DIM, HEAD_DIM)],
            cache=rand(2, MAX_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM),
        ) for _ in range(layers)]
        self.block_tables = torch.randperm(MAX_BLOCKS, generator=g)[None].to(DEVICE, torch.int32)
        self.seq_lens = torch.tensor([CONTEXT], dtype=torch.int32, device=DEVICE)
        position = CONTEXT - 1
        self.positions = torch.tensor([position], device=DEVICE)
        block = self.block_tables[0, position // BLOCK_SIZE].item()
        self.slot_mapping = torch.tensor([block * BLOCK_SIZE + position % BLOCK_SIZE], device=DEVICE)
        angles = torch.outer(torch.arange(CONTEXT).float(), 1e6 ** -(torch.arange(0, HEAD_DIM, 2) / HEAD_DIM))
        self.cos_sin = torch.cat([angles.cos(), angles.sin()], dim=1).to(DEVICE)
        self.x = rand(1, HIDDEN)

    def forward(self) -> torch.Tensor:
        from minivllm.kernels.fused_ops import qk_norm_rope_and_cache, rms_norm, silu_and_mul
        from minivllm.kernels.gemv import gemv
        from minivllm.kernels.paged_attention import paged_attention_decode

        h, residual = self.x, torch.zeros_like(self.x)
        for i, layer in enumerate(self.layers):
            input_norm, post_norm, q_norm, k_norm = layer["norms"]
            normed, residual = rms_norm(h, input_norm, 1e-6, residual)
            q, k, v = gemv(normed, layer["qkv"]).view(1, -1, HEAD_DIM).split([HEADS, KV_HEADS, KV_HEADS], dim=1)
            key_cache, value_cache = layer["cache"]
            q = qk_norm_rope_and_cache(q, k, v, key_cache, value_cache, self.slot_mapping, self.positions,
                                       self.cos_sin, q_norm, k_norm)
            attn = paged_attention_decode(q, key_cache, value_cache, self.block_tables, self.seq_lens,
                                          HEAD_DIM**-0.5, num_kv_splits=None if i % 2 == 0 else 1)
            normed, residual = rms_norm(gemv(attn.view(1, -1), layer["o"]), post_norm, 1e-6, residual)
            h = gemv(silu_and_mul(gemv(normed, layer["gate_up"])), layer["down"])
        return rms_norm(h, self.layers[0]["norms"][0], 1e-6, residual)[0]


@pytest.mark.gpu
def test_programmatic_launch_changes_no_bit_in_a_graph(monkeypatch):
    stack = DecoderStack(layers=8)
    g = torch.Generator().manual_seed(1)

    def without_pdl():
        with monkeypatch.context() as patch:
            patch.setattr(launch, "programmatic_launch", lambda device: False)
            return stack.forward()

    stack.forward()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = stack.forward()
    for _ in range(20):  # a new token every replay: a kernel reading early would see the last one's
        stack.x.copy_(torch.randn(1, HIDDEN, generator=g).to(DEVICE, torch.bfloat16))
        graph.replay()  # each layer's cache slot still holds the last token's K/V: stale if read early
        torch.cuda.synchronize()
        expected = without_pdl()
        assert torch.isfinite(expected).all()
        assert torch.equal(out, expected)
