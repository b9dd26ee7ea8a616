"""Server processes for the API tests.

A test module declares what it needs at module level:

    SERVERS = {"main": MAIN_SERVER}                       # name -> ServerProcess kwargs
    BACKGROUND = {"reference": [python, "-c", ...]}       # name -> command (output kept in a log)

When the first test of tests/api runs, every process that the selected modules declare starts at
once, so their model loads overlap; each module then waits only for its own (``get_server``).
Modules that use the same name share the process. The embedded model's weights are dequantized
into the run's cache directory first, once, so no server spends its start dequantizing them.
The processes stop as soon as the last test of tests/api has run: about 20 GB of idle servers
would otherwise sit beside the rest of the suite.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from apitest_server import launch_for_modules, stop_all, warm_default_model_cache

_HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="session", autouse=True)
def _api_processes(request):
    items = request.session.items
    warm_default_model_cache()
    launch_for_modules({i.module for i in items if i.module is not None and Path(i.path).resolve().parent == _HERE})
    yield
    stop_all(keep_logs=request.session.testsfailed > 0)  # a run that ends inside tests/api


def pytest_runtest_teardown(item, nextitem):
    # Called for the items under this directory only; the next one may be elsewhere.
    if nextitem is None or _HERE not in Path(nextitem.path).resolve().parents:
        stop_all(keep_logs=item.session.testsfailed > 0)
