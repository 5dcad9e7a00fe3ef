"""Checkers for the notebooks' exercises: each runs the learner's function on cases and says
exactly what is wrong.

The pattern of srush's puzzles: a spec in the notebook, a stub cell for the learner, a
`check_...(fn)` from here, and the solution hidden in a collapsed cell. A checker never raises
on a wrong answer (a notebook under nbval must run with the stubs in place): it prints
"✓ ..." and returns True, or prints "✗ <the first case that fails, expected vs got>" and
returns False. A stub that still raises `NotImplementedError` reads "not written yet".
`tests/viz/test_exercises.py` runs every notebook's hidden solution through its checker.

The expected answers come from the real code where there is one (`BlockSpaceManager`,
`hash_block_tokens`) and from a dense reference otherwise (softmax attention, the rejection
sampler's formula). Index of exercises: docs/exercises.md.
"""

from __future__ import annotations

import math
import random
from typing import Callable, Iterable

import torch

from minivllm.core.block_manager import hash_block_tokens


class _Wrong(Exception):
    """One failing case, with the message the learner sees."""


def _run(name: str, fn: Callable, cases: Callable[[Callable], Iterable[None]]) -> bool:
    try:
        for _ in cases(fn):
            pass
    except NotImplementedError:
        print(f"✗ {name}: not written yet (replace `raise NotImplementedError`).")
        return False
    except _Wrong as wrong:
        print(f"✗ {name}: {wrong}")
        return False
    except Exception as error:  # the learner's code crashed: show where it hurts, not a traceback
        print(f"✗ {name}: your function raised {type(error).__name__}: {error}")
        return False
    print(f"✓ {name}: all cases pass.")
    return True


def _expect(got, expected, what: str) -> None:
    if got != expected:
        raise _Wrong(f"{what}: expected {expected!r}, got {got!r}")


def _expect_close(got: torch.Tensor, expected: torch.Tensor, what: str, atol: float = 1e-5) -> None:
    got = torch.as_tensor(got, dtype=torch.float64)
    if got.shape != expected.shape:
        raise _Wrong(f"{what}: expected shape {tuple(expected.shape)}, got {tuple(got.shape)}")
    error = (got - expected).abs().max().item()
    if not error <= atol:
        raise _Wrong(f"{what}: max abs difference {error:.3g} from the reference (allowed {atol:g})")


# ================================================================ notebook 00: the step's callees
STEP_CALLEES = ("Scheduler.schedule", "UniProcExecutor.execute_model", "SequenceGroupOutputProcessor.process_outputs")


def check_step_order(answer: list[str]) -> bool:
    """`answer`: the three calls `LLMEngine.step` makes, in order (as "Class.method")."""
    def cases(_):
        if answer is NotImplemented:
            raise NotImplementedError
        _expect(list(answer), list(STEP_CALLEES), "the order of one step's calls")
        yield
    return _run("step order", None, cases)


# ================================================================ notebooks 01/12: sizes
def check_kv_bytes_per_token(fn: Callable[[int, int, int, int], int]) -> bool:
    """fn(num_layers, num_kv_heads, head_dim, bytes_per_element) -> KV-cache bytes per token."""
    def cases(fn):
        for args, name in [((32, 8, 128, 2), "Llama-3-8B in bf16"), ((32, 32, 128, 2), "Llama-2-7B in fp16"),
                           ((40, 40, 128, 2), "OPT-13B in fp16"), ((4, 2, 32, 4), "the bundled model in fp32")]:
            _expect(fn(*args), 2 * math.prod(args), f"{name} {args}")
            yield
    return _run("kv_bytes_per_token", fn, cases)


