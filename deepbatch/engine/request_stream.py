"""One request's updates on the event loop side of the async engine."""

from __future__ import annotations

import asyncio

from deepbatch.core.outputs import RequestOutput


class RequestStream:
    """Updates of one request, as an async iterator of cumulative ``RequestOutput``s.

    Updates coalesce: a consumer slower than the engine sees the newest output, never a backlog
    (outputs are cumulative, so nothing is lost). The final output (``finished``) or an error
    ends the iteration.
    """

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop):
        self.request_id = request_id
        self.loop = loop
        self.finished = False  # the final output or an error has arrived
        self._latest: RequestOutput | None = None
        self._error: BaseException | None = None
        self._closed = False
        self._event = asyncio.Event()

    # Called on the stream's event loop only.
    def _put(self, output: RequestOutput) -> None:
        self._latest = output
        self.finished = self.finished or output.finished
        self._event.set()

    def _fail(self, error: BaseException) -> None:
        self._error = error
        self.finished = True
        self._event.set()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        while True:
            if self._latest is not None:
                out, self._latest = self._latest, None
                self._closed = out.finished
                return out
            if self._error is not None:
                error, self._error = self._error, None
                self._closed = True
                raise error
            if self._closed:
                raise StopAsyncIteration
            self._event.clear()
            await self._event.wait()

    async def result(self) -> RequestOutput:
        """The final output (raises the request's error, if any)."""
        last = None
        async for last in self:
            pass
        assert last is not None
        return last
