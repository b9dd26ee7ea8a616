"""Collectives over one tensor-parallel process group, each bounded by a timeout.

A collective that does not complete within the timeout (a peer stopped answering) or whose peer
went away (its socket closed) raises ``RuntimeError`` instead of waiting forever; the executor
turns that into a dead engine. Every function here is called by all ranks of the group in the
same order with tensors of the same shape, or it deadlocks until the timeout.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist


def all_reduce(process_group, x: torch.Tensor, timeout: timedelta, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """Sum (or ``op``) ``x`` over the ranks, in place; returns ``x``."""
    opts = dist.AllreduceOptions()
    opts.reduceOp = op
    opts.timeout = timeout
    process_group.allreduce([x], opts).wait(timeout)
    return x


def all_reduce_min(process_group, value: int, timeout: timedelta) -> int:
    """The smallest ``value`` of all ranks (KV block counts, which must agree)."""
    t = torch.tensor([value], dtype=torch.int64)
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MIN
    opts.timeout = timeout
    process_group.allreduce([t], opts).wait(timeout)
    return int(t.item())


def gather_to_first(process_group, rank: int, world_size: int, x: torch.Tensor, dim: int,
                    timeout: timedelta) -> torch.Tensor | None:
    """Concatenate every rank's ``x`` along ``dim`` on rank 0 (in rank order); other ranks get
    None. The other ranks send and are done: only rank 0 pays for the whole tensor."""
    x = x.contiguous()
    opts = dist.GatherOptions()
    opts.rootRank = 0
    opts.timeout = timeout
    if rank == 0:
        parts = [torch.empty_like(x) for _ in range(world_size)]
        process_group.gather([parts], [x], opts).wait(timeout)
        return torch.cat(parts, dim=dim)
    process_group.gather([], [x], opts).wait(timeout)
    return None


def broadcast_from_first(process_group, x: torch.Tensor, timeout: timedelta) -> torch.Tensor:
    """Rank 0's ``x`` into every rank's ``x`` (same shape and dtype on all), in place."""
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    opts.rootTensor = 0
    opts.timeout = timeout
    process_group.broadcast([x], opts).wait(timeout)
    return x
