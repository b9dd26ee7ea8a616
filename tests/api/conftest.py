"""Server processes for the API tests.

A test module declares what it needs at module level:

    SERVERS = {"main": MAIN_SERVER}                       # name -> ServerProcess kwargs
    BACKGROUND = {"reference": [python, "-c", ...]}       # name -> command (output kept in a log)

When a module's tests start, the processes it declares start, and with them those of the next
``_PREFETCH`` modules, so their model loads overlap the tests before them; each module waits only
for its own (``get_server``). Modules that use the same name share the process. When a module
is done, every process no later module declares stops: a few servers are alive at a time, not
all twenty (about 1 GB each). The embedded model's weights are dequantized into the run's
cache directory first, once, so no server spends its start dequantizing them.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from apitest_server import declared, launch_for_modules, stop_all, stop_unneeded, warm_default_model_cache

_HERE = Path(__file__).resolve().parent
_PREFETCH = 2


def _server_modules(session) -> list:
    """This directory's test modules (not its subdirectories'), in the order they run."""
    modules = []
    for item in session.items:
        if item.module is not None and Path(item.path).resolve().parent == _HERE and item.module not in modules:
            modules.append(item.module)
    return modules


@pytest.fixture(scope="session", autouse=True)
def _api_processes(request):
    warm_default_model_cache()
    yield
    stop_all(keep_logs=request.session.testsfailed > 0)


@pytest.fixture(scope="module", autouse=True)
def _module_processes(request):
    modules = _server_modules(request.session)
    if request.module not in modules:
        yield
        return
    i = modules.index(request.module)
    launch_for_modules(modules[i:i + 1 + _PREFETCH])
    yield
    stop_unneeded(declared(modules[i + 1:]))
