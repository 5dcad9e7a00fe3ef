"""Offline batched generation: `LLM`, vLLM's quickstart class.

    from minivllm import LLM, SamplingParams
    llm = LLM()                                      # the bundled tiny-shakespeare model
    outputs = llm.generate(["ROMEO:", "JULIET:"], SamplingParams(temperature=0.8, max_tokens=32))
    for output in outputs:
        print(output.prompt, output.outputs[0].text)

`generate` adds every prompt to one `LLMEngine` and steps it until all are done: the
scheduler batches them continuously, so a batch of prompts runs far faster than a loop
over them. Mirrors `vllm/entrypoints/llm.py` (v0).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.llm_engine import LLMEngine, PromptInput
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import RequestOutputKind, SamplingParams


class LLM:
    """A model ready to generate; `LLM.llm_engine` is the `LLMEngine` underneath.

    Args:
        model: checkpoint folder or hub id; None = the bundled tiny-shakespeare model.
        **engine_args: any `EngineArgs` field (block_size=..., enable_prefix_caching=True, ...).
    """

    def __init__(self, model: str | None = None, **engine_args) -> None:
        self.llm_engine = LLMEngine.from_engine_args(EngineArgs(model=model, **engine_args))
        self.request_counter = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.get_tokenizer()

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt; returns the finished outputs in the prompts' order.

        Args:
            prompts: a string, `{"prompt_token_ids": [...]}`, or a list of either.
            sampling_params: one for all prompts, or one per prompt (default: SamplingParams()).
            use_tqdm: show a progress bar with prompt and generation throughput.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params_list = self._params_per_prompt(sampling_params, len(prompts))
        request_ids = []
        try:
            for prompt, params in zip(prompts, params_list):
                request_id = str(next(self.request_counter))
                # Only finished outputs are kept: spare the engine a RequestOutput per step.
                params = dataclasses.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
                self.llm_engine.add_request(request_id, prompt, params)
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
            self.llm_engine.abort_request([r for r in request_ids if self._is_unfinished(r)])
            raise
        return [finished[request_id] for request_id in request_ids]

    def _is_unfinished(self, request_id: str) -> bool:
        return any(g.request_id == request_id for g in self.llm_engine._unfinished_groups())

    @staticmethod
    def _params_per_prompt(sampling_params, num_prompts: int) -> list[SamplingParams]:
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * num_prompts
        params_list = list(sampling_params)
        if len(params_list) != num_prompts:
            raise ValueError(
                f"got {len(params_list)} sampling params for {num_prompts} prompts: give one, or one per prompt."
            )
        return params_list

    def _run_engine(self, num_requests: int, use_tqdm: bool) -> dict[str, RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm  # only when a bar is wanted (scripts run without tqdm)

            bar = tqdm(total=num_requests, desc="Processed prompts", dynamic_ncols=True)
        prompt_tokens = generated_tokens = 0
        while self.llm_engine.has_unfinished_requests():
            for output in self.llm_engine.step():
                if not output.finished:
                    continue
                finished[output.request_id] = output
                prompt_tokens += len(output.prompt_token_ids)
                generated_tokens += sum(len(c.token_ids) for c in output.outputs)
                if bar is not None:
                    elapsed = bar.format_dict["elapsed"] or 1e-9
                    bar.set_postfix_str(
                        f"est. speed input: {prompt_tokens / elapsed:.1f} toks/s, "
                        f"output: {generated_tokens / elapsed:.1f} toks/s"
                    )
                    bar.update(1)
        if bar is not None:
            bar.close()
        return finished
