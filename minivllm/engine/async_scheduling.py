"""Async scheduling: the next multi-step run queued while the current one's last step computes.

vLLM's async scheduling, for multi-step runs. Once every output of a run but the last is
processed, `AsyncScheduler.schedule_ahead` plans the next run as if each sequence already had
the token the last step is sampling, and the worker queues it at once (a `ContinuedRunRequest`:
that token is taken on the device). The device then runs it right after the last step instead
of waiting for the host to process that step, schedule and prepare the next batch; the next
`step()` only processes it. The price: a request that stops on its last token of a run (EOS, a
stop string) computes one run past its end, thrown away. State between two steps: `RunAhead`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from minivllm.core.async_scheduler import AsyncScheduler
from minivllm.core.scheduler import ScheduledSequenceGroup, SchedulerOutputs
from minivllm.engine.metrics import Stats
from minivllm.engine.multi_step import MultiStepLLMEngine
from minivllm.executor.distributed_executor import WorkerDiedError
from minivllm.sequence import ExecuteModelRequest, SamplerOutput
from minivllm.worker.multi_step_worker import ContinuedRunRequest

logger = logging.getLogger(__name__)


@dataclass
class RunAhead:
    """A run scheduled during one step, to be processed by the next."""

    scheduler_outputs: SchedulerOutputs
    request: ExecuteModelRequest  # a ContinuedRunRequest when queued
    outputs: Iterable[SamplerOutput] | None  # the queued run's outputs; None: it runs the usual way
    # id() of its groups that ended (and were reported) before the step that processes it.
    ended: set[int] = field(default_factory=set)


class AsyncSchedulingLLMEngine(MultiStepLLMEngine):
    """`MultiStepLLMEngine` that schedules and queues the next run before the last output."""

    mode_scheduler = AsyncScheduler

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._scheduled_ahead: RunAhead | None = None  # scheduled for the next step
        self._running_ahead: RunAhead | None = None  # this step's run, when scheduled ahead

    def _schedule(self) -> tuple[SchedulerOutputs, ExecuteModelRequest | None]:
        self._running_ahead = self._take_scheduled_ahead()
        if self._running_ahead is None:
            return super()._schedule()
        return self._running_ahead.scheduler_outputs, self._running_ahead.request

    def _execute(self, request: ExecuteModelRequest) -> Iterable[SamplerOutput]:
        ahead = self._running_ahead
        queued = ahead is not None and ahead.request is request and ahead.outputs is not None
        outputs = ahead.outputs if queued else super()._execute(request)
        return self._scheduling_ahead_of_last_step(outputs, request)

    def _scheduling_ahead_of_last_step(self, outputs: Iterable[SamplerOutput],
                                       request: ExecuteModelRequest) -> Iterator[SamplerOutput]:
        """`outputs` in turn; once all but the last are processed, the next run is queued."""
        for sampler_output in outputs:
            yield sampler_output
            if getattr(sampler_output, "steps_left", 0) == 1:
                self._schedule_ahead(request)

    def _schedule_ahead(self, request: ExecuteModelRequest) -> None:
        """Schedule the next run and queue it on the device now (`AsyncScheduler.schedule_ahead`
        says when it can); the sequences running every step of `request` have a token in flight."""
        self.scheduler.free_finished_seq_groups()  # requests that stopped earlier in this run
        in_flight = {m.request_id for m in request.seq_group_metadata_list
                     if m.num_lookahead_slots == request.num_steps - 1}
        scheduled = self.scheduler.schedule_ahead(in_flight)
        if scheduled is None:
            return
        metadata, scheduler_outputs = scheduled
        plain = self._execute_model_request(metadata, scheduler_outputs)
        continued = ContinuedRunRequest(**{f.name: getattr(plain, f.name) for f in dataclasses.fields(plain)})
        try:
            outputs = self.model_executor.execute_model(continued)
        except WorkerDiedError:
            raise
        except Exception as error:  # run it the usual way next step, from the host's tokens
            if self.engine_config.parallel_config.world_size > 1:
                # The other ranks may have queued it already: their collectives would pair
                # with the retry's. Nothing safe is left to do.
                raise WorkerDiedError(f"queueing the run scheduled ahead failed on the driver ({error!r}); "
                                      "the other ranks may have queued it: the engine cannot continue.") from error
            logger.warning("could not queue the run scheduled ahead (%r); it runs after this one", error)
            self._scheduled_ahead = RunAhead(scheduler_outputs, plain, None)
            return
        self._scheduled_ahead = RunAhead(scheduler_outputs, continued, outputs)

    def _take_scheduled_ahead(self) -> RunAhead | None:
        """The run scheduled ahead, or None. A run none of whose requests is still unfinished
        is drained and dropped."""
        ahead, self._scheduled_ahead = self._scheduled_ahead, None
        if ahead is None:
            return None
        scheduled = ahead.scheduler_outputs.scheduled_seq_groups
        if all(s.seq_group.is_finished() for s in scheduled):
            if ahead.outputs is None:  # never reached the worker: its finished ids still must
                self._finished_requests_ids.extend(ahead.request.finished_requests_ids)
            for _ in ahead.outputs or ():  # its device work, computed past every request's end
                pass
            return None
        # A request of the run may have ended since (its last token, an abort): it was
        # reported then, and its rows in this run are computed past its end.
        ahead.ended = {id(s.seq_group) for s in scheduled if s.seq_group.is_finished()}
        return ahead

    def _report(self, scheduler_outputs: SchedulerOutputs, now: float, stats: Stats):
        ahead = self._running_ahead
        if ahead is not None and ahead.ended:
            scheduler_outputs = dataclasses.replace(scheduler_outputs, scheduled_seq_groups=[
                s for s in scheduler_outputs.scheduled_seq_groups if id(s.seq_group) not in ahead.ended])
        return super()._report(scheduler_outputs, now, stats)

    def _recover_from_failed_run(self, request: ExecuteModelRequest, scheduled_groups: list[ScheduledSequenceGroup],
                                 stats: Stats, error: Exception, num_processed: int) -> None:
        self._drop_run_continuing_lost_tokens()
        super()._recover_from_failed_run(request, scheduled_groups, stats, error, num_processed)

    def _drop_run_continuing_lost_tokens(self) -> None:
        """A run that failed after the next was queued may not have appended the tokens that
        run continues from: drop it (its device work is thrown away; the next schedule starts
        again from the host's tokens, whose K/V the failed run wrote)."""
        ahead = self._scheduled_ahead
        if ahead is None or ahead.outputs is None:
            return  # nothing queued, or a plain request: it runs from the host's tokens
        self._scheduled_ahead = None
        with contextlib.suppress(Exception):  # its own failure changes nothing: it is dropped anyway
            for _ in ahead.outputs:
                pass
