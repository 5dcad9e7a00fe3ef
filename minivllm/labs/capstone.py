"""The capstone's grader: a shortest-job-first scheduling policy with a starvation bound, plugged
in as a `scheduler_cls` (a `Scheduler` subclass) or a `Policy` subclass (`PolicyFactory.register`).

    python -m minivllm.labs.capstone my_policy:ShortestJobFirst       # module:Class
    python -m minivllm.labs.capstone path/to/my_policy.py:ShortestJobFirst

The contract (notebooks/labs/capstone.md): waiting requests are admitted shortest first, by
the tokens their prefill needs (`seq.get_len()`: the prompt, plus the outputs of a recomputed
request), ties by arrival; a request that has waited `AGING_STEPS` scheduler steps goes ahead
of every younger one. Every test below is worth points; `grade` returns the rows the table
prints, the command exits 0 only with full marks. Step counts, not seconds: the grade is the
same on any machine.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from minivllm.config import CacheConfig, SchedulerConfig, resolve_obj_by_qualname
from minivllm.core.policy import Policy, PolicyFactory
from minivllm.core.scheduler import Scheduler
from minivllm.entrypoints.llm import LLM
from minivllm.labs import LabCheckFailed, expect
from minivllm.labs.parity import assert_greedy_matches_transformers
from minivllm.sampling_params import SamplingParams
from minivllm.sequence import Sequence, SequenceGroup
from minivllm.viz.device import engine_kwargs
from minivllm.viz.sim import SimRequest, Simulator, make_workload

AGING_STEPS = 16  # a request that has waited this many scheduler steps is served before younger ones
POLICY_NAME = "capstone"  # the name a submitted Policy is registered under
BLOCK_SIZE = 16


@dataclass
class Submission:
    """The learner's class as the engine takes it: `scheduler_cls=` or `scheduling_policy=`."""

    cls: type
    name: str

    @classmethod
    def load(cls, target: str | type) -> Submission:
        obj = _load(target) if isinstance(target, str) else target
        if isinstance(obj, type) and issubclass(obj, Policy):
            PolicyFactory.register(POLICY_NAME, obj)
        elif not (isinstance(obj, type) and issubclass(obj, Scheduler)):
            raise ValueError(f"{target!r} is neither a Scheduler nor a Policy subclass.")
        return cls(obj, target if isinstance(target, str) else f"{obj.__module__}:{obj.__qualname__}")

    @property
    def is_policy(self) -> bool:
        return issubclass(self.cls, Policy)

    def scheduler_config(self, **kwargs) -> SchedulerConfig:
        if self.is_policy:
            return SchedulerConfig(policy=POLICY_NAME, **kwargs)
        return SchedulerConfig(scheduler_cls=self.cls, **kwargs)

    def engine_kwargs(self) -> dict:
        return {"scheduling_policy": POLICY_NAME} if self.is_policy else {"scheduler_cls": self.cls}

    def scheduler(self, **kwargs) -> Scheduler:
        config = self.scheduler_config(**kwargs)
        scheduler_cls = Scheduler if self.is_policy else self.cls
        return scheduler_cls(config, CacheConfig(block_size=BLOCK_SIZE, num_gpu_blocks=1024, num_cpu_blocks=0))


def _load(target: str):
    where, sep, name = target.rpartition(":")
    if sep and where.endswith(".py"):
        spec = importlib.util.spec_from_file_location(Path(where).stem, where)
        if spec is None:
            raise ValueError(f"cannot load {where!r}.")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        return getattr(module, name)
    return resolve_obj_by_qualname(target)


# -------------------------------------------------------------------------------- the tests


def _group(request_id: str, num_tokens: int, arrival: float) -> SequenceGroup:
    seq = Sequence(int(request_id.split("-")[-1]), None, list(range(1, num_tokens + 1)), BLOCK_SIZE)
    return SequenceGroup(request_id, [seq], arrival_time=arrival)


def _expected_admission(groups: list[SequenceGroup], budget: int, max_num_seqs: int) -> list[str]:
    """Shortest first, ties by arrival, until one does not fit the token budget (head-of-line)."""
    admitted, used = [], 0
    for group in sorted(groups, key=lambda g: (g.first_seq.get_len(), g.arrival_time)):
        if used + group.first_seq.get_len() > budget or len(admitted) == max_num_seqs:
            break
        admitted.append(group.request_id)
        used += group.first_seq.get_len()
    return admitted


def test_ordering(sub: Submission, lengths: Callable[[random.Random], int], trials: int = 20) -> str:
    """One `schedule()` on a queue added in random order: the admitted prompts are the shortest."""
    for trial in range(trials):
        rng = random.Random(trial)
        scheduler = sub.scheduler(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=256)
        arrivals = list(range(12))
        groups = [_group(f"r-{i}", lengths(rng), float(i)) for i in arrivals]
        for group in rng.sample(groups, len(groups)):  # the queue's order is not the arrival order
            scheduler.add_seq_group(group)
        _, outputs, _ = scheduler.schedule()
        got = [s.seq_group.request_id for s in outputs.scheduled_seq_groups]
        want = _expected_admission(groups, 256, 8)
        lens = {g.request_id: g.first_seq.get_len() for g in groups}
        expect(got == want, f"queue {trial} (prompt lengths by arrival {[lens[g.request_id] for g in groups]}): "
                            f"admitted {[(r, lens[r]) for r in got]}, expected {[(r, lens[r]) for r in want]}")
    return f"{trials} random queues, admission = the shortest prompts that fit"


