"""FP8 block-wise routed experts (DeepSeek-V3/R1's own format), and ``--quantization fp8`` for
MoE models, whose experts are quantized the same block-wise way while loading.

Per expert, as in the checkpoint: ``gate_proj``/``up_proj``/``down_proj`` e4m3 weights with
``weight_scale_inv`` of one float32 per 128 x 128 block. Stacked here like the 16-bit experts::

    gate_up_proj [E, 2I, H] e4m3     gate_up_proj_scale_inv [E, 2I/bn, ceil(H/bk)]
    down_proj    [E, H, I]  e4m3     down_proj_scale_inv    [E, ceil(H/bn), I/bk]

so ``I`` (this rank's share) must be a multiple of the block. Both grouped GEMMs are W8A8 with the
activations quantized per token and ``bk``-column group (``kernels/fused_moe.py``).
"""

from __future__ import annotations

import math

import torch

from deepbatch.layers.quantization.base import FusedMoEMethod, moe_param
from deepbatch.layers.quantization.fp8_weights import FP8, quantize_fp8_blocks, use_fp8_kernels


class Fp8BlockMoEMethod(FusedMoEMethod):
    name = "fp8-block"

    def __init__(self, block_size: tuple[int, int], online: bool = False):
        self.block_size = tuple(block_size)
        self.online = online  # 16-bit experts loaded, quantized in process_weights_after_loading

    def create_weights(self, layer, num_experts, hidden, intermediate, dtype):
        bn, bk = self.block_size
        if intermediate % bn or intermediate % bk:
            raise ValueError(f"quantization fp8: moe_intermediate_size {intermediate} (per rank) is not a multiple of "
                             f"the {bn}x{bk} weight block")
        if self.online:
            return super().create_weights(layer, num_experts, hidden, intermediate, dtype)
        layer.gate_up_proj = moe_param(torch.empty(num_experts, 2 * intermediate, hidden, dtype=FP8), "gate_up")
        layer.down_proj = moe_param(torch.empty(num_experts, hidden, intermediate, dtype=FP8), "down")
        layer.gate_up_proj_scale_inv = moe_param(
            torch.empty(num_experts, 2 * intermediate // bn, math.ceil(hidden / bk), dtype=torch.float32), "gate_up", bn)
        layer.down_proj_scale_inv = moe_param(
            torch.empty(num_experts, math.ceil(hidden / bn), intermediate // bk, dtype=torch.float32), "down", bk)

    @torch.no_grad()
    def process_weights_after_loading(self, layer):
        if layer.gate_up_proj.dtype == FP8:
            return
        bn, bk = self.block_size
        for name in ("gate_up_proj", "down_proj"):
            w = getattr(layer, name)
            q = torch.empty(w.shape, dtype=FP8, device=w.device)
            scales = []
            for e in range(w.shape[0]):  # one expert at a time: no full-size float copy
                q[e], s = quantize_fp8_blocks(w[e], self.block_size)
                scales.append(s)
            role, unit = ("gate_up", bn) if name == "gate_up_proj" else ("down", bk)
            setattr(layer, name, moe_param(q, role))
            setattr(layer, f"{name}_scale_inv", moe_param(torch.stack(scales), role, unit))

    def apply(self, layer, x, topk_weights, topk_ids):
        from deepbatch.kernels import fused_moe as kernels

        w13, w2 = layer.gate_up_proj, layer.down_proj
        w13_scale, w2_scale = layer.gate_up_proj_scale_inv, layer.down_proj_scale_inv
        if use_fp8_kernels(x):
            return kernels.fused_moe(x, w13, w2, topk_weights, topk_ids, w13_scale=w13_scale, w2_scale=w2_scale,
                                     block_size=self.block_size)
        return kernels.fused_moe_fp8_block_ref(x, w13, w2, w13_scale, w2_scale, topk_weights, topk_ids,
                                               block_size=self.block_size)

    def dequantize(self, layer):
        from deepbatch.kernels.fp8_quant import dequantize_fp8_blocks_ref

        w13 = torch.stack([dequantize_fp8_blocks_ref(layer.gate_up_proj[e], layer.gate_up_proj_scale_inv[e],
                                                     self.block_size) for e in range(layer.gate_up_proj.shape[0])])
        w2 = torch.stack([dequantize_fp8_blocks_ref(layer.down_proj[e], layer.down_proj_scale_inv[e],
                                                    self.block_size) for e in range(layer.down_proj.shape[0])])
        return w13, w2

    @torch.no_grad()
    def init_random(self, layer, generator):
        if self.online:
            return super().init_random(layer, generator)
        for name in ("gate_up_proj", "down_proj"):
            w, scale = getattr(layer, name), getattr(layer, f"{name}_scale_inv")
            for e in range(w.shape[0]):
                chunk = torch.empty(w.shape[1:], device=w.device).normal_(0.0, 0.02, generator=generator)
                w[e], scale[e] = quantize_fp8_blocks(chunk, self.block_size)
