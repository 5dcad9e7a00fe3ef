"""minivllm's extension points, each in a few lines, on the bundled model (runs on a CPU).

    python examples/extension_points.py

1. an out-of-tree model (`ModelRegistry.register_model`)
2. a logits processor (`SamplingParams.logits_processors`)
3. an attention backend by name (`minivllm.kernels.register_backend`)
4. a scheduling policy (`PolicyFactory.register`)
5. a KV connector (`register_connector`) -- see also `minivllm.distributed.kv_transfer`
A plugin package runs registrations like these in every process through a
`minivllm.general_plugins` entry point (`minivllm.plugins`).
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from minivllm import LLM, ModelRegistry, SamplingParams
from minivllm.bundled_models import resolve_model
from minivllm.config import KVTransferConfig
from minivllm.core.policy import Policy, PolicyFactory
from minivllm.distributed.kv_transfer import register_connector
from minivllm.kernels import register_backend
from minivllm.model_executor.models import LlamaForCausalLM

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


class LoudLlama(LlamaForCausalLM):
    """1. A model class of our own: Llama, counting its forward passes."""

    forward_calls = 0

    def forward(self, *args, **kwargs):
        LoudLlama.forward_calls += 1
        return super().forward(*args, **kwargs)


def out_of_tree_model(folder: Path) -> list[int]:
    ModelRegistry.register_model("LoudLlamaForCausalLM", LoudLlama)
    shutil.copytree(resolve_model(None), folder)  # the bundled checkpoint, renamed architecture
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "architectures": ["LoudLlamaForCausalLM"]}))
    return LLM(model=str(folder), device="cpu").generate(["ROMEO:"], GREEDY)[0].outputs[0].token_ids


def ban_token(banned: int):
    """2. A logits processor: `f(output_token_ids, logits) -> logits`."""
    def processor(output_token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        logits[banned] = -float("inf")
        return logits
    return processor


class ShortestPromptFirst(Policy):
    """4. A scheduling policy: a sort key, lower first."""

    def sort_key(self, seq_group):
        return (len(seq_group.prompt_token_ids), seq_group.arrival_time)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        tokens = out_of_tree_model(Path(tmp) / "loud")
        print("1. out-of-tree model:", tokens, "forward calls:", LoudLlama.forward_calls)

        llm = LLM(device="cpu")
        plain = llm.generate(["ROMEO:"], GREEDY)[0].outputs[0].token_ids
        banned = llm.generate(["ROMEO:"], SamplingParams(temperature=0.0, max_tokens=8,
                                                         logits_processors=[ban_token(plain[0])]))
        print("2. logits processor: first token", plain[0], "->", banned[0].outputs[0].token_ids[0])

        register_backend("reference-again", "minivllm.kernels.reference")  # any module with the five ops
        same = LLM(device="cpu", attention_backend="reference-again").generate(["ROMEO:"], GREEDY)
        print("3. attention backend by name: same tokens:", same[0].outputs[0].token_ids == plain)

        PolicyFactory.register("spf", ShortestPromptFirst)
        spf = LLM(device="cpu", scheduling_policy="spf", max_num_seqs=1)
        print("4. scheduling policy 'spf':", [len(o.prompt_token_ids) for o in
                                              spf.generate(["JULIET: O Romeo, Romeo", "ROMEO:"], GREEDY)])

        register_connector("MyStorage", "minivllm.distributed.kv_transfer.shared_storage_connector",
                           "SharedStorageConnector")  # a third-party class would go here
        store = KVTransferConfig("MyStorage", "kv_both", {"shared_storage_path": str(Path(tmp) / "kv")})
        prompt = "ROMEO: But soft, what light through yonder window breaks? It is the east"
        LLM(device="cpu", kv_transfer_config=store).generate([prompt], GREEDY)
        again = LLM(device="cpu", kv_transfer_config=store).generate([prompt], GREEDY)[0]
        print("5. KV connector by name: cached tokens after a restart:", again.num_cached_tokens)


if __name__ == "__main__":
    sys.exit(main())