def test_starvation(sub: Submission) -> str:
    """A long prompt under a stream of short ones: its first token comes within the bound."""
    config = sub.scheduler_config(max_num_seqs=16, max_num_batched_tokens=128, max_model_len=128)
    requests = [SimRequest("long", list(range(1, 121)), [2])]
    requests += [SimRequest(f"short-{step}-{i}", list(range(1, 41)), [2], arrival_step=step)
                 for step in range(60) for i in range(3)]
    result = Simulator(config, CacheConfig(block_size=BLOCK_SIZE, num_gpu_blocks=1024)).run(requests)
    ttft = result.results["long"].ttft_steps
    bound = AGING_STEPS + 2
    expect(ttft <= bound, f"the 120-token prompt waited {ttft} steps for its first token under a stream of "
                          f"40-token prompts (3 a step); after {AGING_STEPS} steps of waiting it must go first "
                          f"(bound: {bound} steps)")
    return f"the long prompt's first token after {ttft} steps (bound {bound})"


def test_invariants(sub: Submission) -> str:
    """A mixed workload into a small pool, recompute and swap: nothing lost, every block back."""
    notes = []
    for mode in ("recompute", "swap"):
        config = sub.scheduler_config(max_num_seqs=8, max_num_batched_tokens=128, max_model_len=128,
                                      preemption_mode=mode)
        workload = make_workload(30, prompt_len=(4, 80), output_len=(4, 40), arrival_every=1.0, seed=7)
        sim = Simulator(config, CacheConfig(block_size=8, num_gpu_blocks=40, num_cpu_blocks=80))
        result = sim.run(workload)
        for request in workload:
            got = result.results[request.request_id]
            expect((got.status, got.seq_output_lens) == ("FINISHED_STOPPED", request.output_lens),
                   f"preemption_mode={mode!r}: request {request.request_id} ended {got.status} with "
                   f"{got.seq_output_lens} tokens, expected FINISHED_STOPPED with {request.output_lens}")
        for snapshot in result.snapshots:
            expect(snapshot.num_batched_tokens <= 128 and len(snapshot.batch) <= 8,
                   f"preemption_mode={mode!r}: step {snapshot.step} ran {snapshot.num_batched_tokens} tokens "
                   f"in {len(snapshot.batch)} groups (budget 128 tokens, 8 sequences)")
        bm = sim.scheduler.block_manager
        held_gpu = bm.num_total_gpu_blocks - bm.get_num_free_gpu_blocks()
        held_cpu = bm.num_total_cpu_blocks - bm.get_num_free_cpu_blocks()
        expect(held_gpu == held_cpu == 0,
               f"preemption_mode={mode!r}: {held_gpu} GPU and {held_cpu} CPU blocks still held after the run")
        expect(result.stats.num_preemptions > 0, f"preemption_mode={mode!r}: the workload should preempt")
        notes.append(f"{mode}: {result.stats.num_preemptions} preemptions")
    return "30 requests finished, every block free (" + ", ".join(notes) + ")"


PARITY_PROMPTS = (
    "ROMEO:\n",
    "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n",
    "JULIET:\n",
    "KING HENRY VI:\nWhat, will the aspiring blood of Lancaster sink in the ground?\n",
)


def test_parity(sub: Submission) -> str:
    """The bundled model under preemption: greedy output equal to transformers', blocks returned."""
    llm = LLM(**engine_kwargs(**sub.engine_kwargs(), block_size=8, num_gpu_blocks_override=12, max_num_seqs=4,
                              max_model_len=256, num_scheduler_steps=1, swap_space=0.01))
    assert_greedy_matches_transformers(PARITY_PROMPTS, 24, llm=llm)
    scheduler = llm.llm_engine.scheduler
    bm = scheduler.block_manager
    expect(bm.get_num_free_gpu_blocks() == bm.num_total_gpu_blocks, "GPU blocks still held after the run")
    return f"4 prompts x 24 tokens equal to transformers, {scheduler.num_cumulative_preemption} preemptions"


# ---------------------------------------------------------------------------- the benchmark


@dataclass
class TTFT:
    """Time to first token, in engine steps (1: the step the request arrived in)."""

    mean: float
    p90: float
    max_short: int
    max_long: int


