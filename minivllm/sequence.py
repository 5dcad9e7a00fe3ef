"""Requests as the scheduler sees them, and what engine and worker exchange. No torch.

Mirrors `vllm/sequence.py` (v0). A request is a `SequenceGroup` of `best_of` (or beam width)
`Sequence`s sharing the prompt. tokens = prompt_token_ids + output_token_ids; the first
`num_computed_tokens` of them have their K/V in the paged cache. A prefill computes a chunk of
the rest, a decode exactly the last one.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from minivllm.sampling_params import SamplingParams

if TYPE_CHECKING:  # a plain dataclass; imported for the annotations only
    from minivllm.lora.request import LoRARequest


class SequenceStatus(enum.IntEnum):
    """Life cycle of one sequence (the order matters: everything after SWAPPED is finished)."""

    WAITING = 0
    RUNNING = 1
    SWAPPED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5
    FINISHED_IGNORED = 6

    @staticmethod
    def is_finished(status: "SequenceStatus") -> bool:
        return status > SequenceStatus.SWAPPED

    @staticmethod
    def get_finished_reason(status: "SequenceStatus") -> str | None:
        """The OpenAI-style `finish_reason` for a status ("stop", "length", "abort")."""
        return _FINISH_REASONS.get(status)


# An ignored request (too long a prompt, n above max_num_seqs, a swapped-out request that can
# never fit back) never ran to its end: "abort" with a `finish_message`, not vLLM v0's "length".
_FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH_CAPPED: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
    SequenceStatus.FINISHED_IGNORED: "abort",
}


@dataclass
class Logprob:
    """One token's log-probability at one position, as `RequestOutput`s carry it (vLLM's)."""

    logprob: float  # natural log, under the distribution the token was sampled from
    rank: int | None = None  # 1 for the most likely token (None: unknown)
    decoded_token: str | None = None  # the token's text, when the request detokenizes


class SequenceStage(enum.Enum):
    PREFILL = enum.auto()
    DECODE = enum.auto()


@dataclass
class SequenceData:
    """The token ids of one sequence and how many of them are already in the KV cache."""

    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    num_computed_tokens: int = 0

    def append_token_id(self, token_id: int, logprob: float) -> None:
        self.output_token_ids.append(token_id)
        self.cumulative_logprob += logprob

    def get_len(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def get_prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    def get_output_len(self) -> int:
        return len(self.output_token_ids)

    def get_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def get_last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    def get_num_uncomputed_tokens(self) -> int:
        return self.get_len() - self.num_computed_tokens

    def update_num_computed_tokens(self, num_new_computed_tokens: int) -> None:
        if self.num_computed_tokens + num_new_computed_tokens > self.get_len():
            raise ValueError(f"cannot mark {num_new_computed_tokens} more tokens computed: "
                             f"{self.num_computed_tokens} of {self.get_len()} already are.")
        self.num_computed_tokens += num_new_computed_tokens

    def reset_state_for_recompute(self) -> None:
        """Preemption by recompute drops the KV cache: every token must be computed again."""
        self.num_computed_tokens = 0

    @property
    def stage(self) -> SequenceStage:
        if self.get_num_uncomputed_tokens() > 1 or not self.output_token_ids:
            return SequenceStage.PREFILL
        return SequenceStage.DECODE


class Sequence:
    """One stream of tokens: a prompt (never empty) and the tokens generated after it.

    `seq_id` is unique across the engine; `block_size` serves `n_blocks` only (the block
    manager counts with its own); `lora_request` None runs the base model.
    """

    def __init__(self, seq_id: int, prompt: str | None, prompt_token_ids: list[int],
                 block_size: int, eos_token_id: int | None = None,
                 lora_request: LoRARequest | None = None) -> None:
        if not prompt_token_ids:
            raise ValueError("a sequence needs at least one prompt token.")
        self.seq_id = seq_id
        self.prompt = prompt
        self.block_size = block_size
        self.eos_token_id = eos_token_id
        self.lora_request = lora_request
        self.data = SequenceData(list(prompt_token_ids))
        self.output_text = ""
        # Per generated token: {token_id: logprob} (the sampled one and the top-N), and its rank.
        self.output_logprobs: list[dict[int, float]] = []
        self.output_ranks: list[int | None] = []
        self.status = SequenceStatus.WAITING
        self.stop_reason: int | str | None = None
        # `minivllm.engine.detokenizer`'s state: the window, a fast tokenizer's stream.
        self.prefix_offset = self.read_offset = 0
        self.decode_stream = None
        self.stream_fed = 0
        # What the request's outputs have returned so far (RequestOutputKind.DELTA).
        self.last_output_token_ids_offset = 0
        self.last_output_text_offset = 0

    @property
    def lora_int_id(self) -> int:
        return self.lora_request.lora_int_id if self.lora_request else 0

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.data.prompt_token_ids

    @property
    def output_token_ids(self) -> list[int]:
        return self.data.output_token_ids

    @property
    def n_blocks(self) -> int:
        """Blocks of this sequence's own `block_size` that hold its tokens (vLLM's)."""
        return (self.get_len() + self.block_size - 1) // self.block_size

    def get_len(self) -> int:
        return self.data.get_len()

    def get_prompt_len(self) -> int:
        return self.data.get_prompt_len()

    def get_output_len(self) -> int:
        return self.data.get_output_len()

    def get_token_ids(self) -> list[int]:
        return self.data.get_token_ids()

    def get_output_token_ids(self) -> list[int]:
        return self.data.output_token_ids

    def get_last_token_id(self) -> int:
        return self.data.get_last_token_id()

    def get_cumulative_logprob(self) -> float:
        return self.data.cumulative_logprob

    def get_num_computed_tokens(self) -> int:
        return self.data.num_computed_tokens

    def get_num_uncomputed_tokens(self) -> int:
        return self.data.get_num_uncomputed_tokens()

    def is_prefill(self) -> bool:
        return self.data.stage == SequenceStage.PREFILL

    def is_finished(self) -> bool:
        return self.status > SequenceStatus.SWAPPED  # SequenceStatus.is_finished, inlined (hot)

    def append_token_id(self, token_id: int, logprobs: dict[int, float] | dict[int, Logprob],
                        rank: int | None = None) -> None:
        """Add a sampled token. `logprobs`: `{token_id: float}` or vLLM's `{token_id: Logprob}`
        (its rank used when `rank` is None), stored as floats; without the sampled token its
        logprob counts as 0.0 (a stand-in model without probabilities)."""
        sampled = logprobs.get(token_id)
        if isinstance(sampled, Logprob) and rank is None:
            rank = sampled.rank
        # Without logprobs asked the dict is one float: no scan.
        if (len(logprobs) > 1 or not isinstance(sampled, float)) and any(
                isinstance(v, Logprob) for v in logprobs.values()):
            logprobs = {t: v.logprob if isinstance(v, Logprob) else v for t, v in logprobs.items()}
        self.output_logprobs.append(logprobs)
        self.output_ranks.append(rank)
        self.data.append_token_id(token_id, logprobs.get(token_id, 0.0))

    def get_output_token_ids_to_return(self, delta: bool) -> list[int]:
        """The output token ids a `RequestOutput` carries: all, or (delta) the new ones."""
        if not delta:
            return list(self.data.output_token_ids)
        start, self.last_output_token_ids_offset = self.last_output_token_ids_offset, self.get_output_len()
        return self.data.output_token_ids[start:]

    def get_output_text_to_return(self, buffer_length: int, delta: bool) -> str:
        """The output text to return: all, or (delta) the part not yet returned; while running,
        less the last `buffer_length` characters, which a stop string may still take back."""
        end = len(self.output_text) if self.is_finished() else max(len(self.output_text) - buffer_length, 0)
        if not delta:
            return self.output_text[:end]
        start = self.last_output_text_offset
        self.last_output_text_offset = max(start, end)
        return self.output_text[start:end]

    def get_beam_search_score(self, length_penalty: float = 1.0, seq_len: int | None = None,
                              eos_token_id: int | None = None) -> float:
        """cumulative logprob / length ** length_penalty (vLLM's, transformers'); the length
        counts prompt and output tokens, less a final EOS."""
        if seq_len is None:
            seq_len = self.get_len()
            if eos_token_id is not None and self.get_last_token_id() == eos_token_id:
                seq_len -= 1
        return self.get_cumulative_logprob() / (seq_len**length_penalty)

    def fork(self, new_seq_id: int) -> "Sequence":
        """A child with the same tokens (its KV blocks are shared via `BlockSpaceManager.fork`)."""
        child = Sequence.__new__(Sequence)
        child.__dict__.update(self.__dict__)
        child.seq_id = new_seq_id
        data = self.data
        child.data = SequenceData(list(data.prompt_token_ids), list(data.output_token_ids),
                                  data.cumulative_logprob, data.num_computed_tokens)
        child.output_logprobs = list(self.output_logprobs)
        child.output_ranks = list(self.output_ranks)
        child.decode_stream = None  # not copyable: the child rebuilds one from the offsets
        # A new completion: its first delta carries the parent's tokens too.
        child.last_output_token_ids_offset = child.last_output_text_offset = 0
        return child

    def reset_state_for_recompute(self) -> None:
        self.data.reset_state_for_recompute()

    def __repr__(self) -> str:
        return f"Sequence(seq_id={self.seq_id}, status={self.status.name}, num_tokens={self.get_len()})"


@dataclass
class RequestMetrics:
    """Timestamps (seconds, `time.monotonic()`-like) for latency metrics."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    time_in_queue: float | None = None
    finished_time: float | None = None
    last_token_time: float | None = None


