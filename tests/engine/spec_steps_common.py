"""Speculative decoding's test helper: steps with and without drafts alternating under async
scheduling."""

from __future__ import annotations


def alternate_draft_steps(engine, monkeypatch) -> list[bool]:
    """Run ``engine`` asynchronously with two steps in three drafting (synchronous) and the third
    without drafts (launched before the one in flight is committed); returns the choices made."""
    monkeypatch.setattr(engine, "async_scheduling", True)
    choices: list[bool] = []

    def alternate() -> bool:
        choices.append(len(choices) % 3 != 0)
        return choices[-1]

    monkeypatch.setattr(engine, "_wants_drafts", alternate)
    return choices
