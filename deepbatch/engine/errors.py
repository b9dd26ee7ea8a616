"""Moved to ``deepbatch.core.errors``; re-exported until every caller imports it from there."""

from deepbatch.core.errors import EngineDeadError, InvalidRequestError  # noqa: F401
