"""Lab 03's checks: one scheduler step of vLLM v0's default mode (`vllm/core/scheduler.py`:
`SchedulingBudget`, `_schedule_prefills`, `_schedule_running`, `_schedule_swapped`, `_preempt`).

    check_budget(LabBudget)                   scripted add / subtract / can_schedule calls,
                                              each answer against the package's `SchedulingBudget`
    check_scheduler_step(LabScheduler)        small workloads through the simulator (the real
                                              engine, a scripted model): every step's decision
                                              against the package's `Scheduler` on the same workload
    check_scheduler_in_engine(LabScheduler)   a real `LLM` with a small KV pool, preempting by
                                              recompute, then by swap: greedy output equal to
                                              transformers, preemptions counted, every block free

Expected values always come from the package's own classes run on the same input.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

from minivllm.config import CacheConfig, SchedulerConfig
from minivllm.core.scheduler import SchedulingBudget
from minivllm.entrypoints.llm import LLM
from minivllm.labs import LabCheckFailed, expect, expect_yours, passed
from minivllm.labs.parity import assert_greedy_matches_transformers
from minivllm.viz.device import engine_kwargs
from minivllm.viz.sim import DEFAULT_MAX_STEPS, SimRequest, Simulator, make_workload

# ------------------------------------------------------------------------------------ budget

# (title, (token_budget, max_num_seqs), calls). A call: (method, *args); "can" is
# can_schedule(num_new_tokens=, num_new_seqs=), "remaining" is remaining_token_budget().
BUDGET_CASES = (
    ("a request that exactly fills the token budget fits", (64, 4),
     [("can", 64, 1), ("add_num_batched_tokens", "a", 60), ("can", 4, 1), ("can", 5, 1), ("remaining",)]),
    ("max_num_seqs binds like the token budget", (64, 3),
     [("add_num_seqs", "a", 2), ("can", 1, 1), ("can", 1, 2), ("add_num_seqs", "b", 1), ("can", 0, 1)]),
    ("a request's tokens count once, however often it is added", (64, 4),
     [("add_num_batched_tokens", "a", 30), ("add_num_batched_tokens", "a", 30), ("can", 34, 0), ("remaining",)]),
    ("a request's sequences count once (running groups are counted at the start of the step "
     "and again when scheduled)", (64, 4),
     [("add_num_seqs", "a", 2), ("add_num_seqs", "a", 2), ("add_num_seqs", "b", 1), ("can", 1, 1), ("can", 1, 2)]),
    ("a preempted request's sequences leave the budget", (64, 3),
     [("add_num_seqs", "a", 2), ("add_num_seqs", "b", 1), ("can", 1, 1), ("subtract_num_seqs", "a", 2),
      ("can", 1, 2), ("add_num_seqs", "a", 2), ("can", 1, 1)]),
    ("subtracting a request that was never counted changes nothing", (64, 4),
     [("add_num_seqs", "a", 1), ("subtract_num_seqs", "b", 2), ("can", 1, 3), ("can", 1, 4)]),
)


def check_budget(budget_cls: type) -> None:
    """Run every `BUDGET_CASES` script on `budget_cls` and on `SchedulingBudget`; LabCheckFailed
    at the first call whose answer or counters differ."""
    for title, (token_budget, max_num_seqs), calls in BUDGET_CASES:
        ours, theirs = budget_cls(token_budget, max_num_seqs), SchedulingBudget(token_budget, max_num_seqs)
        done = []
        for call in calls:
            done.append(_describe_call(call))
            got, expected = _apply(ours, call), _apply(theirs, call)
            where = (f"budget case {title!r} (token_budget={token_budget}, max_num_seqs={max_num_seqs}), "
                     f"after {'; '.join(done)}")
            expect(got == expected, f"{where}: returned {got!r}, expected {expected!r}")
            for name in ("num_batched_tokens", "num_curr_seqs"):
                expect(getattr(ours, name) == getattr(theirs, name),
                       f"{where}: {name} is {getattr(ours, name)}, expected {getattr(theirs, name)}")
    passed(f"{len(BUDGET_CASES)} budget cases agree with SchedulingBudget")


def _apply(budget, call):
    name, *args = call
    if name == "can":
        return budget.can_schedule(num_new_tokens=args[0], num_new_seqs=args[1])
    if name == "remaining":
        return budget.remaining_token_budget()
    return getattr(budget, name)(*args)


def _describe_call(call) -> str:
    name, *args = call
    if name == "can":
        return f"can_schedule(num_new_tokens={args[0]}, num_new_seqs={args[1]})"
    if name == "remaining":
        return "remaining_token_budget()"
    return f"{name}({', '.join(map(repr, args))})"


# ------------------------------------------------------------------------- scheduler steps


@dataclass(frozen=True)
class StepCase:
    """A workload for the simulator and the configuration it runs under."""

    title: str
    scheduler: dict  # SchedulerConfig keyword arguments
    cache: dict  # CacheConfig keyword arguments
    requests: tuple[SimRequest, ...]

    def simulator(self, scheduler_cls: type | None = None, max_steps: int = DEFAULT_MAX_STEPS) -> Simulator:
        """A simulator for this case with `scheduler_cls` (None: the package's `Scheduler`)."""
        extra = {} if scheduler_cls is None else {"scheduler_cls": scheduler_cls}
        sim = Simulator(SchedulerConfig(**self.scheduler, **extra), CacheConfig(**self.cache), max_steps=max_steps)
        if scheduler_cls is not None:
            expect_yours(sim.scheduler, scheduler_cls, "the engine's scheduler")
        return sim

    def run(self, scheduler_cls: type | None = None, max_steps: int | None = None) -> Simulator:
        """Run the workload; the simulator holds the snapshots and results. A run still going
        after `max_steps` (default: the package's steps + EXTRA_STEPS for a learner's class)
        raises RuntimeError."""
        if max_steps is None:
            max_steps = DEFAULT_MAX_STEPS if scheduler_cls is None else len(self.run().snapshots) + EXTRA_STEPS
        sim = self.simulator(scheduler_cls, max_steps)
        with _quiet_engine():
            sim.run(list(self.requests))
        return sim


@contextlib.contextmanager
def _quiet_engine():
    """Hide the engine's warning for each request it finishes unrun: the cases expect them."""
    engine_logger = logging.getLogger("minivllm.engine.llm_engine")
    level = engine_logger.level
    engine_logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        engine_logger.setLevel(level)


def _prompt(length: int, start: int = 1) -> list[int]:
    return list(range(start, start + length))


def _req(request_id: str, prompt_len: int, output_lens: list[int], arrival_step: int = 0) -> SimRequest:
    return SimRequest(request_id, _prompt(prompt_len), output_lens, arrival_step=arrival_step)


_SMALL = {"max_num_seqs": 4, "max_num_batched_tokens": 64, "max_model_len": 64}

STEP_CASES = (
    StepCase("max_num_seqs caps a prefill step", {**_SMALL, "max_num_seqs": 3},
             {"block_size": 4, "num_gpu_blocks": 32},
             tuple(_req(name, 8, [4]) for name in "ABCDE")),
    StepCase("the token budget caps a prefill step (three 30-token prompts, 64 tokens)", _SMALL,
             {"block_size": 4, "num_gpu_blocks": 32},
             tuple(_req(name, 30, [2]) for name in "XYZ")),
    StepCase("a prompt that must wait for blocks (LATER) blocks every prompt behind it", _SMALL,
             {"block_size": 4, "num_gpu_blocks": 8},
             (_req("big", 20, [8]), _req("later", 16, [2], 1), _req("small", 4, [2], 1))),
    StepCase("prompts that can never run are finished as ignored, the rest admitted",
             {**_SMALL, "max_num_seqs": 2}, {"block_size": 4, "num_gpu_blocks": 8},
             (_req("fits", 8, [3]), _req("too-many-blocks", 40, [2]),
              SimRequest("n=3", _prompt(4), [2, 2, 2]), _req("also-fits", 4, [2]))),
    StepCase("decode steps preempt the newest running group (recompute)",
             {**_SMALL, "preemption_mode": "recompute"}, {"block_size": 4, "num_gpu_blocks": 12},
             tuple(_req(name, 8, [14], arrival) for name, arrival in zip("ABCD", (0, 0, 1, 1)))),
    StepCase("preemption by swap; swapped groups return before new prompts are admitted",
             {**_SMALL, "preemption_mode": "swap"}, {"block_size": 4, "num_gpu_blocks": 12, "num_cpu_blocks": 32},
             tuple(_req(name, 8, [14], arrival) for name, arrival in zip("ABCDE", (0, 0, 1, 1, 6)))),
    StepCase("vLLM v0's rule: a group of two sequences is swapped, a lone sequence recomputed",
             {**_SMALL, "max_num_seqs": 8}, {"block_size": 4, "num_gpu_blocks": 16, "num_cpu_blocks": 32},
             tuple(SimRequest(str(i), _prompt(8), [12] if i % 2 else [12, 10], arrival_step=i) for i in range(4))),
    StepCase("no room in the CPU pool: a lone sequence is recomputed, a group of two aborted",
             {**_SMALL, "max_num_seqs": 8, "preemption_mode": "swap"},
             {"block_size": 4, "num_gpu_blocks": 16, "num_cpu_blocks": 0},
             tuple(SimRequest(str(i), _prompt(8), [12] if i % 2 else [12, 10], arrival_step=i) for i in range(4))),
    StepCase("a random workload, preemption by recompute",
             {"max_num_seqs": 6, "max_num_batched_tokens": 64, "max_model_len": 64, "preemption_mode": "recompute"},
             {"block_size": 4, "num_gpu_blocks": 24},
             tuple(make_workload(16, prompt_len=(4, 28), output_len=(4, 30), arrival_every=1.5, seed=3))),
    StepCase("a random workload, preemption by swap",
             {"max_num_seqs": 6, "max_num_batched_tokens": 64, "max_model_len": 64, "preemption_mode": "swap"},
             {"block_size": 4, "num_gpu_blocks": 24, "num_cpu_blocks": 48},
             tuple(make_workload(16, prompt_len=(4, 28), output_len=(4, 30), arrival_every=1.5, seed=3))),
)

# The cases each part of the lab touches (the rest of the step is the package's until you write it).
ADMISSION_CASES = STEP_CASES[:4]
DECODE_CASES = (STEP_CASES[0], STEP_CASES[4], STEP_CASES[8])
PREEMPTION_CASES = STEP_CASES[4:]
SWAP_IN_CASES = (STEP_CASES[5], STEP_CASES[6], STEP_CASES[9])

# The parts of a step's snapshot that are the scheduler's decision (and its effect on the pool).
DECISION_FIELDS = ("batch", "num_batched_tokens", "waiting", "running", "swapped", "preempted_by_recompute",
                   "preempted_by_swap", "swapped_in", "ignored", "blocks_to_swap_out", "blocks_to_swap_in",
                   "num_free_gpu_blocks", "num_free_cpu_blocks")
# A run this many steps longer than the package's has gone wrong (a scheduler that never
# schedules anything would run until the simulator's own limit).
EXTRA_STEPS = 50


def check_scheduler_step(scheduler_cls: type, cases: tuple[StepCase, ...] = STEP_CASES) -> None:
    """Run every case with `scheduler_cls` and with `Scheduler`; LabCheckFailed names the case,
    the first step and the first field of the decision that differ."""
    for case in cases:
        expected = case.run()
        number = STEP_CASES.index(case) + 1 if case in STEP_CASES else "*"
        label = f"step case {number} ({case.title!r})"
        sim = _run_learner(case, scheduler_cls, expected, label)
        _compare_runs(label, expected, sim)
    numbers = ", ".join(str(STEP_CASES.index(c) + 1) for c in cases if c in STEP_CASES)
    passed(f"scheduler cases {numbers}: every step's decision agrees with the package's Scheduler")


def _run_learner(case: StepCase, scheduler_cls: type, expected: Simulator, label: str) -> Simulator:
    """Run the case with the learner's class; on an error, the first step that already differs
    from the package's is the better message, so the steps that ran are compared first."""
    max_steps = len(expected.snapshots) + EXTRA_STEPS
    sim = case.simulator(scheduler_cls, max_steps)
    try:
        with _quiet_engine():
            sim.run(list(case.requests))
    except (NotImplementedError, LabCheckFailed):
        raise
    except Exception as error:  # the learner's code broke an invariant the engine checks, or never ends
        _compare_steps(label, expected, sim)
        if "did not finish" in str(error):
            raise LabCheckFailed(f"{label}: the run did not finish within {max_steps} steps (the package's "
                                 f"Scheduler needs {len(expected.snapshots)})") from error
        raise LabCheckFailed(f"{label}: step {sim.current_step}: your scheduler raised "
                             f"{type(error).__name__}: {error} (the traceback above shows where)") from error
    return sim


def _compare_runs(label: str, expected: Simulator, sim: Simulator) -> None:
    _compare_steps(label, expected, sim)
    expect(len(sim.snapshots) == len(expected.snapshots),
           f"{label}: the run took {len(sim.snapshots)} steps, expected {len(expected.snapshots)}")
    want = {rid: (r.status, r.seq_output_lens) for rid, r in expected.results.items()}
    got = {rid: (r.status, r.seq_output_lens) for rid, r in sim.results.items()}
    expect(want == got, f"{label}: requests ended as {got}, expected {want}")


def _compare_steps(label: str, expected: Simulator, sim: Simulator) -> None:
    """LabCheckFailed at the first step and field where the recorded decisions differ."""
    for theirs, ours in zip(expected.snapshots, sim.snapshots):
        for name in DECISION_FIELDS:
            want, got = _field(theirs, name), _field(ours, name)
            expect(want == got, f"{label}: step {theirs.step}: {name} is {got!r}, expected {want!r}\n"
                                f"  expected step: {_summary(theirs)}\n  your step:     {_summary(ours)}")


def _field(snapshot, name: str):
    value = getattr(snapshot, name)
    if name == "batch":
        return [(e.request_id, e.phase, e.num_tokens) for e in value]
    if name == "ignored":
        return sorted(value)  # the ids; the reason's wording is yours
    return value


def _summary(snapshot) -> str:
    batch = ", ".join(f"{e.request_id}:{e.phase}x{e.num_tokens}" for e in snapshot.batch) or "-"
    return (f"batch [{batch}] waiting {snapshot.waiting} running {snapshot.running} swapped {snapshot.swapped} "
            f"free GPU blocks {snapshot.num_free_gpu_blocks}")


# ---------------------------------------------------------------------------- the engine

# Four prompts whose KV cache outgrows a pool of 10 blocks of 8 tokens as they decode: the
# newest running request is preempted several times before all of them finish.
ENGINE_PROMPTS = (
    "ROMEO:\nBut, soft! what light through yonder window breaks?\n",
    "JULIET:\nO Romeo, Romeo! wherefore art thou Romeo?\n",
    "First Citizen:\nBefore we proceed any further, hear me speak.\n",
    "KING HENRY VI:\nWhat, will the aspiring blood of Lancaster\n",
)
ENGINE_KWARGS = {"block_size": 8, "num_gpu_blocks_override": 10, "max_num_seqs": 4, "max_model_len": 256,
                 "num_scheduler_steps": 1, "swap_space": 0.01}
ENGINE_MAX_TOKENS = 24


def check_scheduler_in_engine(scheduler_cls: type, modes: tuple[str, ...] = ("recompute", "swap")) -> None:
    """A real `LLM` on the bundled model with `scheduler_cls`, once per preemption mode: greedy
    output token-identical to transformers, at least one preemption, every block free at the end."""
    for mode in modes:
        llm = LLM(**engine_kwargs(**ENGINE_KWARGS, preemption_mode=mode, scheduler_cls=scheduler_cls))
        scheduler = llm.llm_engine.scheduler
        expect_yours(scheduler, scheduler_cls, f"preemption_mode={mode!r}: the engine's scheduler")
        assert_greedy_matches_transformers(ENGINE_PROMPTS, ENGINE_MAX_TOKENS, llm=llm)
        expect(scheduler.num_cumulative_preemption > 0,
               f"preemption_mode={mode!r}: the run finished without a preemption (num_cumulative_preemption "
               f"is 0), but a pool of {ENGINE_KWARGS['num_gpu_blocks_override']} blocks cannot hold "
               f"{len(ENGINE_PROMPTS)} growing requests: does your scheduler count its preemptions?")
        bm = scheduler.block_manager
        for pool, free, total in (("GPU", bm.get_num_free_gpu_blocks(), bm.num_total_gpu_blocks),
                                  ("CPU", bm.get_num_free_cpu_blocks(), bm.num_total_cpu_blocks)):
            expect(free == total, f"preemption_mode={mode!r}: after the run {total - free} {pool} blocks "
                                  f"are still held ({free} of {total} free): a preempted or finished request "
                                  "kept its blocks")
        passed(f"preemption_mode={mode!r}: {scheduler.num_cumulative_preemption} preemptions, "
               "every block free at the end")
