"""A value computed for one batch of requests, kept while the next batches hold the same requests
in the same order (most decode steps): what the sampler and the penalty state derive from the
requests' sampling parameters, which never change, is built once per batch composition."""

from __future__ import annotations

from typing import Any

from deepbatch.core.request import Request


class BatchMemo:
    def __init__(self) -> None:
        self._key: tuple[list[int], Any] | None = None
        # The requests themselves are held, so no id of theirs can be reused while the key is kept.
        self._requests: list[Request] = []
        self._value: Any = None

    def get(self, requests: list[Request], extra: Any = None) -> Any:
        """The value put for this batch (the same requests, in order, and the same ``extra``), or None."""
        if self._key is not None and self._key == (list(map(id, requests)), extra):
            return self._value
        return None

    def put(self, requests: list[Request], value: Any, extra: Any = None) -> Any:
        self._key, self._requests, self._value = (list(map(id, requests)), extra), list(requests), value
        return value

    def clear(self) -> None:
        self._key, self._requests, self._value = None, [], None
