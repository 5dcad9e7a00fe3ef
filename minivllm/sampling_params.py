"""How to sample one request: vLLM's `SamplingParams`, with its names and defaults.

Pure Python (no torch), so the scheduler and the notebooks can use it without a model.
Every invalid value raises `ValueError` naming the parameter and the reason.
"""

from __future__ import annotations

import copy
import enum
from dataclasses import dataclass, field

# Below this temperature sampling is treated as greedy (as in vLLM): dividing logits by a
# tiny number only overflows, and the arg-max is what the user means.
_SAMPLING_EPS = 1e-5


class SamplingType(enum.IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2
    BEAM = 3


class RequestOutputKind(enum.Enum):
    """What `LLMEngine.step()` returns for a request that has not finished (vLLM's enum).

    CUMULATIVE: its whole output so far, every step (streaming servers). FINAL_ONLY:
    nothing until it finishes (`LLM.generate`, which only keeps finished outputs, so the
    engine need not build a `RequestOutput` per request per step). vLLM's third kind,
    DELTA, is not implemented: the OpenAI server computes its deltas itself.
    """

    CUMULATIVE = 0
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    """Sampling parameters for text generation (vLLM v0, around 0.6).

    Example:
        >>> SamplingParams(temperature=0.0, max_tokens=8).sampling_type
        <SamplingType.GREEDY: 0>
        >>> SamplingParams(n=2, best_of=1)
        Traceback (most recent call last):
        ...
        ValueError: best_of must be greater than or equal to n, got n=2 and best_of=1.
    """

    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Filled in by the engine: EOS ids of the model that must count as stop tokens.
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        if self.best_of is None:
            self.best_of = self.n
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.all_stop_token_ids = set(self.stop_token_ids)
        self._verify_args()
        if self.use_beam_search:
            self._verify_beam_search()
        elif self.temperature < _SAMPLING_EPS:
            # Greedy: the filters below cannot change the arg-max, so reset them.
            self.top_p, self.top_k, self.min_p = 1.0, -1, 0.0
            self._verify_greedy()

    # ------------------------------------------------------------------ checks
    def _verify_args(self) -> None:
        _check_int("n", self.n, minimum=1)
        _check_int("best_of", self.best_of, minimum=1)
        if self.best_of < self.n:
            raise ValueError(
                f"best_of must be greater than or equal to n, got n={self.n} and best_of={self.best_of}."
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}.")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}.")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if not isinstance(self.top_k, int) or self.top_k < -1 or self.top_k == 0:
            raise ValueError(f"top_k must be -1 (disable), or at least 1, got {self.top_k}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, minimum=1)
        _check_int("min_tokens", self.min_tokens, minimum=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}."
            )
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, minimum=0)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, minimum=0)
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}.")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise ValueError(f"stop must contain only non-empty strings, got {self.stop!r}.")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}.")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings are only supported when detokenize is True.")

    def _verify_beam_search(self) -> None:
        if self.best_of == 1:
            raise ValueError(f"best_of must be greater than 1 when using beam search, got {self.best_of}.")
        if self.temperature > _SAMPLING_EPS:
            raise ValueError("temperature must be 0 when using beam search.")
        if self.top_p < 1.0 - _SAMPLING_EPS or self.top_k != -1 or self.min_p > _SAMPLING_EPS:
            raise ValueError("top_p, top_k and min_p must be disabled when using beam search.")
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(
                f"early_stopping must be True, False, or 'never', got {self.early_stopping!r}."
            )

    def _verify_greedy(self) -> None:
        if self.best_of > 1:
            raise ValueError(f"best_of must be 1 when using greedy sampling, got {self.best_of}.")

    # --------------------------------------------------------------- queries
    @property
    def sampling_type(self) -> SamplingType:
        if self.use_beam_search:
            return SamplingType.BEAM
        if self.temperature < _SAMPLING_EPS:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    def clone(self) -> "SamplingParams":
        return copy.deepcopy(self)


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}.")
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}.")
