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

The weight's format is the layer's ``quant_method`` (``deepbatch/layers/quantization``), taken from
the quantization scope at construction. The loaders below cut every parameter by the metadata it
carries (``output_dim``/``input_dim`` and their units), so a block scale or a packed int4 tensor is
sharded and merged by the same code as a bf16 weight.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deepbatch.distributed.parallel_state import TensorParallelGroup, current_tp_group
from deepbatch.layers.quantization.base import UNQUANTIZED, LinearMethod, current_linear_method, shard_param


def _copy_checked(dst: torch.Tensor, loaded: torch.Tensor, what: str) -> None:
    if dst.shape != loaded.shape:
        raise ValueError(f"checkpoint {what} of shape {tuple(loaded.shape)} for {tuple(dst.shape)}")
    dst.copy_(loaded)


def _units(features: int, unit: int, what: str) -> int:
    """``features`` in indices of a dim whose index covers ``unit`` features (block scales, packed
    ints): a part or a rank's share that does not start and end on a unit boundary cannot be cut."""
    if features % unit:
        raise ValueError(f"{what}: {features} features do not split on the format's unit of {unit} "
                         "(a quantization block or packed word would straddle two parts or ranks)")
    return features // unit


def _rank_slice(param: nn.Parameter, loaded: torch.Tensor, side: str | None, local_features: int,
                tp: TensorParallelGroup) -> torch.Tensor:
    """This rank's 1/N of ``loaded`` along the param's ``side`` ("output" or "input") dim, which
    holds ``local_features`` features per rank (the whole tensor where the param has no such dim)."""
    dim = getattr(param, f"{side}_dim", None) if side is not None else None
    if dim is None or tp.is_single:
        return loaded
    _units(local_features, getattr(param, f"{side}_unit"), f"tensor_parallel_size {tp.world_size}")
    if loaded.shape[dim] % tp.world_size:
        raise ValueError(f"tensor_parallel_size: checkpoint tensor of shape {tuple(loaded.shape)} does not split "
                         f"into {tp.world_size} along dim {dim}")
    return loaded.chunk(tp.world_size, dim)[tp.rank]


def check_merged_parts_loaded(model: nn.Module) -> None:
    """A merged layer's parameter counts as loaded once any part is, so a checkpoint missing one
    part (``k_proj``'s scale, say) would leave those rows uninitialized: refuse it, naming the part."""
    for name, module in model.named_modules():
        parts = len(getattr(module, "part_sizes", ()))
        if parts < 2:
            continue
        for pname, p in module.named_parameters(recurse=False):
            got = getattr(p, "parts_loaded", None)
            if got and None not in got and got != set(range(parts)):
                missing = sorted(set(range(parts)) - got)
                raise ValueError(f"model: the checkpoint has no tensor for part(s) {missing} of {name}.{pname} "
                                 f"(merged from {parts} projections, in checkpoint order: q|k|v or gate|up)")


class Linear(nn.Module):
    """Replicated: every rank holds the whole weight."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, out_sizes: list[int] | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.part_sizes = list(out_sizes) if out_sizes is not None else [out_features]
        self.params_dtype = torch.get_default_dtype()
        self.quant_method: LinearMethod = UNQUANTIZED
        self.set_quant_method(current_linear_method())
        self.bias = shard_param(torch.empty(out_features), output_dim=0) if bias else None

    def set_quant_method(self, method: LinearMethod) -> None:
        """(Re)create the weight's parameters for ``method``, dropping those of the old one."""
        for name in [n for n in self._parameters if n != "bias"]:
            delattr(self, name)
        self.quant_method = method
        method.create_weights(self, self.in_features, self.part_sizes, self.params_dtype)

    def process_weights_after_loading(self) -> None:
        self.quant_method.process_weights_after_loading(self)

    @torch.no_grad()
    def dequantize_in_place(self) -> None:
        """Keep the weight as a plain ``[out, in]`` matrix in the model dtype from now on (for code
        that reads the matrix itself, like MLA's absorbed ``kv_b_proj``); call after loading."""
        if self.quant_method is UNQUANTIZED:
            return
        weight = self.quant_method.dequantize(self).to(self.params_dtype).contiguous()
        self.set_quant_method(UNQUANTIZED)
        self.weight.data = weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant_method is UNQUANTIZED:
            return F.linear(x, self.weight, self.bias)
        y = self.quant_method.apply(self, x)
        return y + self.bias if self.bias is not None else y

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: int | None = None) -> None:
        """Copy checkpoint tensor ``loaded`` (part ``shard`` of a merged projection, or the whole
        tensor) into this rank's ``param``. A format's parameter that needs its own handling
        (metadata, tensors shared by the parts) carries a ``custom_loader``."""
        custom = getattr(param, "custom_loader", None)
        if custom is not None:
            custom(self, param, loaded, shard)
        else:
            self._load(param, loaded, shard)
        if not hasattr(param, "parts_loaded"):
            param.parts_loaded = set()
        param.parts_loaded.add(shard)  # None: the whole tensor at once

    def _load(self, param: nn.Parameter, loaded: torch.Tensor, shard: int | None) -> None:
        _copy_checked(param.data, loaded, "tensor")


