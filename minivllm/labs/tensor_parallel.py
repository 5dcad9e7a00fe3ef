"""Lab 10's checks: the learner's column- and row-parallel linear layers over two gloo processes,
then inside a real `LLM(tensor_parallel_size=2)`.

    check_parallel_linears(layers)          two spawned ranks build each of `layers`' four classes
                                            (ColumnParallelLinear, MergedColumnParallelLinear,
                                            QKVParallelLinear, RowParallelLinear), load random dense
                                            weights through their `weight_loader`s and compare the
                                            shard each rank holds and its output with one dense
                                            `F.linear`
    check_tensor_parallel_engine(worker)    an `mp` engine of two CPU ranks whose `worker_cls` puts
                                            those layers in the model (`replace_parallel_linears`);
                                            greedy output must equal transformers'

The layers mirror `vllm/model_executor/layers/linear.py`; the reference is
`minivllm/model_executor/layers/linear.py`. `layers` is any module (or object) with the four
classes as attributes, importable in another process (the ranks are spawned).
"""

from __future__ import annotations

import contextlib
import os
import queue as queue_lib
import socket
import traceback
from typing import Any

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from minivllm.distributed import (destroy_distributed_environment, init_distributed_environment,
                                  initialize_model_parallel)
from minivllm.labs import LabCheckFailed, expect, passed
from minivllm.model_executor.model_loader import default_dtype

LAYER_NAMES = ("ColumnParallelLinear", "MergedColumnParallelLinear", "QKVParallelLinear", "RowParallelLinear")
TP = 2
# How long the parent waits for both ranks; a rank that hangs in a collective its peer never
# joins (the peer failed, or skipped it) is ended after this.
RANK_TIMEOUT_S = 90
ATOL = 1e-5


# ---------------------------------------------------------------------------- the unit cases
def _dense(*shape: int, seed: int) -> torch.Tensor:
    """The same random tensor on every rank (the checkpoint, the input)."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _load(layer: nn.Module, name: str, tensor: torch.Tensor, *shard_id) -> None:
    param = getattr(layer, name)
    expect(callable(getattr(param, "weight_loader", None)),
           f"{type(layer).__name__}.{name} has no weight_loader (build it with loaded_parameter(..., weight_loader=...))")
    param.weight_loader(param, tensor, *shard_id)


def _same(got: torch.Tensor, want: torch.Tensor) -> bool:
    return tuple(got.shape) == tuple(want.shape) and torch.allclose(got, want, atol=ATOL)


def _rows(tensor: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    size = tensor.shape[0] // tp
    return tensor[rank * size:(rank + 1) * size]


def _which_rows(got: torch.Tensor, full: torch.Tensor, tp: int, part: str = "rows") -> str:
    """Names the slice of `full` a wrong shard equals, if any (the usual mistakes)."""
    for r in range(tp):
        if _same(got, _rows(full, r, tp)):
            return f"it holds rank {r}'s {part}"
    if _same(got, full):
        return "it holds the whole tensor"
    return f"shape {tuple(got.shape)}, values from no single slice"


def column_case(layers: Any, rank: int, tp: int) -> str:
    """Weight and bias split by output rows; the output is this rank's columns of the dense one."""
    weight, bias, x = _dense(8, 6, seed=1), _dense(8, seed=2), _dense(3, 6, seed=3)
    for gather in (False, True):
        layer = layers.ColumnParallelLinear(6, 8, bias=True, gather_output=gather)
        _load(layer, "weight", weight)
        _load(layer, "bias", bias)
        want = _rows(weight, rank, tp)
        expect(_same(layer.weight.data, want), f"ColumnParallelLinear(6, 8), rank {rank} of {tp}: the weight should "
               f"be rows {rank * 4}:{rank * 4 + 4} of the checkpoint's [8, 6]; {_which_rows(layer.weight.data, weight, tp)}")
        expect(_same(layer.bias.data, _rows(bias, rank, tp)), f"ColumnParallelLinear, rank {rank}: the bias should "
               f"be elements {rank * 4}:{rank * 4 + 4} of the checkpoint's; {_which_rows(layer.bias.data, bias, tp)}")
        dense = F.linear(x, weight, bias)
        want_out = dense if gather else dense[:, rank * 4:rank * 4 + 4]
        should = ("the whole dense output [3, 8] (all-gather the ranks' columns)" if gather
                  else f"columns {rank * 4}:{rank * 4 + 4} of the dense output, shape [3, 4]")
        got = layer(x)
        expect(_same(got, want_out), f"ColumnParallelLinear(6, 8, gather_output={gather}), rank {rank}: the output "
               f"should be {should}; got shape {tuple(got.shape)}, max difference {_max_diff(got, want_out)}")
    return "ColumnParallelLinear: each rank holds its rows of W and b; its output is its columns (all of them with gather_output)"


