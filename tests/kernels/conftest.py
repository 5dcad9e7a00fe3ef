"""Shared fixtures of the kernel tests: random paged caches, block tables and tolerances.

The Triton kernels run on the GPU when there is one, else in Triton's interpreter on the CPU
(tests/conftest.py sets TRITON_INTERPRET=1 before triton is imported). The interpreter is slow,
so the CPU shapes are tiny and the parametrizations are hand-picked, not cartesian products.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# ‖out - ref‖ / ‖ref‖ allowed per dtype; the reference runs in fp32 on the same inputs.
# fp32: the kernels' dots run in true fp32 on a GPU too (input_precision="ieee", not TF32).
REL_TOL = {
    torch.float32: 1e-5 if DEVICE == "cpu" else 1e-4,
    torch.float16: 2e-3,
    torch.bfloat16: 1e-2,
}


def pytest_collection_modifyitems(config, items):
    """GPU-marked tests are skipped (not failed) where there is no CUDA device."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run with -m gpu on the GPU machine)")
    here = Path(__file__).parent
    for item in items:
        if "gpu" in item.keywords and here in Path(item.fspath).parents:
            item.add_marker(skip)


class PagedCache:
    """A random paged KV cache plus helpers to lay sequences out in it, like the block manager."""

    def __init__(self, num_blocks, block_size, num_kv_heads, head_dim, dtype, seed=0):
        self.generator = torch.Generator().manual_seed(seed)
        self.block_size = block_size
        # Random, not zeros: zeros would hide unwritten slots and wrong indexing.
        self.kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim,
                                    generator=self.generator).to(DEVICE, dtype)
        self.key_cache, self.value_cache = self.kv_cache[0], self.kv_cache[1]
        self.free_blocks = torch.randperm(num_blocks, generator=self.generator).tolist()

    def block_tables(self, seq_lens: list[int]) -> torch.Tensor:
        """[num_seqs, max_blocks] int32 of distinct, scattered physical blocks (unused entries 0)."""
        max_blocks = max(-(-n // self.block_size) for n in seq_lens)
        table = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
        for i, n in enumerate(seq_lens):
            for j in range(-(-n // self.block_size)):
                table[i, j] = self.free_blocks.pop()
        return table.to(DEVICE)

    def randn(self, *shape, dtype) -> torch.Tensor:
        return torch.randn(*shape, generator=self.generator).to(DEVICE, dtype)


@pytest.fixture
def paged_cache():
    return PagedCache


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    """Relative error in the 2-norm, plus: every element finite (NaN never passes)."""
    assert out.shape == ref.shape
    assert torch.isfinite(out).all(), "output has NaN/inf (unwritten or masked-out rows?)"
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    assert err < REL_TOL[dtype], f"relative error {err:.2e} >= {REL_TOL[dtype]:.0e} ({dtype})"


@pytest.fixture
def check_close():
    return assert_close
