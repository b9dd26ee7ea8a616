"""Quantized GEMMs against cuBLAS bf16 on the GPU, per batch size, on a model's own linear shapes.

For each projection (N, K) of the config and each M it times:

- ``bf16``: ``x @ w.T`` in bf16 (cuBLAS), the baseline the quantized formats must beat;
- ``fp8-channel-cublas`` / ``fp8-channel-triton``: the per-channel W8A8 GEMM (online FP8 and
  FP8_DYNAMIC), through ``torch._scaled_mm`` and through the Triton kernel, each with the
  per-token activation quantization it needs;
- ``fp8-block-triton``: DeepSeek-V3's block-wise W8A8 GEMM with its per-group quantization;
- ``w4a16-triton``: the 4-bit weight-only GEMM (AWQ/GPTQ/W4A16), group 128.

    python benchmarks/quant_gemm_sweep.py --model-config benchmarks/models/llama-3.1-8b.json --output-json s.json
"""

from __future__ import annotations

import argparse
import json

import torch

from deepbatch.bench.timing import device_time_us
from deepbatch.kernels import fp8_quant, w8a8_fp8_gemm
from deepbatch.kernels.w4a16_gemm import pack_int4, w4a16_matmul


def shapes(cfg: dict) -> dict[str, tuple[int, int]]:
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    d = cfg.get("head_dim") or h // heads
    kvh = cfg.get("num_key_value_heads") or heads
    return {"qkv_proj": ((heads + 2 * kvh) * d, h), "o_proj": (h, heads * d),
            "gate_up_proj": (2 * cfg["intermediate_size"], h), "down_proj": (h, cfg["intermediate_size"])}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-config", required=True)
    ap.add_argument("--m", default="1,16,64,128,256,1024,8192")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run under TRITON_INTERPRET=1")
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()
    with open(args.model_config) as f:
        cfg = json.load(f)
    dev = args.device
    rows = []
    for proj, (n, k) in shapes(cfg).items():
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        w_q, w_s = (t.contiguous() for t in _channel(w))
        wb_q, wb_s = _block(w)
        q4 = torch.randint(0, 16, (k, n), device=dev, dtype=torch.int32)
        qweight = pack_int4(q4)
        scales = torch.rand(k // 128, n, device=dev, dtype=torch.bfloat16) * 1e-2
        zeros = torch.full((k // 128, n), 8.0, device=dev, dtype=torch.bfloat16)
        for m in map(int, args.m.split(",")):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            runs = {
                "bf16": lambda: x @ w.t(),
                "fp8-channel-cublas": lambda: w8a8_fp8_gemm.w8a8_channel_fp8_matmul(
                    *fp8_quant.per_token_group_quant_fp8(x, k), w_q, w_s, torch.bfloat16),
                "fp8-channel-triton": lambda: w8a8_fp8_gemm.w8a8_channel_fp8_matmul(
                    *fp8_quant.per_token_group_quant_fp8(x, k), w_q, w_s, torch.bfloat16, backend="triton"),
                "fp8-block-triton": lambda: w8a8_fp8_gemm.w8a8_block_fp8_matmul(
                    *fp8_quant.per_token_group_quant_fp8(x, 128), wb_q, wb_s, (128, 128), torch.bfloat16),
                "w4a16-triton": lambda: w4a16_matmul(x, qweight, scales, zeros, 128),
            }
            row = {"proj": proj, "n": n, "k": k, "m": m}
            for name, fn in runs.items():
                try:
                    row[name] = round(device_time_us(fn, args.reps), 1)
                except Exception as e:  # a path that does not apply to this shape is reported
                    row[name] = f"error: {str(e)[:80]}"
            rows.append(row)
            base = row["bf16"]
            print(f"{proj:<13} N={n:<6} K={k:<6} M={m:<5} bf16 {base:>8.1f} us | " + " | ".join(
                f"{name} {v:>8.1f} us ({base / v:.2f}x)" if isinstance(v, float) else f"{name} {v}"
                for name, v in row.items() if name not in ("proj", "n", "k", "m", "bf16")), flush=True)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"model_config": args.model_config, "rows": rows}, f, indent=1)


def _channel(w):
    from deepbatch.layers.quantization.fp8 import quantize_fp8_channels

    return quantize_fp8_channels(w)


def _block(w):
    from deepbatch.layers.quantization.fp8 import quantize_fp8_blocks

    return quantize_fp8_blocks(w, (128, 128))


if __name__ == "__main__":
    main()
