"""Labs 06 (the model runner's batch) and 07 (the sampler): their checks pass on the package's
own code and on a learner's correct solution, and fail, naming the field or case, on the usual
mistakes: positions not offset by the computed tokens, a slot in the wrong block, top-p keeping
one token too few, temperature applied after the softmax."""

from __future__ import annotations

import pytest
import torch

from minivllm.kernels import reference
from minivllm.labs import LabCheckFailed
from minivllm.labs import model_input as lab06
from minivllm.labs import sampler as lab07
from minivllm.model_executor.layers.sampler import Sampler
from minivllm.worker.model_runner import ModelRunner
from minivllm.worker.worker import Worker


# ------------------------------------------------------------------------------ lab 06
def slots_for(block_table, start, num_tokens, block_size):
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, start + num_tokens)]


def slots_of_last_block(block_table, start, num_tokens, block_size):
    """Wrong: every token in the table's last block."""
    return [block_table[-1] * block_size + p % block_size for p in range(start, start + num_tokens)]


def slots_by_chunk_index(block_table, start, num_tokens, block_size):
    """Wrong: the block of the token's index in the chunk, not of its position."""
    return [block_table[i // block_size] * block_size + (start + i) % block_size for i in range(num_tokens)]


class SolutionRunner(ModelRunner):
    """A learner's correct `build_flat_batch`; `offset_positions` and `slots` plant the mistakes."""

    offset_positions = True
    slots = staticmethod(slots_for)

    def build_flat_batch(self, seq_group_metadata_list):
        batch = lab06.FlatBatch([], [], [], [], [], [], 0, [])
        for metadata in seq_group_metadata_list:
            for seq_id, data in metadata.seq_data.items():
                if metadata.is_prompt:
                    start = data.num_computed_tokens
                    tokens = data.get_token_ids()[start:start + metadata.token_chunk_size]
                    batch.num_prefills += 1
                else:
                    start, tokens = data.get_len() - 1, [data.get_last_token_id()]
                table = metadata.block_tables[seq_id]
                first = start if self.offset_positions or not metadata.is_prompt else 0
                batch.input_ids += tokens
                batch.positions += range(first, first + len(tokens))
                batch.slot_mapping += self.slots(table, start, len(tokens), self.block_size)
                batch.block_tables.append(table)
                batch.context_lens.append(start)
                batch.query_lens.append(len(tokens))
                if metadata.do_sample:
                    batch.selected_token_indices.append(len(batch.input_ids) - 1)
        return batch

    def prepare_model_input(self, seq_group_metadata_list):
        return lab06.pack_model_input(self.build_flat_batch(seq_group_metadata_list), seq_group_metadata_list,
                                      self.device)


class PackageRunner(SolutionRunner):
    """The package's own `prepare_model_input`, read back as lists."""

    def build_flat_batch(self, seq_group_metadata_list):
        return lab06.flat_batch_of(ModelRunner.prepare_model_input(self, seq_group_metadata_list),
                                   seq_group_metadata_list)


class UnoffsetPositions(SolutionRunner):
    """Wrong: a prefill's positions count from 0, not from its computed tokens."""

    offset_positions = False


class WrongBlockSlots(SolutionRunner):
    """Wrong: slots in the block of the chunk's index, not of the position."""

    slots = staticmethod(slots_by_chunk_index)


def _worker_with(runner_cls):
    class LabWorker(Worker):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.model_runner = runner_cls(self.engine_config, self.device)

    return LabWorker


def test_lab06_unit_checks_pass_on_the_package_and_a_solution():
    lab06.check_slots(slots_for)
    lab06.check_flat_batch(PackageRunner)
    lab06.check_flat_batch(SolutionRunner)


@pytest.mark.parametrize("wrong", [slots_of_last_block, slots_by_chunk_index])
def test_lab06_slot_check_fails_on_a_slot_in_the_wrong_block(wrong):
    with pytest.raises(LabCheckFailed, match="should be slot"):
        lab06.check_slots(wrong)


@pytest.mark.parametrize(("runner_cls", "field"), [(UnoffsetPositions, "positions differs"),
                                                    (WrongBlockSlots, "slot_mapping differs")])
def test_lab06_batch_check_names_the_wrong_field(runner_cls, field):
    with pytest.raises(LabCheckFailed, match=f"case .*: {field}"):
        lab06.check_flat_batch(runner_cls)


def test_lab06_skeleton_fails_with_not_implemented():
    class Skeleton(ModelRunner):
        def build_flat_batch(self, seq_group_metadata_list):
            raise NotImplementedError("write `build_flat_batch`")

    with pytest.raises(NotImplementedError):
        lab06.check_flat_batch(Skeleton)


def test_lab06_engine_check_passes_with_mixed_steps_and_cached_prefixes(capsys):
    lab06.check_model_input_in_engine(_worker_with(SolutionRunner), SolutionRunner)
    assert "mixed steps" in capsys.readouterr().out


def test_lab06_engine_check_fails_on_slots_in_the_wrong_block():
    with pytest.raises(LabCheckFailed, match="transformers says"):
        lab06.check_model_input_in_engine(_worker_with(WrongBlockSlots), WrongBlockSlots)


def test_lab06_engine_check_refuses_a_worker_without_the_learners_runner():
    with pytest.raises(LabCheckFailed, match="model runner"):
        lab06.check_model_input_in_engine(Worker, SolutionRunner)


# ------------------------------------------------------------------------------ lab 07
def kept_mask(z, top_k, top_p, min_p):
    vocab_size = z.shape[1]
    values, order = z.sort(dim=-1, descending=True)
    k = torch.where((top_k <= 0) | (top_k >= vocab_size), vocab_size, top_k)
    in_top_k = values >= values.gather(1, (k - 1).unsqueeze(1))
    probs = values.masked_fill(~in_top_k, -float("inf")).softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    in_top_p = (mass_before < top_p.unsqueeze(1)) | (top_p >= 1.0).unsqueeze(1)
    in_top_p[:, 0] = True
    in_min_p = torch.exp(values - values[:, :1]) >= min_p.unsqueeze(1)
    kept = in_top_k & in_top_p & in_min_p
    return torch.zeros_like(kept).scatter(1, order, kept)


def kept_mask_top_p_one_short(z, top_k, top_p, min_p):
    """Wrong: stops before the token whose probability reaches top_p."""
    vocab_size = z.shape[1]
    values, order = z.sort(dim=-1, descending=True)
    k = torch.where((top_k <= 0) | (top_k >= vocab_size), vocab_size, top_k)
    in_top_k = values >= values.gather(1, (k - 1).unsqueeze(1))
    probs = values.masked_fill(~in_top_k, -float("inf")).softmax(dim=-1)
    in_top_p = (probs.cumsum(dim=-1) < top_p.unsqueeze(1)) | (top_p >= 1.0).unsqueeze(1)
    in_top_p[:, 0] = True
    in_min_p = torch.exp(values - values[:, :1]) >= min_p.unsqueeze(1)
    kept = in_top_k & in_top_p & in_min_p
    return torch.zeros_like(kept).scatter(1, order, kept)


def sampling_probs(logits, temperature, top_k, top_p, min_p):
    z = logits.float() / torch.where(temperature == 0, 1.0, temperature).unsqueeze(1)
    kept = kept_mask(z, top_k, top_p, min_p)
    return z.double().masked_fill(~kept, -float("inf")).softmax(dim=-1)


def sampling_probs_temperature_after_softmax(logits, temperature, top_k, top_p, min_p):
    """Wrong: filters and softmax on the raw logits, then the probabilities divided by T."""
    kept = kept_mask(logits.float(), top_k, top_p, min_p)
    probs = logits.double().masked_fill(~kept, -float("inf")).softmax(dim=-1)
    probs = probs / torch.where(temperature == 0, 1.0, temperature).double().unsqueeze(1)
    return probs / probs.sum(dim=-1, keepdim=True)


def seeded_draw(probs, seeds, offsets):
    tokens = []
    for row, seed, offset in zip(probs, seeds.tolist(), offsets.tolist()):
        generator = torch.Generator(device=probs.device).manual_seed(reference.mix_seed(seed, offset))
        uniform = torch.rand(probs.shape[1], generator=generator, dtype=torch.float64, device=probs.device)
        tokens.append(int((row / -torch.log1p(-uniform)).argmax()))
    return torch.tensor(tokens, dtype=torch.int64, device=probs.device)


def seeded_draw_by_row_index(probs, seeds, offsets):
    """Wrong: the stream of the row's index in the batch, not of its position."""
    return seeded_draw(probs, seeds, torch.arange(len(seeds)))


def _sampler_worker(sample_tokens):
    class LabSampler(Sampler):
        def __init__(self, backend="torch"):
            super().__init__(backend)
            self.device_sampler.sample_tokens = sample_tokens

    class LabRunner(ModelRunner):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.sampler = LabSampler(self.backend)

    return _worker_with(LabRunner), LabSampler


PACKAGE_PIECES = (reference.kept_mask, lab07.reference_probs, lab07.reference_draw)
SOLUTION_PIECES = (kept_mask, sampling_probs, seeded_draw)


@pytest.mark.parametrize("pieces", [PACKAGE_PIECES, SOLUTION_PIECES], ids=["package", "solution"])
def test_lab07_unit_checks_pass_on_the_package_and_a_solution(pieces):
    mask, probs, draw = pieces
    lab07.check_kept_mask(mask)
    lab07.check_sampling_probs(probs)
    lab07.check_seeded_draw(draw)
    lab07.check_sample_tokens(lab07.sample_tokens_from(probs, draw))


def test_lab07_mask_check_fails_when_top_p_keeps_one_token_too_few():
    with pytest.raises(LabCheckFailed, match=r"top-p = 0.6.*missing"):
        lab07.check_kept_mask(kept_mask_top_p_one_short)


def test_lab07_probability_check_fails_on_temperature_after_softmax():
    with pytest.raises(LabCheckFailed, match="temperature 0.5"):
        lab07.check_sampling_probs(sampling_probs_temperature_after_softmax)


def test_lab07_draw_check_fails_on_a_stream_of_the_row_index():
    with pytest.raises(LabCheckFailed, match="batch"):
        lab07.check_seeded_draw(seeded_draw_by_row_index)


def test_lab07_pipeline_check_fails_on_temperature_after_softmax():
    wrong = lab07.sample_tokens_from(sampling_probs_temperature_after_softmax, seeded_draw)
    with pytest.raises(LabCheckFailed, match="chi-square"):
        lab07.check_sample_tokens(wrong)


@pytest.mark.parametrize("pieces", [PACKAGE_PIECES[1:], SOLUTION_PIECES[1:]], ids=["package", "solution"])
def test_lab07_engine_check_passes(pieces, capsys):
    lab07.check_sampler_in_engine(*_sampler_worker(lab07.sample_tokens_from(*pieces)))
    assert "token-identical to the package's Sampler" in capsys.readouterr().out


def test_lab07_engine_check_fails_on_temperature_after_softmax():
    wrong = lab07.sample_tokens_from(sampling_probs_temperature_after_softmax, seeded_draw)
    with pytest.raises(LabCheckFailed, match="the package's Sampler draws"):
        lab07.check_sampler_in_engine(*_sampler_worker(wrong))


def test_lab07_probability_check_asks_for_float64():
    def fp32_softmax(logits, temperature, top_k, top_p, min_p):
        z = logits.float() / torch.where(temperature == 0, 1.0, temperature).unsqueeze(1)
        return z.masked_fill(~kept_mask(z, top_k, top_p, min_p), -float("inf")).softmax(dim=-1).double()

    with pytest.raises(LabCheckFailed, match="float64"):
        lab07.check_sampling_probs(fp32_softmax)
