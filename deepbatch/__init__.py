"""deepbatch: an LLM serving engine for DeepSeek-family models and their relatives."""

from deepbatch.engine.errors import EngineDeadError, InvalidRequestError
from deepbatch.engine.outputs import CompletionOutput, RequestOutput
from deepbatch.engine.sampling_params import SamplingParams

__version__ = "0.1.0"


def __getattr__(name):
    # LLM pulls in torch and the model code; import it on first use so `import deepbatch` is light.
    if name == "LLM":
        from deepbatch.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "InvalidRequestError", "EngineDeadError"]
