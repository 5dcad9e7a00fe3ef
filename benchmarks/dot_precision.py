"""Which attention kernels use tensor cores, per dtype: the compiled PTX, counted.

The paged decode (v1, v2) and prefill kernels pass `input_precision="ieee"` to every `tl.dot`
so that fp32 engines compute in true fp32 (Triton's default for fp32 operands is TF32). This
compiles each kernel for bf16 and for fp32 into a fresh Triton cache and counts the `mma` /
`wgmma` instructions in each PTX: bf16 must keep them (tensor cores), fp32 must have none.

    python benchmarks/dot_precision.py          # on a GPU
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="minivllm-triton-"))

import torch  # noqa: E402

from minivllm.kernels.paged_attention import paged_attention_decode  # noqa: E402
from minivllm.kernels.prefill_attention import paged_prefill_attention  # noqa: E402


def compile_all(dtype: torch.dtype) -> None:
    num_blocks, block_size, kv_heads, head_dim, heads = 64, 16, 8, 128, 16
    key_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, device="cuda", dtype=dtype)
    value_cache = torch.randn_like(key_cache)
    tables = torch.arange(num_blocks, device="cuda", dtype=torch.int32).view(4, 16)
    seq_lens = torch.full((4,), 250, device="cuda", dtype=torch.int32)
    query = torch.randn(4, heads, head_dim, device="cuda", dtype=dtype)
    for splits in (1, 4):  # v1 and v2
        paged_attention_decode(query, key_cache, value_cache, tables, seq_lens, 0.1, num_kv_splits=splits)
    starts = torch.tensor([0, 10, 20, 30, 40], device="cuda", dtype=torch.int32)
    paged_prefill_attention(torch.randn(40, heads, head_dim, device="cuda", dtype=dtype), key_cache, value_cache,
                            tables, starts, seq_lens, 0.1)


def main() -> int:
    for dtype in (torch.bfloat16, torch.float32):
        compile_all(dtype)
    torch.cuda.synchronize()
    for ptx in sorted(Path(os.environ["TRITON_CACHE_DIR"]).glob("*/*.ptx")):
        text = ptx.read_text()
        operands = "bf16" if "bf16" in text else "fp32"
        print(f"{ptx.stem:32s} {operands}: {len(re.findall(r'(?:wgmma|mma)[.]', text)):3d} mma/wgmma instructions")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
