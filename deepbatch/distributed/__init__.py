"""Tensor-parallel primitives: the rank's process group and its collectives (``parallel_state``,
``communication``) and the step messages rank 0 sends its workers (``messages``). Low in the
layering: layers reduce over the group. The worker process is ``runner/worker.py``; rank 0's
executor, the worker launch and the watchdog are ``deepbatch/executor/``."""
