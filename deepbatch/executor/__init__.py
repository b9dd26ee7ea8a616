"""Rank 0 of a tensor-parallel engine, beside the engine: the executor that runs each step on all
ranks (``tensor_parallel``), starting and stopping the worker processes (``launch``) and the
watchdog that turns a lost worker into a dead engine (``watchdog``)."""
