"""The server's settings (``ServerConfig``, frozen, built by the CLI) and its mutable state
(``ServerState``: draining, keys, open replies), apart from the app so that the request gate and
the Ray Serve ingress can name them without importing the server."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import uvicorn

from deepbatch.api.auth import KeyTable

# The server process's exit statuses (see server.py's lifecycle).
EXIT_OK = 0  # drained (or stopped before serving)
EXIT_ENGINE_DEAD = 1  # a model step failed
# A second signal cut the drain short. Not 2: that is the command line's usage-error status.
EXIT_FORCED = 3


@dataclass(frozen=True)
class ServerConfig:
    host: str = "0.0.0.0"
    port: int = 8000
    served_model_names: tuple[str, ...] = ()  # empty: the engine's model name
    api_key: str | None = None
    api_keys_file: str | None = None  # keys bound to tenants (deepbatch/api/auth.py); reloaded on SIGHUP
    shutdown_timeout: float = 30.0
    max_request_body_bytes: int = 4 << 20
    log_stats_interval: float = 10.0
    chat_template: str | None = None  # template text (loaded by chat_template.load_chat_template)
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None  # vLLM's --tool-call-parser names
    reasoning_parser: str | None = None  # deepseek_r1, qwen3
    # uvicorn's event loop: "auto" takes uvloop when it is installed. With the engine stepped on a
    # thread of this process (DEEPBATCH_ENGINE_PROCESS=0) "asyncio" served a fifth more at
    # saturation: the engine thread shares the interpreter lock with the loop (docs/benchmarks.md).
    event_loop: str = "auto"
    # Bind the port with SO_REUSEPORT, beside the other API processes of one engine core
    # (``--api-server-count``, deepbatch/api/launcher.py); the kernel spreads connections over them.
    reuse_port: bool = False


@dataclass
class ServerState:
    draining: bool = False
    forcing: bool = False  # a second signal arrived: in-flight requests are being failed
    exit_code: int = EXIT_OK
    keys: KeyTable | None = None  # None: no authentication
    open_requests: int = 0  # HTTP requests whose reply has not been fully written
    server: uvicorn.Server | None = None
    loop: asyncio.AbstractEventLoop | None = None
    tasks: set = field(default_factory=set)

    def spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)  # a strong reference, so the task is not collected mid-flight
        task.add_done_callback(self.tasks.discard)
