"""How many CPU threads torch uses for a model: fewer for a small one (a worker on a CPU)."""

from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger(__name__)

# One thread per this many parameters: a small model's matmuls are too small to split, and
# each op's threads wait for the slowest, so extra threads only add waiting.
_PARAMS_PER_CPU_THREAD = 25_000_000


def limit_cpu_threads(model_config) -> None:
    """Use fewer of torch's CPU threads for a small model (never more than torch already uses).

    torch.set_num_threads is process-wide; OMP_NUM_THREADS, when set, is the user's choice.
    """
    if os.environ.get("OMP_NUM_THREADS"):
        return
    cfg = model_config.hf_config
    hidden, layers = cfg.hidden_size, cfg.num_hidden_layers
    intermediate = getattr(cfg, "intermediate_size", 4 * hidden)
    # Embedding plus, per layer, attention (at most 4 hidden x hidden) and a gated MLP.
    num_params = cfg.vocab_size * hidden + layers * (4 * hidden * hidden + 3 * hidden * intermediate)
    threads = min(torch.get_num_threads(), max(1, num_params // _PARAMS_PER_CPU_THREAD))
    if threads < torch.get_num_threads():
        logger.info("small model (~%.0fM parameters): using %d CPU thread(s)", num_params / 1e6, threads)
        torch.set_num_threads(threads)
