"""Beam search's selection after each step: which of a request's beams live on.

Mirrors the beam branch of `vllm/engine/output_processor/single_step.py` (v0, 0.6). The
sampler proposed 2 x beam_width (parent, token) candidates (`parallel_sampling.py`), the output
processor appended and forked them; `select_beams` keeps the best `beam_width` finished beams
(new ones compete with those of earlier steps) and the best `beam_width` running ones, scored
by `Sequence.get_beam_search_score`, until `_beam_search_done`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from minivllm.sampling_params import SamplingParams
from minivllm.sequence import Sequence, SequenceGroup

if TYPE_CHECKING:
    from minivllm.engine.output_processor import ChildAndParent, StopChecker


def select_beams(seq_group: SequenceGroup, child_seqs: list[ChildAndParent], existing_finished: list[Sequence],
                 stop_checker: StopChecker) -> tuple[list[ChildAndParent], list[ChildAndParent]]:
    """(selected, unselected) lists of (seq, parent); old finished beams pushed out of the top
    `beam_width` leave the group here."""
    params = seq_group.sampling_params
    beam_width = params.best_of
    eos_token_id = stop_checker.eos_token_id
    selected: list[ChildAndParent] = []
    unselected: list[ChildAndParent] = []
    # (seq, parent, is_new) for all finished beams, best first.
    finished = [(s, None, False) for s in existing_finished]
    finished += [(s, p, True) for s, p in child_seqs if s.is_finished()]
    finished.sort(key=lambda x: _score(x[0], params, eos_token_id), reverse=True)
    for seq, parent, is_new in finished[:beam_width]:
        if is_new:
            selected.append((seq, parent))
    for seq, parent, is_new in finished[beam_width:]:
        if is_new:
            unselected.append((seq, parent))
        else:
            seq_group.remove(seq.seq_id)
    running = sorted(((s, p) for s, p in child_seqs if not s.is_finished()),
                     key=lambda x: _score(x[0], params, eos_token_id), reverse=True)
    if not running:
        done = True
    elif len(finished) < beam_width:
        done = False
    else:
        done = _beam_search_done(params, running[0][0], finished[beam_width - 1][0], stop_checker)
    if done:
        unselected += running
    else:
        selected += running[:beam_width]
        unselected += running[beam_width:]
    return selected, unselected


def _score(seq: Sequence, params: SamplingParams, eos_token_id: int | None, seq_len: int | None = None) -> float:
    return seq.get_beam_search_score(params.length_penalty, seq_len, eos_token_id)


def _beam_search_done(params: SamplingParams, best_running: Sequence, worst_finished: Sequence,
                      stop_checker: StopChecker) -> bool:
    """`early_stopping` as in transformers: True stops once beam_width beams finished;
    False stops when the best running beam, scored now, cannot beat the worst kept finished
    one; "never" scores the best running beam at the longest length it could still reach."""
    if params.early_stopping is True:
        return True
    best_len = None
    if params.early_stopping == "never" and params.length_penalty > 0.0:
        best_len = max(best_running.get_prompt_len() + params.max_tokens, stop_checker.max_model_len)
    eos_token_id = stop_checker.eos_token_id
    return _score(worst_finished, params, eos_token_id) >= _score(best_running, params, eos_token_id, best_len)
