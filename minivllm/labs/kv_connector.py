"""Checks of lab 09: a KV connector that saves a request's KV to a store and loads it back
(`notebooks/labs/lab09_kv_connector.ipynb`).

The learner's class is a `minivllm.distributed.kv_transfer.KVConnectorBase` (vLLM's KV connector
v1, `vllm/distributed/kv_transfer/kv_connector/v1/base.py`) over a dict the caller owns,
`kv_connector_extra_config["store"]`. Its metadata is the package's `KVConnectorMetadata`: one
`ReqMeta` per request with `load` / `save` lists of (logical block index, store key).

    unit cases   both sides built by hand (real requests, random caches): an empty store
                 matches nothing; a prefill lists its full blocks for saving (never the block
                 of the prompt's last token; a chunk only the blocks it completes); a second
                 pair of objects over the same store matches the saved prefix after the local
                 hits, lists exactly those loads and copies the very bytes into the new cache
    engine       a fresh store; engine 1 saves, engine 2 (fresh) loads; both greedy outputs
                 equal transformers', and every loaded block holds what engine 1 saved

Expected block counts come from `keys.block_digests` (the blocks the package's connectors may
reuse), expected bytes from the caches the blocks were saved from.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from minivllm.config import KVTransferConfig
from minivllm.core.scheduler import ScheduledSequenceGroup
from minivllm.distributed.kv_transfer import (KVConnectorBase, KVConnectorFactory, KVConnectorMetadata,
                                              KVConnectorRole, register_connector)
from minivllm.distributed.kv_transfer.keys import block_digests
from minivllm.labs import LabCheckFailed, expect, passed
from minivllm.labs.parity import assert_greedy_matches_transformers
from minivllm.sampling_params import SamplingParams
from minivllm.sequence import Sequence, SequenceGroup

UNIT_BLOCK_SIZE = 4
UNIT_LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
UNIT_CACHE_SHAPE = (2, 16, UNIT_BLOCK_SIZE, 2, 8)  # [2, num_blocks, block_size, num_kv_heads, head_dim]
ENGINE_BLOCK_SIZE = 4  # small blocks: the parity prompts have several full ones


@dataclasses.dataclass
class _Step:
    """The one field of `SchedulerOutputs` a connector reads."""

    scheduled_seq_groups: list[ScheduledSequenceGroup]


def _engine_config(store: dict, role: str = "kv_both", name: str = "LabUnitConnector"):
    from minivllm.engine.arg_utils import EngineArgs

    transfer = KVTransferConfig(kv_connector=name, kv_role=role, kv_connector_extra_config={"store": store})
    return EngineArgs(device="cpu", block_size=UNIT_BLOCK_SIZE, max_model_len=256,
                      kv_transfer_config=transfer).create_engine_config()


def _request(request_id: str, token_ids: list[int], num_computed_tokens: int = 0) -> SequenceGroup:
    seq = Sequence(int(request_id.lstrip("r")), None, token_ids, UNIT_BLOCK_SIZE)
    seq.data.num_computed_tokens = num_computed_tokens
    return SequenceGroup(request_id, [seq], sampling_params=SamplingParams(temperature=0.0))


def _caches(fill: Callable[..., torch.Tensor]) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {name: fill(UNIT_CACHE_SHAPE, generator=generator) for name in UNIT_LAYERS}


def _num_reusable_blocks(token_ids: list[int]) -> int:
    return len(block_digests(token_ids, UNIT_BLOCK_SIZE, "any"))


def _matched(connector: KVConnectorBase, request: SequenceGroup, num_computed_tokens: int, what: str) -> int:
    answer = connector.get_num_new_matched_tokens(request, num_computed_tokens)
    expect(isinstance(answer, tuple) and len(answer) == 2 and answer[1] is False,
           f"get_num_new_matched_tokens({what}) must return (num_tokens, False) (False: loaded inside the next "
           f"step, not asynchronously), got {answer!r}")
    return int(answer[0])


def _build(connector: KVConnectorBase, scheduled: list[tuple[SequenceGroup, int]], what: str) -> KVConnectorMetadata:
    meta = connector.build_connector_meta(_Step([ScheduledSequenceGroup(g, n) for g, n in scheduled]))
    expect(isinstance(meta, KVConnectorMetadata),
           f"build_connector_meta ({what}) must return a KVConnectorMetadata (one ReqMeta per request that loads "
           f"or saves; the worker maps its logical block indices to physical ids), got {type(meta).__name__}")
    return meta


def _listed(meta: KVConnectorMetadata, request_id: str, field: str) -> list[int]:
    """The logical block indices `meta` lists for one request's loads or saves."""
    return [index for r in meta.requests if r.request_id == request_id for index, _ in getattr(r, field)]


