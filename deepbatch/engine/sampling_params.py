"""Moved to ``deepbatch.core.sampling_params``; re-exported until every caller imports it from there."""

from deepbatch.core.sampling_params import SamplingParams, SamplingParamsError, StructuredOutputsParams  # noqa: F401
