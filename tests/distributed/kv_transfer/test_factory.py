"""KVTransferConfig (in code, as JSON, on the command line) and the connector factory."""

from __future__ import annotations

import argparse

import pytest

import kv_transfer_testing as kvt
from minivllm.config import KVTransferConfig
from minivllm.distributed.kv_transfer import KVConnectorFactory, KVConnectorRole, register_connector
from minivllm.distributed.kv_transfer.cpu_offload_connector import CPUOffloadConnector
from minivllm.engine.arg_utils import EngineArgs


def test_config_checks_its_fields():
    with pytest.raises(ValueError, match="kv_role"):
        KVTransferConfig("SharedStorageConnector", "kv_sender")
    with pytest.raises(ValueError, match="kv_connector"):
        KVTransferConfig("")
    with pytest.raises(ValueError, match="extra_config"):
        KVTransferConfig("SharedStorageConnector", "kv_both", ["not", "a", "dict"])


def test_config_from_json():
    config = KVTransferConfig.from_json('{"kv_connector": "RedisConnector", "kv_role": "kv_consumer", '
                                        '"kv_connector_extra_config": {"url": "redis://h:1/0"}}')
    assert config == KVTransferConfig("RedisConnector", "kv_consumer", {"url": "redis://h:1/0"})
    for text, reason in (("{", "not valid JSON"), ("[1]", "JSON object"), ('{"kv_role": "kv_both"}', "needs kv_connector"),
                         ('{"kv_connector": "X", "typo": 1}', "unknown fields")):
        with pytest.raises(ValueError, match=reason):
            KVTransferConfig.from_json(text)


def test_command_line_flag():
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--kv-transfer-config", '{"kv_connector": "CPUOffloadConnector"}'])
    assert EngineArgs.from_cli_args(args).kv_transfer_config == KVTransferConfig("CPUOffloadConnector")
    assert EngineArgs.from_cli_args(parser.parse_args([])).kv_transfer_config is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-transfer-config", "not json"])


def test_modes_that_cannot_carry_a_connector_are_refused():
    config = KVTransferConfig("CPUOffloadConnector")
    with pytest.raises(ValueError, match="speculative"):
        EngineArgs(device="cpu", speculative_model="[ngram]", num_speculative_tokens=2, ngram_prompt_lookup_max=2,
                   kv_transfer_config=config).create_engine_config()


def test_factory_names_what_is_registered():
    with pytest.raises(ValueError, match="unknown KV connector 'Nope'.*SharedStorageConnector"):
        kvt.make_engine(KVTransferConfig("Nope"))
    register_connector("NotAConnector", "collections", "OrderedDict")
    with pytest.raises(ValueError, match="not a KVConnectorBase"):
        KVConnectorFactory.get_connector_class("NotAConnector")
    with pytest.raises(ValueError, match="already registered"):
        register_connector("SharedStorageConnector", "elsewhere", "Other")
    assert KVConnectorFactory.get_connector_class("CPUOffloadConnector") is CPUOffloadConnector


def test_shared_storage_needs_its_path():
    with pytest.raises(ValueError, match="shared_storage_path"):
        kvt.make_engine(KVTransferConfig("SharedStorageConnector"))


class RecordingConnector(CPUOffloadConnector):
    """Records every call of the seven methods, by side."""

    calls: list[tuple[str, str]] = []

    def __getattribute__(self, name):
        attribute = super().__getattribute__(name)
        if name in SEVEN:
            RecordingConnector.calls.append((self.role.name, name))
        return attribute


SEVEN = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta", "request_finished",
         "bind_connector_metadata", "start_load_kv", "wait_for_layer_load", "save_kv_layer", "wait_for_save")


def test_each_side_calls_only_its_own_methods():
    register_connector("RecordingConnector", __name__, "RecordingConnector")
    RecordingConnector.calls.clear()
    engine = kvt.make_engine(KVTransferConfig("RecordingConnector"))
    kvt.run(engine, kvt.PROMPTS[:1])
    kvt.run(engine, kvt.PROMPTS[:1])  # a hit: a load this time
    by_side = {side: {name for s, name in RecordingConnector.calls if s == side} for side in ("SCHEDULER", "WORKER")}
    assert by_side["SCHEDULER"] == set(SEVEN[:4])
    assert by_side["WORKER"] == set(SEVEN[4:])
    num_layers = engine.model_config.hf_config.num_hidden_layers
    waits = [c for c in RecordingConnector.calls if c[1] == "wait_for_layer_load"]
    assert len(waits) % num_layers == 0 and waits  # one per layer per step
