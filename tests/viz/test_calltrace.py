"""The call graph is recorded from a real run: the step's path down the stack is in it."""

from minivllm import LLM
from minivllm.viz.calltrace import COMPONENTS, POSITIONS, record_llm_generate


def test_generate_walks_the_stack_top_down():
    run, setup = record_llm_generate(lambda: LLM(seed=0, device="cpu"), max_tokens=3)
    for caller, callee, method in [("LLM", "LLMEngine", "step"), ("LLMEngine", "Scheduler", "schedule"),
                                   ("Scheduler", "BlockSpaceManager", "allocate"),
                                   ("LLMEngine", "UniProcExecutor", "execute_model"),
                                   ("UniProcExecutor", "Worker", "execute_model"),
                                   ("Worker", "ModelRunner", "execute_model"),
                                   ("ModelRunner", "LlamaForCausalLM", "forward"),
                                   ("LlamaForCausalLM", "Attention", "forward"), ("ModelRunner", "Sampler", "forward")]:
        assert run.edges[(caller, callee)][method] >= 1, (caller, callee, method)
    # Three generated tokens for two prompts: three steps, each one schedule and one forward pass.
    assert run.edges[("LLMEngine", "Scheduler")]["schedule"] == run.edges[("Worker", "ModelRunner")]["execute_model"]
    # The scheduler never calls into the compute stack, and nothing below calls up.
    assert not any(caller in ("Scheduler", "BlockSpaceManager") and COMPONENTS[callee] not in ("core",)
                   for caller, callee in run.edges)
    # The setup is where the cache is sized and allocated.
    assert ("Worker", "CacheEngine") in setup.edges
    assert set(COMPONENTS) == set(POSITIONS)
