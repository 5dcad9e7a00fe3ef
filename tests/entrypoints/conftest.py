"""Fixtures for the entry-point tests: the shared tiny Llama checkpoint (tests/conftest.py)."""

import torch

torch.set_num_threads(1)  # tiny tensors: see tests/engine/conftest.py
