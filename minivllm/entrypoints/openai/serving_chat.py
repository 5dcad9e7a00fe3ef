"""`POST /v1/chat/completions`: messages -> the chat template -> one prompt -> the engine.

Mirrors `vllm/entrypoints/openai/serving_chat.py`. The only chat-specific step is turning
the messages into a prompt with the tokenizer's chat template (a Jinja template shipped in
`tokenizer_config.json`); after that a chat request is a completion request whose answer is
wrapped as an assistant message. A stream sends `{"role": "assistant"}` first, then the
content in pieces, then the finish reason.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from minivllm.entrypoints.openai.protocol import (
    ChatCompletionLogProbs,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    ChatResponseMessage,
    ChatTokenLogprob,
    ChatTopLogprob,
    MAX_CHAT_MESSAGES,
    DeltaMessage,
    UsageInfo,
    random_uuid,
)
from minivllm.entrypoints.openai.serving_engine import (
    Delta,
    DeltaTracker,
    OpenAIError,
    OpenAIServing,
    collect_final_outputs,
    merge_streams,
    reported_logprob,
    sse_event,
    top_entries,
    wire_stop_reason,
)
from minivllm.outputs import CompletionOutput, Logprob

# For a tokenizer without a chat template (a base model such as the bundled one): a plain
# play-script layout, "ROLE:" then the text, which any causal LM can continue.
FALLBACK_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] | upper }}:\n{{ message['content'] }}\n\n{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:\n{% endif %}"
)


class OpenAIServingChat(OpenAIServing):
    async def render_chat(self, messages: list[ChatMessage], add_generation_prompt: bool,
                          check_length: bool = False) -> list[int]:
        """Messages -> prompt token ids, through the tokenizer's chat template (`check_length`:
        a text far past the context is refused from its beginning, as `encode_prompt`)."""
        if len(messages) > MAX_CHAT_MESSAGES:
            raise OpenAIError(f"A chat may hold at most {MAX_CHAT_MESSAGES} messages, got {len(messages)}.",
                              param="messages")
        conversation = [{"role": m.role, "content": m.text()} for m in messages]
        template = None if getattr(self.tokenizer, "chat_template", None) else FALLBACK_CHAT_TEMPLATE
        try:
            text = await self.run_in_tokenizer_thread(
                "apply_chat_template",
                conversation,
                chat_template=template,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
            )
        except Exception as e:  # a template may reject a conversation (e.g. roles out of order)
            raise OpenAIError(f"The chat template could not render the messages: {e}", param="messages") from e
        # The template writes any BOS token itself; adding special tokens again would double it.
        encode = self.encode_prompt if check_length else self.encode
        return await encode(text, add_special_tokens=False)

    async def create_chat_completion(
        self, request: ChatCompletionRequest, receive
    ) -> ChatCompletionResponse | AsyncIterator[str]:
        lora_request = self.check_model(request.model)
        self.check_num_seqs(request, 1)
        prompt_ids = await self.render_chat(request.messages, request.add_generation_prompt, check_length=True)
        params = self.build_sampling_params(request, len(prompt_ids))
        request_id = f"chatcmpl-{random_uuid()}"
        streams = await self.add_requests(request_id, [prompt_ids], [params], request.priority, lora_request)
        model = request.model
        if request.stream:
            return self.sse_stream(request_id, self._events(request, request_id, model, len(prompt_ids), streams), streams)
        (final,) = await collect_final_outputs(streams, receive, self.engine.abort)
        return self._response(request, request_id, model, len(prompt_ids), final)

    # ------------------------------------------------------------- answers
    def _response(self, request, request_id, model, num_prompt, final) -> ChatCompletionResponse:
        outputs = final.outputs if final is not None else []
        choices = [
            ChatCompletionResponseChoice(
                index=position,
                message=ChatResponseMessage(content=output.text),
                logprobs=self._logprobs(request, output.token_ids, output.logprobs),
                finish_reason=output.finish_reason,
                stop_reason=wire_stop_reason(output),
            )
            for position, output in enumerate(outputs)
        ]
        num_generated = sum(len(output.token_ids) for output in outputs)
        usage = UsageInfo(prompt_tokens=num_prompt, completion_tokens=num_generated, total_tokens=num_prompt + num_generated)
        return ChatCompletionResponse(id=request_id, model=model, choices=choices, usage=usage)

    def _logprobs(self, request, token_ids, step_logprobs: list[dict[int, Logprob]] | None) -> ChatCompletionLogProbs | None:
        """Chat's logprobs: per token its text, bytes, logprob and the top alternatives."""
        if not request.logprobs:
            return None
        content = []
        for token_id, step in zip(token_ids, step_logprobs or []):
            token = self.decoded(token_id, step[token_id])
            top = [
                ChatTopLogprob(token=(t := self.decoded(tid, lp)), logprob=reported_logprob(lp.logprob), bytes=list(t.encode()))
                for tid, lp in top_entries(step, request.top_logprobs or 0)
            ]
            content.append(
                ChatTokenLogprob(token=token, logprob=reported_logprob(step[token_id].logprob), bytes=list(token.encode()), top_logprobs=top)
            )
        return ChatCompletionLogProbs(content=content)

    # -------------------------------------------------------------- stream
    async def _events(self, request, request_id, model, num_prompt, streams) -> AsyncIterator[str]:
        created = int(time.time())
        tracker = DeltaTracker()

        def chunk(choices, usage=None) -> str:
            return sse_event(ChatCompletionStreamResponse(id=request_id, created=created, model=model, choices=choices, usage=usage))

        # OpenAI opens every choice with the role, before any content.
        yield chunk([ChatCompletionStreamChoice(index=i, delta=DeltaMessage(role="assistant", content="")) for i in range(request.n)])
        async for _, request_output in merge_streams(streams):
            for output in request_output.outputs:
                delta = tracker.delta(output.index, output)
                if delta is not None:
                    yield chunk([self._stream_choice(request, output, delta)])
        if request.include_usage:
            total = num_prompt + tracker.num_generated
            yield chunk([], UsageInfo(prompt_tokens=num_prompt, completion_tokens=tracker.num_generated, total_tokens=total))

    def _stream_choice(self, request, output: CompletionOutput, delta: Delta) -> ChatCompletionStreamChoice:
        return ChatCompletionStreamChoice(
            index=output.index,
            delta=DeltaMessage(content=delta.text),
            logprobs=self._logprobs(request, delta.token_ids, delta.logprobs),
            finish_reason=output.finish_reason,
            stop_reason=wire_stop_reason(output),
        )
