"""`POST /v1/completions`: prompts in, text out, whole or streamed as Server-Sent Events.

Mirrors `vllm/entrypoints/openai/serving_completion.py`. One HTTP request may carry a batch
of prompts; each becomes its own engine request, and choice `i` of prompt `p` is reported
as choice `p * n + i`, as OpenAI does.

A stream asks the engine for DELTA outputs (`RequestOutputKind.DELTA`: only what is new
since the request's last output) and sends each as a chunk:

    step 1: "To"      -> data: {"choices": [{"index": 0, "text": "To"}]}
    step 2: " be"     -> data: {"choices": [{"index": 0, "text": " be"}]}
    ...                  data: [DONE]

(A cumulative output would repeat all the text so far every step: building, shipping and
cutting it costs time proportional to its length, per token.)
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from minivllm.entrypoints.openai.protocol import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamResponse,
    UsageInfo,
    random_uuid,
)
from minivllm.entrypoints.openai.serving_engine import (
    DeltaTracker,
    OpenAIError,
    OpenAIServing,
    StagedStream,
    collect_final_outputs,
    merge_streams,
    reported_logprob,
    sse_event,
    wire_stop_reason,
)
from minivllm.outputs import CompletionOutput, Logprob


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, request: CompletionRequest, receive) -> CompletionResponse | AsyncIterator[str]:
        """Validate, add one engine request per prompt, then answer (or stream).

        `receive` is the ASGI receive channel, used to notice a client that hangs up.
        """
        lora_request = self.check_model(request.model)
        prompts = await self._prompts_token_ids(request)
        params = [self.build_sampling_params(request, len(ids)) for ids in prompts]
        request_id = f"cmpl-{random_uuid()}"
        streams = await self.add_requests(request_id, prompts, params, request.priority, lora_request)
        model = request.model
        if request.stream:
            return self.sse_stream(request_id, self._events(request, request_id, model, prompts, streams), streams)
        finals = await collect_final_outputs(streams, receive, self.engine.abort)
        return self._response(request, request_id, model, prompts, finals)

    async def _prompts_token_ids(self, request: CompletionRequest) -> list[list[int]]:
        """OpenAI's four prompt shapes -> one list of token ids per prompt."""
        prompt = request.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompt = [prompt]
        # An empty text would still tokenize to a lone BOS; refuse it as the engine does.
        if not prompt or any(len(p) == 0 for p in prompt):
            raise OpenAIError("The prompt is empty.", param="prompt")
        if len(prompt) > self.max_prompts_per_request:
            raise OpenAIError(
                f"A request may carry at most {self.max_prompts_per_request} prompts, got {len(prompt)}.", param="prompt")
        self.check_num_seqs(request, len(prompt))
        prompts = [await self.encode_prompt(p, add_special_tokens=True) if isinstance(p, str) else list(p)
                   for p in prompt]
        for token_ids in prompts:
            self.check_token_ids(token_ids)
        return prompts

    # ------------------------------------------------------------- answers
    def _response(self, request, request_id, model, prompts, finals) -> CompletionResponse:
        choices, num_generated = [], 0
        for prompt_index, final in enumerate(finals):
            if final is None:
                continue  # aborted before its first token (the client left)
            for position, output in enumerate(final.outputs):
                # best_of > n may return indices >= n; OpenAI numbers the n choices densely.
                index = prompt_index * request.n + position
                echo = self._echo_text(request, prompts[prompt_index])
                choices.append(self._choice(request, index, output, output.token_ids, output.logprobs, echo + output.text))
                num_generated += len(output.token_ids)
        num_prompt = sum(len(ids) for ids in prompts)
        usage = UsageInfo(prompt_tokens=num_prompt, completion_tokens=num_generated, total_tokens=num_prompt + num_generated)
        return CompletionResponse(id=request_id, model=model, choices=choices, usage=usage)

    def _echo_text(self, request: CompletionRequest, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True) if request.echo else ""

    def _choice(self, request, index, output: CompletionOutput, token_ids, logprobs, text, text_offset=0):
        return CompletionResponseChoice(
            index=index,
            text=text,
            logprobs=self._logprobs(token_ids, logprobs, text_offset) if request.logprobs is not None else None,
            finish_reason=output.finish_reason,
            stop_reason=wire_stop_reason(output),
        )

    def _logprobs(self, token_ids, step_logprobs: list[dict[int, Logprob]] | None, text_offset: int) -> CompletionLogProbs:
        """OpenAI's legacy logprobs: per token its text, logprob, alternatives and char offset."""
        result = CompletionLogProbs()
        for token_id, step in zip(token_ids, step_logprobs or []):
            token = self.decoded(token_id, step[token_id])
            result.tokens.append(token)
            result.token_logprobs.append(reported_logprob(step[token_id].logprob))
            result.top_logprobs.append({self.decoded(t, lp): reported_logprob(lp.logprob) for t, lp in step.items()})
            result.text_offset.append(text_offset)
            text_offset += len(token)
        return result

    # -------------------------------------------------------------- stream
    async def _events(self, request, request_id, model, prompts, streams: list[StagedStream]) -> AsyncIterator[str]:
        created = int(time.time())
        tracker = DeltaTracker()
        # Per choice, where its next token's text starts (legacy logprobs' text_offset): counted
        # over the tokens sent, not the text sent, which holds back what a stop string may cut.
        token_offsets: dict[int, int] = {}

        def chunk(choices, usage=None) -> str:
            return sse_event(CompletionStreamResponse(id=request_id, created=created, model=model, choices=choices, usage=usage))

        async for prompt_index, request_output in merge_streams(streams):
            for output in request_output.outputs:
                index = prompt_index * request.n + output.index
                delta = tracker.delta(index, output)
                if delta is None:
                    continue
                echo = self._echo_text(request, prompts[prompt_index]) if delta.first else ""
                text = echo + delta.text
                choice = self._choice(request, index, output, delta.token_ids, delta.logprobs, text,
                                      token_offsets.get(index, 0))
                if choice.logprobs is not None and choice.logprobs.tokens:
                    token_offsets[index] = choice.logprobs.text_offset[-1] + len(choice.logprobs.tokens[-1])
                yield chunk([choice])
        if request.include_usage:
            num_prompt = sum(len(ids) for ids in prompts)
            total = num_prompt + tracker.num_generated
            yield chunk([], UsageInfo(prompt_tokens=num_prompt, completion_tokens=tracker.num_generated, total_tokens=total))