class MergedLinear(Linear):
    """Several projections of the same input, concatenated along the output dim."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False):
        super().__init__(in_features, sum(out_sizes), bias, out_sizes=out_sizes)
        self.out_sizes = list(out_sizes)
        self.offsets = [sum(out_sizes[:i]) for i in range(len(out_sizes))]

    def _load(self, param: nn.Parameter, loaded: torch.Tensor, shard: int | None) -> None:
        if shard is None:
            return super()._load(param, loaded, None)
        dim = getattr(param, "output_dim", None)
        if dim is None:
            raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} is one value for the whole merged "
                             f"projection, but part {shard} came alone")
        unit = param.output_unit
        what = f"part {shard} of a merged projection"
        dst = param.data.narrow(dim, _units(self.offsets[shard], unit, what), _units(self.out_sizes[shard], unit, what))
        _copy_checked(dst, loaded, f"shard {shard}")


class ColumnParallelLinear(Linear):
    """Rank r holds output rows ``[r*out/N, (r+1)*out/N)``; its output is that slice."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        self.tp = current_tp_group()
        super().__init__(in_features, self.tp.split(out_features, "output features"), bias)

    def _load(self, param: nn.Parameter, loaded: torch.Tensor, shard: int | None) -> None:
        _copy_checked(param.data, _rank_slice(param, loaded, "output", self.out_features, self.tp), "tensor")


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

    def _load(self, param: nn.Parameter, loaded: torch.Tensor, shard: int | None) -> None:
        dim = getattr(param, "output_dim", None)
        if shard is None:  # an already merged checkpoint tensor: load part by part
            if dim is None:
                return super()._load(param, loaded, None)
            unit = param.output_unit
            sizes = [_units(s, unit, "a merged checkpoint tensor") for s in self.global_sizes]
            if loaded.shape[dim] != sum(sizes):
                raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} for parts of {self.global_sizes} rows")
            for i, part in enumerate(loaded.split(sizes, dim)):
                self._load(param, part, i)
            return
        block, num_blocks = self.part_shards[shard]
        if dim is not None and num_blocks > 1:
            if loaded.shape[dim] % num_blocks:
                raise ValueError(f"tensor_parallel_size: part {shard} of shape {tuple(loaded.shape)} does not split "
                                 f"into {num_blocks} along dim {dim}")
            loaded = loaded.chunk(num_blocks, dim)[block]
        super()._load(param, loaded, shard)


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
            return super().forward(x)
        y = F.linear(x, self.weight) if self.quant_method is UNQUANTIZED else self.quant_method.apply(self, x)
        if self.reduce_results:
            y = self.tp.all_reduce(y)
        elif self.tp.rank != 0:
            return y
        return y + self.bias if self.bias is not None else y

    def _load(self, param: nn.Parameter, loaded: torch.Tensor, shard: int | None) -> None:
        # The bias (and any per-output-channel scale) has no input dim: every rank takes it whole.
        side = None if param is self.bias else "input"
        _copy_checked(param.data, _rank_slice(param, loaded, side, self.in_features, self.tp), "tensor")
