"""Moved to ``deepbatch.core.outputs``; re-exported until every caller imports it from there."""

from deepbatch.core.outputs import CompletionOutput, RequestMetrics, RequestOutput  # noqa: F401
