"""Weight-only 4-bit linear layers (W4A16): what AWQ, GPTQ and compressed-tensors' pack-quantized
format share.

Each format registers its checkpoint's own tensors (``create_weights``), so the layers' loaders cut
and merge them by their metadata, then ``convert`` turns them into the one layout
``kernels/w4a16_gemm.py`` reads, and every later step (apply, dequantize) is common::

    qweight  int32 [K // 8, N]        packed along K, lowest nibble first
    scales   [K // g, N]              activation dtype
    zeros    [K // g, N]              activation dtype, the zero point as a number
    W[n, k] = (q(n, k) - zeros[k // g, n]) * scales[k // g, n]

``g`` is the group size; a format's "one group over all of K" (GPTQ's ``group_size: -1``) is
``g = K`` of this rank's share, its scales replicated over the ranks of a row-parallel layer.

Scales are loaded in float32 whatever the checkpoint stored (fp16, bf16 or fp32 all fit exactly)
and rounded once to the model dtype at conversion: in bf16 a fp16 scale keeps 8 of its 11
significant bits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deepbatch.layers.quantization.base import (
    LinearMethod,
    QuantizationConfig,
    ignored_by,
    refuse_option,
    refuse_unknown_options,
    require_option,
    shard_param,
)

PACK = 8  # 4-bit values per int32 word
# Tokens (rows of the activation) from which ``apply`` dequantizes the weight to the activation
# dtype and multiplies with cuBLAS instead of running the fused 4-bit GEMM. With thousands of tokens
# the GEMM is bound by the tensor cores, not by the weight read, and the fused kernel's prefill
# tiles ran at 0.41-0.43x of cuBLAS bf16 on Llama-3.1-8B's shapes at M = 8192 (H200). 1024 is a
# first guess, to be set by a sweep timed inside CUDA graphs (``benchmarks/quant_gemm_sweep.py
# --graphs``, columns ``w4a16-triton`` and ``w4a16-dequant``); read at every call, so a sweep or a
# test may override it.
W4A16_DEQUANT_MIN_TOKENS = 1024
# W = (q - 8) * s with q uniform in 0..15 has a standard deviation of about 4.6 s: 0.02 for this s.
RANDOM_SCALE = 0.0043
# How ``init_random`` fills a checkpoint tensor (the ``random_fill`` each one carries).
RANDOM_BITS, RANDOM_SCALES = "bits", "scales"


def _use_kernels(x: torch.Tensor) -> bool:
    """The Triton kernels on a GPU; the torch reference elsewhere (the CPU, CI)."""
    from deepbatch.kernels.common import triton

    return x.is_cuda and triton is not None


def nibble_word(value: int) -> int:
    """The int32 whose eight nibbles all hold ``value`` (a packed tensor of one constant)."""
    word = sum((value & 0xF) << (4 * i) for i in range(PACK))
    return word - 2**32 if word >= 2**31 else word


def checkpoint_param(shape: tuple[int, ...], dtype: torch.dtype, random_fill, **meta) -> nn.Parameter:
    """A checkpoint tensor's parameter: its sharding metadata, how ``init_random`` fills it
    (``RANDOM_BITS``, ``RANDOM_SCALES``, a nibble value repeated, or ``fn(layer, param, generator)``).
    (The model loader checks that every part of a merged layer came: ``check_merged_parts_loaded``.)"""
    p = shard_param(torch.empty(shape, dtype=dtype), **meta)
    p.random_fill = random_fill
    return p


def checkpoint_shape(layer: nn.Module, shard: int | None) -> tuple[int, int]:
    """``(N, K)`` of the whole checkpoint tensor that part ``shard`` of ``layer`` (or all of it)
    loads from, before tensor parallelism cut it."""
    from deepbatch.layers import linear  # which imports this package
    tp = getattr(layer, "tp", None)
    ranks = 1 if tp is None else tp.world_size
    k = layer.in_features * (ranks if isinstance(layer, linear.RowParallelLinear) else 1)
    if isinstance(layer, linear.MergedColumnParallelLinear):
        return (sum(layer.global_sizes) if shard is None else layer.global_sizes[shard]), k
    if isinstance(layer, linear.MergedLinear) and shard is not None:
        return layer.out_sizes[shard], k
    return layer.out_features * (ranks if isinstance(layer, linear.ColumnParallelLinear) else 1), k


def check_group_size(fmt: str, group_size, *, allow_whole_k: bool = False) -> int | None:
    """The config's group size as an int (None: one group over all of K, where allowed)."""
    if allow_whole_k and group_size == -1:
        return None
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0 or group_size % PACK:
        allowed = " or -1" if allow_whole_k else ""
        refuse_option(fmt, "group_size", group_size, f"a positive multiple of {PACK}{allowed}")
    return group_size