def row_case(layers: Any, rank: int, tp: int) -> str:
    """Weight split by input columns, bias whole; partial sums all-reduced, the bias counted once."""
    weight, bias, x = _dense(6, 8, seed=4), _dense(6, seed=5), _dense(3, 8, seed=6)
    layer = layers.RowParallelLinear(8, 6, bias=True)
    _load(layer, "weight", weight)
    _load(layer, "bias", bias)
    cols = slice(rank * 4, rank * 4 + 4)
    expect(_same(layer.weight.data, weight[:, cols]), f"RowParallelLinear(8, 6), rank {rank} of {tp}: the weight "
           f"should be columns {cols.start}:{cols.stop} of the checkpoint's [6, 8]; {_which_rows(layer.weight.data.T, weight.T, tp, 'columns')}")
    expect(_same(layer.bias.data, bias), f"RowParallelLinear, rank {rank}: every rank keeps the whole bias [6]; "
           f"got shape {tuple(layer.bias.shape)}")
    got, dense = layer(x[:, cols]), F.linear(x, weight, bias)
    partial = F.linear(x[:, cols], weight[:, cols])
    if _same(got, partial) or _same(got, partial + bias):
        raise LabCheckFailed(f"RowParallelLinear, rank {rank}: the output is this rank's partial sum only: the "
                             "all-reduce that adds the ranks' partial sums is missing")
    if _same(got, dense + (tp - 1) * bias):
        raise LabCheckFailed(f"RowParallelLinear, rank {rank}: the bias is counted {tp} times: every rank added it "
                             "before the all-reduce; add it once (after the all-reduce, or on rank 0 only)")
    expect(_same(got, dense), f"RowParallelLinear, rank {rank}: the output should equal the dense layer's [3, 6]; "
           f"got shape {tuple(got.shape)}, max difference {_max_diff(got, dense)}")
    no_reduce = layers.RowParallelLinear(8, 6, bias=False, reduce_results=False)
    _load(no_reduce, "weight", weight)
    got = no_reduce(x[:, cols])
    expect(_same(got, partial), f"RowParallelLinear(8, 6, bias=False, reduce_results=False), rank {rank}: the output "
           "should be this rank's partial sum, not reduced (the caller reduces it later)")
    return "RowParallelLinear: each rank holds its columns of W; one all-reduce gives the dense output, the bias once"


def merged_case(layers: Any, rank: int, tp: int) -> str:
    """[gate; up] in one matrix: each part split on its own, this rank's gate rows then its up rows."""
    gate, up, x = _dense(4, 6, seed=7), _dense(8, 6, seed=8), _dense(3, 6, seed=9)
    layer = layers.MergedColumnParallelLinear(6, [4, 8], bias=False)
    _load(layer, "weight", gate, 0)
    _load(layer, "weight", up, 1)
    want = torch.cat([_rows(gate, rank, tp), _rows(up, rank, tp)])
    if _same(layer.weight.data, _rows(torch.cat([gate, up]), rank, tp)):
        raise LabCheckFailed(f"MergedColumnParallelLinear(6, [4, 8]), rank {rank}: the concatenation [gate; up] was "
                             "split as one matrix; split each part on its own, so every rank holds [gate_r; up_r]")
    expect(_same(layer.weight.data, want), f"MergedColumnParallelLinear(6, [4, 8]), rank {rank} of {tp}: the weight "
           f"should be gate rows {rank * 2}:{rank * 2 + 2} then up rows {rank * 4}:{rank * 4 + 4} (shape [6, 6]); "
           f"max difference {_max_diff(layer.weight.data, want)}")
    expect(_same(layer(x), F.linear(x, want)), f"MergedColumnParallelLinear, rank {rank}: output != x @ [gate_r; up_r].T")
    return "MergedColumnParallelLinear: shard 0 (gate) and shard 1 (up) each split, stacked [gate_r; up_r]"


