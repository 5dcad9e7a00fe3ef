"""What the engine does with each step's samples: append, fork, detokenize, stop, free.

Mirrors `vllm/engine/output_processor/single_step.py` and `stop_checker.py` (v0, 0.6). Each
`SequenceOutput` names the parent sequence it extends. A parent with several samples (the
prompt step of `best_of` > 1, a beam that won several candidates) keeps the last and forks a
child per other one: `Scheduler.fork_seq` shares the parent's blocks (copy-on-write). Beam
search keeps the best `beam_width` of them (`beam_search.py`); parallel sampling keeps all.
"""

from __future__ import annotations

from collections.abc import Iterator

from minivllm.core.scheduler import Scheduler
from minivllm.engine.beam_search import select_beams
from minivllm.engine.detokenizer import Detokenizer
from minivllm.sampling_params import SamplingParams
from minivllm.sequence import Sequence, SequenceGroup, SequenceOutput, SequenceStatus

# (sequence, the parent it came from); a parent that continues itself is its own parent.
ChildAndParent = tuple[Sequence, Sequence]


class StopChecker:
    """Finishes a sequence when a stop condition holds, in vLLM's order:

    min_tokens not reached -> never stop; EOS (unless `ignore_eos`); a `stop_token_ids` token
    (`stop_reason` = the id); a stop string in the new text (the text is cut there, or after it
    with `include_stop_str_in_output`; `stop_reason` = the string); `max_model_len` reached;
    `max_tokens` reached ("length").
    """

    def __init__(self, max_model_len: int, eos_token_id: int | None) -> None:
        self.max_model_len = max_model_len
        self.eos_token_id = eos_token_id

    def maybe_stop_sequence(self, seq: Sequence, new_char_count: int, params: SamplingParams) -> None:
        output_len = seq.get_output_len()
        if output_len < params.min_tokens:
            return
        last_token = seq.get_last_token_id()
        if not params.ignore_eos and last_token == self.eos_token_id:
            seq.status = SequenceStatus.FINISHED_STOPPED
            return
        if last_token in params.stop_token_ids:
            seq.status = SequenceStatus.FINISHED_STOPPED
            seq.stop_reason = last_token
            return
        stop_str = self._find_stop_string(seq, new_char_count, params) if params.stop else None
        if stop_str is not None:
            seq.status = SequenceStatus.FINISHED_STOPPED
            seq.stop_reason = stop_str
            return
        # >= : a sequence never holds more tokens than the model's context.
        if output_len >= params.max_tokens or seq.get_len() >= self.max_model_len:
            seq.status = SequenceStatus.FINISHED_LENGTH_CAPPED

    @staticmethod
    def _find_stop_string(seq: Sequence, new_char_count: int, params: SamplingParams) -> str | None:
        """A stop string ending in the new text, or None; truncates `seq.output_text` there."""
        if not new_char_count:
            return None
        for stop_str in params.stop:
            # Only a match that overlaps the new characters can be new.
            start = max(len(seq.output_text) - new_char_count - len(stop_str) + 1, 0)
            index = seq.output_text.find(stop_str, start)
            if index == -1:
                continue
            end = index + len(stop_str) if params.include_stop_str_in_output else index
            seq.output_text = seq.output_text[:end]
            return stop_str
        return None


class SequenceGroupOutputProcessor:
    """Applies one request's samples to its sequences. The scheduler forks and frees their
    blocks (`fork_seq`, `free_seq`); `seq_counter` (the engine's) numbers new sequences."""

    def __init__(self, scheduler: Scheduler, detokenizer: Detokenizer, stop_checker: StopChecker,
                 seq_counter: Iterator[int]) -> None:
        self.scheduler = scheduler
        self.detokenizer = detokenizer
        self.stop_checker = stop_checker
        self.seq_counter = seq_counter

    def process_outputs(self, seq_group: SequenceGroup, samples: list[SequenceOutput]) -> None:
        params = seq_group.sampling_params
        if len(samples) == 1 and len(seq_group.seqs) == 1 and not params.use_beam_search:
            self._continue_lone_sequence(seq_group.seqs[0], samples[0], params)
            return
        existing_finished = seq_group.get_finished_seqs()
        child_seqs = self._append_and_fork(seq_group, samples)
        for seq, _ in child_seqs:
            new_char_count = self.detokenizer.decode_sequence_inplace(seq, params) if params.detokenize else 0
            self.stop_checker.maybe_stop_sequence(seq, new_char_count, params)
        if params.use_beam_search:
            selected, unselected = select_beams(
                seq_group, child_seqs, existing_finished, self.stop_checker)
        else:
            selected, unselected = child_seqs, []
        self._apply_selection(seq_group, selected, unselected)

    def _continue_lone_sequence(self, seq: Sequence, sample: SequenceOutput, params: SamplingParams) -> None:
        """n = 1: the general path for one sequence and one sample, without the fork and
        selection bookkeeping that would cost more than the rest, once per token."""
        if sample.parent_seq_id != seq.seq_id or seq.status != SequenceStatus.RUNNING:
            raise ValueError(f"sample for sequence {sample.parent_seq_id}, but sequence {seq.seq_id} "
                             f"is the request's running one (status {seq.status.name}).")
        seq.append_token_id(sample.output_token, sample.logprobs, sample.rank)
        new_char_count = self.detokenizer.decode_sequence_inplace(seq, params) if params.detokenize else 0
        self.stop_checker.maybe_stop_sequence(seq, new_char_count, params)
        if seq.is_finished():
            self.scheduler.free_seq(seq)

    def _append_and_fork(self, seq_group: SequenceGroup, samples: list[SequenceOutput]) -> list[ChildAndParent]:
        """Give every running parent its samples: the last one in place, the others to forks."""
        child_seqs: list[ChildAndParent] = []
        for parent in seq_group.get_seqs(status=SequenceStatus.RUNNING):
            child_samples = [s for s in samples if s.parent_seq_id == parent.seq_id]
            if not child_samples:
                # Beam search gave this beam no candidate: it has no future, free it now.
                parent.status = SequenceStatus.FINISHED_ABORTED
                seq_group.remove(parent.seq_id)
                self.scheduler.free_seq(parent)
                continue
            for sample in child_samples[:-1]:
                child = parent.fork(next(self.seq_counter))
                child.append_token_id(sample.output_token, sample.logprobs, sample.rank)
                child_seqs.append((child, parent))
            last = child_samples[-1]
            parent.append_token_id(last.output_token, last.logprobs, last.rank)
            child_seqs.append((parent, parent))
        return child_seqs

    def _apply_selection(self, seq_group: SequenceGroup, selected: list[ChildAndParent],
                         unselected: list[ChildAndParent]) -> None:
        # Fork the new children first, then free finished parents: a child must take its
        # references to the parent's blocks before the parent lets go of them.
        for seq, parent in selected:
            if seq is not parent:
                seq_group.add(seq)
                if not seq.is_finished():
                    self.scheduler.fork_seq(parent, seq)
        for seq, parent in selected:
            if seq is parent and seq.is_finished():
                self.scheduler.free_seq(seq)
        for seq, parent in unselected:
            if seq is parent:
                seq_group.remove(seq.seq_id)
                self.scheduler.free_seq(seq)