class W4A16LinearMethod(LinearMethod):
    """The common part; a format subclass says which tensors its checkpoint holds
    (``create_weights``) and how they become the canonical three (``convert``)."""

    fmt = "w4a16"

    def __init__(self, group_size: int | None):
        self.group_size = group_size  # None: one group over the layer's whole input (this rank's K)

    def layer_group_size(self, in_features: int) -> int:
        return in_features if self.group_size is None else self.group_size

    def check_shape(self, in_features: int, out_sizes: list[int], packed_output: bool) -> int:
        """Refuse a layer the format cannot hold; returns its group size. ``packed_output``: some
        tensor packs eight output channels per word, so each merged part must fill whole words."""
        g = self.layer_group_size(in_features)
        if in_features % PACK or in_features % g:
            raise ValueError(f"quantization {self.fmt}: group_size {self.group_size} does not divide the "
                             f"{in_features} input features of a layer (per tensor-parallel rank), or they are "
                             f"not a multiple of {PACK}")
        if packed_output:
            for size in out_sizes:
                if size % PACK:
                    raise ValueError(f"quantization {self.fmt}: an output of {size} features is not a multiple of "
                                     f"{PACK} (eight 4-bit values per packed int32 word)")
        return g

    def convert(self, layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(qweight, scales, zeros)`` in the canonical layout from the loaded tensors."""
        raise NotImplementedError

    @torch.no_grad()
    def process_weights_after_loading(self, layer):
        if "zeros" in layer._parameters:  # already converted
            return
        qweight, scales, zeros = self.convert(layer)
        k, n = layer.in_features, layer.out_features
        g = self.layer_group_size(k)
        want = {"qweight": (k // PACK, n), "scales": (k // g, n), "zeros": (k // g, n)}
        for name, t in (("qweight", qweight), ("scales", scales), ("zeros", zeros)):
            if tuple(t.shape) != want[name]:  # a conversion bug, not a checkpoint error: loaders checked shapes
                raise RuntimeError(f"quantization {self.fmt}: converted {name} {tuple(t.shape)} != {want[name]}")
        for name in [p for p in layer._parameters if p != "bias"]:
            delattr(layer, name)
        dtype = layer.params_dtype
        whole_k = self.group_size is None
        layer.qweight = shard_param(qweight.to(torch.int32).contiguous(), output_dim=1, input_dim=0, input_unit=PACK)
        layer.scales = shard_param(scales.to(dtype).contiguous(), output_dim=1,
                                   input_dim=None if whole_k else 0, input_unit=g)
        layer.zeros = shard_param(zeros.to(dtype).contiguous(), output_dim=1,
                                  input_dim=None if whole_k else 0, input_unit=g)

    def apply(self, layer, x):
        from deepbatch.kernels import w4a16_gemm

        x2 = x.reshape(-1, x.shape[-1])
        g = self.layer_group_size(layer.in_features)
        if not _use_kernels(x):
            y = w4a16_gemm.w4a16_matmul_ref(x2, layer.qweight, layer.scales, layer.zeros, g)
        elif x2.shape[0] >= W4A16_DEQUANT_MIN_TOKENS:
            from deepbatch.kernels.int4_dequant import dequantize_int4

            # A scratch 16-bit weight from the caching allocator (inside a CUDA graph, from the
            # graph's pool), freed once the product is done: no dequantized copy outlives the call.
            y = F.linear(x2, dequantize_int4(layer.qweight, layer.scales, layer.zeros, g))
        else:
            y = w4a16_gemm.w4a16_matmul(x2.contiguous(), layer.qweight, layer.scales, layer.zeros, g)
        return y.view(*x.shape[:-1], y.shape[-1])

    def dequantize(self, layer):
        from deepbatch.kernels.w4a16_gemm import dequantize_int4_ref

        return dequantize_int4_ref(layer.qweight, layer.scales, layer.zeros, self.layer_group_size(layer.in_features))

    @torch.no_grad()
    def init_random(self, layer, generator):
        """The checkpoint tensors themselves, filled directly: random words (every nibble uniform
        in 0..15), scales around ``RANDOM_SCALE``, the format's encoding of a zero point of 8."""
        for name, p in layer.named_parameters(recurse=False):
            fill = getattr(p, "random_fill", None)
            if name == "bias" or fill is None:
                continue
            if fill == RANDOM_BITS:
                p.copy_(torch.randint(-2**31, 2**31, p.shape, generator=generator, device=p.device,
                                      dtype=torch.int64))
            elif fill == RANDOM_SCALES:
                p.uniform_(0.5 * RANDOM_SCALE, 1.5 * RANDOM_SCALE, generator=generator)
            elif isinstance(fill, int):
                p.fill_(nibble_word(fill))
            else:
                fill(layer, p, generator)


class W4A16Config(QuantizationConfig):
    """A 4-bit format: one method for every linear layer, ``ignored`` the checkpoint's names of
    layers left in 16 bits, matched by ``_matches``."""

    # The options a format reads, or knows not to change what its tensors mean; others are refused.
    _KNOWN: frozenset[str] = frozenset()

    def __init__(self, method: W4A16LinearMethod, ignored: tuple[str, ...] = ()):
        self._method = method
        self.ignored = ignored

    @classmethod
    def check_options(cls, qc: dict) -> None:
        """What every 4-bit format refuses alike: an option it does not know, another bit width."""
        refuse_unknown_options(cls.name, qc, cls._KNOWN)
        require_option(cls.name, qc, "bits", 4)

    @property
    def group_size(self) -> int | None:
        return self._method.group_size

    def linear_method(self) -> LinearMethod:
        return self._method

    def _matches(self, name: str) -> bool:
        raise NotImplementedError

    def is_ignored(self, module_name: str) -> bool:
        return bool(self.ignored) and ignored_by(module_name, self._matches, self.name)

    def weight_bits(self) -> float:
        return w4a16_weight_bits(self.group_size)


def w4a16_weight_bits(group_size: int | None) -> float:
    """4 bits, plus a scale and a zero point per group as held after conversion (16-bit model
    dtype; one group per channel: a few bits per thousand weights)."""
    return 4.0 if group_size is None else 4 + 32 / group_size
