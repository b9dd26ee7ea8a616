"""The embedded SmolLM2 (shared with the rest of the suite), with async scheduling restored after
each test."""

from __future__ import annotations

import pytest


@pytest.fixture
def llm(smollm_llm):
    engine = smollm_llm.engine
    saved = engine.async_scheduling
    yield smollm_llm
    engine.async_scheduling = saved
    assert not engine.has_unfinished_requests()

