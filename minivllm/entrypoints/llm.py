"""Offline batched generation: `LLM`, vLLM's quickstart class (`vllm/entrypoints/llm.py`, v0).

    from minivllm import LLM, SamplingParams
    llm = LLM()                                      # the bundled tiny-shakespeare model
    outputs = llm.generate(["ROMEO:", "JULIET:"], SamplingParams(temperature=0.8, max_tokens=32))
    for output in outputs:
        print(output.prompt, output.outputs[0].text)
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.llm_engine import LLMEngine, PromptInput
from minivllm.engine.profiler import LLMProfilerMixin
from minivllm.entrypoints.gc_tuning import gc_heap_frozen
from minivllm.lora.request import LoRARequest
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import RequestOutputKind, SamplingParams


class LLM(LLMProfilerMixin):
    """A model ready to generate over one `LLMEngine` (`llm_engine`). `model`: a checkpoint
    folder or hub id (None: the bundled model); `engine_args`: any `EngineArgs` field."""

    def __init__(self, model: str | None = None, **engine_args) -> None:
        self.llm_engine = LLMEngine.from_engine_args(EngineArgs(model=model, **engine_args))
        self.request_counter = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.get_tokenizer()

    def generate(self, prompts: PromptInput | Sequence[PromptInput] | None = None,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 prompt_token_ids: list[int] | list[list[int]] | None = None, use_tqdm: bool = True,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                 priority: list[int] | None = None) -> list[RequestOutput]:
        """The finished outputs, in the prompts' order. `prompts`: a string, `{"prompt": text}`,
        `{"prompt_token_ids": [...]}` or a list of them (or vLLM's older `prompt_token_ids`:
        one list of ids, or several). `sampling_params` and `lora_request`: one for all prompts,
        or one per prompt; `priority`: one per prompt (with `scheduling_policy="priority"`).
        """
        prompts = _as_prompt_list(prompts, prompt_token_ids)
        params = SamplingParams() if sampling_params is None else sampling_params
        params_list = self._params_per_prompt(params, len(prompts))
        priorities = [0] * len(prompts) if priority is None else list(priority)
        if len(priorities) != len(prompts):
            raise ValueError(f"got {len(priorities)} priorities for {len(prompts)} prompts: give one per prompt.")
        loras = [lora_request] * len(prompts) if lora_request is None or isinstance(lora_request, LoRARequest) \
            else list(lora_request)
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(loras)} lora requests for {len(prompts)} prompts: give one, or one per prompt.")
        return self._generate(prompts, params_list, priorities, use_tqdm, loras)

    def chat(self, messages: list[dict[str, str]] | list[list[dict[str, str]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False,
             lora_request: LoRARequest | None = None) -> list[RequestOutput]:
        """Replies to one conversation (`[{"role": "user", "content": "..."}]`) or a list of
        them, each rendered by the tokenizer's chat template (or `chat_template`, Jinja). As
        in the OpenAI server, no special tokens are added: the template writes BOS itself."""
        if not messages:
            raise ValueError("messages is empty: give a conversation, a list of {'role', 'content'} dicts.")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        tokenizer = self.get_tokenizer()
        prompts = []
        for conversation in conversations:
            text = tokenizer.apply_chat_template(
                conversation, chat_template=chat_template, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, tokenize=False)
            prompts.append({"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def _generate(self, prompts: list[PromptInput], params_list: list[SamplingParams], priorities: list[int],
                  use_tqdm: bool, loras: list[LoRARequest | None]) -> list[RequestOutput]:
        request_ids = []
        try:
            for prompt, params, priority, lora in zip(prompts, params_list, priorities, loras):
                request_id = str(next(self.request_counter))
                # Only finished outputs are kept: spare the engine a RequestOutput per step.
                params = dataclasses.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
                self.llm_engine.add_request(request_id, prompt, params, priority=priority, lora_request=lora)
                request_ids.append(request_id)
        except BaseException:
            # One bad prompt (ValueError, TypeError, ... or Ctrl-C) rejects the whole call: take
            # back the ones already queued, or the next generate() would run them silently.
            self.llm_engine.abort_request(request_ids)
            raise
        try:
            finished = self._run_engine(len(request_ids), use_tqdm)
        except BaseException:
            # Whatever stopped the loop, no request of this call may outlive it holding blocks.
            unfinished = {g.request_id for g in self.llm_engine._unfinished_groups()}
            self.llm_engine.abort_request([r for r in request_ids if r in unfinished])
            raise
        return [finished[request_id] for request_id in request_ids]

    @staticmethod
    def _params_per_prompt(sampling_params, num_prompts: int) -> list[SamplingParams]:
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * num_prompts
        params_list = list(sampling_params)
        if len(params_list) != num_prompts:
            raise ValueError(f"got {len(params_list)} sampling params for {num_prompts} prompts: "
                             "give one, or one per prompt.")
        return params_list

    def _run_engine(self, num_requests: int, use_tqdm: bool) -> dict[str, RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm  # only when a bar is wanted (scripts run without tqdm)

            bar = tqdm(total=num_requests, desc="Processed prompts", dynamic_ncols=True)
        prompt_tokens = generated_tokens = 0
        with gc_heap_frozen():  # no full GC scan of the model's objects mid-run
            while self.llm_engine.has_unfinished_requests():
                for output in (o for o in self.llm_engine.step() if o.finished):
                    finished[output.request_id] = output
                    prompt_tokens += len(output.prompt_token_ids)
                    generated_tokens += sum(len(c.token_ids) for c in output.outputs)
                    if bar is not None:
                        elapsed = bar.format_dict["elapsed"] or 1e-9
                        bar.set_postfix_str(
                            f"est. speed input: {prompt_tokens / elapsed:.1f} toks/s, "
                            f"output: {generated_tokens / elapsed:.1f} toks/s")
                        bar.update(1)
        if bar is not None:
            bar.close()
        return finished


def _as_prompt_list(prompts, prompt_token_ids) -> list[PromptInput]:
    """Every form vLLM's `generate` takes, as a list of what `LLMEngine.add_request` takes."""
    if (prompts is None) == (prompt_token_ids is None):
        raise ValueError("give prompts or prompt_token_ids (one of the two).")
    if prompt_token_ids is not None:
        ids = list(prompt_token_ids)
        lists = ids if ids and not isinstance(ids[0], int) else [ids]  # one prompt, or several
        return [{"prompt_token_ids": list(token_ids)} for token_ids in lists]
    prompts = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
    # vLLM's TextPrompt, {"prompt": text}, is plain text to the engine.
    return [p["prompt"] if isinstance(p, dict) and "prompt_token_ids" not in p and "prompt" in p else p
            for p in prompts]
