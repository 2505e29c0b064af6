"""One node's engine. `from engine import LLM, SamplingParams`."""
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "SamplingParams"]


def __getattr__(name):  # lazy: importing SamplingParams must not load torch
    if name == "LLM":
        from engine.llm import LLM
        return LLM
    if name == "LLMEngine":
        from engine.llm_engine import LLMEngine
        return LLMEngine
    raise AttributeError(name)
