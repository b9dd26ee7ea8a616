"""What the ingress and the engine replicas send each other through Ray (pickled).

    ingress  --EngineCall-->  replica.generate
             <--Accepted | Refusal--   first item: queued, or refused by the engine's checks
             <--RequestOutput ...--    cumulative outputs, the last one finished

Engine exceptions are rebuilt on the ingress from a ``Refusal`` rather than pickled: their
constructors take arguments that their pickled form does not carry.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from deepbatch.engine.admission import QueueFullError
from deepbatch.engine.engine_client import EngineDrainingError
from deepbatch.core.errors import EngineDeadError, InvalidRequestError
from deepbatch.core.sampling_params import SamplingParams


@dataclass
class EngineCall:
    request_id: str
    prompt: dict  # {"prompt_token_ids": [...], "prompt": text or None}
    params: SamplingParams
    priority: int
    tenant: str
    # Read by the router: the prompt's chained block hashes, and the session to stick to.
    block_hashes: list[int] = field(default_factory=list)
    session: str | None = None


@dataclass(frozen=True)
class Accepted:
    replica: str  # the replica's id, for logs and per-replica counts


@dataclass(frozen=True)
class Refusal:
    kind: str  # "invalid" | "queue_full" | "draining" | "dead"
    message: str
    param: str | None = None
    code: str = "invalid_value"
    retry_after: float = 1.0

    @classmethod
    def of(cls, e: Exception) -> Refusal:
        if isinstance(e, InvalidRequestError):
            # InvalidRequestError prefixes its message with the param; rebuilt below, it would twice.
            message = e.message[len(e.param) + 2:] if e.param and e.message.startswith(f"{e.param}: ") else e.message
            return cls("invalid", message, e.param, e.code)
        if isinstance(e, QueueFullError):
            return cls("queue_full", str(e), retry_after=e.retry_after)
        if isinstance(e, EngineDrainingError):
            return cls("draining", str(e))
        return cls("dead", str(e))

    def error(self) -> Exception:
        if self.kind == "invalid":
            return InvalidRequestError(self.param, self.message, self.code)
        if self.kind == "queue_full":
            return QueueFullError(self.message, self.retry_after)
        if self.kind == "draining":
            return EngineDrainingError(self.message)
        return EngineDeadError(self.message)


# What a replica refuses with a Refusal; anything else it raises is a replica failure.
REFUSED = (InvalidRequestError, QueueFullError, EngineDrainingError, EngineDeadError)
