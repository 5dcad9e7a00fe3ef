"""selector.py: each mode's worker and runner class, composed once from the engine config."""

import pytest
import torch

from minivllm.config import KVTransferConfig
from minivllm.engine.arg_utils import EngineArgs
from minivllm.spec_decode.spec_decode_worker import SpecDecodeWorker
from minivllm.worker.kv_connector_model_runner import KVConnectorModelRunnerMixin, KVConnectorWorkerMixin
from minivllm.worker.lora_model_runner import LoRAModelRunnerMixin
from minivllm.worker.model_runner import ModelRunner
from minivllm.worker.multi_step_worker import MultiStepWorker
from minivllm.worker.pipeline_model_runner import PipelineStageModelRunner
from minivllm.worker.pipeline_worker import PipelineStageWorker
from minivllm.worker.selector import model_runner_class, worker_class
from minivllm.worker.worker import Worker

CPU = torch.device("cpu")
OFFLOAD = KVTransferConfig("CPUOffloadConnector", "kv_both", {"num_cpu_blocks": 8})


@pytest.mark.parametrize("args, worker_type, runner_type", [
    ({}, Worker, ModelRunner),
    ({"num_scheduler_steps": 4}, MultiStepWorker, ModelRunner),
    ({"pipeline_parallel_size": 2}, PipelineStageWorker, PipelineStageModelRunner),
    ({"speculative_model": "[ngram]", "num_speculative_tokens": 2, "ngram_prompt_lookup_max": 2},
     SpecDecodeWorker, ModelRunner),
])
def test_one_class_per_mode_and_the_plain_pair_by_default(llama_dir, args, worker_type, runner_type):
    config = EngineArgs(model=llama_dir[0], device="cpu", **args).create_engine_config()
    assert worker_class(config) is worker_type
    assert model_runner_class(config, CPU) is runner_type


def test_modes_of_the_forward_pass_are_mixed_over_the_base_runner(llama_dir):
    lora = EngineArgs(model=llama_dir[0], device="cpu", enable_lora=True).create_engine_config()
    runner = model_runner_class(lora, CPU)
    assert runner.__mro__[1:3] == (LoRAModelRunnerMixin, ModelRunner) and runner.__name__ == "LoRAModelRunner"
    assert model_runner_class(lora, CPU) is runner  # one class per combination
    assert worker_class(lora) is Worker

    kv = EngineArgs(model=llama_dir[0], device="cpu", kv_transfer_config=OFFLOAD,
                    num_scheduler_steps=4).create_engine_config()
    assert model_runner_class(kv, CPU).__mro__[1:3] == (KVConnectorModelRunnerMixin, ModelRunner)
    worker = worker_class(kv)
    assert worker.__mro__[1:3] == (KVConnectorWorkerMixin, MultiStepWorker)
    assert worker.__name__ == "KVConnectorMultiStepWorker"
