"""Small helpers of the parallel layers (vLLM's `vllm/distributed/utils.py`)."""

from __future__ import annotations

import socket

from minivllm.config import get_pp_indices


def divide(numerator: int, denominator: int) -> int:
    """numerator / denominator, which must divide exactly (a shard size)."""
    if numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by {denominator}.")
    return numerator // denominator


def get_open_port() -> int:
    """A free TCP port on this machine, for the ranks' rendezvous (`tcp://127.0.0.1:port`)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_distributed_init_method(ip: str, port: int) -> str:
    return f"tcp://{ip}:{port}"


__all__ = ["divide", "get_distributed_init_method", "get_open_port", "get_pp_indices"]
