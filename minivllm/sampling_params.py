"""How to sample one request: vLLM's `SamplingParams`, with its names and defaults.

Pure Python (no torch), so the scheduler and the notebooks can use it without a model.
Every invalid value raises `InvalidParameterError` (a `ValueError`) naming the parameter and
the reason: wrong types (a bool or a string for a number), NaN and infinities, and integers
outside what torch can hold are refused here, so nothing bad reaches a step.
"""

from __future__ import annotations

import copy
import enum
import math
import numbers
from collections.abc import Callable
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

    CUMULATIVE: its whole output so far, every step. DELTA: only what is new since its last
    output (text, token ids, logprobs): what a stream sends, so the OpenAI server streams with
    it. Building and shipping a cumulative output costs time proportional to its length, every
    step, so a stream of L tokens costs O(L^2); deltas cost O(L) (see `Sequence.
    get_output_token_ids_to_return`). FINAL_ONLY: nothing until it finishes (`LLM.generate`,
    which only keeps finished outputs, so the engine need not build a `RequestOutput` per
    request per step).
    """

    CUMULATIVE = 0
    DELTA = 1
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
        minivllm.sampling_params.InvalidParameterError: best_of must be greater than or equal to n, got n=2 and best_of=1.
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
    # vLLM's logits processors: each `f(output_token_ids, logits)` or
    # `f(prompt_token_ids, output_token_ids, logits)` returns the row's `[vocab]` logits, applied
    # before everything else the sampler does. Python callables: offline use (`LLM`), not the server.
    logits_processors: list[Callable] | None = None
    # Filled in by the engine: EOS ids of the model that must count as stop tokens.
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        if self.best_of is None:
            self.best_of = self.n
        self.stop = _as_list("stop", self.stop)
        self.stop_token_ids = _as_list("stop_token_ids", self.stop_token_ids)
        self.logits_processors = _as_list("logits_processors", self.logits_processors)
        self._verify_args()
        self.all_stop_token_ids = set(self.stop_token_ids)
        if self.output_kind == RequestOutputKind.DELTA and (self.use_beam_search or self.best_of > self.n):
            # Which sequences are reported (and in which order) changes from step to step there:
            # a delta of one step would not continue the last.
            raise InvalidParameterError("output_kind", "output_kind DELTA needs best_of == n and no beam search, got "
                                        f"n={self.n}, best_of={self.best_of}, use_beam_search={self.use_beam_search}.")
        if self.use_beam_search:
            self._verify_beam_search()
        elif self.temperature < _SAMPLING_EPS:
            # Greedy: the filters below cannot change the arg-max, so reset them.
            self.top_p, self.top_k, self.min_p = 1.0, -1, 0.0
            self._verify_greedy()

    # ------------------------------------------------------------------ checks
    def _verify_args(self) -> None:
        """Types first, then ranges: every value that reaches the engine is one torch can hold."""
        self._verify_types()
        if self.best_of < self.n:
            raise InvalidParameterError(
                "best_of", f"best_of must be greater than or equal to n, got n={self.n} and best_of={self.best_of}.")
        for name, low, high in _FLOAT_RANGES:
            value = getattr(self, name)
            if not low <= value <= high:
                raise InvalidParameterError(name, f"{name} must be in [{low}, {high}], got {value}.")
        if self.repetition_penalty == 0.0:
            raise InvalidParameterError("repetition_penalty", "repetition_penalty must be in (0, 2], got 0.0.")
        if self.top_p == 0.0:
            raise InvalidParameterError("top_p", "top_p must be in (0, 1], got 0.0.")
        if self.top_k < -1 or self.top_k == 0:
            raise InvalidParameterError("top_k", f"top_k must be -1 (disable), or at least 1, got {self.top_k}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidParameterError(
                "min_tokens",
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}.")
        if any(s == "" for s in self.stop):
            raise InvalidParameterError("stop", f"stop must contain only non-empty strings, got {self.stop!r}.")
        if self.stop and not self.detokenize:
            raise InvalidParameterError("stop", "stop strings are only supported when detokenize is True.")

    def _verify_types(self) -> None:
        """Each field has the type its annotation says, and each integer fits where it goes."""
        for name, minimum, maximum, optional in _INT_FIELDS:
            value = getattr(self, name)
            if not (optional and value is None):
                setattr(self, name, _check_int(name, value, minimum, maximum))
        for name, _, _ in _FLOAT_RANGES:
            setattr(self, name, _check_float(name, getattr(self, name)))
        for name in _BOOL_FIELDS:
            if not isinstance(getattr(self, name), bool):
                raise InvalidParameterError(name, f"{name} must be a bool, got {getattr(self, name)!r}.")
        if not (isinstance(self.early_stopping, bool) or self.early_stopping == "never"):
            raise InvalidParameterError(
                "early_stopping", f"early_stopping must be True, False, or 'never', got {self.early_stopping!r}.")
        if any(not isinstance(s, str) for s in self.stop):
            raise InvalidParameterError("stop", f"stop must be a string or a list of strings, got {self.stop!r}.")
        self.stop_token_ids = [_check_int("stop_token_ids", t, 0, _INT64_MAX) for t in self.stop_token_ids]
        if not all(callable(f) for f in self.logits_processors):
            raise InvalidParameterError("logits_processors", "logits_processors must be callables, got "
                                        f"{self.logits_processors!r:.200}.")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise InvalidParameterError("output_kind", f"output_kind must be a RequestOutputKind, got {self.output_kind!r}.")

    def _verify_beam_search(self) -> None:
        if self.best_of == 1:
            raise InvalidParameterError(
                "best_of", f"best_of must be greater than 1 when using beam search, got {self.best_of}.")
        if self.temperature > _SAMPLING_EPS:
            raise InvalidParameterError("temperature", "temperature must be 0 when using beam search.")
        if self.top_p < 1.0 - _SAMPLING_EPS or self.top_k != -1 or self.min_p > _SAMPLING_EPS:
            raise InvalidParameterError("top_p", "top_p, top_k and min_p must be disabled when using beam search.")

    def _verify_greedy(self) -> None:
        if self.best_of > 1:
            raise InvalidParameterError("best_of", f"best_of must be 1 when using greedy sampling, got {self.best_of}.")

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
        """A deep copy, except the logits processors: they may hold state or large tables and
        are shared, as in vLLM."""
        return copy.deepcopy(self, memo={id(f): f for f in self.logits_processors})


class InvalidParameterError(ValueError):
    """A `ValueError` that names the parameter at fault (`param`), so that a server can say which
    field of the request to fix (vLLM's `VLLMValidationError` plays this part)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param

    def __reduce__(self):  # picklable (a worker process may send it back)
        return type(self), (self.param, str(self))


def _as_list(name: str, value: object) -> list:
    """`stop` may be one string; both list fields may be None (empty) or any list or tuple."""
    if value is None:
        return []
    if isinstance(value, str) and name == "stop":
        return [value]
    if not isinstance(value, (list, tuple)):
        raise InvalidParameterError(name, f"{name} must be a list, got {value!r}.")
    return list(value)


def _check_int(name: str, value: object, minimum: int, maximum: int) -> int:
    """`value` as a plain int in [minimum, maximum]; a bool is not an integer here."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InvalidParameterError(name, f"{name} must be an integer, got {value!r}.")
    if not minimum <= value <= maximum:
        raise InvalidParameterError(name, f"{name} must be in [{minimum}, {maximum}], got {value}.")
    return int(value)


def _check_float(name: str, value: object) -> float:
    """`value` as a finite float: NaN passes every comparison test, so it is refused by name."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidParameterError(name, f"{name} must be a number, got {value!r}.")
    if not math.isfinite(value):
        raise InvalidParameterError(name, f"{name} must be a finite number, got {value}.")
    return float(value)


# Integers end up in torch tensors (int64) or seed a torch.Generator (which takes any 64-bit
# value, signed or not); beyond these bounds they would overflow inside a step.
_INT64_MAX = 2**63 - 1
_INT_FIELDS = (  # (name, minimum, maximum, may be None)
    ("n", 1, _INT64_MAX, False),
    ("best_of", 1, _INT64_MAX, False),
    ("top_k", -1, _INT64_MAX, False),
    ("seed", -(2**63), 2**64 - 1, True),
    ("max_tokens", 1, _INT64_MAX, True),
    ("min_tokens", 0, _INT64_MAX, False),
    ("logprobs", 0, _INT64_MAX, True),
    ("prompt_logprobs", 0, _INT64_MAX, True),
)
# A beam's score is cumulative_logprob / length ** length_penalty: within +-MAX_LENGTH_PENALTY
# the power stays a finite, non-zero float for any length below 2**64 (2**(64*10) < 2**1023).
MAX_LENGTH_PENALTY = 10.0
_FLOAT_RANGES = (  # (name, low, high), both inclusive; a few exclusions follow in _verify_args
    ("presence_penalty", -2.0, 2.0),
    ("frequency_penalty", -2.0, 2.0),
    ("repetition_penalty", 0.0, 2.0),
    ("temperature", 0.0, float("inf")),
    ("top_p", 0.0, 1.0),
    ("min_p", 0.0, 1.0),
    ("length_penalty", -MAX_LENGTH_PENALTY, MAX_LENGTH_PENALTY),
)
_BOOL_FIELDS = ("use_beam_search", "include_stop_str_in_output", "ignore_eos", "detokenize",
                "skip_special_tokens", "spaces_between_special_tokens")
