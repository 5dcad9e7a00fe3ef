"""PagedAttention kernels, imported as `minivllm.kernels` (see pyproject's package-dir)."""