def qkv_case(layers: Any, rank: int, tp: int) -> str:
    """q, k, v split by heads; with fewer KV heads than ranks each KV head is replicated."""
    for kv_heads in (2, 1):
        q, k, v = _dense(8, 8, seed=10), _dense(2 * kv_heads, 8, seed=11), _dense(2 * kv_heads, 8, seed=12)
        what = f"QKVParallelLinear(hidden 8, head_size 2, 4 query heads, {kv_heads} KV heads), rank {rank} of {tp}"
        try:
            layer = layers.QKVParallelLinear(8, 2, 4, kv_heads, bias=False)
            for shard_id, tensor in zip("qkv", (q, k, v)):
                _load(layer, "weight", tensor, shard_id)
        except (NotImplementedError, LabCheckFailed):
            raise
        except Exception as err:
            raise LabCheckFailed(f"{what}: loading raised {type(err).__name__}: {err}") from err
        kv_head = rank * kv_heads // tp  # the one KV head this rank's two query heads use
        want_kv = slice(kv_head * 2, kv_head * 2 + 2)
        want = torch.cat([_rows(q, rank, tp), k[want_kv], v[want_kv]])
        expect(_same(layer.weight.data, want), f"{what}: the weight should be q rows {rank * 4}:{rank * 4 + 4}, then "
               f"k and v rows {want_kv.start}:{want_kv.stop}" + (" (one KV head, kept whole on every rank)" if kv_heads < tp else "")
               + f"; max difference {_max_diff(layer.weight.data, want)}")
    return "QKVParallelLinear: q, k, v split by heads; a KV head replicated when tp > num_kv_heads"


CASES = (column_case, row_case, merged_case, qkv_case)


def _max_diff(got: torch.Tensor, want: torch.Tensor) -> str:
    return f"{(got - want).abs().max().item():.3g}" if got.shape == want.shape else f"shapes {tuple(got.shape)} vs {tuple(want.shape)}"


# ---------------------------------------------------------------------------- two ranks
def _rank_main(rank: int, init_method: str, layers: dict, results) -> None:
    """One spawned rank: join the gloo world of TP ranks, run every case, report."""
    torch.set_num_threads(1)  # two ranks share the machine's cores
    try:
        init_distributed_environment(TP, rank, init_method, backend="gloo")
        initialize_model_parallel(TP)
        namespace = type("Layers", (), layers)
        for case in CASES:
            results.put((rank, "ok", case(namespace, rank, TP)))
        results.put((rank, "done", ""))
    except NotImplementedError as err:
        results.put((rank, "todo", str(err) or "NotImplementedError"))
    except LabCheckFailed as err:
        results.put((rank, "failed", str(err)))
    except Exception:  # the learner's code crashed: show where
        results.put((rank, "error", traceback.format_exc(limit=-4)))
    finally:
        destroy_distributed_environment()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def check_parallel_linears(layers: Any) -> None:
    """Run the unit cases on `TP` spawned gloo ranks; raise what the first failing rank reports."""
    classes = {name: getattr(layers, name, None) for name in LAYER_NAMES}
    missing = [name for name, cls in classes.items() if cls is None]
    expect(not missing, f"{getattr(layers, '__name__', layers)} has no {', '.join(missing)}")
    context = mp.get_context("spawn")  # a fresh interpreter per rank, with this process's sys.path
    results = context.Queue()
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    ranks = [context.Process(target=_rank_main, args=(r, init_method, classes, results), daemon=True)
             for r in range(TP)]
    for process in ranks:
        process.start()
    try:
        lines = _collect(results, ranks)
    finally:
        for process in ranks:
            if process.is_alive():
                process.kill()
            process.join()
    for line in lines:
        passed(line)


