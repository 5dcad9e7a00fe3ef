"""`apply_penalties` (Triton, and its PyTorch reference) against definitions no one here wrote.

Repetition: transformers' `RepetitionPenaltyLogitsProcessor` over each row's prompt + output
tokens. Frequency and presence: OpenAI's formula, token by token in plain Python
(logit - count x frequency - [count > 0] x presence). On the CPU the kernel runs in Triton's
interpreter (tests/conftest.py).
"""

from __future__ import annotations

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from minivllm.kernels import reference, sampling

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
IMPLEMENTATIONS = [pytest.param(sampling.apply_penalties, id="triton"),
                   pytest.param(reference.apply_penalties, id="reference")]


def random_rows(num_rows: int, vocab_size: int, dtype=torch.float32, seed: int = 0):
    """Logits of both signs, and for each row a prompt and an output as token lists."""
    generator = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(num_rows, vocab_size, generator=generator)).to(dtype)
    prompts = [torch.randint(vocab_size, (int(n),), generator=generator).tolist()
               for n in torch.randint(1, 40, (num_rows,), generator=generator)]
    outputs = [torch.randint(vocab_size // 4, (int(n),), generator=generator).tolist()  # repeats likely
               for n in torch.randint(0, 60, (num_rows,), generator=generator)]
    return logits, prompts, outputs


def statistics(prompts, outputs, vocab_size):
    prompt_mask = torch.zeros(len(prompts), vocab_size, dtype=torch.bool)
    counts = torch.zeros(len(prompts), vocab_size)
    for row, (prompt, output) in enumerate(zip(prompts, outputs)):
        prompt_mask[row, prompt] = True
        for token in output:
            counts[row, token] += 1
    return prompt_mask.to(DEVICE), counts.to(DEVICE)


def spec(logits, prompts, outputs, repetition, frequency, presence):
    """The definitions, row by row."""
    expected = logits.float().clone()
    for row, (prompt, output) in enumerate(zip(prompts, outputs)):
        seen = torch.tensor([prompt + output])
        processor = RepetitionPenaltyLogitsProcessor(penalty=repetition[row])
        expected[row] = processor(seen, expected[row:row + 1])[0]
        for token in set(output):
            expected[row, token] -= output.count(token) * frequency[row] + presence[row]
    return expected


@pytest.mark.parametrize("apply_penalties", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_rows,vocab_size", [(1, 7), (3, 3000), (5, 4100)])
def test_penalties_follow_their_definitions(apply_penalties, num_rows, vocab_size, dtype):
    logits, prompts, outputs = random_rows(num_rows, vocab_size, dtype, seed=vocab_size)
    prompt_mask, counts = statistics(prompts, outputs, vocab_size)
    repetition = [1.0 + 0.3 * row for row in range(num_rows)]  # row 0: off
    frequency = [0.25 * (row % 3) for row in range(num_rows)]
    presence = [0.5 - 0.4 * (row % 2) for row in range(num_rows)]
    column = lambda values: torch.tensor(values, device=DEVICE)  # noqa: E731
    out = apply_penalties(logits.to(DEVICE), prompt_mask, counts, column(repetition), column(frequency),
                          column(presence))
    assert out.dtype == torch.float32 and out.shape == (num_rows, vocab_size)
    expected = spec(logits, prompts, outputs, repetition, frequency, presence)
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-6, atol=1e-6)


def test_kernel_reads_row_strided_inputs_and_returns_the_references_values():
    """Rows of a wider buffer (as the sampler's gathered rows may be), and 0 rows."""
    logits, prompts, outputs = random_rows(4, 2500, seed=1)
    prompt_mask, counts = statistics(prompts, outputs, 2500)
    wide = torch.zeros(4, 3000, device=DEVICE)
    wide[:, :2500] = logits.to(DEVICE)
    penalties = [torch.tensor([1.2, 1.0, 0.8, 2.0], device=DEVICE), torch.full((4,), 0.1, device=DEVICE),
                 torch.full((4,), 0.3, device=DEVICE)]
    out = sampling.apply_penalties(wide[:, :2500], prompt_mask, counts, *penalties)
    torch.testing.assert_close(out, reference.apply_penalties(logits.to(DEVICE), prompt_mask, counts, *penalties),
                               rtol=0, atol=0)
    empty = sampling.apply_penalties(logits[:0].to(DEVICE), prompt_mask[:0], counts[:0], *(p[:0] for p in penalties))
    assert empty.shape == (0, 2500)


def test_bad_statistics_raise():
    logits = torch.zeros(2, 10, device=DEVICE)
    ones = torch.ones(2, device=DEVICE)
    with pytest.raises(ValueError, match="prompt_mask"):
        sampling.apply_penalties(logits, torch.zeros(2, 9, dtype=torch.bool, device=DEVICE), torch.zeros(2, 10, device=DEVICE),
                                 ones, ones, ones)
    with pytest.raises(ValueError, match="fp32"):
        sampling.apply_penalties(logits, torch.zeros(2, 10, dtype=torch.bool, device=DEVICE),
                                 torch.zeros(2, 10, dtype=torch.int32, device=DEVICE), ones, ones, ones)
