"""How long one tensor-parallel all-reduce takes on two GPUs, by message size and by method.

A Llama-3-8B decode step at TP=2 runs two all-reduces per layer (after o_proj and after
down_proj), 64 in all, each of `[num_tokens, 4096]` bf16: 8 KiB at batch 1. At that size the
time is latency, not bandwidth, which is why vLLM does not leave small all-reduces to NCCL
(`vllm/distributed/device_communicators/custom_all_reduce.py`, and PyTorch's symmetric memory
in newer releases). Measured here, each inside a CUDA graph as the engine runs them:

    nccl        torch.distributed.all_reduce on the NCCL group (what minivllm uses)
    one_shot    PyTorch symmetric memory: each GPU copies its input into a buffer every peer
                can address over NVLink, then reads all peers' buffers and sums (one kernel)
    two_shot    symmetric memory, reduce-scatter then all-gather (half the reads per GPU)

and, as the decoder runs them after o_proj and down_proj, with the residual add and RMSNorm:

    two_shot+norm   two_shot, then minivllm's add + RMSNorm kernel (`fused_ops.rms_norm`)
    fused           minivllm's one kernel for all three (`kernels/custom_all_reduce.py`:
                    one-shot up to 64 KiB, two-shot above, as the engine picks)

    python benchmarks/all_reduce.py --out benchmarks/results/     # needs 2 GPUs; -> all_reduce_<gpu>x2.json

Time per all-reduce: REPS of them captured in one graph, the graph replayed and timed with
CUDA events (median of ROUNDS). Multicast stays off (NCCL_NVLS_ENABLE=0 and friends).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

for _name, _value in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                      "NVSHMEM_DISABLE_NVLS": "1"}.items():
    os.environ.setdefault(_name, _value)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from common import gpu_tag  # noqa: E402

HIDDEN = 4096
ROWS = (1, 8, 64, 256, 1024)
REPS, ROUNDS = 50, 20


def _time_graph(fn) -> float:
    """Microseconds per call of `fn`, REPS calls captured in one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()  # warm-up outside the graph (NCCL and symm-mem set up lazily)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(REPS):
            fn()
    times = []
    for _ in range(ROUNDS):
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(1e3 * start.elapsed_time(end) / REPS)
    return statistics.median(times)


def _methods(group_name: str, max_rows: int):
    """name -> factory(x) giving fn() that all-reduces x (the sum lands in a tensor)."""
    methods = {"nccl": lambda x: (lambda: dist.all_reduce(x))}
    try:
        import torch.distributed._symmetric_memory as symm_mem

        # Twice the largest tensor: the fused two-shot keeps the sums in the buffer's second half.
        buf = symm_mem.empty(2 * max_rows * HIDDEN, dtype=torch.bfloat16, device="cuda")
        handle = symm_mem.rendezvous(buf, group_name)
    except Exception as e:  # noqa: BLE001 - reported, not fatal: NCCL still measured
        print(f"symmetric memory unavailable: {e!r}", flush=True)
        return methods
    from minivllm.distributed.symm_mem import ONE_SHOT_MAX_BYTES
    from minivllm.kernels import custom_all_reduce, fused_ops

    addresses = [torch.tensor(ptrs, dtype=torch.int64, device="cuda")  # every rank's buffer, signal pad
                 for ptrs in (handle.buffer_ptrs, handle.signal_pad_ptrs)]
    weight = torch.randn(HIDDEN, dtype=torch.bfloat16, device="cuda")

    def one_shot(x):
        out = torch.empty_like(x)
        view = buf[: x.numel()]

        def fn():
            view.copy_(x.view(-1))
            torch.ops.symm_mem.one_shot_all_reduce_out(view, "sum", group_name, out.view(-1))
        return fn

    def two_shot(x):
        view = buf[: x.numel()]

        def fn():
            view.copy_(x.view(-1))
            torch.ops.symm_mem.two_shot_all_reduce_(view, "sum", group_name)
        return fn

    def two_shot_norm(x):
        all_reduce, total, residual = two_shot(x), buf[: x.numel()].view_as(x), torch.randn_like(x)

        def fn():
            all_reduce()
            fused_ops.rms_norm(total, weight, 1e-5, residual)
        return fn

    def fused(x):
        residual, two_shot = torch.randn_like(x), x.numel() * x.element_size() > ONE_SHOT_MAX_BYTES
        return lambda: custom_all_reduce.all_reduce_add_rms_norm(x, residual, weight, 1e-5, *addresses, handle.rank,
                                                                 handle.world_size, two_shot=two_shot)

    methods.update({"one_shot": one_shot, "two_shot": two_shot, "two_shot+norm": two_shot_norm, "fused": fused})
    return methods


def _worker(rank: int, world: int, port: int, out_file: str) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    group_name = dist.group.WORLD.group_name
    results: dict[str, dict[int, float | str]] = {}
    for name, factory in _methods(group_name, max(ROWS)).items():
        results[name] = {}
        for rows in ROWS:
            x = torch.randn(rows, HIDDEN, dtype=torch.bfloat16, device="cuda")
            try:
                results[name][rows] = round(_time_graph(factory(x)), 2)
            except Exception as e:  # noqa: BLE001 - one method failing must not hide the others
                results[name][rows] = f"failed: {e!r}"[:200]
    correct = _correct(group_name, rank)
    if rank == 0:
        Path(out_file).write_text(json.dumps({"us_per_all_reduce": results, "sums_correct": correct,
                                              "hidden": HIDDEN, "dtype": "bfloat16", "reps_per_graph": REPS,
                                              "gpu": torch.cuda.get_device_name()}, indent=1))
    dist.barrier()
    dist.destroy_process_group()


def _correct(group_name: str, rank: int) -> dict[str, bool]:
    """Each method's sum against the exact answer (rank r sends r + 1: the sum is 3)."""
    import torch.distributed._symmetric_memory as symm_mem

    x = torch.full((8, HIDDEN), float(rank + 1), dtype=torch.bfloat16, device="cuda")
    ok = {}
    y = x.clone()
    dist.all_reduce(y)
    ok["nccl"] = bool(torch.all(y == 3))
    try:
        buf = symm_mem.empty(x.numel(), dtype=torch.bfloat16, device="cuda")
        symm_mem.rendezvous(buf, group_name)
        buf.copy_(x.view(-1))
        out = torch.empty_like(buf)
        torch.ops.symm_mem.one_shot_all_reduce_out(buf, "sum", group_name, out)
        ok["one_shot"] = bool(torch.all(out == 3))
        buf.copy_(x.view(-1))
        torch.ops.symm_mem.two_shot_all_reduce_(buf, "sum", group_name)
        ok["two_shot"] = bool(torch.all(buf == 3))
    except Exception as e:  # noqa: BLE001
        ok["symm_mem_error"] = repr(e)[:200]
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    if torch.cuda.device_count() < 2:
        raise SystemExit(f"needs 2 GPUs, found {torch.cuda.device_count()}.")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    out_file = out / f"all_reduce_{gpu_tag(torch.cuda.get_device_name(), 2)}.json"
    mp.spawn(_worker, args=(2, 29517, str(out_file)), nprocs=2, join=True)
    report = json.loads(out_file.read_text())
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
