"""Several decode steps per schedule, fed back on the device: `MultiStepModelRunner`.

Mirrors `vllm/worker/multi_step_model_runner.py` (vLLM v0's multi-step scheduling). It wraps
a plain `ModelRunner` (eager or CUDA-graph) and runs a decode batch's forward pass several
times back to back. Between two steps nothing goes back to the host: `advance_step` turns
each row's sampled token into the next step's input on the device (position + 1, sequence
length + 1, the slot from the block table the scheduler already grew by its lookahead
slots). So every step of the run is queued on the GPU at once; each step's tokens are
copied to the host as soon as they exist and handed to the engine in turn, so the engine's
output processing overlaps the GPU, and the scheduling and batch building around the GPU
are paid once per run.

Why all at once: handing step s over only once step s + 1 was queued (the first design)
kept the GPU at most one step ahead of the host. At 256 sequences the host's processing of
one step (appending 256 tokens, detokenizing, stop checks: ~3-5 ms) is close to the GPU's
step (~8 ms on an H100), so any host hiccup left the GPU idle (`docs/benchmarks.md`).

With tensor parallelism every rank runs the same steps on its share of each layer; TP rank 0
gathers the logits and samples, and broadcasts the tokens (on the device) that every rank
feeds into its next step. Rank 0's sampling sits between collectives: should it raise, the
other ranks wait in the next collective until its timeout (`COLLECTIVE_TIMEOUT`), where a
single-step TP engine would have finished the step; the sampler's inputs are validated before
they get here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import torch

from minivllm.attention import AttentionMetadata
from minivllm.attention.metadata import slot_of, to_device
from minivllm.distributed import get_tp_group, tensor_model_parallel_broadcast
from minivllm.model_executor.layers.device_sampler import DeviceSample
from minivllm.model_executor.sampling_metadata import SamplingTensors, SequenceGroupToSample
from minivllm.sequence import SamplerOutput, SequenceGroupMetadata, SequenceGroupOutput
from minivllm.worker.model_runner import ModelRunner

# A row out of reserved slots writes its K/V nowhere.
_NO_SLOT = -1


class MultiStepModelRunner:
    """Runs up to `num_steps` decode steps of one batch with no host sync between them."""

    def __init__(self, base: ModelRunner) -> None:
        self.base = base
        self.sampler = base.sampler.device_sampler

    def can_run(self, seq_group_metadata_list: list[SequenceGroupMetadata]) -> bool:
        """Decodes only, each one sequence the device sampler can serve (seeds, penalties,
        min_tokens and logprobs included: all of it stays on the device)."""
        return bool(seq_group_metadata_list) and all(
            not m.is_prompt and self.sampler.can_sample(m.sampling_params, list(m.seq_data.values()))
            for m in seq_group_metadata_list
        )

    @torch.inference_mode()
    def execute_model(self, seq_group_metadata_list: list[SequenceGroupMetadata], kv_caches: list[torch.Tensor],
                      num_steps: int, finished_requests_ids: list[str] | None = None) -> Iterator[SamplerOutput]:
        """Queue every step on the device, then yield one `SamplerOutput` per step as its
        tokens reach the host.

        Group i runs `1 + num_lookahead_slots` steps (the slots its blocks hold); in later
        steps its row keeps computing but writes no K/V, and its output has no samples.
        Should queueing step s raise, steps before it are still handed over, then the error.
        Requires `can_run`.
        """
        base = self.base
        base.release_requests(finished_requests_ids or [])
        model_input = base.prepare_model_input(seq_group_metadata_list)
        steps_allowed = [1 + m.num_lookahead_slots for m in seq_group_metadata_list]
        limits = to_device(torch.tensor(steps_allowed), base.device)
        input_ids, positions, md = model_input.input_ids, model_input.positions, model_input.attn_metadata
        groups = model_input.sampling_metadata.seq_groups
        if not get_tp_group().is_first_rank:  # tensor parallelism: TP rank 0 samples
            yield from self._follow_rank0(input_ids, positions, md, kv_caches, num_steps, limits)
            return
        tensors = self.sampler.prepare(groups, base.model_config.hf_config.vocab_size, base.device)
        queued, error = [], None  # each step's samples on their way to the host
        try:
            for step in range(num_steps):
                pending, (input_ids, positions, md) = self._queue_step(step, input_ids, positions, md, kv_caches,
                                                                       tensors, limits, num_steps)
                queued.append(pending)
        except Exception as exc:  # the steps queued before it still count
            error = exc
        for step, pending in enumerate(queued):
            yield _step_output(pending, step, groups, tensors, steps_allowed)
        if error is not None:
            raise error

    def _queue_step(self, step: int, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata,
                    kv_caches: list[torch.Tensor], tensors: SamplingTensors, limits: torch.Tensor, num_steps: int):
        """Queue one forward pass and its sampling on the device; returns ((host copies, their
        event), (the next step's input ids, positions, metadata)). input_ids, positions:
        `[num_seqs]` (the previous step's tokens and positions after step 0)."""
        if step:
            input_ids, positions, md = self.advance_step(input_ids, positions, md, limits > step)
        hidden_states = self.base.run_model(input_ids, positions, md, kv_caches)
        # A decode samples every row; the sampler upcasts what it needs to fp32.
        logits = self.base.model.compute_logits(hidden_states, upcast=False)
        drawn = self.sampler(logits, tensors, step)
        self.sampler.record(tensors, drawn.tokens)  # for the next step's penalties
        if step + 1 < num_steps:  # (every TP rank feeds rank 0's tokens into the next step)
            tensor_model_parallel_broadcast(drawn.tokens)
        # The sampled tokens stay on the device: the next step's input ids.
        return _copy_to_host(drawn), (drawn.tokens, positions, md)

    def _follow_rank0(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata,
                      kv_caches: list[torch.Tensor], num_steps: int, limits: torch.Tensor) -> Iterator[SamplerOutput]:
        """A TP rank other than 0: the same forward passes, its share of every layer; the next
        input ids are the tokens rank 0 sampled, received on the device (no host between)."""
        for step in range(num_steps):
            if step:
                input_ids, positions, md = self.advance_step(input_ids, positions, md, limits > step)
            # The logits gather is a collective: every rank joins it, only rank 0 gets logits.
            self.base.model.compute_logits(self.base.run_model(input_ids, positions, md, kv_caches))
            if step + 1 < num_steps:
                input_ids = tensor_model_parallel_broadcast(torch.empty_like(input_ids))
            yield SamplerOutput([])

    def advance_step(self, sampled: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata,
                     active: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """The next decode step's inputs, computed on the device (vLLM's `advance_step`).

        sampled, positions, active: `[num_seqs]`. An active row feeds its sampled token at
        the next position and writes its K/V to that position's slot. A row out of reserved
        slots stays where it is and writes nothing (its later tokens are dropped).
        """
        block_size = self.base.block_size
        moved = active.long()
        positions = positions + moved
        seq_lens = md.seq_lens + moved.to(md.seq_lens.dtype)
        rows = torch.arange(positions.shape[0], device=positions.device)
        slots = slot_of(md.block_tables[rows, positions // block_size].long(), positions, block_size)
        slot_mapping = torch.where(active, slots, _NO_SLOT)
        md = dataclasses.replace(md, slot_mapping=slot_mapping, seq_lens=seq_lens, max_seq_len=md.max_seq_len + 1)
        return sampled, positions, md


def _step_output(pending, step: int, groups: list[SequenceGroupToSample], tensors: SamplingTensors,
                 steps_allowed: list[int]) -> SamplerOutput:
    """One output per group: its sampled token, or none past its reserved slots."""
    drawn, ready = pending
    if ready is not None:
        ready.synchronize()  # this step's copy only, not the steps queued after it
    samples = drawn.sequence_outputs(groups, tensors)  # one per group: each has one sequence
    return SamplerOutput([SequenceGroupOutput(samples=group_samples if step < allowed else [])
                          for group_samples, allowed in zip(samples, steps_allowed)])


def _copy_to_host(drawn: DeviceSample):
    """(host copies, event): copies started without waiting; wait on the event to read them."""
    if drawn.tokens.device.type != "cuda":
        return drawn, None
    host = drawn.to_host(non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return host, ready
