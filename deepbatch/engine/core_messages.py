"""The messages between the API process and the engine core process (``core_process.py``).

    API process (EngineCoreClient)                       engine core process (EngineCore)
    ------------------------------                       --------------------------------
    AddRequest / Abort /           -- PUSH ---- PULL ->  input thread -> inbox -> busy loop
      FinishSample / Shutdown
    asyncio reader                 <- PULL ---- PUSH --  Ready (once), StepOutputs (one per
                                                         engine iteration), Dead (once)

Everything on the hot path is a ``msgspec`` struct encoded as MessagePack: an ``AddRequest``
carries token ids (the API process tokenizes), and a ``StepOutputs`` carries, for every request
that made progress in one engine iteration, only what is new since the previous message (token
ids and logprobs past an offset), never the whole output again and never a tensor. Text is the
API process's work: it detokenizes, finds stop strings and ends a sample with ``FinishSample``. The
engine's counters (``EngineSnapshot``) ride along at most ten times a second, pickled: they are
small, off the per-token path, and their classes belong to the engine.
"""

from __future__ import annotations

from dataclasses import replace

import msgspec

from deepbatch.core.sampling_params import SamplingParams

# -- API process -> engine core ---------------------------------------------------------------


class AddRequest(msgspec.Struct, tag=True, array_like=True):
    """One prompt of an API call, already tokenized and validated (the core checks it again)."""

    request_id: str
    prompt_token_ids: list[int]
    prompt: str | None
    params: SamplingParams
    priority: int
    tenant: str
    arrival_time: float  # time.monotonic(): one clock for every process on the host


def wire_params(params: SamplingParams) -> SamplingParams:
    """``params`` without what an engine attached to them (a compiled grammar, EOS ids): the core
    attaches its own, and a compiled grammar is no message."""
    if params._compiled_grammar is None and not params._eos_token_ids:
        return params
    return replace(params, _compiled_grammar=None, _eos_token_ids=frozenset())


class Abort(msgspec.Struct, tag=True, array_like=True):
    request_ids: list[str]


class FinishSample(msgspec.Struct, tag=True, array_like=True):
    """End one sample of a request, as the API process decided from its text: a stop string
    (``stop_reason``) or text that could not be decoded (``error``). The core frees it and counts
    it as stopped (or failed); tokens it sampled meanwhile are not used."""

    request_id: str
    index: int
    stop_reason: str | None
    error: str | None = None


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    """Stop after the step in progress; every request still held ends with an error."""


class SetStepDelay(msgspec.Struct, tag=True, array_like=True):
    """Testing only: sleep ``seconds`` before every model step from now on (0: never), to make a
    live engine slow on purpose (a canary that breaks its latency objective)."""

    seconds: float


ClientMessage = AddRequest | Abort | FinishSample | Shutdown | SetStepDelay

# -- engine core -> API process -----------------------------------------------------------------


class Ready(msgspec.Struct, tag=True, array_like=True):
    """Sent once the model, the KV cache and the CUDA graphs are set up."""

    pid: int
    num_blocks: int
    cache_info: dict[str, str] | None  # the labels of vllm:cache_config_info
    snapshot: bytes  # a pickled EngineSnapshot


class CompletionDelta(msgspec.Struct, array_like=True, gc=False):
    """What is new in one sample's output: ``token_ids`` and ``logprobs`` extend the lists from
    their offsets. No text: the API process detokenizes (``output_assembler.py``)."""

    index: int
    token_offset: int
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None
    logprobs_offset: int = 0
    # Logprobs past ``logprobs_offset``: {token: (logprob, rank)} per token, the sampled one first.
    logprobs: list[dict[int, tuple[float, int | None]]] | None = None


class OutputDelta(msgspec.Struct, array_like=True, gc=False):
    """One parent request's progress in one engine iteration."""

    request_id: str
    completions: list[CompletionDelta]
    finished: bool
    num_cached_tokens: int
    error: str | None
    error_code: str | None
    # RequestMetrics: arrival, first scheduled, first token, finished, preemptions; sent until
    # the first token, then only at the end (None in between: unchanged).
    metrics: tuple[float, float | None, float | None, float | None, int] | None
    # Prompt logprobs past ``prompt_logprobs_offset``: None entries, or {token: (logprob, rank)}.
    prompt_logprobs_offset: int = 0
    prompt_logprobs: list[dict[int, tuple[float, int | None]] | None] | None = None
    # The core refused the request before queueing it: (kind, param, message, code), kind
    # "invalid" (an InvalidRequestError) or "error" (anything else).
    refusal: tuple[str, str | None, str, str] | None = None


class StepOutputs(msgspec.Struct, tag=True, array_like=True):
    """One engine iteration: the outputs, and the waiting queue as the iteration left it (the API
    process checks its queue bounds against it)."""

    outputs: list[OutputDelta]
    applied_seqs: int  # sequences and prompt tokens of every AddRequest applied so far
    applied_tokens: int
    # For the queue's drain rate (QueueBounds.observe): the iteration's span, whether requests
    # waited when it began, and the waiting (sequences, tokens) around its step; ``waiting_after``
    # is also the queue the API process checks its bounds against.
    start: float
    end: float
    backlog: bool
    waiting_before: tuple[int, int]
    waiting_after: tuple[int, int]
    snapshot: bytes | None = None  # a pickled EngineSnapshot, at most every SNAPSHOT_INTERVAL_S


class Dead(msgspec.Struct, tag=True, array_like=True):
    """The engine failed (a model step raised, a rank died) or was stopped; the core exits."""

    message: str


CoreMessage = Ready | StepOutputs | Dead

SNAPSHOT_INTERVAL_S = 0.1

_encoder = msgspec.msgpack.Encoder()
_client_decoder = msgspec.msgpack.Decoder(ClientMessage)
_core_decoder = msgspec.msgpack.Decoder(CoreMessage)


def encode(message: ClientMessage | CoreMessage) -> bytes:
    return _encoder.encode(message)


def decode_client_message(data: bytes) -> ClientMessage:
    return _client_decoder.decode(data)


def decode_core_message(data: bytes) -> CoreMessage:
    return _core_decoder.decode(data)
