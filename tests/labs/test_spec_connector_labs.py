"""Labs 08 (the rejection sampler) and 09 (a KV connector): their checks pass on the package's own
code and on the notebooks' solutions, and fail, naming the case, on the usual mistakes:
accepting with p/q uncapped, resampling from p instead of max(0, p - q), accepted drafts that are
not a prefix, a worker that keeps the package's sampler; a connector that reports matched tokens
it never loads, matches the block of the prompt's last token, or ignores the local hits."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import nbformat
import pytest
import torch

from minivllm.distributed.kv_transfer import register_connector
from minivllm.distributed.kv_transfer.store_connector import KVStore, StoreConnector
from minivllm.labs import LabCheckFailed
from minivllm.labs import kv_connector as lab09
from minivllm.labs import rejection_sampler as lab08
from minivllm.model_executor.layers.rejection_sampler import RejectionSampler
from minivllm.spec_decode.spec_decode_worker import SpecDecodeWorker

LABS = Path(__file__).resolve().parents[2] / "notebooks" / "labs"


def notebook_module(name: str, notebook: str, defines: tuple[str, ...], preamble: str) -> types.ModuleType:
    """The notebook's cells that define `defines`, run after `preamble` in a module named `name`
    (importable: the KV connector factory imports its class by module and name)."""
    if name in sys.modules:
        return sys.modules[name]
    module = types.ModuleType(name)
    exec(preamble, module.__dict__)
    for cell in nbformat.read(LABS / notebook, as_version=4).cells:
        if cell.cell_type == "code" and any(f"class {d}(" in cell.source or f"class {d}:" in cell.source
                                            for d in defines):
            exec(cell.source, module.__dict__)
    missing = [d for d in defines if d not in module.__dict__]
    assert not missing, f"{notebook}: no cell defines {missing}"
    sys.modules[name] = module
    return module


# ------------------------------------------------------------------------------ lab 08
@pytest.fixture(scope="module")
def lab08_solution():
    return notebook_module("lab08_solution", "lab08_rejection_sampler.ipynb",
                           ("MyRejectionSampler", "MySpecDecodeWorker"),
                           "import torch\nimport torch.nn.functional as F\n"
                           "from minivllm.model_executor.layers.rejection_sampler import NO_TOKEN\n"
                           "from minivllm.spec_decode.spec_decode_worker import SpecDecodeWorker\n")


def test_lab08_unit_checks_pass_on_the_solution(lab08_solution):
    lab08.check_rejection_sampler(lab08_solution.MyRejectionSampler)


def test_lab08_call_checks_pass_on_the_package_sampler():
    lab08.check_greedy(RejectionSampler)
    lab08.check_sampled_distribution(RejectionSampler)


def test_lab08_accepting_with_p_over_q_uncapped_fails(lab08_solution):
    class NoMin(lab08_solution.MyRejectionSampler):
        def accept_probs(self, target_probs, draft_probs, draft_token_ids):
            k = draft_token_ids.shape[1]
            index = draft_token_ids.unsqueeze(2)
            return (target_probs[:, :k].gather(2, index) / draft_probs.gather(2, index)).squeeze(2)

    with pytest.raises(LabCheckFailed, match=r"accept_probs .* expected min\(1, .*a probability is at most 1"):
        lab08.check_accept_probs(NoMin)
    with pytest.raises(LabCheckFailed, match="should have probability"):
        lab08.check_exact_distribution(NoMin)


def test_lab08_resampling_from_p_fails(lab08_solution):
    class FromP(lab08_solution.MyRejectionSampler):
        def recovered_probs(self, target_probs, draft_probs):
            return target_probs[:, :draft_probs.shape[1]]

    with pytest.raises(LabCheckFailed, match=r"recovered_probs .* expected norm\(max\(0, p - q\)\)"):
        lab08.check_recovered_probs(FromP)
    with pytest.raises(LabCheckFailed, match="should have probability"):
        lab08.check_exact_distribution(FromP)
    # The sampled check alone catches it too, from the call's output.
    with pytest.raises(LabCheckFailed, match="the target's p says"):
        lab08.check_sampled_distribution(FromP)


def test_lab08_accepted_drafts_that_are_not_a_prefix_fail(lab08_solution):
    class NotAPrefix(lab08_solution.MyRejectionSampler):
        def __call__(self, target_probs, draft_token_ids, num_proposed, draft_probs=None, generator=None):
            # Wrong: counts every accepted draft, not the leading run.
            batch, k = draft_token_ids.shape
            q = draft_probs if draft_probs is not None else torch.nn.functional.one_hot(
                draft_token_ids, target_probs.shape[2]).float()
            accepted = (torch.rand(batch, k, generator=generator) < self.accept_probs(target_probs, q, draft_token_ids))
            accepted &= torch.arange(k) < num_proposed.unsqueeze(1)
            n = accepted.sum(dim=1)
            output = torch.full((batch, k + 1), -1)
            output[:, :k] = torch.where(torch.arange(k) < n.unsqueeze(1), draft_token_ids, -1)
            output[torch.arange(batch), n] = target_probs[torch.arange(batch), n].argmax(dim=1)
            return output

    with pytest.raises(LabCheckFailed, match=r"greedy, .* row 2: drafts \[3, 6, 4\]"):
        lab08.check_greedy(NotAPrefix)


class PackageSampler(RejectionSampler):
    """The package's own sampler, as a learner's class."""


class PackageSamplerWorker(SpecDecodeWorker):
    def __init__(self, engine_config):
        super().__init__(engine_config)
        self.rejection_sampler = PackageSampler()


class NeverAccepts(RejectionSampler):
    def __call__(self, target_probs, draft_token_ids, num_proposed, draft_probs=None, generator=None):
        return super().__call__(target_probs, draft_token_ids, torch.zeros_like(num_proposed), draft_probs, generator)


class NeverAcceptsWorker(SpecDecodeWorker):
    def __init__(self, engine_config):
        super().__init__(engine_config)
        self.rejection_sampler = NeverAccepts()


def test_lab08_engine_check_passes_on_the_package_sampler():
    tokens = lab08.check_in_engine(PackageSamplerWorker, max_tokens=8)
    assert len(tokens) == 4 and all(len(t) == 8 for t in tokens)


def test_lab08_engine_check_fails_on_a_worker_that_keeps_the_package_sampler():
    with pytest.raises(LabCheckFailed, match="still the package's RejectionSampler"):
        lab08.check_in_engine(SpecDecodeWorker, max_tokens=4)


def test_lab08_engine_check_fails_when_no_draft_is_accepted():
    # Greedy output stays right (every step emits the target's arg-max): only the counter tells.
    with pytest.raises(LabCheckFailed, match="none accepted by NeverAccepts"):
        lab08.check_in_engine(NeverAcceptsWorker, max_tokens=8)


# ------------------------------------------------------------------------------ lab 09
@pytest.fixture(scope="module")
def lab09_solution():
    module = notebook_module("lab09_solution", "lab09_kv_connector.ipynb", ("DictConnector",),
                             "from minivllm.distributed.kv_transfer import (KVConnectorBase, KVConnectorMetadata,\n"
                             "                                              ReqMeta)\n"
                             "from minivllm.distributed.kv_transfer.keys import block_digests\n")
    module.FakeLoads = type("FakeLoads", (module.DictConnector,), {"start_load_kv": _counts_loads_it_never_makes})
    for name in ("DictConnector", "FakeLoads"):
        register_connector(f"Lab09Solution{name}", "lab09_solution", name)
    return module


def _counts_loads_it_never_makes(self):
    """Wrong: reports (and counts) the matched blocks, copies nothing into the cache."""
    for r in self._get_connector_metadata().requests:
        self.stats.num_tokens_loaded += self.block_size * len(r.load)


class DictKVStore(KVStore):
    """The package's store interface over a dict: the package's connector logic with lab 09's store."""

    def __init__(self, values: dict) -> None:
        self.values = values

    def exists(self, keys):
        return all(key in self.values for key in keys)

    def get(self, key, max_bytes):
        data = self.values.get(key)
        return data if data is not None and len(data) <= max_bytes else None

    def put_many(self, items):
        self.values.update(items)
        return len(items)