class SequenceGroup:
    """One request: its sequences, sampling parameters, arrival time (None: now) and priority
    (lower first, ties by arrival). vLLM 0.6.3's arguments in its order."""

    def __init__(self, request_id: str, seqs: list[Sequence], arrival_time: float | None = None,
                 sampling_params: SamplingParams | None = None,
                 lora_request: LoRARequest | None = None, embeddings: list[float] | None = None,
                 pooling_params: object | None = None, encoder_seq: Sequence | None = None,
                 trace_headers: dict[str, str] | None = None,
                 prompt_adapter_request: object | None = None, priority: int = 0) -> None:
        if not seqs:
            raise ValueError("a sequence group needs at least one sequence.")
        unsupported = {  # vLLM's argument -> (the value given, why it must be None)
            "embeddings": (embeddings, "embedding (pooling) models are not served"),
            "pooling_params": (pooling_params, "embedding (pooling) models are not served"),
            "encoder_seq": (encoder_seq, "encoder-decoder models are not served"),
            "trace_headers": (trace_headers, "there is no OpenTelemetry tracing"),
            "prompt_adapter_request": (prompt_adapter_request, "prompt adapters are not served (LoRA is: "
                                                              "lora_request)"),
        }
        for name, (value, reason) in unsupported.items():
            if value is not None:
                raise ValueError(f"{name} must be None in minivllm: {reason}.")
        if arrival_time is not None and (isinstance(arrival_time, bool) or not isinstance(arrival_time, (int, float))):
            raise ValueError(f"arrival_time must be a number, got {arrival_time!r} (vLLM's order: "
                             "request_id, seqs, arrival_time, sampling_params).")
        self.request_id = request_id
        self.seqs = list(seqs)
        self.sampling_params = sampling_params or SamplingParams()
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.priority = priority
        self.lora_request = lora_request
        self.metrics = RequestMetrics(arrival_time=self.arrival_time)
        self.prompt_logprobs: list[dict[int, float] | None] | None = None
        self.prompt_ranks: list[int | None] | None = None
        self.finish_message: str | None = None  # why it was ignored or aborted
        # Prompt tokens whose KV was reused at admission (prefix cache, KV connector); vLLM's.
        self.num_cached_tokens: int | None = None

    @property
    def first_seq(self) -> Sequence:
        return self.seqs[0]

    @property
    def lora_int_id(self) -> int:
        return self.lora_request.lora_int_id if self.lora_request else 0

    @property
    def prompt(self) -> str | None:
        return self.first_seq.prompt

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.first_seq.prompt_token_ids

    def get_seqs(self, status: SequenceStatus | None = None) -> list[Sequence]:
        if status is None:
            return list(self.seqs)
        return [seq for seq in self.seqs if seq.status == status]

    def get_unfinished_seqs(self) -> list[Sequence]:
        if len(self.seqs) == 1:  # the common case, once per token: no generator
            return [] if self.seqs[0].status > SequenceStatus.SWAPPED else self.seqs[:]
        return [seq for seq in self.seqs if not seq.is_finished()]

    def get_finished_seqs(self) -> list[Sequence]:
        return [seq for seq in self.seqs if seq.is_finished()]

    def num_seqs(self, status: SequenceStatus | None = None) -> int:
        return len(self.get_seqs(status))

    def find(self, seq_id: int) -> Sequence:
        for seq in self.seqs:
            if seq.seq_id == seq_id:
                return seq
        raise ValueError(f"sequence {seq_id} not found in request {self.request_id}.")

    def add(self, seq: Sequence) -> None:
        if any(s.seq_id == seq.seq_id for s in self.seqs):
            raise ValueError(f"sequence {seq.seq_id} already exists in request {self.request_id}.")
        self.seqs.append(seq)

    def remove(self, seq_id: int) -> None:
        self.seqs.remove(self.find(seq_id))

    def is_finished(self) -> bool:
        if len(self.seqs) == 1:  # the common case, once per token: no generator
            return self.seqs[0].status > SequenceStatus.SWAPPED
        return all(seq.is_finished() for seq in self.seqs)

    def is_prefill(self) -> bool:
        # Unfinished sequences of a group move in lockstep (they share the prompt and are
        # preempted together), so the first unfinished one tells; a finished sibling doesn't.
        unfinished = self.get_unfinished_seqs()
        return (unfinished[0] if unfinished else self.first_seq).is_prefill()

    def get_max_num_running_seqs(self) -> int:
        """How many sequences this group may run at once: in prefill, the `best_of` (or beam
        width) it forks into right after."""
        if self.sampling_params.use_beam_search or self.is_prefill():
            return self.sampling_params.best_of
        return len(self.get_unfinished_seqs())

    def get_num_uncomputed_tokens(self) -> int:
        return sum(seq.get_num_uncomputed_tokens() for seq in self.get_unfinished_seqs())

    def update_num_computed_tokens(self, num_new_computed_tokens: int) -> None:
        for seq in self.get_unfinished_seqs():
            seq.data.update_num_computed_tokens(num_new_computed_tokens)

    def set_status(self, status: SequenceStatus) -> None:
        for seq in self.get_unfinished_seqs():
            seq.status = status

    def __repr__(self) -> str:
        return (f"SequenceGroup(request_id={self.request_id!r}, priority={self.priority}, "
                f"num_seqs={len(self.seqs)})")