def benchmark_workload(seed: int = 0) -> list[tuple[str, int, list[int]]]:
    """(request id, arrival step, prompt token ids): 32 requests in bursts of 8 a step, a
    quarter of them long (150-200 tokens) among short ones (8-24): the token budget binds."""
    rng = random.Random(seed)
    workload = []
    for i in range(32):
        long = rng.random() < 0.25
        length = rng.randint(150, 200) if long else rng.randint(8, 24)
        workload.append((f"{'long' if long else 'short'}-{i}", i // 8, [rng.randrange(3, 4096) for _ in range(length)]))
    return workload


def run_benchmark(engine_args: dict, max_tokens: int = 12) -> TTFT:
    """Serve `benchmark_workload()` on the bundled model, arrivals by step; TTFT in steps."""
    llm = LLM(**engine_kwargs(**engine_args, max_num_seqs=32, max_num_batched_tokens=256, max_model_len=256,
                              num_scheduler_steps=1))
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    pending = benchmark_workload()
    arrival, first = {}, {}
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][1] <= step:
            request_id, _, prompt = pending.pop(0)
            engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
            arrival[request_id] = step
        for output in engine.step():
            if output.outputs[0].token_ids and output.request_id not in first:
                first[output.request_id] = step
        step += 1
    ttft = sorted(first[r] - arrival[r] + 1 for r in arrival)
    by_kind = {kind: [first[r] - arrival[r] + 1 for r in arrival if r.startswith(kind)] for kind in ("short", "long")}
    return TTFT(mean=sum(ttft) / len(ttft), p90=ttft[int(0.9 * (len(ttft) - 1))],
                max_short=max(by_kind["short"]), max_long=max(by_kind["long"]))


def test_benchmark(sub: Submission, results: dict) -> str:
    """Mean and p90 time to first token below FCFS's on a mixed short/long workload."""
    results["fcfs"] = fcfs = run_benchmark({})
    results["yours"] = yours = run_benchmark(sub.engine_kwargs())
    expect(yours.mean < fcfs.mean and yours.p90 <= fcfs.p90,
           f"mean TTFT {yours.mean:.2f} steps (FCFS {fcfs.mean:.2f}), p90 {yours.p90} (FCFS {fcfs.p90}): "
           "shortest-first should lower both")
    return f"mean TTFT {yours.mean:.2f} vs FCFS {fcfs.mean:.2f} steps, p90 {yours.p90} vs {fcfs.p90}"


# -------------------------------------------------------------------------------- the grade


@dataclass
class Row:
    test: str
    points: int
    earned: int
    detail: str


def grade(target: str | type, *, with_engine: bool = True) -> tuple[list[Row], dict]:
    """Run every test on the submission; returns the table's rows and the benchmark's TTFTs.
    `with_engine=False` skips the two tests that load the bundled model."""
    sub = Submission.load(target)
    results: dict = {}
    tests = [
        ("ordering: shortest prompt first", 30, lambda: test_ordering(sub, lambda rng: rng.randint(1, 100))),
        ("ordering: ties by arrival", 10, lambda: test_ordering(sub, lambda rng: rng.choice((16, 32)), trials=5)),
        (f"starvation bound ({AGING_STEPS} steps)", 20, lambda: test_starvation(sub)),
        ("engine invariants (simulated)", 20, lambda: test_invariants(sub)),
    ]
    if with_engine:
        tests += [("greedy parity (bundled model)", 10, lambda: test_parity(sub)),
                  ("benchmark: TTFT vs FCFS", 10, lambda: test_benchmark(sub, results))]
    rows = []
    for title, points, run in tests:
        try:
            with contextlib.redirect_stdout(io.StringIO()):  # the table reports each test
                detail = run()
            rows.append(Row(title, points, points, detail))
        except (LabCheckFailed, NotImplementedError) as failure:
            rows.append(Row(title, points, 0, f"FAIL: {failure}"))
    return rows, results


def format_table(target: str, rows: list[Row], results: dict) -> str:
    lines = [f"capstone grade: {target}", "",
             f"{'test':34} {'points':>6}  result  detail", "-" * 100]
    for row in rows:
        verdict = "PASS" if row.earned == row.points else "FAIL"
        lines.append(f"{row.test:34} {row.earned:>3}/{row.points:<3} {verdict:6}  {row.detail}")
    lines += ["-" * 100, f"{'total':34} {sum(r.earned for r in rows):>3}/{sum(r.points for r in rows)}"]
    if results:
        lines += ["", "benchmark (bundled model, 32 requests, TTFT in engine steps)",
                  f"{'policy':10} {'mean':>6} {'p90':>5} {'max short':>10} {'max long':>9}"]
        for name, ttft in results.items():
            lines.append(f"{name:10} {ttft.mean:6.2f} {ttft.p90:5d} {ttft.max_short:10d} {ttft.max_long:9d}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minivllm.labs.capstone", description=__doc__.splitlines()[0])
    parser.add_argument("target", help="module:Class or path/to/file.py:Class (a Scheduler or Policy subclass)")
    parser.add_argument("--no-engine", action="store_true", help="skip the two tests that load the bundled model")
    args = parser.parse_args(argv)
    rows, results = grade(args.target, with_engine=not args.no_engine)
    print(format_table(args.target, rows, results))
    return 0 if all(r.earned == r.points for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