def _collect(results, ranks: list) -> list[str]:
    """Rank 0's passed cases once both ranks are done; the first failure raised as it comes."""
    lines, done = [], set()
    while len(done) < TP:
        try:
            rank, status, text = results.get(timeout=RANK_TIMEOUT_S)
        except queue_lib.Empty:
            raise LabCheckFailed(f"the ranks gave no answer within {RANK_TIMEOUT_S} s: one waits in a collective the "
                                 "other never called (every rank must call the same all-reduces in the same order)") from None
        if status == "todo":
            raise NotImplementedError(f"rank {rank}: {text}")
        if status == "failed":
            raise LabCheckFailed(text)
        if status == "error":
            raise LabCheckFailed(f"rank {rank} raised:\n{text}")
        if status == "done":
            done.add(rank)
        elif rank == 0:
            lines.append(text)
    return lines


# ---------------------------------------------------------------------------- inside the engine
def replace_parallel_linears(model: nn.Module, layers: Any, model_config: Any) -> list[str]:
    """Swap each of the package's parallel linear layers in `model` for the class of the same
    name in `layers` (same constructor arguments), then load the checkpoint again so every
    swapped weight arrives through the new class's `weight_loader`. Returns the swapped names.
    vLLM's LoRA swaps layers the same way (`vllm/lora/utils.py: replace_submodule`)."""
    from minivllm.model_executor import model_loader
    from minivllm.model_executor.layers import linear

    param = next(model.parameters())
    swapped = []
    for name, module in list(model.named_modules()):
        kind = type(module).__name__
        if kind not in LAYER_NAMES or type(module) is not getattr(linear, kind):
            continue
        with default_dtype(param.dtype), param.device:
            new = getattr(layers, kind)(*_constructor_args(module))
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, new)
        swapped.append(name)
    model_dir = model_loader.resolve_model_dir(model_config.model, model_config.revision)
    loaded = model.load_weights(model_loader.iterate_weights(model_dir))
    unloaded = sorted(p for p, _ in model.named_parameters() if p not in loaded)
    if unloaded:
        raise ValueError(f"after the swap these parameters were not loaded: {unloaded[:4]}")
    return swapped


def _constructor_args(module: nn.Module) -> tuple:
    bias = module.bias is not None
    kind = type(module).__name__
    if kind == "QKVParallelLinear":
        return module.input_size, module.head_size, module.total_num_heads, module.total_num_kv_heads, bias
    if kind == "MergedColumnParallelLinear":
        return module.input_size, module.output_sizes, bias, module.gather_output
    if kind == "ColumnParallelLinear":
        return module.input_size, module.output_size, bias, module.gather_output
    return module.input_size, module.output_size, bias, module.reduce_results


@contextlib.contextmanager
def _spawned_workers():
    """Worker processes as fresh interpreters: they take this process's sys.path now, so they
    import a module written a moment ago (a fork server started earlier would not)."""
    from minivllm.executor.multiproc_executor import MULTIPROC_METHOD_ENV

    previous = os.environ.get(MULTIPROC_METHOD_ENV)
    os.environ[MULTIPROC_METHOD_ENV] = "spawn"
    try:
        yield
    finally:
        if previous is None:
            del os.environ[MULTIPROC_METHOD_ENV]
        else:
            os.environ[MULTIPROC_METHOD_ENV] = previous


def check_tensor_parallel_engine(worker_cls: str, max_tokens: int = 12) -> list[list[int]]:
    """A CPU engine of `TP` ranks (`mp`: rank 0 here, rank 1 in a worker process) built with
    `worker_cls` ("module:Class"); its model must hold the worker's layers, and its greedy
    output must equal transformers'. Returns the engine's token ids."""
    from minivllm.entrypoints.llm import LLM
    from minivllm.labs.parity import assert_greedy_matches_transformers

    with _spawned_workers():
        llm = LLM(device="cpu", tensor_parallel_size=TP, distributed_executor_backend="mp", worker_cls=worker_cls,
                  max_model_len=256, max_num_seqs=4)
    try:
        model = llm.llm_engine.model_executor.driver_worker.model_runner.model
        theirs = {type(m).__module__ for m in model.modules() if type(m).__name__ in LAYER_NAMES}
        expect(theirs and "minivllm.model_executor.layers.linear" not in theirs,
               f"the driver's model holds parallel linear layers from {sorted(theirs)}: {worker_cls}'s load_model "
               "should put yours in (replace_parallel_linears)")
        passed(f"rank 0's model runs the layers of {', '.join(sorted(theirs))}")
        return assert_greedy_matches_transformers(max_tokens=max_tokens, llm=llm)
    finally:
        llm.llm_engine.shutdown()