@dataclass
class SequenceGroupMetadata:
    """What the worker needs to run one scheduled group for one step."""

    request_id: str
    is_prompt: bool  # a prefill (or a chunk of one); False: a decode
    seq_data: dict[int, SequenceData]  # the running sequences only
    sampling_params: SamplingParams
    block_tables: dict[int, list[int]]  # seq_id -> physical block numbers
    token_chunk_size: int  # new tokens each sequence computes this step
    do_sample: bool = True  # False for a prefill chunk short of the prompt's end
    num_lookahead_slots: int = 0  # a multi-step run may take 1 + this many decode steps
    lora_request: LoRARequest | None = None

    @property
    def lora_int_id(self) -> int:
        return self.lora_request.lora_int_id if self.lora_request else 0


@dataclass
class SequenceOutput:
    """One sampled token, the sequence it extends (several may share one: the engine forks)."""

    parent_seq_id: int
    output_token: int
    logprobs: dict[int, float]
    rank: int | None = None  # of output_token (1 = most likely), when logprobs are asked


@dataclass
class SequenceGroupOutput:
    """The sampler's result for one group in one step."""

    samples: list[SequenceOutput]
    # With `prompt_logprobs`: per prompt token computed this step, its logprobs and rank.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_ranks: list[int | None] | None = None


@dataclass
class SamplerOutput:
    """One model step's samples: a `SequenceGroupOutput` per scheduled group, in batch order.
    A mode's extra data travels in a subclass in its own module (`MultiStepSamplerOutput`, ...)."""

    outputs: list[SequenceGroupOutput]

    def __getitem__(self, index: int) -> SequenceGroupOutput:
        return self.outputs[index]

    def __iter__(self) -> Iterator[SequenceGroupOutput]:
        return iter(self.outputs)

    def __len__(self) -> int:
        return len(self.outputs)


@dataclass
class ExecuteModelRequest:
    """What the engine asks the executor (and its workers) to do in one step.

    The block moves, lists of (src, dst) block numbers, apply before the forward pass.
    `finished_requests_ids`: requests ended since the last step (workers drop their state).
    """

    seq_group_metadata_list: list[SequenceGroupMetadata]
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # preempted by swap
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write
    finished_requests_ids: list[str] = field(default_factory=list)
    num_steps: int = 1  # > 1: a multi-step decode run (the worker may run one)
    kv_connector_metadata: object | None = None  # this step's KV connector loads and saves
