"""Where the notebooks' engines run: the GPU when there is one, in fp32, with a small KV pool.

On a GPU an engine profiles the device and takes `gpu_memory_utilization` (90 %) of it for
itself; a notebook builds several engines in one process, so the second would find no memory
left, and a pool of millions of blocks makes every step's bookkeeping slow. So notebooks build
engines with `**engine_kwargs(...)`:

    engine_kwargs(max_num_seqs=4)  # CPU: {"device": "cpu", "max_num_seqs": 4}
                                   # GPU: {"device": "cuda", "dtype": "float32",
                                   #       "num_gpu_blocks_override": 1024, "max_num_seqs": 4}

fp32 on the GPU too, because greedy parity with transformers is token-exact only in fp32 (in
bf16 the engine is right, just not bit-identical). The profile run still happens on the GPU
(the override only replaces its answer), and what a notebook passes explicitly wins.
"""

from __future__ import annotations

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_GPU = DEVICE == "cuda"
# 1024 blocks of 16 tokens: 16k tokens of KV, more than any notebook workload holds at once,
# and 50 MB for the bundled model in fp32.
GPU_POOL_BLOCKS = 1024


def engine_kwargs(**kwargs) -> dict:
    """EngineArgs / LLM keyword arguments for a notebook engine on `DEVICE` (see the module doc)."""
    kwargs.setdefault("device", DEVICE)
    if kwargs["device"] == "cuda":
        kwargs.setdefault("dtype", "float32")
        # One token per step, as the notebooks draw it (a GPU engine runs 8 by default).
        kwargs.setdefault("num_scheduler_steps", 1)
        kwargs.setdefault("num_gpu_blocks_override", GPU_POOL_BLOCKS)
    return kwargs
