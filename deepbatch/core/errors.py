"""Errors a caller can act on. ``param`` names the offending input and ``code`` is a short
machine-readable reason (the OpenAI error body carries both)."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    def __init__(self, param: str | None, message: str, code: str = "invalid_value"):
        super().__init__(f"{param}: {message}" if param else message)
        self.param = param
        self.code = code
        self.message = str(self)


class EngineDeadError(RuntimeError):
    """The engine loop stopped after a fault; no request can make progress."""
