"""Noticing a client that went away, streaming or not, so its request is aborted at once.

A request costs KV blocks and a seat in every step until it finishes, so a disconnect has to be
seen while the engine is still working on it, not only at the next write:
- ``SSEResponse`` listens for ``http.disconnect`` beside the stream (Starlette does so only for
  ASGI < 2.4 servers) and closes the body iterator, whose ``finally`` aborts the request;
- ``run_until_disconnect`` races a non-streaming request against the disconnect.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

import anyio
from fastapi import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

T = TypeVar("T")


class SSEResponse(StreamingResponse):
    media_type = "text/event-stream"

    def __init__(self, content, on_close=None, status_code: int = 200):
        """``on_close()`` runs however the response ends, even if ``content`` never started (a
        generator that never ran has no ``finally`` to run)."""
        super().__init__(content, status_code, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:

                async def stream() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:  # the client is gone; the listener sees it too
                        pass
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            # Cancelling the writer leaves the generator suspended; closing it runs its finally.
            try:
                aclose = getattr(self.body_iterator, "aclose", None)
                if aclose is not None:
                    await aclose()
            finally:
                if self.on_close is not None:
                    self.on_close()


async def wait_for_disconnect(request: Request) -> None:
    """Returns when the client disconnects. Call only after the body has been read: from then on
    the only message the server sends is ``http.disconnect``."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def run_until_disconnect(request: Request, work: Awaitable[T]) -> T | None:
    """``await work``, unless the client disconnects first: then cancel it and return None."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.wait({task})  # let its cleanup run; it raises nothing here
    if not task.cancelled():
        task.exception()  # retrieved, so asyncio does not log it as lost
    return None
