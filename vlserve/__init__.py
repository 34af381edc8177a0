"""vlserve: a paged-KV, continuous-batching serving engine for vision/audio-language models."""

from vlserve.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from vlserve.outputs import CompletionOutput, Logprob, RequestOutput
from vlserve.sampling_params import SamplingParams
from vlserve.structured_output.params import StructuredOutputsParams

__version__ = "0.1.0"
__all__ = [
    "LLM",
    "AsyncLLM",
    "SamplingParams",
    "StructuredOutputsParams",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "BeamSearchParams",
    "BeamSearchOutput",
    "BeamSearchSequence",
    "LoRARequest",
    "__version__",
]


def __getattr__(name):
    # LLM pulls in torch and transformers; import it lazily so `import vlserve` stays light.
    if name == "LLM":
        from vlserve.llm import LLM

        return LLM
    if name == "LoRARequest":  # vlserve.lora pulls in torch
        from vlserve.lora.request import LoRARequest

        return LoRARequest
    if name == "AsyncLLM":
        from vlserve.engine.async_llm import AsyncLLM

        return AsyncLLM
    raise AttributeError(name)
