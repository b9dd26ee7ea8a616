"""Moved to ``deepbatch.core.request``; re-exported until every caller imports it from there."""

from deepbatch.core.request import Request, RequestStatus  # noqa: F401
