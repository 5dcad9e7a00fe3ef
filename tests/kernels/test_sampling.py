"""The greedy rows of `sample_tokens` (one pass over the logits) against torch.argmax and
torch.logsumexp.

On the CPU it runs in Triton's interpreter (tests/conftest.py), natively on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from minivllm.kernels import reference, sampling

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def greedy(sample_tokens, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row greedy (temperature 0), nothing truncated."""
    rows = logits.shape[0]
    full = lambda value, dtype: torch.full((rows,), value, dtype=dtype, device=logits.device)  # noqa: E731
    return sample_tokens(logits, full(0.0, torch.float32), full(-1, torch.int64), full(1.0, torch.float32),
                         full(0.0, torch.float32), full(0, torch.int64), full(0, torch.int64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_rows,vocab_size", [(1, 7), (3, 4096), (5, 9000), (2, 151936)])
def test_greedy_rows_match_argmax_and_logsumexp(num_rows, vocab_size, dtype):
    torch.manual_seed(vocab_size)
    logits = (4 * torch.randn(num_rows, vocab_size, device=DEVICE)).to(dtype)
    tokens, logprobs = greedy(sampling.sample_tokens, logits)
    exact = logits.float()
    assert torch.equal(tokens, exact.argmax(dim=-1))
    expected = exact.gather(1, tokens.unsqueeze(1)).squeeze(1) - torch.logsumexp(exact, dim=-1)
    torch.testing.assert_close(logprobs, expected, rtol=1e-5, atol=1e-5)
    ref_tokens, ref_logprobs = greedy(reference.sample_tokens, logits)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logprobs, ref_logprobs, rtol=1e-5, atol=1e-5)


def test_ties_go_to_the_first_index_across_blocks():
    """The max appears in two loop iterations (blocks of 4096): the earlier index wins, as in torch."""
    logits = torch.zeros(2, 9000, device=DEVICE)
    logits[0, [100, 5000, 8999]] = 3.0
    logits[1, [4095, 4096]] = 1.0
    tokens, logprobs = greedy(sampling.sample_tokens, logits)
    assert tokens.tolist() == [100, 4095] == logits.argmax(dim=-1).tolist()
    assert torch.all(logprobs < 0)


def test_huge_logits_do_not_overflow():
    logits = torch.full((1, 300), -1e4, device=DEVICE)
    logits[0, 17] = 1e4  # exp(1e4) overflows fp32 without the max subtracted first
    tokens, logprobs = greedy(sampling.sample_tokens, logits)
    assert tokens.item() == 17 and logprobs.item() == pytest.approx(0.0, abs=1e-6)


def test_bad_shapes_raise():
    with pytest.raises(ValueError):
        greedy(sampling.sample_tokens, torch.zeros(3, device=DEVICE))
    with pytest.raises(ValueError):
        greedy(sampling.sample_tokens, torch.zeros(4, 6, device=DEVICE).t())
