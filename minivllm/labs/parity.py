"""The end-to-end check of every lab: greedy output through a real `LLM` built with the
learner's piece, token for token against transformers' `generate` on the same checkpoint.

    prompts ──LLM(**engine_kwargs, your class)──▶ token ids ─┐
            ──transformers AutoModelForCausalLM.generate────▶ token ids ─┴─ equal, or LabCheckFailed

fp32 on either device (`minivllm.viz.device.engine_kwargs`), so equality is exact. Both sides
ignore end-of-sequence, so every prompt yields `max_tokens` tokens to compare.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from minivllm.bundled_models import resolve_model
from minivllm.engine.step_observer import StepObserver
from minivllm.entrypoints.llm import LLM
from minivllm.labs import LabCheckFailed, passed
from minivllm.sampling_params import SamplingParams
from minivllm.viz.device import engine_kwargs as device_kwargs

PROMPTS = (
    "ROMEO:\n",
    "JULIET:\nO Romeo, Romeo! wherefore art thou Romeo?\n",
    "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\n",
    "KING HENRY VI:\n",
)
# A learner's scheduler or block manager that never lets a request run would keep `generate`
# stepping forever; this many steps in a row that schedule nothing fail the check instead.
MAX_IDLE_STEPS = 100


def assert_greedy_matches_transformers(prompts=PROMPTS, max_tokens: int = 16, *, llm: LLM | None = None,
                                       **engine_kwargs) -> list[list[int]]:
    """Generate greedily with `llm` (or a new `LLM(**engine_kwargs)` on the bundled model) and
    with transformers; raise `LabCheckFailed` at the first differing token. Prompts are text or
    token-id lists. Returns the engine's token ids, one list per prompt."""
    if llm is None:
        llm = LLM(**device_kwargs(**engine_kwargs))
    inputs = [{"prompt_token_ids": list(p)} if not isinstance(p, str) else p for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    with stall_guard(llm):
        outputs = llm.generate(inputs, params, use_tqdm=False)
    model_dir = llm.llm_engine.model_config.model
    ours = [list(output.outputs[0].token_ids) for output in outputs]
    for index, output in enumerate(outputs):
        theirs = transformers_greedy(model_dir, tuple(output.prompt_token_ids), max_tokens)
        _compare(index, output.prompt or output.prompt_token_ids, ours[index], theirs, output.outputs[0])
    passed(f"{len(outputs)} prompts x {max_tokens} tokens: token-identical to transformers")
    return ours


@contextlib.contextmanager
def stall_guard(llm: LLM):
    """Inside it, `llm`'s engine raises `LabCheckFailed` after `MAX_IDLE_STEPS` empty steps in a row."""
    guard = _StallGuard()
    llm.llm_engine.add_step_observer(guard)
    try:
        yield
    finally:
        llm.llm_engine.remove_step_observer(guard)


class _StallGuard(StepObserver):
    def __init__(self) -> None:
        self.idle_steps = 0

    def on_scheduled(self, engine, scheduler_outputs) -> None:
        self.idle_steps = self.idle_steps + 1 if scheduler_outputs.is_empty() else 0
        if self.idle_steps >= MAX_IDLE_STEPS:
            raise LabCheckFailed(f"the engine scheduled nothing for {MAX_IDLE_STEPS} steps in a row with "
                                 f"{engine.get_num_unfinished_requests()} requests unfinished: your piece "
                                 "never lets them run (no prompt admitted, no block given)")


def transformers_greedy(model_dir: str, prompt_token_ids: tuple[int, ...], max_tokens: int) -> list[int]:
    """transformers' greedy continuation of one prompt, end-of-sequence ignored."""
    model = _hf_model(model_dir or resolve_model(None))
    ids = torch.tensor([prompt_token_ids], device=model.device)
    with torch.no_grad():
        # eos_token_id=None: generate past end-of-sequence (min_new_tokens would mask it instead).
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                             do_sample=False, eos_token_id=None)
    return out[0, ids.shape[1]:].tolist()


@functools.cache
def _hf_model(model_dir: str):
    import transformers  # deferred: only the end-to-end check needs it

    transformers.utils.logging.disable_progress_bar()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()


def _compare(index: int, prompt, ours: list[int], theirs: list[int], completion) -> None:
    for position, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            raise LabCheckFailed(f"prompt {index} ({prompt!r:.40}): token {position} is {a}, transformers "
                                 f"says {b} (the first {position} tokens agree)")
    if len(ours) != len(theirs):
        raise LabCheckFailed(f"prompt {index} ({prompt!r:.40}): {len(ours)} tokens, transformers {len(theirs)} "
                             f"(the engine ended it: finish_reason {completion.finish_reason!r}"
                             + (f", {completion.finish_message}" if completion.finish_message else "") + ")")
