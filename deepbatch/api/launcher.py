"""``deepbatch serve --api-server-count N``: N API processes on one port in front of one engine core.

    launcher (deepbatch::Launcher)
      |-- engine core (deepbatch::EngineCore)      the busy loop; one socket pair per API process
      |-- API process 0 (deepbatch::APIServer_0)   HTTP, tokenization, detokenization, SSE
      |-- ...                                      each binds the port with SO_REUSEPORT, once
      `-- API process N-1                          the core has said Ready to it

One API process is enough for most models (the engine core keeps the GPU busy behind it); more
help where the HTTP side is the bottleneck: many short requests, long streams of small chunks,
heavy chat templates or tool parsing. With one (the default) ``deepbatch serve`` runs
``server.run_server`` in its own process and starts the core itself; nothing here runs.

The launcher only starts, watches and stops. Every API process serves as a lone one would (the
same drain, the same exit statuses) except that it leaves the core to the launcher:
- SIGTERM and SIGINT (and SIGHUP, with --api-keys-file) to the launcher are passed on to every
  API process (which sit in process groups of their own, so that Ctrl-C in a terminal reaches
  each of them once, through here); a second SIGTERM forces, as with one;
- an API process that exits (drained, dead engine, killed) makes the launcher drain the others;
  once none is left the core is asked to stop (and killed after ``_JOIN_S``);
- the core dies: each API process sees it through a pid file descriptor and exits 1 after its
  grace period, and so does the launcher;
- the launcher is killed: the core sees its parent gone and exits, and the API processes then
  see the core gone.
The launcher exits with the first non-zero status of its API processes (1 when the core died),
or 0.

Metrics: per-request series (counters, histograms) are written by every API process into
prometheus_client's multiprocess directory and summed at each scrape, so any API process answers
``/metrics`` with one set of series; the engine's gauges come from the core's snapshot, the same
in each.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import signal
import tempfile
import time
from multiprocessing.connection import wait

import zmq

from deepbatch.api.server_config import EXIT_ENGINE_DEAD, EXIT_OK, ServerConfig
from deepbatch.config import EngineConfig
from deepbatch.engine.core_messages import Shutdown, encode
from deepbatch.engine.core_process import CoreAddresses, run_engine_core, set_process_title
from deepbatch.executor.launch import choose_start_method

logger = logging.getLogger("deepbatch.launcher")

# How long the core and the API processes get to exit once asked, before they are killed.
_JOIN_S = 10.0


def run_api_servers(config: EngineConfig, server_config: ServerConfig, count: int, *,
                    traces_endpoint: str | None = None, client_kwargs: dict | None = None,
                    fault_inject_step: int | None = None) -> int:
    """Start the engine core and ``count`` API processes, serve until they have all exited;
    returns the exit status."""
    set_process_title("deepbatch::Launcher")
    workdir = tempfile.mkdtemp(prefix="deepbatch-serve-")
    metrics_dir = os.path.join(workdir, "metrics")
    os.mkdir(metrics_dir)
    addresses = CoreAddresses.in_dir(workdir, count)
    # Spawned on a GPU host (this process asked the driver about devices while it built the
    # config), forked where that is safe, as the tensor-parallel workers are.
    mp = multiprocessing.get_context("spawn" if config.device != "cpu" else choose_start_method())
    core = mp.Process(target=run_engine_core, name="deepbatch::EngineCore",
                      args=(config, addresses, fault_inject_step, os.getpid()), daemon=False)
    core.start()
    previous_env = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    servers: list = []
    # From now on signals are passed on (to the API processes started so far): a SIGTERM while
    # the model loads stops them, and the core after them, instead of killing the launcher alone.
    relay = _Relay(servers, server_config.api_keys_file is not None)
    try:
        for i in range(count):
            if relay.stopping:  # told to stop before every API process was started
                break
            server = mp.Process(target=run_api_server, name=f"deepbatch::APIServer_{i}", daemon=False,
                                   args=(i, config, server_config, addresses, core.pid, traces_endpoint,
                                         client_kwargs or {}))
            server.start()
            servers.append(server)
    finally:
        if previous_env is None:
            os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
        else:
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = previous_env
    try:
        return _supervise(core, servers, addresses, relay)
    finally:
        relay.restore()
        shutil.rmtree(workdir, ignore_errors=True)


class _Relay:
    """Passes SIGTERM and SIGINT (and SIGHUP, which reloads --api-keys-file; without one it keeps
    its default action, as with one process) on to every API process that is still running."""

    def __init__(self, servers: list, reload_keys: bool):
        self.servers = servers
        self.stopping = False  # the API processes were asked to drain (a signal, or one exited)
        signals = (signal.SIGTERM, signal.SIGINT) + ((signal.SIGHUP,) if reload_keys else ())
        self._previous = {sig: signal.signal(sig, self._forward) for sig in signals}

    def _forward(self, sig: int, frame) -> None:
        if sig != signal.SIGHUP:
            self.stopping = True
        self.send(sig)

    def send(self, sig: int) -> None:
        for server in self.servers:
            if server.exitcode is None:
                _signal(server.pid, sig)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _supervise(core, servers: list, addresses: CoreAddresses, relay: _Relay) -> int:
    live = {s.sentinel: s for s in servers}
    core_dead = False
    code = EXIT_OK
    try:
        while live:
            sentinels = list(live) + ([] if core_dead else [core.sentinel])
            for ready in wait(sentinels):
                if ready == core.sentinel:
                    core_dead = True
                    core.join()
                    logger.error("the engine core exited with %s; the API processes follow", core.exitcode)
                    code = code or EXIT_ENGINE_DEAD
                    continue
                server = live.pop(ready)
                server.join()
                status = server.exitcode
                if status != EXIT_OK:
                    logger.warning("API process %s exited with %s", server.name, status)
                    code = code or (status if status > 0 else EXIT_ENGINE_DEAD)
                if not relay.stopping and live:
                    logger.info("API process %s exited; draining the others", server.name)
                    relay.stopping = True
                    relay.send(signal.SIGTERM)
            if core_dead and live:  # they exit on their own (engine dead); the status is set already
                _reap_within(list(live.values()), _JOIN_S)
                live.clear()
    finally:
        for server in servers:  # only after an exception in here: every one has exited otherwise
            if server.is_alive():
                server.kill()
        _stop_core(core, addresses)
    return code


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _reap_within(processes: list, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            logger.warning("%s did not exit; killing it", p.name)
            p.kill()
            p.join(5)


def _stop_core(core, addresses: CoreAddresses) -> None:
    """Ask the core to stop after its step in progress; kill it if it has not within ``_JOIN_S``."""
    if core.is_alive():
        ctx = zmq.Context()
        socket = ctx.socket(zmq.PUSH)
        socket.setsockopt(zmq.LINGER, 1000)
        # The first API process's input socket is gone with it: bind it again, the core reconnects.
        try:
            socket.bind(addresses.inputs[0])
            socket.send(encode(Shutdown()))
        except zmq.ZMQError:
            logger.warning("could not ask the engine core to stop")
        _reap_within([core], _JOIN_S)
        socket.close()
        ctx.term()
    core.join(0)


def run_api_server(index: int, config: EngineConfig, server_config: ServerConfig, addresses: CoreAddresses,
                   core_pid: int, traces_endpoint: str | None, client_kwargs: dict) -> None:
    """Entry point of API process ``index``: join the core, serve, exit with the status."""
    import gc
    import sys
    from dataclasses import replace

    # Signals come through the launcher, once each (see the module's docstring); a forked process
    # starts with the launcher's handlers, which are not its own.
    os.setpgrp()
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # A forked process has prometheus_client as the launcher imported it, before the metrics
    # directory was set: its metrics must be written there.
    from prometheus_client import values

    values.ValueClass = values.get_value_class()
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s [%(name)s] %(message)s")
    from deepbatch.api.server import run_server
    from deepbatch.engine.core_client import CoreSeat, EngineCoreClient
    from deepbatch.metrics.tracing import make_tracer_provider

    tracer_provider = make_tracer_provider(traces_endpoint) if traces_endpoint else None
    try:
        engine = EngineCoreClient(config, seat=CoreSeat(index, addresses, core_pid), **client_kwargs)
    except RuntimeError as e:
        logging.getLogger("deepbatch.server").error("%s", e)
        sys.exit(EXIT_ENGINE_DEAD)
    gc.collect()
    gc.freeze()
    try:
        code = run_server(engine, replace(server_config, reuse_port=True), tracer_provider)
    finally:
        if tracer_provider is not None:
            tracer_provider.shutdown()
    # Everything is stopped and written: skip the interpreter's teardown, where extension
    # modules imported on the way (Triton's bindings) report leaks that are none.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