class PackageDictConnector(StoreConnector):
    def make_store(self) -> KVStore:
        return DictKVStore(self.extra_config["store"])


# The factory imports a connector by module and name: give the class a module of its own.
sys.modules.setdefault("lab09_package_connector", types.ModuleType("lab09_package_connector"))
sys.modules["lab09_package_connector"].PackageDictConnector = PackageDictConnector
register_connector("Lab09PackageDictConnector", "lab09_package_connector", "PackageDictConnector")


def test_lab09_unit_checks_pass_on_the_solution(lab09_solution):
    lab09.check_connector(lab09_solution.DictConnector)


def test_lab09_unit_checks_pass_on_the_package_connector():
    lab09.check_connector(PackageDictConnector)


def test_lab09_engine_check_passes_on_the_solution(lab09_solution):
    lab09.check_in_engine("Lab09SolutionDictConnector", max_tokens=8)


def test_lab09_engine_check_passes_on_the_package_connector():
    lab09.check_in_engine("Lab09PackageDictConnector", max_tokens=8)


def test_lab09_a_connector_that_reports_loads_it_never_makes_fails(lab09_solution):
    with pytest.raises(LabCheckFailed, match="the matched tokens were not loaded"):
        lab09.check_connector(lab09_solution.FakeLoads)
    with pytest.raises(LabCheckFailed, match="engine 2: .* does not hold what engine 1 saved"):
        lab09.check_in_engine("Lab09SolutionFakeLoads", max_tokens=8)


def test_lab09_matching_the_last_tokens_block_fails(lab09_solution):
    class AllFullBlocks(lab09_solution.DictConnector):
        def _keys(self, request):  # wrong: every full block, the last token's too
            tokens = request.first_seq.get_token_ids()
            return lab09_solution.block_digests(tokens + [0], self.block_size, self.root)

    with pytest.raises(LabCheckFailed, match=r"its first 20 tokens .* expected 16 tokens .* got 20"):
        lab09.check_connector(AllFullBlocks)


def test_lab09_ignoring_the_local_hits_fails(lab09_solution):
    class FromBlockZero(lab09_solution.DictConnector):
        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            return super().get_num_new_matched_tokens(request, 0)  # wrong: counts the local hits again

    with pytest.raises(LabCheckFailed, match=r"8 tokens already cached locally, num_computed_tokens=8\): expected 12"):
        lab09.check_connector(FromBlockZero)