def _run_worker_step(worker: KVConnectorBase, meta: KVConnectorMetadata, tables: dict[str, list[int]],
                     caches: dict[str, torch.Tensor]) -> None:
    """What the model runner does around one forward pass (`KVConnectorModelRunnerMixin`)."""
    worker.bind_connector_metadata(meta.with_block_tables(tables))
    worker.start_load_kv()
    for name, cache in caches.items():
        worker.wait_for_layer_load(name)
        worker.save_kv_layer(name, cache, None)  # (the attention layer wrote this step's K/V just before)
    worker.wait_for_save()
    worker.clear_connector_metadata()


def check_scheduler_side_saves(connector_cls) -> tuple[dict, dict[str, torch.Tensor], list[int], list[int]]:
    """An empty store matches nothing; a prefill lists its reusable blocks for saving, a chunk
    only the blocks it completes; the worker side puts them in the store. Returns the store,
    the caches they were saved from, the prompt and its block table."""
    store: dict = {}
    config = _engine_config(store)
    scheduler, worker = connector_cls(config, KVConnectorRole.SCHEDULER), connector_cls(config, KVConnectorRole.WORKER)
    caches = _caches(torch.randn)
    worker.register_kv_caches(caches)
    prompt = list(range(100, 121))  # 21 tokens: 5 full blocks of 4, then the last token's block
    table = [9, 3, 12, 5, 7, 1]
    request = _request("r1", prompt)
    got = _matched(scheduler, request, 0, "a 21-token prompt, empty store")
    expect(got == 0, f"get_num_new_matched_tokens: the store is empty, yet it matched {got} tokens")
    scheduler.update_state_after_alloc(request, table, 0)
    meta = _build(scheduler, [(request, len(prompt))], "the 21-token prompt's prefill")
    want = list(range(_num_reusable_blocks(prompt)))
    expect(_listed(meta, "r1", "load") == [],
           f"build_connector_meta, the 21-token prompt's prefill: nothing to load, got loads of blocks "
           f"{_listed(meta, 'r1', 'load')}")
    expect(_listed(meta, "r1", "save") == want,
           f"build_connector_meta, a 21-token prompt in blocks of {UNIT_BLOCK_SIZE}, prefilled whole: expected saves "
           f"of blocks {want} (every full block but the one holding the last token, which no prompt can reuse), "
           f"got {_listed(meta, 'r1', 'save')}")
    _run_worker_step(worker, meta, {"r1": table}, caches)
    expect(len(store) > 0, "after the worker's step (save_kv_layer per layer, then wait_for_save) the store is "
                           "still empty: the saves never reached kv_connector_extra_config['store']")
    expect(worker.stats.num_tokens_saved == len(want) * UNIT_BLOCK_SIZE,
           f"stats.num_tokens_saved: {len(want)} blocks of {UNIT_BLOCK_SIZE} saved, expected "
           f"{len(want) * UNIT_BLOCK_SIZE}, got {worker.stats.num_tokens_saved}")

    chunked = _request("r2", list(range(200, 221)))
    expect(_matched(scheduler, chunked, 0, "another 21-token prompt") == 0,
           "get_num_new_matched_tokens: a prompt that shares no block with the store matched tokens")
    scheduler.update_state_after_alloc(chunked, [0, 2, 4, 6, 8, 10], 0)
    first = _listed(_build(scheduler, [(chunked, 10)], "a chunk of tokens 0-9"), "r2", "save")
    chunked.first_seq.data.num_computed_tokens = 10
    rest = _listed(_build(scheduler, [(chunked, 11)], "the chunk of tokens 10-20"), "r2", "save")
    expect((first, rest) == ([0, 1], [2, 3, 4]),
           f"build_connector_meta, chunked prefill (tokens 0-9, then 10-20, blocks of {UNIT_BLOCK_SIZE}): a step "
           f"saves the blocks it completes, expected [0, 1] then [2, 3, 4], got {first} then {rest}")
    passed("saves: nothing matched in an empty store; the full blocks of a prefill (or of a chunk) saved")
    return store, caches, prompt, table


