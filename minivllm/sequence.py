"""Requests as the scheduler sees them: `Sequence`, `SequenceGroup` and their status.

Mirrors `vllm/sequence.py` (v0). One request is a `SequenceGroup`; it holds `n` (or
`best_of`, or the beam width) `Sequence`s that share the prompt. Everything here is plain
Python with no torch, so the scheduler and block manager run in a notebook with no model.

Token accounting, the one idea to keep in mind:
    tokens = prompt_token_ids + output_token_ids
    num_computed_tokens = how many leading tokens already have their K/V in the paged cache.
A prefill computes a chunk of the uncomputed tokens; a decode computes exactly the last one.
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


# An ignored request (a prompt longer than max_model_len, n above max_num_seqs, a swapped-out
# request that can never fit back) reports "abort" with the group's `finish_message`. vLLM v0
# says "length" there; but the request did not reach a length, it was never run to its end,
# and "length" would hide that behind a normal ending.
_FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH_CAPPED: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
    SequenceStatus.FINISHED_IGNORED: "abort",
}


@dataclass
class Logprob:
    """The log-probability of one token at one position (vLLM's `Logprob`, in vLLM's place).

    Attributes:
        logprob: natural-log probability under the distribution the token was sampled from.
        rank: 1 for the most likely token, 2 for the next, ... (None when unknown).
        decoded_token: the token's text, when the request detokenizes.

    `RequestOutput`s carry them; `Sequence.append_token_id` accepts `{token_id: Logprob}`.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


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
            raise ValueError(
                f"cannot mark {num_new_computed_tokens} more tokens computed: "
                f"{self.num_computed_tokens} of {self.get_len()} already are."
            )
        self.num_computed_tokens += num_new_computed_tokens

    def reset_state_for_recompute(self) -> None:
        """Preemption by recompute drops the KV cache: every token must be computed again."""
        self.num_computed_tokens = 0

    @property
    def stage(self) -> SequenceStage:
        # While any token before the last one is uncomputed we are still prefilling.
        if self.get_num_uncomputed_tokens() > 1 or not self.output_token_ids:
            return SequenceStage.PREFILL
        return SequenceStage.DECODE


