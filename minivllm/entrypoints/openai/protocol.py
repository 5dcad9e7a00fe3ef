"""The OpenAI API as pydantic models: what a client sends and what the server answers.

Mirrors `vllm/entrypoints/openai/protocol.py` (v0, ~0.6): OpenAI's fields with OpenAI's
defaults, plus vLLM's sampling extras (`top_k`, `min_p`, `repetition_penalty`, `ignore_eos`,
`min_tokens`, `stop_token_ids`, `use_beam_search`, `priority`, ...).

A bad request is a 400 naming the field (`error.param`), as in vLLM, whichever layer finds it:
    * a missing field or one of the wrong type (pydantic) -> before any handler runs;
    * a well-typed value out of range (`SamplingParams`)  -> from `to_sampling_params`;
    * a value this model cannot honour (`LLMEngine.add_request`: token ids, logprobs, ...).
Ranges are therefore checked in ONE place, `SamplingParams`, exactly as the engine checks them.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from minivllm.sampling_params import InvalidParameterError, RequestOutputKind, SamplingParams

def _check_utf8(text: str) -> str:
    """JSON escapes can smuggle lone surrogates ("\\udc80") that no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"string is not valid UTF-8 ({e.reason}).") from e
    return text


Utf8Str = Annotated[str, AfterValidator(_check_utf8)]


# Stop strings are matched against every new token's text and a chat's messages are rendered
# one by one: thousands of either cost every other stream time on the shared step thread.
MAX_STOP_STRINGS = 32
MAX_STOP_TOKEN_IDS = 256
MAX_CHAT_MESSAGES = 1024


def random_uuid() -> str:
    return uuid.uuid4().hex


class OpenAIBaseModel(BaseModel):
    # Strict types: "max_tokens": "16" or "stream": "yes" is refused, as with OpenAI. Python's
    # JSON parser accepts NaN and Infinity, which no sampling parameter may be. Unknown fields
    # are ignored so that newer clients keep working.
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")


# ---------------------------------------------------------------------------- errors
class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(OpenAIBaseModel):
    """OpenAI's error body: `{"error": {"message", "type", "param", "code"}}`."""

    error: ErrorInfo


