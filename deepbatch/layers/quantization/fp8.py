"""FP8 (e4m3) weights with activations quantized to FP8 at run time (W8A8).

Three ways in, two layouts:

* block-wise, ``quant_method: "fp8"`` with ``weight_block_size: [128, 128]`` (DeepSeek-V3/R1's
  own checkpoints): ``weight`` e4m3 ``[N, K]`` and ``weight_scale_inv`` float32
  ``[ceil(N/128), ceil(K/128)]``, one scale per 128 x 128 block, multiplied (the name is
  historical: ``W = weight * weight_scale_inv``). Activations get one scale per token and
  128-column group, so both operands of a block's partial product share one pair of scales.
* per output channel, ``weight`` e4m3 ``[N, K]`` and ``weight_scale`` float32 ``[N, 1]``, with one
  activation scale per token: compressed-tensors' FP8_DYNAMIC (``compressed_tensors.py``) and
  ``--quantization fp8`` on a 16-bit checkpoint (``Fp8OnlineLinearMethod`` quantizes each layer
  once its weight is loaded).

On CUDA with Triton the product runs in ``kernels/w8a8_fp8_gemm.py``; elsewhere (the CPU, CI) in
its torch reference, which quantizes the activations the same way, so the numbers match.
"""

from __future__ import annotations

import math

import torch

from deepbatch.layers.quantization.base import (
    LinearMethod,
    QuantizationConfig,
    ignored_by,
    refuse_unknown_options,
    require_option,
    shard_param,
)
from deepbatch.layers.quantization.fp8_weights import (  # noqa: F401 - quantize_fp8_blocks: also this module's API
    FP8,
    FP8_MAX,
    quantize_fp8_blocks,
    quantize_fp8_channels,
    use_fp8_kernels,
)


class Fp8BlockLinearMethod(LinearMethod):
    name = "fp8-block"

    def __init__(self, block_size: tuple[int, int]):
        self.block_size = tuple(block_size)

    def create_weights(self, layer, in_features, out_sizes, dtype):
        bn, bk = self.block_size
        if len(out_sizes) > 1:
            for size in out_sizes:
                if size % bn:
                    raise ValueError(f"quantization fp8: a merged projection's part of {size} rows is not a multiple "
                                     f"of the {bn}-row weight block")
        out = sum(out_sizes)
        layer.weight = shard_param(torch.empty(out, in_features, dtype=FP8), output_dim=0, input_dim=1)
        layer.weight_scale_inv = shard_param(
            torch.empty(math.ceil(out / bn), math.ceil(in_features / bk), dtype=torch.float32),
            output_dim=0, input_dim=1, output_unit=bn, input_unit=bk)

    def apply(self, layer, x):
        from deepbatch.kernels import fp8_quant, w8a8_fp8_gemm

        bk = self.block_size[1]  # activations are quantized in groups of the weight block's columns
        x2 = x.reshape(-1, x.shape[-1])
        if use_fp8_kernels(x):
            x_q, x_s = fp8_quant.per_token_group_quant_fp8(x2, bk)
            y = w8a8_fp8_gemm.w8a8_block_fp8_matmul(x_q, x_s, layer.weight, layer.weight_scale_inv,
                                                    self.block_size, x.dtype)
        else:
            x_q, x_s = fp8_quant.per_token_group_quant_fp8_ref(x2, bk)
            y = w8a8_fp8_gemm.w8a8_block_fp8_matmul_ref(x_q, x_s, layer.weight, layer.weight_scale_inv,
                                                        self.block_size, x.dtype)
        return y.view(*x.shape[:-1], y.shape[-1])

    def dequantize(self, layer):
        from deepbatch.kernels.fp8_quant import dequantize_fp8_blocks_ref

        return dequantize_fp8_blocks_ref(layer.weight, layer.weight_scale_inv, self.block_size)

    @torch.no_grad()
    def init_random(self, layer, generator):
        rows = self.block_size[0] * 8  # a few blocks of rows at a time: no full-size float copy
        for start in range(0, layer.weight.shape[0], rows):
            chunk = torch.empty(min(rows, layer.weight.shape[0] - start), layer.weight.shape[1],
                                device=layer.weight.device).normal_(0.0, 0.02, generator=generator)
            q, s = quantize_fp8_blocks(chunk, self.block_size)
            layer.weight[start:start + chunk.shape[0]] = q
            first = start // self.block_size[0]
            layer.weight_scale_inv[first:first + s.shape[0]] = s