def check_num_gpu_blocks(fn: Callable[..., int]) -> bool:
    """fn(total_bytes, gpu_memory_utilization, peak_bytes, block_bytes) -> number of KV blocks."""
    def cases(fn):
        GiB = 1 << 30
        for args in [(80 * GiB, 0.9, 17 * GiB, 2 * 1 << 20), (24 * GiB, 0.9, 2 * GiB, 131072),
                     (16 * GiB, 0.5, 8 * GiB, 1 << 20)]:
            total, util, peak, block = args
            _expect(fn(*args), max(int((total * util - peak) // block), 0), f"blocks for {args}")
            yield
    return _run("num_gpu_blocks", fn, cases)


# ================================================================ notebooks 02/10: slot mapping
def check_slot_mapping(fn: Callable[[list[int], list[int], int], list[int]]) -> bool:
    """fn(block_table, positions, block_size) -> the flat cache slot of each position."""
    def cases(fn):
        rng = random.Random(0)
        for block_size in (1, 4, 16):
            table = rng.sample(range(64), 6)
            positions = sorted(rng.sample(range(6 * block_size), min(10, 6 * block_size)))
            expected = [table[p // block_size] * block_size + p % block_size for p in positions]
            _expect(list(fn(table, positions, block_size)), expected,
                    f"block_table={table}, block_size={block_size}, positions={positions}")
            yield
    return _run("slot_mapping", fn, cases)


# ================================================================ notebooks 02/06: can_allocate
def check_can_allocate(fn: Callable[[int, int, int, float], str]) -> bool:
    """fn(num_required, num_free, num_total, watermark) -> "OK" | "LATER" | "NEVER"."""
    def reference(required, free, total, watermark):
        watermark_blocks = int(watermark * total)
        if total - required < watermark_blocks:
            return "NEVER"
        return "OK" if free - required >= watermark_blocks else "LATER"

    def cases(fn):
        for args in [(3, 10, 100, 0.01), (3, 3, 100, 0.0), (3, 3, 100, 0.01), (99, 100, 100, 0.01),
                     (100, 100, 100, 0.01), (101, 100, 100, 0.0), (5, 8, 100, 0.04), (5, 9, 100, 0.04)]:
            _expect(fn(*args), reference(*args), f"num_required, num_free, num_total, watermark = {args}")
            yield
    return _run("can_allocate", fn, cases)


# ================================================================ notebook 03: copy-on-write
def check_append_slot_cow(fn: Callable) -> bool:
    """fn(block_table, ref_counts, free_blocks) -> (block_table, copy). Append one token whose slot
    falls in the *last* block (which has room): if that block is shared (ref count > 1), take a
    free block, move this sequence's reference to it and return the copy (src, dst); otherwise
    change nothing and return None. Mutate `ref_counts` and `free_blocks` in place."""
    def cases(fn):
        table, refs, free = [7, 3], {7: 1, 3: 1}, [5, 6]
        new_table, copy = fn(list(table), refs, free)
        _expect((new_table, copy, refs, free), ([7, 3], None, {7: 1, 3: 1}, [5, 6]),
                "an unshared last block is written in place: (table, copy, ref_counts, free)")
        yield
        table, refs, free = [7, 3], {7: 2, 3: 2}, [5, 6]
        new_table, copy = fn(list(table), refs, free)
        _expect(copy, (3, 5), "a shared last block is copied to the first free block: (src, dst)")
        _expect(new_table, [7, 5], "the table points at the copy")
        _expect(refs, {7: 2, 3: 1, 5: 1}, "ref counts (the old block loses this sequence, the copy has one)")
        _expect(free, [6], "the free list after taking one block")
        yield
    return _run("append_slot_cow", fn, cases)


# ================================================================ notebook 04: hash chain
def check_block_hashes(fn: Callable[[list[int], int], list[int]]) -> bool:
    """fn(token_ids, block_size) -> the chained hash of each *full* block, using
    `hash_block_tokens(parent_hash_or_None, tuple_of_token_ids)`."""
    def cases(fn):
        for tokens, block_size in [(list(range(10)), 4), (list(range(8)), 4), ([5, 5, 5], 4), ([1, 2, 3, 4, 5, 6], 2)]:
            expected, parent = [], None
            for start in range(0, len(tokens) - len(tokens) % block_size, block_size):
                parent = hash_block_tokens(parent, tuple(tokens[start:start + block_size]))
                expected.append(parent)
            _expect(list(fn(tokens, block_size)), expected, f"tokens={tokens}, block_size={block_size}")
            yield
    return _run("block_hashes", fn, cases)


# ================================================================ notebook 05: batching
def _static_steps(lengths: list[int], slots: int) -> int:
    return sum(max(lengths[i:i + slots]) for i in range(0, len(lengths), slots))


def _continuous_steps(lengths: list[int], slots: int) -> int:
    waiting, running, steps = list(lengths), [], 0
    while waiting or running:
        while waiting and len(running) < slots:
            running.append(waiting.pop(0))
        running = [left - 1 for left in running if left > 1]
        steps += 1
    return steps


def check_batching_steps(fn: Callable[[list[int], int], tuple[int, int]]) -> bool:
    """fn(output_lengths, num_slots) -> (static steps, continuous steps): decode-only, one token per
    request per step, requests in arrival order; static batching runs each batch of `num_slots`
    requests until its longest one ends; continuous batching refills a slot at the next step."""
    def cases(fn):
        for lengths, slots in [([3, 1, 1, 1], 2), ([5, 1, 1, 1, 1, 1], 2), ([2, 2, 2], 3), ([1, 9, 2, 8, 3, 7], 3)]:
            _expect(tuple(fn(lengths, slots)), (_static_steps(lengths, slots), _continuous_steps(lengths, slots)),
                    f"output_lengths={lengths}, num_slots={slots}")
            yield
    return _run("batching_steps", fn, cases)


# ================================================================ notebook 06: the token budget
def check_admit(fn: Callable[[list[int], int, int], list[int]]) -> bool:
    """fn(prompt_lengths, max_num_batched_tokens, max_num_seqs) -> indices admitted this step:
    first come first served, stop at the first prompt that does not fit (no skipping ahead)."""
    def reference(lengths, budget, max_seqs):
        admitted, used = [], 0
        for i, n in enumerate(lengths):
            if used + n > budget or len(admitted) == max_seqs:
                break
            admitted.append(i)
            used += n
        return admitted

    def cases(fn):
        for args in [([30, 30, 30], 64, 8), ([10, 50, 4], 64, 8), ([10, 10, 10], 64, 2), ([70, 1], 64, 8)]:
            _expect(list(fn(*args)), reference(*args), f"prompt_lengths, budget, max_num_seqs = {args}")
            yield
    return _run("admit", fn, cases)


# ================================================================ notebook 07: preemption
def check_choose_victim(fn: Callable[[list[str]], str]) -> bool:
    """fn(running) -> the request vLLM v0 preempts first; `running` is the running queue in
    scheduling order (FCFS: earliest arrival first)."""
    def cases(fn):
        for running in (["a", "b", "c"], ["r7"], ["x", "y"]):
            _expect(fn(list(running)), running[-1], f"running queue {running}")
            yield
    return _run("choose_victim", fn, cases)


def check_preemption_mode(fn: Callable[[int, str | None], str]) -> bool:
    """fn(num_running_seqs_in_group, user_mode) -> "recompute" | "swap" (vLLM v0's default rule:
    a group of one sequence is recomputed, several are swapped; a user mode applies only to
    one-sequence groups)."""
    def cases(fn):
        for args, expected in [((1, None), "recompute"), ((3, None), "swap"), ((1, "swap"), "swap"),
                               ((4, "recompute"), "swap"), ((1, "recompute"), "recompute")]:
            _expect(fn(*args), expected, f"num_running_seqs, preemption_mode = {args}")
            yield
    return _run("preemption_mode", fn, cases)


# ================================================================ notebook 08: chunked prefill
def check_chunked_step(fn: Callable[[int, list[int], int], list[int]]) -> bool:
    """fn(num_decodes, remaining_prompt_tokens, budget) -> prompt tokens scheduled for each prefill
    this step: decodes first (one token each), then prompt chunks in order with what is left."""
    def reference(decodes, remaining, budget):
        left, chunks = budget - decodes, []
        for n in remaining:
            take = max(min(n, left), 0)
            chunks.append(take)
            left -= take
        return chunks

    def cases(fn):
        for args in [(3, [100], 64), (0, [10, 10], 16), (16, [5], 16), (2, [30, 40, 50], 64)]:
            _expect(list(fn(*args)), reference(*args), f"num_decodes, remaining, budget = {args}")
            yield
    return _run("chunked_step", fn, cases)


# ================================================================ notebook 09: RoPE
def check_rope_angle(fn: Callable[[int, int, int, float], float]) -> bool:
    """fn(position, pair_index, head_dim, base) -> the rotation angle of that pair."""
    def cases(fn):
        for args in [(0, 0, 64, 10000.0), (1, 0, 64, 10000.0), (5, 3, 64, 10000.0), (100, 31, 64, 500000.0)]:
            pos, i, d, base = args
            expected = pos * base ** (-2 * i / d)
            got = fn(*args)
            if not math.isclose(got, expected, rel_tol=1e-9, abs_tol=1e-12):
                raise _Wrong(f"position, pair, head_dim, base = {args}: expected {expected:.6g}, got {got!r}")
            yield
    return _run("rope_angle", fn, cases)


# ================================================================ notebook 10: the gather
def check_gather_keys(fn: Callable[[torch.Tensor, list[int], int], torch.Tensor]) -> bool:
    """fn(key_cache [num_blocks, block_size, d], block_table, seq_len) -> the sequence's keys
    [seq_len, d] in token order, read through the block table."""
    def cases(fn):
        cache = torch.arange(10 * 4 * 2, dtype=torch.float64).reshape(10, 4, 2)
        for table, n in [([3, 7], 5), ([9], 4), ([0, 5, 2], 9), ([6], 1)]:
            expected = torch.cat([cache[b] for b in table])[:n]
            _expect_close(fn(cache, table, n), expected, f"block_table={table}, seq_len={n}")
            yield
    return _run("gather_keys", fn, cases)


# ================================================================ notebooks 10/11: attention
def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.softmax((k @ q) * scale, dim=0) @ v


def check_online_softmax_tile(fn: Callable) -> bool:
    """fn(m, l, acc, scores, v_tile) -> (m, l, acc): fold one tile of scores [T] and values [T, d]
    into the running max m, running sum l and unnormalised accumulator acc [d], as the decode
    kernel's inner loop does. After the last tile the output is acc / l."""
    def cases(fn):
        gen = torch.Generator().manual_seed(0)
        for n, tile in [(10, 4), (33, 8), (5, 5), (64, 16)]:
            q, k, v = (torch.randn(16, generator=gen, dtype=torch.float64),
                       torch.randn(n, 16, generator=gen, dtype=torch.float64) * 3,
                       torch.randn(n, 16, generator=gen, dtype=torch.float64))
            scores = k @ q * 0.25
            m, l, acc = torch.tensor(-math.inf, dtype=torch.float64), torch.tensor(0.0, dtype=torch.float64), torch.zeros(16, dtype=torch.float64)
            for start in range(0, n, tile):
                m, l, acc = fn(m, l, acc, scores[start:start + tile], v[start:start + tile])
            _expect_close(acc / l, _dense(q, k, v, 0.25), f"{n} tokens in tiles of {tile}: acc / l")
            yield
    return _run("online_softmax_tile", fn, cases)


def check_merge_partials(fn: Callable) -> bool:
    """fn(outs [S, d], maxes [S], sums [S]) -> [d]: merge the splits of split-KV (v2) attention.
    Split s attended to its own range of tokens and returned its *normalised* output outs[s], its
    max score maxes[s] and its sum of exp(score - maxes[s]) sums[s]. An empty split has max -inf."""
    def cases(fn):
        gen = torch.Generator().manual_seed(1)
        for n, splits in [(12, 3), (40, 4), (7, 1), (9, 4)]:
            q, k, v = (torch.randn(8, generator=gen, dtype=torch.float64), torch.randn(n, 8, generator=gen, dtype=torch.float64) * 2,
                       torch.randn(n, 8, generator=gen, dtype=torch.float64))
            scores, size = k @ q, -(-n // splits)
            outs, maxes, sums = torch.zeros(splits, 8, dtype=torch.float64), torch.full((splits,), -math.inf, dtype=torch.float64), torch.zeros(splits, dtype=torch.float64)
            for s in range(splits):
                part = slice(s * size, min((s + 1) * size, n))
                if part.start >= n:
                    continue  # an empty split: nothing to attend to
                maxes[s] = scores[part].max()
                weights = torch.exp(scores[part] - maxes[s])
                sums[s], outs[s] = weights.sum(), weights @ v[part] / weights.sum()
            _expect_close(fn(outs, maxes, sums), _dense(q, k, v, 1.0), f"{n} tokens in {splits} splits")
            yield
    return _run("merge_partials", fn, cases)


# ================================================================ notebook 13: sampling
def check_top_p_mask(fn: Callable[[torch.Tensor, float], torch.Tensor]) -> bool:
    """fn(probs [V], top_p) -> bool mask [V] of the tokens kept: the smallest set of most likely
    tokens whose probabilities sum to at least top_p (the most likely token is always kept)."""
    def reference(probs, p):
        order = torch.argsort(probs, descending=True)
        before = torch.cumsum(probs[order], 0) - probs[order]  # mass strictly above each token
        keep = torch.zeros_like(probs, dtype=torch.bool)
        keep[order] = before < p
        return keep

    def cases(fn):
        for probs, p in [([0.5, 0.3, 0.2], 0.5), ([0.5, 0.3, 0.2], 0.6), ([0.1, 0.6, 0.3], 0.95), ([0.25] * 4, 1.0),
                         ([0.7, 0.2, 0.1], 0.01)]:
            probs = torch.tensor(probs, dtype=torch.float64)
            _expect(fn(probs, p).tolist(), reference(probs, p).tolist(), f"probs={probs.tolist()}, top_p={p}")
            yield
    return _run("top_p_mask", fn, cases)


# ================================================================ notebook 14: latency metrics
def check_latency_metrics(fn: Callable[[float, list[float]], tuple[float, float]]) -> bool:
    """fn(arrival_time, token_times) -> (TTFT, TPOT): time to first token, and time per output
    token after the first, (last - first) / (tokens - 1); TPOT is 0.0 for a single token."""
    def cases(fn):
        for arrival, times in [(0.0, [0.5, 0.6, 0.7]), (1.0, [1.2]), (2.0, [2.5, 2.5, 3.5, 4.5])]:
            expected = (times[0] - arrival, (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 0.0)
            got = tuple(fn(arrival, times))
            if len(got) != 2 or not all(math.isclose(a, b, abs_tol=1e-12) for a, b in zip(got, expected)):
                raise _Wrong(f"arrival={arrival}, token_times={times}: expected {expected}, got {got}")
            yield
    return _run("latency_metrics", fn, cases)


# ================================================================ notebook 15: SSE
def check_parse_sse(fn: Callable[[str], list[str]]) -> bool:
    """fn(body) -> the `data:` payloads of a Server-Sent Events body, in order, stopping at
    `data: [DONE]` (blank lines separate events; other lines are ignored)."""
    def cases(fn):
        for body, expected in [('data: {"a": 1}\n\ndata: {"b": 2}\n\ndata: [DONE]\n\n', ['{"a": 1}', '{"b": 2}']),
                               ("data: x\n\n: a comment\n\ndata: y\n\ndata: [DONE]\n\ndata: z\n\n", ["x", "y"]),
                               ("data: [DONE]\n\n", [])]:
            _expect(list(fn(body)), expected, f"body={body!r}")
            yield
    return _run("parse_sse", fn, cases)


def check_text_to_return(fn: Callable[[str, int, int, bool], tuple[str, int]]) -> bool:
    """fn(output_text, returned, buffer_length, finished) -> (the text a DELTA output carries,
    the characters returned after it): from `returned` to the end, less the last
    `buffer_length` characters while the sequence runs (a stop string may still cut them). The
    expected values come from the engine's own `Sequence.get_output_text_to_return`."""
    from minivllm.sequence import Sequence, SequenceStatus

    def cases(fn):
        for text, returned, buffer_length, finished in [("To be", 0, 0, False), ("To be, or", 5, 0, False),
                                                        ("To be, or", 2, 3, False), ("To be, or", 6, 3, True),
                                                        ("ab", 0, 3, False), ("To be", 5, 2, False)]:
            seq = Sequence(0, None, [1], block_size=16)
            seq.output_text, seq.last_output_text_offset = text, returned
            seq.status = SequenceStatus.FINISHED_STOPPED if finished else SequenceStatus.RUNNING
            expected = (seq.get_output_text_to_return(buffer_length, delta=True), seq.last_output_text_offset)
            got = fn(text, returned, buffer_length, finished)
            _expect(tuple(got) if isinstance(got, (tuple, list)) else got, expected,
                    f"output_text={text!r}, returned={returned}, buffer_length={buffer_length}, finished={finished}")
            yield
    return _run("text_to_return", fn, cases)


# ================================================================ speculative decoding
def check_rejection_step(fn: Callable[[torch.Tensor, torch.Tensor, int], tuple[float, torch.Tensor]]) -> bool:
    """fn(p [V], q [V], x) -> (probability of accepting the draft token x, the distribution to
    resample from when it is rejected): min(1, p(x)/q(x)) and norm(max(p - q, 0))."""
    def cases(fn):
        for p, q, x in [([0.5, 0.3, 0.2], [0.2, 0.6, 0.2], 1), ([0.5, 0.3, 0.2], [0.2, 0.6, 0.2], 0),
                        ([0.1, 0.1, 0.8], [0.8, 0.1, 0.1], 0), ([0.0, 1.0], [0.5, 0.5], 0)]:
            p, q = torch.tensor(p, dtype=torch.float64), torch.tensor(q, dtype=torch.float64)
            accept, residual = fn(p, q, x)
            expected = min(1.0, (p[x] / q[x]).item())
            if not math.isclose(float(accept), expected, abs_tol=1e-9):
                raise _Wrong(f"p={p.tolist()}, q={q.tolist()}, x={x}: acceptance expected {expected:.4g}, got {float(accept):.4g}")
            positive = (p - q).clamp(min=0)
            _expect_close(residual, positive / positive.sum(), f"p={p.tolist()}, q={q.tolist()}: the residual distribution",
                          atol=1e-9)
            yield
    return _run("rejection_step", fn, cases)


# ================================================================ notebook 16: tensor parallelism
def check_tp_all_reduce_bytes(fn: Callable[[int, int, int], int]) -> bool:
    """fn(num_layers, hidden_size, bytes_per_element) -> all-reduce payload per token of one TP
    step: two all-reduces per layer (after o_proj and down_proj) plus one for the vocabulary-split
    embedding, each of `hidden_size` elements."""
    def cases(fn):
        for args in [(32, 4096, 2), (4, 256, 4), (1, 8, 1), (80, 8192, 2)]:
            layers, hidden, nbytes = args
            _expect(fn(*args), (2 * layers + 1) * hidden * nbytes, f"num_layers, hidden_size, bytes = {args}")
            yield
    return _run("tp_all_reduce_bytes", fn, cases)


# ================================================================ notebook 17: offload or recompute
def check_flops_per_kv_byte(fn: Callable[[int, int], float]) -> bool:
    """fn(num_params, kv_bytes_per_token) -> FLOPs it takes to recompute one token's KV (about
    2 per parameter, attention's quadratic term left out) per byte of KV you would load instead."""
    def cases(fn):
        for args in [(8_000_000_000, 131072), (600_000_000, 114688), (1_000_000, 3072)]:
            params, kv = args
            got, expected = fn(*args), 2 * params / kv
            if not math.isclose(float(got), expected, rel_tol=1e-9):
                raise _Wrong(f"num_params, kv_bytes_per_token = {args}: expected {expected:.6g}, got {got!r}")
            yield
    return _run("flops_per_kv_byte", fn, cases)


# ================================================================ notebook 18: expected speedup
def check_expected_speedup(fn: Callable[[float, int, float], float]) -> bool:
    """fn(alpha, k, c) -> Leviathan et al.'s expected speedup: expected tokens per target pass,
    (1 - alpha**(k+1)) / (1 - alpha), over the cost of k draft steps and one target pass, k*c + 1."""
    def cases(fn):
        for args in [(0.7, 4, 0.1), (0.5, 1, 0.0), (0.9, 8, 0.2), (0.0, 3, 0.1)]:
            alpha, k, c = args
            expected = (1 - alpha ** (k + 1)) / ((1 - alpha) * (k * c + 1))
            got = fn(*args)
            if not math.isclose(float(got), expected, rel_tol=1e-9):
                raise _Wrong(f"alpha, k, c = {args}: expected {expected:.6g}, got {got!r}")
            yield
    return _run("expected_speedup", fn, cases)


# ================================================================ notebook 19: LoRA
def check_lora_delta(fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]) -> bool:
    """fn(x [T, in], lora_a [r, in], lora_b [out, r], scaling) -> the LoRA term [T, out] added to
    x @ W.T, so that the sum equals x through the merged weight W + scaling * B @ A (PEFT's layout)."""
    def cases(fn):
        gen = torch.Generator().manual_seed(2)
        for tokens, d_in, d_out, r, scaling in [(3, 8, 6, 2, 2.0), (1, 16, 16, 4, 0.5), (5, 4, 12, 1, 1.0)]:
            x = torch.randn(tokens, d_in, generator=gen, dtype=torch.float64)
            w = torch.randn(d_out, d_in, generator=gen, dtype=torch.float64)
            a = torch.randn(r, d_in, generator=gen, dtype=torch.float64)
            b = torch.randn(d_out, r, generator=gen, dtype=torch.float64)
            got = x @ w.T + torch.as_tensor(fn(x, a, b, scaling), dtype=torch.float64)
            _expect_close(got, x @ (w + scaling * b @ a).T, f"x {tuple(x.shape)}, rank {r}, scaling {scaling}: x @ W.T + delta",
                          atol=1e-9)
            yield
    return _run("lora_delta", fn, cases)
