"""Where one request's KV save and load time goes, phase by phase, outside any engine.

The pieces a layerwise connector runs (`distributed/kv_transfer/layerwise.py`,
`store_connector.py`, the file store of `SharedStorageConnector`), timed for one request's
blocks on `disagg.py`'s ~1B model shapes (22 layers, 4 KV heads of 128, blocks of 16 tokens,
bf16; 128 blocks = a 2,048-token prompt, ~92 MB):

    save: start_save (pinned host buffer), save_layer x layers (gather + device->host copy on
          the side stream, enqueued), finish_save (wait for the copies), encode (frame + CRC),
          put_many (atomic file writes)
    load: get + decode (read, check), stack, start_load (pin + host->device copies enqueued),
          wait for every layer's copy

Each phase is synchronised before its clock stops. Three rounds (the first pays allocations).
Every round checks the blocks came back bit for bit.

    python benchmarks/kv_transfer.py                  # on a GPU
    python benchmarks/kv_transfer.py --device cpu --small
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch

from minivllm.distributed.kv_transfer.layerwise import LayerwiseTransfer
from minivllm.distributed.kv_transfer.shared_storage_connector import FileKVStore
from minivllm.distributed.kv_transfer.store_connector import decode_block, encode_block, framed_bytes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--small", action="store_true", help="tiny shapes (a CPU check of the script)")
    parser.add_argument("--store", default=None, help="folder for the files (default: a temporary one)")
    args = parser.parse_args()
    layers, num_blocks, block_size, heads, head_dim, n = (4, 256, 16, 4, 32, 16) if args.small else \
        (22, 4096, 16, 4, 128, 128)
    dtype = torch.float32 if args.small else torch.bfloat16
    caches = {f"layer{i}": torch.randn(2, num_blocks, block_size, heads, head_dim, device=args.device, dtype=dtype)
              for i in range(layers)}
    transfer = LayerwiseTransfer(caches)
    store = FileKVStore(args.store or tempfile.mkdtemp(prefix="minivllm-kv-"))
    ids = list(range(100, 100 + n))

    def timed(fn, sync: bool = True):
        start = time.perf_counter()
        out = fn()
        if sync and args.device == "cuda":
            torch.cuda.synchronize()
        return out, round(1e3 * (time.perf_counter() - start), 2)

    rounds = []
    for r in range(3):
        ms = {}
        for cache in caches.values():  # fresh contents every round
            cache[:, ids] = torch.randn_like(cache[:, ids])
        _, ms["start_save"] = timed(lambda: transfer.start_save(ids))
        _, ms["save_layer (enqueue)"] = timed(lambda: [transfer.save_layer(k, v) for k, v in caches.items()], sync=False)
        blocks, ms["finish_save"] = timed(transfer.finish_save)
        keys = [f"r{r}-{i}" for i in range(n)]
        items, ms["encode"] = timed(lambda: [(key, encode_block(blocks[:, i], key)) for i, key in enumerate(keys)])
        _, ms["put_many (files)"] = timed(lambda: store.put_many(items))
        shape, dtype = transfer.block_shape, transfer.dtype
        got, ms["get + decode"] = timed(lambda: [
            decode_block(store.get(k, framed_bytes(shape, dtype, k)), k, shape, dtype) for k in keys])
        stacked, ms["stack"] = timed(lambda: torch.stack(got, dim=1))
        for cache in caches.values():  # so the check below fails if the load does nothing
            cache[:, ids] = 0
        _, ms["start_load (enqueue)"] = timed(lambda: transfer.start_load(ids, stacked), sync=False)
        _, ms["loads done"] = timed(lambda: [transfer.wait_layer(k) for k in caches])
        exact = all(torch.equal(cache[:, ids].cpu(), blocks[i].transpose(0, 1)) for i, cache in enumerate(caches.values()))
        rounds.append({"ms": ms, "round_trip_exact": exact})
        print(r, json.dumps(ms), "exact:", exact, flush=True)
    mb = n * transfer.block_nbytes / 2**20
    print(json.dumps({"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                      "request_mb": round(mb, 1), "rounds": rounds}, indent=1))
    return 0 if all(r["round_trip_exact"] for r in rounds) else 1


if __name__ == "__main__":
    raise SystemExit(main())
