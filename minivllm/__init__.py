"""minivllm: an educational reference implementation of vLLM's (v0) architecture.

    from minivllm import LLM, SamplingParams
    llm = LLM()  # the bundled tiny-shakespeare model
    outputs = llm.generate(["ROMEO:"], SamplingParams(temperature=0.0, max_tokens=32))
"""

from minivllm.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["SamplingParams", "__version__"]
