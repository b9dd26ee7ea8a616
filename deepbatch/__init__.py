"""deepbatch: an LLM serving engine for DeepSeek-family models and their relatives."""

import os as _os

# CPU inference threads should sleep, not spin, while they wait at a barrier: with spinning, any
# other busy thread (the HTTP loop, a tokenizer, another process) stalls every matmul for a
# scheduler time slice (measured on 2 cores under load: a [16 x 576] x [576 x 3072] matmul took
# 18.8 ms spinning vs 4.6 ms passive). It only takes effect if torch is not imported yet.
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from deepbatch.core.errors import EngineDeadError, InvalidRequestError  # noqa: E402
from deepbatch.core.outputs import CompletionOutput, RequestOutput  # noqa: E402
from deepbatch.core.sampling_params import SamplingParams  # noqa: E402

__version__ = "0.1.0"


def __getattr__(name):
    # LLM pulls in torch and the model code; import it on first use so `import deepbatch` is light.
    if name == "LLM":
        from deepbatch.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "InvalidRequestError", "EngineDeadError"]
