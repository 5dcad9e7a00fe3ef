"""Several decode steps per schedule, fed back on the device: `MultiStepModelRunner`.

Mirrors `vllm/worker/multi_step_model_runner.py` (vLLM v0's multi-step scheduling). It wraps
a plain `ModelRunner` (eager or CUDA-graph) and runs a decode batch's forward pass several
times back to back, with no host sync between the steps:

    step 0      prepare_model_input -> forward -> sample (tokens stay on the device)
    step s > 0  advance_step: step s-1's tokens as input ids, positions + 1, seq_lens + 1,
                slots from the block tables (grown by the lookahead slots) -> forward -> sample
    hand over   each step's tokens are copied to the host as soon as they exist; the iterator
                yields one `MultiStepSamplerOutput` per step

Every step of the run is queued at once, so the engine processes step s while the device
computes the later ones, and scheduling and batch building are paid once per run. With tensor
parallelism TP rank 0 samples and broadcasts the tokens (on the device) that every rank feeds
into its next step; should its sampling raise, the other ranks wait in the next collective
until `COLLECTIVE_TIMEOUT` (the sampler's inputs are validated before they get here).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from minivllm.attention import AttentionMetadata
from minivllm.attention.metadata import slot_of, to_device
from minivllm.distributed import get_tp_group, tensor_model_parallel_broadcast
from minivllm.model_executor.custom_op import CustomOp
from minivllm.model_executor.layers.device_sampler import DeviceSample
from minivllm.model_executor.sampling_metadata import SamplingTensors, SequenceGroupToSample
from minivllm.sequence import SamplerOutput, SequenceGroupMetadata, SequenceGroupOutput
from minivllm.worker.model_runner import ModelRunner

# A row out of reserved slots writes its K/V nowhere.
_NO_SLOT = -1


class AdvanceStep(CustomOp):
    """(positions, seq_lens, block_tables, limits `[num_seqs]`, step, block_size) -> step `step`'s
    (positions, seq_lens, slot_mapping), on the device. A row with limits > step (its reserved
    slots allow the step) moves one token on and writes its K/V to that position's slot; another
    stays where it is and writes nowhere. On "triton" one kernel (`kernels/advance_step.py`,
    vLLM's `advance_step_flashattn`) does what takes a dozen small ones here."""

    def forward_native(self, positions: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                       limits: torch.Tensor, step: int, block_size: int):
        active = limits > step
        positions = positions + active
        seq_lens = seq_lens + active.to(seq_lens.dtype)
        rows = torch.arange(positions.shape[0], device=positions.device)
        slots = slot_of(block_tables[rows, positions // block_size].long(), positions, block_size)
        return positions, seq_lens, torch.where(active, slots, _NO_SLOT)

    def forward_triton(self, positions: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                       limits: torch.Tensor, step: int, block_size: int):
        from minivllm.kernels.advance_step import advance_step  # imports triton: only on this backend

        return advance_step(positions, seq_lens, block_tables, limits, step, block_size)


@dataclass
class MultiStepSamplerOutput(SamplerOutput):
    """One step of a multi-step run. steps_left: model steps of the same run still queued
    behind this one (the engine may schedule the next run while they compute)."""

    steps_left: int = 0


class MultiStepModelRunner:
    """Runs up to `num_steps` decode steps of one batch with no host sync between them."""

    def __init__(self, base: ModelRunner) -> None:
        self.base = base
        self.sampler = base.sampler.device_sampler
        self.advance = AdvanceStep(base.backend)
        # The last run's final tokens (on the device) and each sequence's row in them: what a
        # run that continues it starts from (async scheduling).
        self._last_run: tuple[torch.Tensor, dict[int, int]] | None = None

    def can_run(self, seq_group_metadata_list: list[SequenceGroupMetadata]) -> bool:
        """Decodes only, each one sequence the device sampler can serve (seeds, penalties,
        min_tokens and logprobs included: all of it stays on the device)."""
        return bool(seq_group_metadata_list) and all(
            not m.is_prompt and self.sampler.can_sample(m.sampling_params, list(m.seq_data.values()))
            for m in seq_group_metadata_list
        )

    @torch.inference_mode()
    def execute_model(self, seq_group_metadata_list: list[SequenceGroupMetadata], kv_caches: list[torch.Tensor],
                      num_steps: int, finished_requests_ids: list[str] | None = None,
                      continues_previous_run: bool = False) -> Iterator[SamplerOutput]:
        """Queue every step on the device now; return an iterator that yields one
        `SamplerOutput` per step as its tokens reach the host.

        Group i runs `1 + num_lookahead_slots` steps (the slots its blocks hold); in later
        steps its row keeps computing but writes no K/V, and its output has no samples.
        Should queueing step s raise, steps before it are still handed over, then the error.
        Requires `can_run`.

        continues_previous_run: the batch was scheduled before the host saw the previous
        run's last tokens (async scheduling). Each row's first input is then its sequence's
        token from that run's last step, still on the device, one position past what the
        host holds; the run goes on as if it were that run's next step (sampling offsets,
        min_tokens and penalty counts included), so its tokens are the ones a run scheduled
        after the host had caught up would sample.
        """
        base = self.base
        base.release_requests(finished_requests_ids or [])
        model_input = base.prepare_model_input(seq_group_metadata_list)
        steps_allowed = [1 + m.num_lookahead_slots for m in seq_group_metadata_list]
        limits = to_device(torch.tensor(steps_allowed), base.device)
        input_ids, positions, md = model_input.input_ids, model_input.positions, model_input.attn_metadata
        seq_ids = [next(iter(m.seq_data)) for m in seq_group_metadata_list]
        steps_before = 0  # steps of this batch's sequences already sampled on the device
        if continues_previous_run:
            input_ids, positions, md = self._continue_previous_run(seq_ids, positions, md, limits)
            steps_before = 1
        self._last_run = None  # until every step is queued
        if not get_tp_group().is_first_rank:  # tensor parallelism: TP rank 0 samples
            return iter(self._follow_rank0(input_ids, positions, md, kv_caches, num_steps, limits, seq_ids))
        groups = model_input.sampling_metadata.seq_groups
        tensors = self.sampler.prepare(groups, base.model_config.hf_config.vocab_size, base.device)
        if continues_previous_run:
            self.sampler.record(tensors, input_ids)  # the host has not counted these tokens yet
        queued, error = [], None  # each step's samples on their way to the host
        try:
            for step in range(num_steps):
                pending, (input_ids, positions, md) = self._queue_step(step, steps_before, input_ids, positions, md,
                                                                       kv_caches, tensors, limits)
                queued.append(pending)
            self._last_run = (input_ids, {seq_id: row for row, seq_id in enumerate(seq_ids)})
        except Exception as exc:  # the steps queued before it still count
            error = exc
        return _hand_over(queued, error, groups, tensors, steps_allowed)

    def _queue_step(self, step: int, steps_before: int, input_ids: torch.Tensor, positions: torch.Tensor,
                    md: AttentionMetadata, kv_caches: list[torch.Tensor], tensors: SamplingTensors,
                    limits: torch.Tensor):
        """Queue one forward pass and its sampling on the device; returns ((host copies, their
        event), (the next step's input ids, positions, metadata)). input_ids, positions:
        `[num_seqs]` (the previous step's tokens and positions after step 0)."""
        if step:
            input_ids, positions, md = self.advance_step(input_ids, positions, md, limits, step)
        hidden_states = self.base.run_model(input_ids, positions, md, kv_caches)
        # A decode samples every row; the sampler upcasts what it needs to fp32.
        logits = self.base.model.compute_logits(hidden_states, upcast=False)
        drawn = self.sampler(logits, tensors, steps_before + step)
        self.sampler.record(tensors, drawn.tokens)  # for the next step's penalties
        # Every TP rank feeds rank 0's tokens into the next step (or the next run's first).
        tensor_model_parallel_broadcast(drawn.tokens)
        # The sampled tokens stay on the device: the next step's input ids.
        return _copy_to_host(drawn), (drawn.tokens, positions, md)

    def _follow_rank0(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata,
                      kv_caches: list[torch.Tensor], num_steps: int, limits: torch.Tensor,
                      seq_ids: list[int]) -> list[SamplerOutput]:
        """A TP rank other than 0: the same forward passes, its share of every layer; the next
        input ids are the tokens rank 0 sampled, received on the device (no host between)."""
        for step in range(num_steps):
            if step:
                input_ids, positions, md = self.advance_step(input_ids, positions, md, limits, step)
            # The logits gather is a collective: every rank joins it, only rank 0 gets logits.
            self.base.model.compute_logits(self.base.run_model(input_ids, positions, md, kv_caches))
            input_ids = tensor_model_parallel_broadcast(torch.empty_like(input_ids))
        self._last_run = (input_ids, {seq_id: row for row, seq_id in enumerate(seq_ids)})
        return [SamplerOutput([]) for _ in range(num_steps)]

    def _continue_previous_run(self, seq_ids: list[int], positions: torch.Tensor, md: AttentionMetadata,
                               limits: torch.Tensor):
        """The inputs of a run that continues the previous one: each row's token from that
        run's last step (on the device), at the position after the host's last token."""
        if self._last_run is None:
            raise RuntimeError("continues_previous_run, but the previous multi-step run did not queue all its steps.")
        last_tokens, row_of = self._last_run
        missing = [seq_id for seq_id in seq_ids if seq_id not in row_of]
        if missing:
            raise RuntimeError(f"continues_previous_run, but sequences {missing[:5]} were not in the previous run.")
        rows = to_device(torch.tensor([row_of[seq_id] for seq_id in seq_ids]), positions.device)
        return self.advance_step(last_tokens[rows], positions, md, limits, 0)  # every limit >= 1: all move

    def advance_step(self, sampled: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata,
                     limits: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Step `step`'s inputs, computed on the device (vLLM's `advance_step`).

        sampled, positions, limits: `[num_seqs]`. A row with limits > step feeds its sampled
        token at the next position and writes its K/V to that position's slot. A row out of
        reserved slots stays where it is and writes nothing (its later tokens are dropped).
        """
        positions, seq_lens, slot_mapping = self.advance(positions, md.seq_lens, md.block_tables, limits, step,
                                                         self.base.block_size)
        md = dataclasses.replace(md, slot_mapping=slot_mapping, seq_lens=seq_lens, max_seq_len=md.max_seq_len + 1)
        return sampled, positions, md


def _hand_over(queued: list, error: Exception | None, groups: list[SequenceGroupToSample], tensors: SamplingTensors,
               steps_allowed: list[int]) -> Iterator[SamplerOutput]:
    """Each queued step's output once its tokens are on the host, then the queueing error."""
    for step, pending in enumerate(queued):
        yield _step_output(pending, step, groups, tensors, steps_allowed, steps_left=len(queued) - 1 - step)
    if error is not None:
        raise error


def _step_output(pending, step: int, groups: list[SequenceGroupToSample], tensors: SamplingTensors,
                 steps_allowed: list[int], steps_left: int) -> MultiStepSamplerOutput:
    """One output per group: its sampled token, or none past its reserved slots."""
    drawn, ready = pending
    if ready is not None:
        ready.synchronize()  # this step's copy only, not the steps queued after it
    samples = drawn.sequence_outputs(groups, tensors)  # one per group: each has one sequence
    return MultiStepSamplerOutput([SequenceGroupOutput(samples=group_samples if step < allowed else [])
                                   for group_samples, allowed in zip(samples, steps_allowed)], steps_left=steps_left)


def _copy_to_host(drawn: DeviceSample):
    """(host copies, event): copies started without waiting; wait on the event to read them."""
    if drawn.tokens.device.type != "cuda":
        return drawn, None
    host = drawn.to_host(non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return host, ready
