"""Linear layers that know how to load their checkpoint tensors, and how to shard them over the
tensor-parallel group they were built for (``current_tp_group()``; one rank: no sharding).

``MergedLinear`` stacks several checkpoint projections along the output dim (q|k|v, gate|up) so a
layer runs one GEMM instead of several; each checkpoint tensor is copied into its slice by
``weight_loader(param, tensor, shard)``.

Megatron-style sharding over N ranks, rank r::

    ColumnParallelLinear   W [out, in] -> rows    [r*out/N, (r+1)*out/N)   output stays split
    RowParallelLinear      W [out, in] -> columns [r*in/N,  (r+1)*in/N)    partial sums, all-reduced

A column-parallel layer feeding a row-parallel one (q|k|v -> o, gate|up -> down) needs one
all-reduce for the pair. Merged column layers split each part on its own, so a rank's slice is
``[q_r | k_r | v_r]``, and a split that ends inside nothing but whole heads keeps heads whole.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deepbatch.distributed.parallel_state import TensorParallelGroup, current_tp_group


def _copy_checked(dst: torch.Tensor, loaded: torch.Tensor, what: str) -> None:
    if dst.shape != loaded.shape:
        raise ValueError(f"checkpoint {what} of shape {tuple(loaded.shape)} for {tuple(dst.shape)}")
    dst.copy_(loaded)


class Linear(nn.Module):
    """Replicated: every rank holds the whole weight."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: int | None = None) -> None:
        _copy_checked(param.data, loaded, "tensor")


class MergedLinear(Linear):
    """Several projections of the same input, concatenated along the output dim."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False):
        super().__init__(in_features, sum(out_sizes), bias)
        self.out_sizes = list(out_sizes)
        self.offsets = [sum(out_sizes[:i]) for i in range(len(out_sizes))]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: int | None = None) -> None:
        if shard is None:
            return super().weight_loader(param, loaded)
        _copy_checked(param.data.narrow(0, self.offsets[shard], self.out_sizes[shard]), loaded, f"shard {shard}")


class ColumnParallelLinear(Linear):
    """Rank r holds output rows ``[r*out/N, (r+1)*out/N)``; its output is that slice."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        self.tp = current_tp_group()
        super().__init__(in_features, self.tp.split(out_features, "output features"), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: int | None = None) -> None:
        _copy_checked(param.data, loaded.chunk(self.tp.world_size, 0)[self.tp.rank], "tensor")


class MergedColumnParallelLinear(MergedLinear):
    """``MergedLinear`` whose every part is split over the ranks. Part i of the checkpoint is cut
    into ``part_shards[i][1]`` equal row blocks and this rank holds block ``part_shards[i][0]``
    (``(rank, N)`` unless a subclass replicates a part, as ``QKVParallelLinear`` does)."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False,
                 part_shards: list[tuple[int, int]] | None = None):
        self.tp = current_tp_group()
        self.part_shards = part_shards or [(self.tp.rank, self.tp.world_size)] * len(out_sizes)
        local = []
        for size, (_, num_blocks) in zip(out_sizes, self.part_shards):
            if size % num_blocks:
                raise ValueError(f"tensor_parallel_size: a projection of {size} rows does not split into {num_blocks}")
            local.append(size // num_blocks)
        super().__init__(in_features, local, bias)
        self.global_sizes = list(out_sizes)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: int | None = None) -> None:
        if shard is None:  # an already merged checkpoint tensor: load part by part
            for i, part in enumerate(loaded.split(self.global_sizes, 0)):
                self.weight_loader(param, part, i)
            return
        block, num_blocks = self.part_shards[shard]
        super().weight_loader(param, loaded.chunk(num_blocks, 0)[block], shard)


class QKVParallelLinear(MergedColumnParallelLinear):
    """``[q | k | v]`` split by heads: each rank gets ``num_heads / N`` query heads and
    ``num_kv_heads / N`` KV heads. With fewer KV heads than ranks, each KV head is replicated on
    ``N / num_kv_heads`` consecutive ranks (rank r holds KV head ``r * num_kv_heads // N``), so a
    rank's query heads always find their group's KV head locally. ``num_heads`` and
    ``num_kv_heads`` here are this rank's counts."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False):
        tp = current_tp_group()
        n = tp.world_size
        local_heads = tp.split(num_heads, "num_attention_heads")
        if num_kv_heads >= n:
            local_kv, kv_shard = tp.split(num_kv_heads, "num_key_value_heads"), (tp.rank, n)
        elif n % num_kv_heads == 0:
            local_kv, kv_shard = 1, (tp.rank * num_kv_heads // n, num_kv_heads)
        else:
            raise ValueError(f"tensor_parallel_size: {n} ranks cannot share {num_kv_heads} KV heads evenly")
        q, kv = num_heads * head_dim, num_kv_heads * head_dim
        super().__init__(hidden, [q, kv, kv], bias, part_shards=[(tp.rank, n), kv_shard, kv_shard])
        self.num_heads, self.num_kv_heads = local_heads, local_kv


class RowParallelLinear(Linear):
    """Rank r holds input columns ``[r*in/N, (r+1)*in/N)`` and takes that slice of the input;
    the partial products are all-reduced, then the (whole, unsplit) bias is added once. With
    ``reduce_results=False`` the caller reduces (to fold several partial sums into one
    all-reduce); the bias is then added on rank 0 only, so the sum still counts it once."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, reduce_results: bool = True):
        self.tp: TensorParallelGroup = current_tp_group()
        self.reduce_results = reduce_results
        super().__init__(self.tp.split(in_features, "input features"), out_features, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.is_single:
            return F.linear(x, self.weight, self.bias)
        y = F.linear(x, self.weight)
        if self.reduce_results:
            y = self.tp.all_reduce(y)
        elif self.tp.rank != 0:
            return y
        return y + self.bias if self.bias is not None else y

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: int | None = None) -> None:
        if param is self.bias:
            return super().weight_loader(param, loaded)
        _copy_checked(param.data, loaded.chunk(self.tp.world_size, 1)[self.tp.rank], "tensor")