# ------------------------------------------------------------------- shared pieces
class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class SamplingRequestMixin(OpenAIBaseModel):
    """Fields shared by completion and chat requests, and their mapping to `SamplingParams`."""

    # Required, as in OpenAI's API and vLLM's server: a request for another model than the
    # one served must not quietly get this one's answer.
    model: str
    n: int = 1
    best_of: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: Utf8Str | list[Utf8Str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extras.
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    use_beam_search: bool = False
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: int = 0

    def check_supported(self) -> None:
        """Reject requests that are well-formed but that minivllm cannot honour (-> 400)."""
        if self.logit_bias:
            raise InvalidParameterError("logit_bias", "logit_bias is not supported by minivllm.")
        if self.stream_options is not None and not self.stream:
            raise InvalidParameterError("stream_options", "stream_options can only be set when stream is true.")
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if len(stop) > MAX_STOP_STRINGS:
            raise InvalidParameterError("stop", f"stop may hold at most {MAX_STOP_STRINGS} strings, got {len(stop)}.")
        if len(self.stop_token_ids or []) > MAX_STOP_TOKEN_IDS:
            raise InvalidParameterError("stop_token_ids", f"stop_token_ids may hold at most {MAX_STOP_TOKEN_IDS} "
                                        f"ids, got {len(self.stop_token_ids)}.")
        if self.stream and (self.use_beam_search or (self.best_of or self.n) > self.n):
            # Beams are re-ranked until the very end, so there is no stable prefix to stream.
            raise InvalidParameterError("stream", "streaming is not supported with use_beam_search or best_of > n.")

    # Each request type names its own max-tokens and logprobs fields.
    @property
    def requested_max_tokens(self) -> int | None:
        raise NotImplementedError

    @property
    def requested_logprobs(self) -> int | None:
        raise NotImplementedError

    def to_sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """Map the request onto `SamplingParams`; its `ValueError` becomes a 400.

        `default_max_tokens` (what still fits in the context) applies when the request sets none.
        """
        max_tokens = self.requested_max_tokens
        return SamplingParams(
            n=self.n,
            best_of=self.best_of,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            seed=self.seed,
            use_beam_search=self.use_beam_search,
            length_penalty=self.length_penalty,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            max_tokens=default_max_tokens if max_tokens is None else max_tokens,
            min_tokens=self.min_tokens,
            logprobs=self.requested_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            # A stream sends only what is new, so it asks the engine for only that (as vLLM).
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.CUMULATIVE,
        )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


# --------------------------------------------------------------------- completions
class CompletionRequest(SamplingRequestMixin):
    """`POST /v1/completions` (https://platform.openai.com/docs/api-reference/completions)."""

    # One prompt or a batch: text, token ids, a list of texts or a list of token-id lists.
    prompt: Utf8Str | list[int] | list[Utf8Str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.suffix:
            raise InvalidParameterError("suffix", "suffix is not supported by minivllm.")
        if self.echo and self.logprobs is not None:
            raise InvalidParameterError("echo", "echo together with logprobs is not supported by minivllm.")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def requested_logprobs(self) -> int | None:
        return self.logprobs


class CompletionLogProbs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionResponseChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    # vLLM's extra: the stop string or stop token id that ended this choice.
    stop_reason: int | str | None = None


class CompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"cmpl-{random_uuid()}")
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo


class CompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None


# ---------------------------------------------------------------------------- chat
class ChatContentPart(OpenAIBaseModel):
    type: Literal["text"]
    text: Utf8Str


class ChatMessage(OpenAIBaseModel):
    role: Literal["system", "user", "assistant", "developer"]
    content: Utf8Str | list[ChatContentPart]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingRequestMixin):
    """`POST /v1/chat/completions` (https://platform.openai.com/docs/api-reference/chat)."""

    messages: list[ChatMessage] = Field(min_length=1)
    # None means "as many as fit in the context", as in vLLM.
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None
    # vLLM's extra: end the prompt with the template's "assistant, your turn" marker.
    add_generation_prompt: bool = True

    def check_supported(self) -> None:
        super().check_supported()
        if self.tools:
            raise InvalidParameterError("tools", "tools are not supported by minivllm.")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise InvalidParameterError("response_format", "only response_format type 'text' is supported by minivllm.")
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidParameterError("top_logprobs", "top_logprobs requires logprobs to be true.")

    @property
    def requested_max_tokens(self) -> int | None:
        # `max_completion_tokens` is OpenAI's newer name for `max_tokens`.
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    @property
    def requested_logprobs(self) -> int | None:
        # Chat asks "logprobs: true" plus "top_logprobs: N"; the engine wants one number.
        return (self.top_logprobs or 0) if self.logprobs else None


class ChatResponseMessage(OpenAIBaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatTopLogprob(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatCompletionLogProbs(OpenAIBaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"chatcmpl-{random_uuid()}")
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo


class DeltaMessage(OpenAIBaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatCompletionStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None


# ------------------------------------------------------------------ models, tokens
class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "minivllm"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int | None = None


class LoadLoRAAdapterRequest(OpenAIBaseModel):
    lora_name: Utf8Str | None = None
    lora_path: Utf8Str | None = None


class UnloadLoRAAdapterRequest(OpenAIBaseModel):
    lora_name: Utf8Str | None = None
    lora_int_id: int | None = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


class TokenizeRequest(OpenAIBaseModel):
    """vLLM's `POST /tokenize`: a prompt, or chat messages rendered with the chat template."""

    model: str | None = None
    prompt: Utf8Str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class TokenizeResponse(OpenAIBaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str
