"""The kernels compile once per model shape, not once per batch.

Triton compiles a kernel again for each new value class (== 1, a multiple of 16, other) of
an int argument it specializes on, and for each new value of a `tl.constexpr`. Block-table
width, KV splits and a row's slices change from batch to batch, so those arguments are exempt
(`do_not_specialize`) and the constexprs come from the model, not the batch: otherwise a run
would stop mid-way to compile (0.2-0.5 s each). Here each kernel runs at batch
shapes that cover every value class, in a fresh process with an empty Triton cache; after
each kernel's first call no new kernel may appear in the cache.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import json, os, sys
    from pathlib import Path
    import torch
    from minivllm.kernels import paged_attention, prefill_attention, sampling

    cache = Path(os.environ["TRITON_CACHE_DIR"])
    def compiled():
        return sum(1 for entry in cache.iterdir() if entry.is_dir()) if cache.is_dir() else 0

    torch.manual_seed(0)
    dev, dtype, block_size, kv_heads, heads, dim = "cuda", torch.bfloat16, 16, 2, 4, 64
    key_cache = torch.randn(512, block_size, kv_heads, dim, device=dev, dtype=dtype)
    value_cache = torch.randn_like(key_cache)
    vocab = 151936  # Qwen3's: the sampler cuts a row into more slices the smaller the batch

    def table(num_seqs, width):
        return torch.randint(0, 512, (num_seqs, width), device=dev, dtype=torch.int32)

    def decode(num_seqs, width, splits):
        q = torch.randn(num_seqs, heads, dim, device=dev, dtype=dtype)
        lens = torch.full((num_seqs,), width * block_size, device=dev, dtype=torch.int32)
        paged_attention.paged_attention_decode(q, key_cache, value_cache, table(num_seqs, width), lens, 0.1, splits)

    def prefill(num_seqs, width):
        q_len = 5
        q = torch.randn(num_seqs * q_len, heads, dim, device=dev, dtype=dtype)
        start = torch.arange(0, (num_seqs + 1) * q_len, q_len, device=dev, dtype=torch.int32)
        lens = torch.full((num_seqs,), width * block_size, device=dev, dtype=torch.int32)
        prefill_attention.paged_prefill_attention(q, key_cache, value_cache, table(num_seqs, width), start, lens,
                                                  0.1)

    def prefill_from_packed_copy(num_seqs, q_len):
        # The engine's path: the metadata's tensors are views into one copied buffer, at offsets
        # that move with the batch's sizes (`packed_copy.to_device_together`).
        from minivllm.attention import build_attn_metadata
        tables = [[s % 512 for s in range(i, i + 3)] for i in range(num_seqs)]
        md = build_attn_metadata(tables, [0] * num_seqs, [q_len] * num_seqs, num_prefills=num_seqs,
                                 block_size=block_size, device=dev)
        q = torch.randn(num_seqs * q_len, heads, dim, device=dev, dtype=dtype)
        prefill_attention.paged_prefill_attention(q, key_cache, value_cache, md.block_tables, md.query_start_loc,
                                                  md.seq_lens, 0.1)

    def sample(rows, top_k):
        logits = torch.randn(rows, vocab, device=dev)
        full = lambda value, dt: torch.full((rows,), value, device=dev, dtype=dt)
        sampling.sample_tokens(logits, full(0.6, torch.float32), full(top_k, torch.int32), full(1.0, torch.float32),
                               full(0.0, torch.float32), full(1, torch.int64), full(0, torch.int64))

    # Each kernel: first the call that compiles it, then shapes in every other value class.
    cases = {
        # (v2's SPLITS_PAD, the next power of 2 of the splits, is a constexpr on purpose: a wider
        # merge would cost batch 1. Decode runs in CUDA graphs, each compiled at capture.)
        "decode v2 (split-KV)": (lambda: decode(3, 17, 3), [lambda: decode(16, 32, 4), lambda: decode(5, 1, 3)]),
        # A one-sequence launch is programmatically dependent on Hopper (`kernels/launch.py`):
        # its own variant, compiled as the batch-1 graph's capture compiles it.
        "decode v1": (lambda: (decode(3, 17, 1), decode(1, 17, 1)),
                      [lambda: decode(16, 32, 1), lambda: decode(1, 1, 1), lambda: decode(2, 1, 1)]),
        "prefill": (lambda: prefill(3, 17), [lambda: prefill(16, 32), lambda: prefill(1, 1)]),
        "prefill, inputs from the packed copy": (lambda: prefill_from_packed_copy(4, 5),
                                                 [lambda: prefill_from_packed_copy(n, q) for n, q in ((3, 5), (1, 7), (5, 3))]),
        "sampling, temperature": (lambda: sample(3, 0), [lambda: sample(1, 0), lambda: sample(16, 0), lambda: sample(256, 0)]),
        "sampling, top-k": (lambda: sample(3, 50), [lambda: sample(16, 50), lambda: sample(1, 50), lambda: sample(200, 50)]),
    }
    report = {}
    for name, (first, others) in cases.items():
        first()
        torch.cuda.synchronize()
        before = compiled()
        for run in others:
            run()
        torch.cuda.synchronize()
        report[name] = compiled() - before
    print(json.dumps(report))
""")


@pytest.mark.gpu
def test_batch_shapes_never_compile_a_kernel_again(tmp_path):
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "triton-cache")}
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report == {name: 0 for name in report}, report
