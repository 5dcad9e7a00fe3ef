"""minivllm: an educational reference implementation of vLLM's (v0) architecture.

    from minivllm import LLM, SamplingParams
    llm = LLM()  # the bundled tiny-shakespeare model
    outputs = llm.generate(["ROMEO:"], SamplingParams(temperature=0.0, max_tokens=32))

`import minivllm` stays light (no torch, no transformers): `LLM`, `LLMEngine`, ... are
imported on first use through the module-level `__getattr__` below (PEP 562).
"""

from minivllm.sampling_params import SamplingParams

__version__ = "0.1.0"

# public name -> module that defines it, imported when the name is first used.
_LAZY_EXPORTS = {
    "LLM": "minivllm.entrypoints.llm",
    "LLMEngine": "minivllm.engine.llm_engine",
    "EngineArgs": "minivllm.engine.arg_utils",
    "RequestOutput": "minivllm.outputs",
    "CompletionOutput": "minivllm.outputs",
    "ModelRegistry": "minivllm.model_executor.models",
}
__all__ = ["SamplingParams", "__version__", *_LAZY_EXPORTS]


def __getattr__(name: str):
    if name in _LAZY_EXPORTS:
        import importlib

        value = getattr(importlib.import_module(_LAZY_EXPORTS[name]), name)
        globals()[name] = value  # cache: the next lookup is a plain attribute
        return value
    raise AttributeError(f"module 'minivllm' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
