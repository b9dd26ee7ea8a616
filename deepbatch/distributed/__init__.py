"""Tensor parallelism: the rank's process group and its collectives (``parallel_state``,
``communication``), the step messages rank 0 sends (``messages``), the worker process
(``worker``), rank 0's executor that drives the workers (``executor``) and the watchdog that turns
a lost worker into a dead engine (``watchdog``)."""