class Fp8ChannelLinearMethod(LinearMethod):
    """Per-output-channel weight scales, per-token dynamic activation scales."""

    name = "fp8-channel"

    def create_weights(self, layer, in_features, out_sizes, dtype):
        out = sum(out_sizes)
        layer.weight = shard_param(torch.empty(out, in_features, dtype=FP8), output_dim=0, input_dim=1)
        layer.weight_scale = shard_param(torch.empty(out, 1, dtype=torch.float32), output_dim=0)

    def apply(self, layer, x):
        from deepbatch.kernels import fp8_quant, w8a8_fp8_gemm

        x2 = x.reshape(-1, x.shape[-1])
        k = x2.shape[-1]
        if use_fp8_kernels(x):
            x_q, x_s = fp8_quant.per_token_group_quant_fp8(x2, k)
            y = w8a8_fp8_gemm.w8a8_channel_fp8_matmul(x_q, x_s, layer.weight, layer.weight_scale, x.dtype)
        else:
            x_q, x_s = fp8_quant.per_token_group_quant_fp8_ref(x2, k)
            y = w8a8_fp8_gemm.w8a8_channel_fp8_matmul_ref(x_q, x_s, layer.weight, layer.weight_scale, x.dtype)
        return y.view(*x.shape[:-1], y.shape[-1])

    def dequantize(self, layer):
        return layer.weight.float() * layer.weight_scale.float().view(-1, 1)

    @torch.no_grad()
    def init_random(self, layer, generator):
        rows = 1024
        for start in range(0, layer.weight.shape[0], rows):
            chunk = torch.empty(min(rows, layer.weight.shape[0] - start), layer.weight.shape[1],
                                device=layer.weight.device).normal_(0.0, 0.02, generator=generator)
            q, s = quantize_fp8_channels(chunk)
            layer.weight[start:start + chunk.shape[0]] = q
            layer.weight_scale[start:start + chunk.shape[0]] = s


class Fp8OnlineLinearMethod(Fp8ChannelLinearMethod):
    """``--quantization fp8`` on a 16-bit checkpoint: the layer loads its weight in the model
    dtype, then ``process_weights_after_loading`` replaces it by e4m3 + per-channel scales (the
    16-bit weights of the whole model are held until then)."""

    name = "fp8-online"

    def create_weights(self, layer, in_features, out_sizes, dtype):
        layer.weight = shard_param(torch.empty(sum(out_sizes), in_features, dtype=dtype), output_dim=0, input_dim=1)

    @torch.no_grad()
    def process_weights_after_loading(self, layer):
        if layer.weight.dtype == FP8:
            return
        q, s = quantize_fp8_channels(layer.weight.data)
        layer.weight = shard_param(q, output_dim=0, input_dim=1)
        layer.weight_scale = shard_param(s, output_dim=0)

    @torch.no_grad()
    def init_random(self, layer, generator):
        layer.weight.normal_(0.0, 0.02, generator=generator)


class Fp8Config(QuantizationConfig):
    """``quant_method: "fp8"`` (block-wise), or ``--quantization fp8`` (online, per channel)."""

    name = "fp8"

    def __init__(self, block_size: tuple[int, int] | None, ignored: tuple[str, ...] = ()):
        self.block_size = block_size
        self.ignored = ignored
        self._method = Fp8BlockLinearMethod(block_size) if block_size else Fp8OnlineLinearMethod()

    @classmethod
    def from_hf(cls, qc: dict) -> Fp8Config:
        known = {"quant_method", "activation_scheme", "fmt", "weight_block_size", "modules_to_not_convert",
                 "ignored_layers", "dequantize"}
        refuse_unknown_options("fp8", qc, known)
        require_option("fp8", qc, "activation_scheme", "dynamic")
        require_option("fp8", qc, "fmt", "e4m3")
        block = qc.get("weight_block_size")
        if block is None:
            raise ValueError("quantization_config: an fp8 checkpoint without weight_block_size (per-tensor scales) "
                             "is not supported; block-wise ([128, 128]) is")
        if (not isinstance(block, (list, tuple)) or len(block) != 2
                or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
            raise ValueError(f"quantization_config: fp8 weight_block_size must be two positive ints, got {block!r}")
        ignored = tuple(qc.get("modules_to_not_convert") or ()) + tuple(qc.get("ignored_layers") or ())
        return cls((int(block[0]), int(block[1])), ignored)

    def linear_method(self) -> LinearMethod:
        return self._method

    def moe_method(self):
        from deepbatch.layers.quantization.fp8_moe import Fp8BlockMoEMethod

        # Online: the experts are quantized block-wise too (the fused-MoE kernel has one fp8 form).
        return Fp8BlockMoEMethod(self.block_size or (128, 128), online=self.block_size is None)

    def is_ignored(self, module_name: str) -> bool:
        # transformers' rule for modules_to_not_convert: a listed name anywhere in the module's name.
        return bool(self.ignored) and ignored_by(module_name, lambda n: any(m in n for m in self.ignored), self.name)

    def weight_bits(self) -> float:
        if self.block_size:
            return 8 + 32 / (self.block_size[0] * self.block_size[1])
        return 8.0  # one float32 per output row: a few bits per thousand weights

    def compute_speedup(self) -> float:
        return 2.0  # W8A8: FP8 tensor cores have twice the bf16 rate

    def describe(self) -> str:
        if self.block_size:
            return f"fp8 block-wise {self.block_size[0]}x{self.block_size[1]} (W8A8, dynamic activation scales)"
        return "fp8 online per-channel (W8A8, dynamic per-token activation scales)"


def online_fp8() -> Fp8Config:
    return Fp8Config(None)
