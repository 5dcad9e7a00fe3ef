"""Per-request failure isolation: a step that raises ends only the request it belongs to.

Validation at `add_request` makes this rare; when it happens the engine stays usable:

    the model raised before any sample came back   the batch is as it was before the step (no
        token appended, no computed count advanced; K/V the run wrote is written again), so
        each group runs again alone (`_execute_alone`); only a group that fails alone ends
    a later model step of a run raised             what came back stands; the next step goes
                                                   on from there
    one group's output processing raised           that group ends (`_fail_requests`)

A failed request finishes with finish_reason "abort", a `finish_message`, its blocks back in the
pool and its traceback in the log. `WorkerDiedError` is the engine's failure, never isolated.
No vLLM counterpart: vLLM v0 lets the step's exception end the engine.
"""

from __future__ import annotations

import dataclasses
import logging

from minivllm.core.scheduler import ScheduledSequenceGroup
from minivllm.engine.metrics import Stats
from minivllm.sequence import ExecuteModelRequest, SequenceGroup, SequenceGroupMetadata

logger = logging.getLogger(__name__)


class FailureIsolationMixin:
    """`LLMEngine`'s recovery from a run that raised (it calls `_recover_from_failed_run`)."""

    def _recover_from_failed_run(self, request: ExecuteModelRequest, scheduled_groups: list[ScheduledSequenceGroup],
                                 stats: Stats, error: Exception, num_processed: int) -> None:
        """`error` ended the run of `request` after `num_processed` of its model steps were applied."""
        if num_processed:
            logger.warning("step %d failed after %d model steps; the rest runs next step: %r",
                           self.step_counter, num_processed, error)
        elif len(scheduled_groups) == 1:
            self._fail_requests([scheduled_groups[0].seq_group], error)
        else:
            logger.warning("step %d failed for a batch of %d requests (%r); running each alone to find the cause",
                           self.step_counter, len(scheduled_groups), error)
            for scheduled, metadata in zip(scheduled_groups, request.seq_group_metadata_list):
                self._execute_alone(scheduled, metadata, stats, request.kv_connector_metadata)

    def _execute_alone(self, scheduled: ScheduledSequenceGroup, metadata: SequenceGroupMetadata, stats: Stats,
                       kv_connector_metadata=None) -> None:
        # No block moves: the failed run applied them before the model ran (they are the
        # scheduler's own, not a request's), and a swap-out repeated now could read a block
        # that a prefill has since written.
        # The group's own KV connector loads and saves go with it (loading twice is harmless).
        if kv_connector_metadata is not None:
            kv_connector_metadata = dataclasses.replace(kv_connector_metadata, requests=[
                r for r in kv_connector_metadata.requests if r.request_id == metadata.request_id])
        request = ExecuteModelRequest(seq_group_metadata_list=[metadata], num_steps=1 + metadata.num_lookahead_slots,
                                      kv_connector_metadata=kv_connector_metadata)
        self._execute_and_process(request, [scheduled], stats)

    def _fail_requests(self, seq_groups: list[SequenceGroup], error: Exception) -> None:
        """End requests that failed inside a step; they are reported at the end of this step
        like any request that finished in it."""
        for seq_group in seq_groups:
            logger.error("request %s failed inside engine step %d; finishing it", seq_group.request_id,
                         self.step_counter, exc_info=error)
            seq_group.finish_message = "failed inside an engine step; the details are in the engine's log."
            # The failed step may have left its blocks' K/V unwritten: no later request may reuse them.
            self.scheduler.block_manager.forget_computed_blocks(seq_group)
        self.abort_request([g.request_id for g in seq_groups])