def check_loads(connector_cls) -> tuple[dict, list[int]]:
    """A second pair of objects (a fresh engine) over the filled store: matches after the local
    hits, never the last token's block; lists those loads; copies the saved bytes into its cache."""
    store, saved_caches, prompt, saved_table = check_scheduler_side_saves(connector_cls)
    config = _engine_config(store)
    scheduler, worker = connector_cls(config, KVConnectorRole.SCHEDULER), connector_cls(config, KVConnectorRole.WORKER)
    caches = _caches(lambda shape, generator: torch.zeros(shape))
    worker.register_kv_caches(caches)
    num_saved = _num_reusable_blocks(prompt) * UNIT_BLOCK_SIZE
    cases = (  # (what, tokens, local prefix-cache hits, expected matched tokens)
        ("the saved 21-token prompt", prompt, 0, num_saved),
        ("the saved prompt with 8 tokens already cached locally", prompt, 8, num_saved - 8),
        ("its first 20 tokens (the last token ends block 4)", prompt[:20], 0, _num_reusable_blocks(prompt[:20]) * 4),
        ("a prompt that shares its first 10 tokens", prompt[:10] + list(range(300, 311)), 0, 8),
        # Block 1's tokens are the saved block 1's, its prefix is not: a block's key names its prefix.
        ("a prompt that differs in its first token, block 0 cached locally", [99] + prompt[1:], 4, 0),
    )
    for i, (what, tokens, local, want) in enumerate(cases):
        got = _matched(scheduler, _request(f"r{10 + i}", tokens), local, what)
        expect(got == want, f"get_num_new_matched_tokens({what}, num_computed_tokens={local}): expected {want} "
                            f"tokens (whole stored blocks after the local hits, up to the first missing one, never "
                            f"the block of the prompt's last token), got {got}")
    request, table = _request("r20", prompt, num_computed_tokens=8), [4, 11, 2, 14, 6, 0]
    scheduler.get_num_new_matched_tokens(request, 8)
    scheduler.update_state_after_alloc(request, table, num_saved - 8)
    request.first_seq.data.num_computed_tokens = num_saved  # the scheduler counts the loaded tokens as computed
    meta = _build(scheduler, [(request, len(prompt) - num_saved)], "a request loading blocks 2-4")
    want = list(range(8 // UNIT_BLOCK_SIZE, num_saved // UNIT_BLOCK_SIZE))
    expect(_listed(meta, "r20", "load") == want,
           f"build_connector_meta after update_state_after_alloc(num_external_tokens={num_saved - 8}) with 8 tokens "
           f"cached locally: expected loads of blocks {want}, got {_listed(meta, 'r20', 'load')}")
    expect(_listed(meta, "r20", "save") == [],
           f"build_connector_meta: this step computes only the last token (no full block), yet it saves blocks "
           f"{_listed(meta, 'r20', 'save')}")
    _run_worker_step(worker, meta, {"r20": table}, caches)
    for name in UNIT_LAYERS:
        for index in want:
            ok = torch.equal(caches[name][:, table[index]], saved_caches[name][:, saved_table[index]])
            expect(ok, f"after start_load_kv / wait_for_layer_load({name!r}): block {index} of the request (physical "
                       f"block {table[index]}) does not hold the K/V saved from physical block {saved_table[index]} "
                       f"of the first cache: the matched tokens were not loaded")
    expect(worker.stats.num_tokens_loaded == len(want) * UNIT_BLOCK_SIZE,
           f"stats.num_tokens_loaded: {len(want)} blocks loaded, expected {len(want) * UNIT_BLOCK_SIZE}, "
           f"got {worker.stats.num_tokens_loaded}")
    passed("loads: the stored prefix matched after the local hits, listed, and copied byte for byte")
    return store, prompt


def check_roles(connector_cls, store: dict, prompt: list[int]) -> None:
    """Over a store that holds `prompt`'s blocks: kv_producer only saves (matches nothing),
    kv_consumer only loads (saves nothing)."""
    producer = connector_cls(_engine_config(store, "kv_producer"), KVConnectorRole.SCHEDULER)
    got = _matched(producer, _request("r1", prompt), 0, "kv_producer, a stored prompt")
    expect(got == 0, f"kv_role='kv_producer' only saves (is_consumer is False), yet it matched {got} tokens")
    consumer = connector_cls(_engine_config(store, "kv_consumer"), KVConnectorRole.SCHEDULER)
    request = _request("r2", list(range(200, 221)))
    consumer.update_state_after_alloc(request, list(range(6)), 0)
    saves = _listed(_build(consumer, [(request, 21)], "kv_consumer's prefill"), "r2", "save")
    expect(saves == [], f"kv_role='kv_consumer' only loads (is_producer is False), yet it saves blocks {saves}")
    passed("roles: kv_producer matches nothing, kv_consumer saves nothing")


def check_connector(connector_cls) -> None:
    """Every unit case, in the order the lab builds them."""
    expect(isinstance(connector_cls, type) and issubclass(connector_cls, KVConnectorBase),
           f"a connector is a subclass of KVConnectorBase, got {connector_cls!r}")
    store, prompt = check_loads(connector_cls)  # (runs the saves' cases first)
    check_roles(connector_cls, store, prompt)


# ------------------------------------------------------------------ in the engine
class _Recorder:
    """What the check's wrapper saw: per step, the scheduler side's matches, the blocks engine 1
    saved (by store key and layer), and engine 2's loaded blocks that differ from them."""

    def __init__(self) -> None:
        self.matched: dict[str, int] = {}  # request id -> tokens matched at its (last) admission
        self.saved: dict[tuple[str, str], torch.Tensor] = {}
        self.loaded_blocks = 0
        self.wrong_loads: list[str] = []


def _recording_subclass(base: type[KVConnectorBase], recorder: _Recorder) -> type[KVConnectorBase]:
    """`base` with every call passed through, watched from outside (like `viz.kv_transfer`'s tracer)."""

    class Checked(base):
        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            answer = super().get_num_new_matched_tokens(request, num_computed_tokens)
            recorder.matched[request.request_id] = answer[0]
            return answer

        def register_kv_caches(self, kv_caches):
            self._lab_caches = kv_caches
            super().register_kv_caches(kv_caches)

        def bind_connector_metadata(self, connector_metadata):
            self._lab_meta = connector_metadata
            super().bind_connector_metadata(connector_metadata)

        def _lab_blocks(self, field: str):
            for r in self._lab_meta.requests:
                for block_id, (index, key) in zip(getattr(r, f"{field}_block_ids"), getattr(r, field)):
                    yield r.request_id, index, block_id, repr(key)

        def save_kv_layer(self, layer_name, kv_layer, attn_metadata):
            super().save_kv_layer(layer_name, kv_layer, attn_metadata)
            for _, _, block_id, key in self._lab_blocks("save"):
                recorder.saved[key, layer_name] = kv_layer[:, block_id].detach().cpu().clone()

        def wait_for_layer_load(self, layer_name):
            super().wait_for_layer_load(layer_name)
            for request_id, index, block_id, key in self._lab_blocks("load"):
                recorder.loaded_blocks += layer_name == next(iter(self._lab_caches))
                want = recorder.saved.get((key, layer_name))
                got = self._lab_caches[layer_name][:, block_id].cpu()
                if want is None or not torch.equal(got, want):
                    recorder.wrong_loads.append(
                        f"request {request_id}, block {index} (physical {block_id}), layer {layer_name!r}: "
                        + ("no block was saved under its key" if want is None else
                           "after wait_for_layer_load it does not hold what engine 1 saved under its key"))

    Checked.__name__ = Checked.__qualname__ = f"LabChecked{base.__name__}"
    return Checked


def check_in_engine(connector_name: str, prompts=None, max_tokens: int = 16, **engine_kwargs) -> None:
    """Engine 1 (a fresh store) saves, engine 2 (fresh) loads: both greedy outputs equal
    transformers', engine 2 matched whole blocks of every prompt, and each loaded block holds
    exactly what engine 1 saved. `connector_name`: the name you registered."""
    from minivllm.entrypoints.llm import LLM
    from minivllm.viz.device import engine_kwargs as device_kwargs

    base = KVConnectorFactory.get_connector_class(connector_name)  # registered and importable?
    recorder = _Recorder()
    checked = _recording_subclass(base, recorder)
    globals()[checked.__name__] = checked  # so the factory imports it by module and name
    register_connector(checked.__name__, __name__, checked.__name__)
    store: dict = {}
    transfer = KVTransferConfig(kv_connector=checked.__name__, kv_role="kv_both",
                                kv_connector_extra_config={"store": store})
    kwargs = dict(kv_transfer_config=transfer, block_size=ENGINE_BLOCK_SIZE, max_model_len=256, **engine_kwargs)
    parity = {} if prompts is None else {"prompts": prompts}

    first = LLM(**device_kwargs(**kwargs))
    assert_greedy_matches_transformers(max_tokens=max_tokens, llm=first, **parity)
    saved = first.llm_engine.kv_transfer_stats
    expect(sum(recorder.matched.values()) == 0,
           f"engine 1 started from an empty store, yet matched {sum(recorder.matched.values())} tokens")
    expect(len(store) > 0 and saved is not None and saved.num_tokens_saved > 0,
           f"engine 1 saved nothing (store entries: {len(store)}, stats.num_tokens_saved: "
           f"{saved.num_tokens_saved if saved else None})")
    recorder.matched.clear()

    second = LLM(**device_kwargs(**kwargs))
    try:
        assert_greedy_matches_transformers(max_tokens=max_tokens, llm=second, **parity)
    except LabCheckFailed as failure:
        if recorder.wrong_loads:  # the precise reason first
            raise LabCheckFailed(f"engine 2: {recorder.wrong_loads[0]}") from failure
        raise
    expect(not recorder.wrong_loads, f"engine 2: {recorder.wrong_loads[0] if recorder.wrong_loads else ''}")
    matched, loaded = sum(recorder.matched.values()), second.llm_engine.kv_transfer_stats
    expect(matched > 0, "engine 2 matched no tokens in the store engine 1 filled: get_num_new_matched_tokens "
                        "found none of the saved blocks")
    expect(recorder.loaded_blocks * ENGINE_BLOCK_SIZE == matched,
           f"engine 2 matched {matched} tokens at admission but its steps loaded "
           f"{recorder.loaded_blocks * ENGINE_BLOCK_SIZE}: the scheduler skipped tokens that were never loaded")
    expect(loaded is not None and loaded.num_tokens_loaded == matched,
           f"engine 2's stats.num_tokens_loaded is {loaded.num_tokens_loaded if loaded else None}, "
           f"expected the {matched} tokens it loaded")
    passed(f"engine 1 saved {saved.num_tokens_saved} tokens; engine 2 loaded {matched} prompt tokens instead of "
           f"computing them, each block as engine 1 saved it")


__all__ = ["LabCheckFailed", "check_connector", "check_in_engine", "check_loads", "check_roles",
           "check_scheduler_side_saves"]
