"""Tiny random checkpoints (model + tokenizer) that the engine tests save and load.

Shared by tests/engine, tests/worker and tests/entrypoints (their conftest files load this
file by path: pytest's importlib mode keeps tests/ off sys.path).
"""

from __future__ import annotations

import random
import string
import subprocess
import sys
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

VOCAB_SIZE = 128
EOS_TOKEN_ID = 2
_SPECIAL = ["<unk>", "<s>", "</s>"]
_COMMON = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=EOS_TOKEN_ID)
FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM, dict(num_attention_heads=4, num_key_value_heads=2)),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, dict(num_attention_heads=4, num_key_value_heads=2,
                                                   tie_word_embeddings=True)),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(num_attention_heads=4, num_key_value_heads=2,
                                                   head_dim=32, tie_word_embeddings=False)),
}


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer: 3 special tokens, then printable ASCII."""
    vocab = {token: i for i, token in enumerate(_SPECIAL + list(string.printable[:95]))}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def build_hf_model(family: str, seed: int = 0):
    """A random fp32 model; 1-D weights get noise so a forgotten bias or norm would show."""
    config_class, model_class, kwargs = FAMILIES[family]
    config = config_class(**_COMMON, **kwargs)
    config.architectures = [model_class.__name__]
    torch.manual_seed(seed)
    model = model_class(config).float().eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 1:
                param.add_(torch.randn_like(param) * 0.2)
    return model


def save_checkpoint(family: str, path: Path, seed: int = 0):
    """Save model + tokenizer under `path`; returns the transformers model."""
    model = build_hf_model(family, seed)
    model.save_pretrained(path, safe_serialization=True)
    build_tokenizer().save_pretrained(path)
    return model


def hf_greedy(model, prompt_token_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy generate, EOS ignored: the reference output token ids."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_token_ids]), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
            do_sample=False, eos_token_id=None, pad_token_id=0,
        )
    return out[0, len(prompt_token_ids):].tolist()


def greedy_margin(model, prompt_token_ids: list[int], output_token_ids: list[int]) -> float:
    """The smallest gap between the top two logits over the steps that chose `output_token_ids`.
    A GPU's fp32 sums in another order than the CPU's (differences near 1e-5): a reference
    compared on a GPU needs gaps well above that, or either token is right."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt_token_ids + output_token_ids])).logits[0]
    top2 = logits[len(prompt_token_ids) - 1:-1].topk(2, dim=-1).values
    return float((top2[:, 0] - top2[:, 1]).min())


def mixed_prompts(num: int, seed: int = 0, max_len: int = 40) -> list[list[int]]:
    """`num` prompts of token ids: lengths around block edges (block size 8), then random."""
    rng = random.Random(seed)
    lengths = [1, 7, 8, 9, 16, 23, max_len][:num] + [rng.randint(1, max_len) for _ in range(num - 7)]
    return [[rng.randrange(3, VOCAB_SIZE) for _ in range(n)] for n in lengths]


def assert_all_blocks_free(engine) -> None:
    block_manager = engine.scheduler.block_manager
    assert block_manager.get_num_free_gpu_blocks() == engine.cache_config.num_gpu_blocks
    assert block_manager.get_num_free_cpu_blocks() == engine.cache_config.num_cpu_blocks


def run_to_completion(engine, prompts, params) -> dict:
    """Add each prompt as request "0", "1", ... (each its own params if `params` is a list),
    step until none is left; request id -> its final CompletionOutput. Every finished request
    must be reported exactly once."""
    params_list = params if isinstance(params, list) else [params] * len(prompts)
    for i, (prompt, p) in enumerate(zip(prompts, params_list)):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, p)
    results = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                assert output.request_id not in results, "a finished request was reported twice"
                results[output.request_id] = output.outputs[0]
    return results


def launches_seen_by_each_output(engine) -> list[int]:
    """Record, each time the engine processes a sequence's sampled token, how many forward
    passes the worker had launched by then (what the overlap tests assert on)."""
    runner = engine.model_executor.driver_worker.model_runner
    launched, seen = [], []
    run_model, process_outputs = runner.run_model, engine.output_processor.process_outputs
    runner.run_model = lambda *args: launched.append(1) or run_model(*args)
    engine.output_processor.process_outputs = lambda *args: seen.append(len(launched)) or process_outputs(*args)
    return seen


def run_rank_scripts(script: str, world_size: int = 2, timeout: float = 120) -> list[str]:
    """Run `script` once per rank as `python -c script <rank> <init method>` (plain processes:
    no test module has to be importable in a child); assert each exited 0 and printed
    "ok <rank>". Returns each rank's output."""
    from minivllm.distributed.utils import get_distributed_init_method, get_open_port

    init_method = get_distributed_init_method("127.0.0.1", get_open_port())
    ranks = [subprocess.Popen([sys.executable, "-c", script, str(rank), init_method],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in range(world_size)]
    outputs = [process.communicate(timeout=timeout)[0] for process in ranks]
    for rank, (process, output) in enumerate(zip(ranks, outputs)):
        assert process.returncode == 0 and f"ok {rank}" in output, f"rank {rank} failed:\n{output[-3000:]}"
    return outputs
