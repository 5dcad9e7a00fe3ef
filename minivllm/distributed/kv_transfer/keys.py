"""Store keys: the prefix cache's hash chain, made to mean the same thing everywhere.

A block's key must name its tokens AND every token before it (the KV of a token depends on
its whole prefix), exactly what the block manager's chain `hash_block_tokens(parent, tokens)`
does. A store outlives the process and is shared by engines and machines, so the chain here
uses SHA-256 instead of Python's `hash`: 64 bits are too few for a store every engine writes
into, and Python's hash of `None` (the chain's root) differed between processes before 3.12.

    key of block i = sha256(key of block i-1 || tokens of block i), the root seeded with the
                     model's identity, so two models (or dtypes) never share a block.

Each rank of a tensor-parallel worker holds its own shard of every block (its KV heads), so a
full key adds the shard: "<identity>/tp<rank>of<size>/<digest>".

    >>> len(block_digests([1, 2, 3, 4, 5], block_size=2, root="m"))   # the block of token 5: no
    2
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any

from minivllm.distributed.kv_transfer.fingerprint import checkpoint_folder, weights_fingerprint

if TYPE_CHECKING:
    from minivllm.config import EngineConfig

_DIGEST_CHARS = 32  # 128 bits of SHA-256: no collision in any store's lifetime
# Config entries that name where or by which library version, not what the model computes.
_CONFIG_NOT_MODEL = ("_name_or_path", "transformers_version")


def model_identity(engine_config: EngineConfig) -> str:
    """A short digest of what makes KV bytes comparable: the weights' contents (never their
    path: `fingerprint.py`), the model config, the dtype setting, the device type ("auto"
    dtype means fp32 on a CPU, the checkpoint's on a GPU), the block size (a block's shape)
    and the tensor/pipeline layout (each rank's share of the heads and layers)."""
    model, parallel = engine_config.model_config, engine_config.parallel_config
    config = {k: v for k, v in model.hf_config.to_dict().items() if k not in _CONFIG_NOT_MODEL}
    parts = [weights_fingerprint(checkpoint_folder(model.model, model.revision)),
             json.dumps(config, sort_keys=True, default=str), model.dtype,
             engine_config.device_config.device_type, str(engine_config.cache_config.block_size),
             f"tp{parallel.tensor_parallel_size}", f"pp{parallel.pipeline_parallel_size}"]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def request_root(root: str, lora_request: Any | None) -> str:
    """The chain's root for one request: the model's, or, for a request with a LoRA adapter
    (whose KV differs from the base model's), the model's and the adapter's name and path (its
    integer id is only unique within one engine)."""
    if lora_request is None:
        return root
    adapter = f"{lora_request.lora_name}|{lora_request.lora_path}"
    return hashlib.sha256(f"{root}|lora|{adapter}".encode()).hexdigest()[:16]


def shard_name(tp_rank: int, tp_size: int) -> str:
    return f"tp{tp_rank}of{tp_size}"


def block_digests(token_ids: list[int], block_size: int, root: str) -> list[str]:
    """The chain's digest of every full block that may be reused: all but the block holding
    the last token (a prefill must compute at least one token to produce logits), the block
    manager's rule."""
    num_blocks = (len(token_ids) - 1) // block_size
    digests, parent = [], root.encode()
    for i in range(num_blocks):
        block = token_ids[i * block_size:(i + 1) * block_size]
        h = hashlib.sha256(parent)
        h.update(b",".join(str(t).encode() for t in block))
        parent = h.hexdigest()[:_DIGEST_CHARS].encode()
        digests.append(parent.decode())
    return digests