class Sequence:
    """One stream of tokens: a prompt and the tokens generated after it.

    Args:
        seq_id: unique id across the engine.
        prompt: the prompt text, if the request gave text.
        prompt_token_ids: the prompt's token ids (never empty).
        block_size: tokens per KV-cache block, for `n_blocks` only: the block manager counts
            with its own block size (as vLLM's v2 manager).
        eos_token_id: the model's end-of-sequence id, or None.
        lora_request: the adapter it runs with (None: the base model). Its id is part of the
            prefix-cache hash: the same tokens under two adapters have different KV.
    """

    def __init__(
        self,
        seq_id: int,
        prompt: str | None,
        prompt_token_ids: list[int],
        block_size: int,
        eos_token_id: int | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError("a sequence needs at least one prompt token.")
        self.seq_id = seq_id
        self.prompt = prompt
        self.block_size = block_size
        self.eos_token_id = eos_token_id
        self.lora_request = lora_request
        self.data = SequenceData(list(prompt_token_ids))
        self.output_text = ""
        # One dict per generated token: {token_id: logprob} (the sampled token and the top-N).
        self.output_logprobs: list[dict[int, float]] = []
        # Rank (1 = most likely) of each generated token, when logprobs are requested.
        self.output_ranks: list[int | None] = []
        self.status = SequenceStatus.WAITING
        self.stop_reason: int | str | None = None
        # Incremental detokenization state (see `minivllm.engine.detokenizer`): the window's
        # offsets, and a fast tokenizer's `DecodeStream` with the output tokens it has seen.
        self.prefix_offset = 0
        self.read_offset = 0
        self.decode_stream = None
        self.stream_fed = 0
        # What the request's outputs have returned so far (RequestOutputKind.DELTA).
        self.last_output_token_ids_offset = 0
        self.last_output_text_offset = 0

    @property
    def lora_int_id(self) -> int:
        return self.lora_request.lora_int_id if self.lora_request else 0

    # ------------------------------------------------------------ token view
    @property
    def prompt_token_ids(self) -> list[int]:
        return self.data.prompt_token_ids

    @property
    def output_token_ids(self) -> list[int]:
        return self.data.output_token_ids

    @property
    def n_blocks(self) -> int:
        """Blocks of this sequence's own `block_size` that hold its tokens (vLLM's property;
        `BlockSpaceManager` never reads it)."""
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

    # --------------------------------------------------------------- updates
    def append_token_id(
        self, token_id: int, logprobs: dict[int, float] | dict[int, Logprob], rank: int | None = None
    ) -> None:
        """Add a sampled token; `logprobs` maps token ids (the sampled one included) to logprobs.

        Takes vLLM's `{token_id: Logprob}` too (its rank is used when `rank` is None); it is
        stored as `{token_id: float}`, the form the rest of minivllm reads. Unlike vLLM, a
        dict without the sampled token is accepted (its logprob counts as 0.0): a stand-in
        model without probabilities can still append tokens.
        """
        sampled = logprobs.get(token_id)
        if isinstance(sampled, Logprob) and rank is None:
            rank = sampled.rank
        # (Per token: without logprobs asked, the sampler's dict is one float, which skips the scan.)
        if (len(logprobs) > 1 or not isinstance(sampled, float)) and any(
                isinstance(v, Logprob) for v in logprobs.values()):
            logprobs = {t: v.logprob if isinstance(v, Logprob) else v for t, v in logprobs.items()}
        self.output_logprobs.append(logprobs)
        self.output_ranks.append(rank)
        self.data.append_token_id(token_id, logprobs.get(token_id, 0.0))

    # ------------------------------------------------------------ outputs
    def get_output_token_ids_to_return(self, delta: bool) -> list[int]:
        """The output token ids a `RequestOutput` carries: all of them, or (delta) the ones no
        output has returned yet. Only the new tokens are copied: O(1) per step, not O(length)."""
        if not delta:
            return list(self.data.output_token_ids)
        start, self.last_output_token_ids_offset = self.last_output_token_ids_offset, self.get_output_len()
        return self.data.output_token_ids[start:]

    def get_output_text_to_return(self, buffer_length: int, delta: bool) -> str:
        """The output text to return: all of it, or (delta) the part not returned yet; while
        running, less its last `buffer_length` characters, which a stop string still being
        generated could cut off (so a stream never shows text that is later taken back)."""
        end = len(self.output_text) if self.is_finished() else max(len(self.output_text) - buffer_length, 0)
        if not delta:
            return self.output_text[:end]
        start = self.last_output_text_offset
        self.last_output_text_offset = max(start, end)
        return self.output_text[start:end]

    def get_beam_search_score(
        self, length_penalty: float = 1.0, seq_len: int | None = None, eos_token_id: int | None = None
    ) -> float:
        """Beam score as in vLLM and transformers: cumulative logprob / length ** length_penalty.

        The length counts prompt and output tokens, less a final EOS token.
        """
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
        child.data = SequenceData(
            list(self.data.prompt_token_ids),
            list(self.data.output_token_ids),
            self.data.cumulative_logprob,
            self.data.num_computed_tokens,
        )
        child.output_logprobs = list(self.output_logprobs)
        child.output_ranks = list(self.output_ranks)
        child.decode_stream = None  # a stream cannot be copied: the child rebuilds one from the offsets
        # A new completion: its first delta carries everything it has (the parent's tokens too).
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
    """One request: its sequences, its sampling parameters, arrival time and priority.

    Lower `priority` values are served first (vLLM's convention); ties go to earlier arrival.
    The arguments are vLLM 0.6.3's, in its order. `lora_request`: the adapter (None: the base
    model). `arrival_time=None` means now (vLLM requires it). vLLM's `embeddings`,
    `pooling_params`, `encoder_seq`, `trace_headers` and `prompt_adapter_request` (embedding
    and encoder-decoder models, tracing, prompt adapters) are not built: they must be None.
    """

    def __init__(
        self,
        request_id: str,
        seqs: list[Sequence],
        arrival_time: float | None = None,
        sampling_params: SamplingParams | None = None,
        lora_request: LoRARequest | None = None,
        embeddings: list[float] | None = None,
        pooling_params: object | None = None,
        encoder_seq: Sequence | None = None,
        trace_headers: dict[str, str] | None = None,
        prompt_adapter_request: object | None = None,
        priority: int = 0,
    ) -> None:
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
        # Why the request was ignored or aborted, for the user (None while it runs).
        self.finish_message: str | None = None
        # Prompt tokens whose KV was reused at first admission: prefix-cache hits plus tokens
        # loaded by a KV connector (vLLM's `num_cached_tokens`; None before admission).
        self.num_cached_tokens: int | None = None

    # --------------------------------------------------------------- queries
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
        """How many sequences this group may run at once (its future block demand).

        During prefill only one sequence exists but it will fork into `best_of` (or the beam
        width) right after, so the scheduler must budget for all of them.
        """
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
        return (
            f"SequenceGroup(request_id={self.request_id!r}, priority={self.priority}, "
            f"num_seqs={len(self.seqs)})"
        )


@dataclass
class SequenceGroupMetadata:
    """What the worker needs to run one scheduled group for one step.

    Attributes:
        request_id: the request.
        is_prompt: True for a prefill (or a chunk of one), False for a decode step.
        seq_data: seq_id -> its `SequenceData` (the running sequences only).
        sampling_params: the request's sampling parameters.
        block_tables: seq_id -> list of physical block numbers.
        token_chunk_size: how many new tokens each sequence computes this step.
        do_sample: False for a prefill chunk that does not reach the end of the prompt.
        num_lookahead_slots: slots reserved after the next token: a multi-step run may take
            `1 + num_lookahead_slots` decode steps for this group.
        lora_request: the adapter this group runs with, or None (the base model).
    """

    request_id: str
    is_prompt: bool
    seq_data: dict[int, SequenceData]
    sampling_params: SamplingParams
    block_tables: dict[int, list[int]]
    token_chunk_size: int
    do_sample: bool = True
    num_lookahead_slots: int = 0
    lora_request: LoRARequest | None = None

    @property
    def lora_int_id(self) -> int:
        return self.lora_request.lora_int_id if self.lora_request else 0


@dataclass
class SequenceOutput:
    """One sampled token for one sequence: which parent it extends, and its logprobs.

    With beam search or `n > 1` several outputs may share a parent; the engine then forks.
    """

    parent_seq_id: int
    output_token: int
    logprobs: dict[int, float]
    # Rank of `output_token` in its distribution (1 = most likely), when logprobs are requested.
    rank: int | None = None


@dataclass
class SequenceGroupOutput:
    """The sampler's result for one group in one step."""

    samples: list[SequenceOutput]
    # For a prefill with `prompt_logprobs`: one dict per prompt token computed this step.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # The rank of each of those prompt tokens in the model's distribution (1 = most likely).
    prompt_ranks: list[int | None] | None = None


@dataclass
class SamplerOutput:
    """One model step's samples for the whole batch: one `SequenceGroupOutput` per scheduled
    group, in the batch's order (vLLM 0.6's `sequence.py` keeps it here too; torch-free for the
    engine). A mode's extra data travels in a subclass from the mode's own module:
    `MultiStepSamplerOutput` (steps_left), `KVTransferSamplerOutput`, `SpecDecodeSamplerOutput`."""

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

    The block moves are applied before the forward pass: swap-in and swap-out from the
    scheduler's preemption decisions, copy for copy-on-write. Each is a list of (src, dst)
    block numbers. `finished_requests_ids` lets workers drop per-request state (the penalties' token
    statistics) of requests that finished or were aborted since the last step.
    `num_steps` > 1 asks for a multi-step run of a decode batch (see
    `SchedulerConfig.num_scheduler_steps`); the worker may run fewer (one) when the batch
    needs the host between steps. `kv_connector_metadata`: the KV connector's loads and saves
    for the step (`KVConnectorMetadata`), None without a connector. A run scheduled ahead (async
    scheduling) is the subclass `ContinuedRunRequest` (`minivllm/worker/multi_step_worker.py`).
    """

    seq_group_metadata_list: list[SequenceGroupMetadata]
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    finished_requests_ids: list[str] = field(default_factory=list)
    num_steps: int = 1
    kv_connector_metadata: object | None = None  # this step's KV connector loads and saves
