"""Which tensor-parallel rank this process is, and the process group its layers reduce over.

Layers read the group once, when they are built (``current_tp_group()``), keep it, and use it in
their own ``forward``; model files never see it. Outside ``building_for(group)`` the current group
is ``SINGLE``, so a model built without tensor parallelism never shards and never communicates::

    with building_for(group):          # rank r of N
        model = build_model(...)       # every parallel layer holds its 1/N slice and `group`

The process group is built directly from a store rather than through ``init_process_group``, so
no torch-global default group exists and one process can start, lose and restart engines.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from deepbatch.distributed import communication


@dataclass(frozen=True)
class TensorParallelGroup:
    rank: int = 0
    world_size: int = 1
    process_group: object | None = None  # a torch ProcessGroup backend; None for one rank
    timeout_s: float = 60.0

    @property
    def is_single(self) -> bool:
        return self.world_size == 1

    @property
    def timeout(self) -> timedelta:
        return timedelta(seconds=self.timeout_s)

    def split(self, size: int, what: str) -> int:
        """This rank's part of a dim of ``size`` that divides evenly over the ranks."""
        if size % self.world_size:
            raise ValueError(f"tensor_parallel_size: {what} ({size}) is not divisible by {self.world_size} ranks")
        return size // self.world_size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks (in place); free on a single rank."""
        if self.is_single:
            return x
        return communication.all_reduce(self.process_group, x, self.timeout)

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        """Elementwise maximum over the ranks (in place); free on a single rank."""
        if self.is_single:
            return x
        return communication.all_reduce(self.process_group, x, self.timeout, dist.ReduceOp.MAX)

    def all_reduce_min(self, value: int) -> int:
        if self.is_single:
            return value
        return communication.all_reduce_min(self.process_group, value, self.timeout)

    def gather_to_first(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
        """Rank 0 gets every rank's ``x`` concatenated along ``dim``; the others get None."""
        if self.is_single:
            return x
        return communication.gather_to_first(self.process_group, self.rank, self.world_size, x, dim, self.timeout)

    def broadcast_from_first(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` becomes rank 0's (in place)."""
        if self.is_single:
            return x
        return communication.broadcast_from_first(self.process_group, x, self.timeout)


SINGLE = TensorParallelGroup()
_current = SINGLE


def current_tp_group() -> TensorParallelGroup:
    """The group layers built now shard over (``SINGLE`` unless inside ``building_for``)."""
    return _current


@contextlib.contextmanager
def building_for(group: TensorParallelGroup) -> Iterator[TensorParallelGroup]:
    """Layers constructed inside this block shard over ``group``."""
    global _current
    prev, _current = _current, group
    try:
        yield group
    finally:
        _current = prev


# Start-up (spawning, imports, reading a checkpoint) can take minutes and differ between ranks, so
# it is bounded apart from the step timeout: ranks meet at store keys (``joined_key`` once a
# worker reaches the store, ``loaded_key`` once a rank holds its shard) before any collective,
# and rank 0 checks that the workers are alive while it waits.
STARTUP_TIMEOUT_S = 900.0


def joined_key(rank: int) -> str:
    return f"deepbatch/joined/{rank}"


def loaded_key(rank: int) -> str:
    return f"deepbatch/loaded/{rank}"


def backend_for(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def init_tensor_parallel_group(rank: int, world_size: int, device: str, store: dist.Store,
                               timeout_s: float) -> TensorParallelGroup:
    """Join the group over ``store`` (blocks until all ``world_size`` ranks have joined, for as
    long as the store's own timeout allows); collectives then time out after ``timeout_s``."""
    timeout = timedelta(seconds=timeout_s)
    if backend_for(device) == "gloo":
        pg = dist.ProcessGroupGloo(store, rank, world_size, timeout)
    else:
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        pg = dist.ProcessGroupNCCL(store, rank, world_size, opts)
    return TensorParallelGroup(rank, world_size, pg, timeout_s)
