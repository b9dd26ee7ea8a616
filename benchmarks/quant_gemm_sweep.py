"""Quantized GEMMs against cuBLAS bf16 on the GPU, per batch size, on a model's own linear shapes.

For each projection (N, K) of the config and each M it times:

- ``bf16``: ``x @ w.T`` in bf16 (cuBLAS), the baseline the quantized formats must beat;
- ``fp8-channel-cublas`` / ``fp8-channel-triton``: the per-channel W8A8 GEMM (online FP8 and
  FP8_DYNAMIC), through ``torch._scaled_mm`` and through the Triton kernel, each with the
  per-token activation quantization it needs;
- ``fp8-block-triton`` / ``fp8-block-cublas``: DeepSeek-V3's block-wise W8A8 GEMM with its
  per-group quantization, through the Triton kernel and through cuBLASLt's block scaling (SM90);
- ``w4a16-triton``: the fused 4-bit weight-only GEMM (AWQ/GPTQ/W4A16), group 128;
- ``w4a16-dequant``: the same weight dequantized to bf16 by ``kernels/int4_dequant.py``, then
  ``F.linear`` (what a W4A16 layer runs from ``W4A16_DEQUANT_MIN_TOKENS`` tokens on).

By default each path is timed eagerly (CUDA events around a loop of Python calls), which at decode
sizes measures the host's launch overhead more than the GPU. ``--graphs`` captures
``--graph-calls`` calls of each path in one CUDA graph and times its replays: the GPU time per call
a decode step replaying its graph sees. Each call reads the next of several copies of the weights
(``--rotate-mib``), so that a small weight is not served from L2 on every call, as it would not be
in a model's forward pass.

    python benchmarks/quant_gemm_sweep.py --model-config benchmarks/models/llama-3.1-8b.json --output-json s.json
    python benchmarks/quant_gemm_sweep.py --model-config benchmarks/models/llama-3.1-8b.json --graphs \\
        --m 1,2,4,8,16,32,64,128,256,512,1024,2048,4096,8192 --output-json s-graphs.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from deepbatch.bench.timing import device_time_us
from deepbatch.kernels import fp8_quant, w8a8_fp8_gemm
from deepbatch.kernels.int4_dequant import dequantize_int4
from deepbatch.kernels.w4a16_gemm import pack_int4, w4a16_matmul

GROUP = 128  # W4A16 group size
MAX_COPIES = 64  # weight copies per projection at most (--rotate-mib)


def shapes(cfg: dict) -> dict[str, tuple[int, int]]:
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    d = cfg.get("head_dim") or h // heads
    kvh = cfg.get("num_key_value_heads") or heads
    return {"qkv_proj": ((heads + 2 * kvh) * d, h), "o_proj": (h, heads * d),
            "gate_up_proj": (2 * cfg["intermediate_size"], h), "down_proj": (h, cfg["intermediate_size"])}


def graph_time_us(fn: Callable[[], object], calls: int, reps: int, warmup: int = 3) -> float:
    """Mean microseconds per call of ``fn`` with ``calls`` calls captured in one CUDA graph and the
    graph replayed ``reps`` times between CUDA events: no host launch overhead in the time. The
    warm-up runs eagerly (Triton compiles, cuBLAS picks its kernels, a path that does not apply
    raises) on a side stream, as the engine's graph capture does."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / (reps * calls) * 1e3


class Weights:
    """One (N, K) projection's weight in every format the sweep runs."""

    def __init__(self, n: int, k: int, dev: str, seed: int):
        torch.manual_seed(seed)
        self.w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        self.w_q, self.w_s = (t.contiguous() for t in _channel(self.w))
        self.wb_q, self.wb_s = _block(self.w)
        self.qweight = pack_int4(torch.randint(0, 16, (k, n), device=dev, dtype=torch.int32))
        self.scales = torch.rand(k // GROUP, n, device=dev, dtype=torch.bfloat16) * 1e-2
        self.zeros = torch.full((k // GROUP, n), 8.0, device=dev, dtype=torch.bfloat16)


def paths(x: torch.Tensor, k: int) -> dict[str, Callable[[Weights], torch.Tensor]]:
    bf16 = torch.bfloat16
    return {
        "bf16": lambda w: x @ w.w.t(),
        "fp8-channel-cublas": lambda w: w8a8_fp8_gemm.w8a8_channel_fp8_matmul(
            *fp8_quant.per_token_group_quant_fp8(x, k), w.w_q, w.w_s, bf16),
        "fp8-channel-triton": lambda w: w8a8_fp8_gemm.w8a8_channel_fp8_matmul(
            *fp8_quant.per_token_group_quant_fp8(x, k), w.w_q, w.w_s, bf16, backend="triton"),
        "fp8-block-triton": lambda w: w8a8_fp8_gemm.w8a8_block_fp8_matmul(
            *fp8_quant.per_token_group_quant_fp8(x, 128), w.wb_q, w.wb_s, (128, 128), bf16, backend="triton"),
        "fp8-block-cublas": lambda w: w8a8_fp8_gemm.w8a8_block_fp8_matmul(
            *fp8_quant.per_token_group_quant_fp8(x, 128), w.wb_q, w.wb_s, (128, 128), bf16, backend="cublas"),
        "w4a16-triton": lambda w: w4a16_matmul(x, w.qweight, w.scales, w.zeros, GROUP),
        "w4a16-dequant": lambda w: F.linear(x, dequantize_int4(w.qweight, w.scales, w.zeros, GROUP)),
    }


def rotating(fn: Callable[[Weights], torch.Tensor], copies: list[Weights]) -> Callable[[], torch.Tensor]:
    """``fn`` on the next weight copy at each call."""
    turn = itertools.cycle(copies)
    return lambda: fn(next(turn))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-config", required=True)
    ap.add_argument("--m", default="1,16,64,128,256,1024,8192")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--graphs", action="store_true",
                    help="time each path inside a captured CUDA graph (decode sizes without launch overhead)")
    ap.add_argument("--graph-calls", type=int, default=32,
                    help="calls captured in each graph (with --graphs; at least one per weight copy)")
    ap.add_argument("--rotate-mib", type=float, default=256.0,
                    help=f"cycle through copies of the weights (at most {MAX_COPIES}) holding at least this many "
                         "MiB of the 4-bit weight, so that a call does not find in L2 the weight an earlier call "
                         "read (0: one copy; always one on the CPU)")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run under TRITON_INTERPRET=1")
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()
    if args.graphs and args.device != "cuda":
        ap.error("--graphs needs --device cuda")
    if args.graph_calls < 1 or args.reps < 1:
        ap.error("--graph-calls and --reps must be at least 1")
    with open(args.model_config) as f:
        cfg = json.load(f)
    dev = args.device
    rows = []
    for proj, (n, k) in shapes(cfg).items():
        int4_mib = n * k / 2 / 2**20
        wanted = 1 if dev == "cpu" or args.rotate_mib <= 0 else math.ceil(args.rotate_mib / int4_mib)
        copies = [Weights(n, k, dev, seed) for seed in range(min(MAX_COPIES, wanted))]
        calls = max(args.graph_calls, len(copies))
        for m in map(int, args.m.split(",")):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            row = {"proj": proj, "n": n, "k": k, "m": m, "weight_copies": len(copies),
                   "calls_per_graph": calls if args.graphs else None}
            for name, fn in paths(x, k).items():
                call = rotating(fn, copies)
                try:
                    us = graph_time_us(call, calls, args.reps) if args.graphs else device_time_us(call, args.reps)
                    row[name] = round(us, 2 if us < 100 else 1)
                except Exception as e:  # a path that does not apply to this shape is reported
                    row[name] = f"error: {str(e)[:160]}"
            rows.append(row)
            print(_line(row), flush=True)
        del copies
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"model_config": args.model_config, "graphs": args.graphs, "rows": rows}, f, indent=1)


def _line(row: dict) -> str:
    base = row["bf16"]
    cells = []
    for name, v in row.items():
        if name in ("proj", "n", "k", "m", "weight_copies", "calls_per_graph", "bf16"):
            continue
        if isinstance(v, float) and isinstance(base, float):
            cells.append(f"{name} {v:>8.1f} us ({base / v:.2f}x)")
        else:
            cells.append(f"{name} {v}")
    head = f"{base:>8.1f} us" if isinstance(base, float) else base
    return f"{row['proj']:<13} N={row['n']:<6} K={row['k']:<6} M={row['m']:<5} bf16 {head} | " + " | ".join(cells)


def _channel(w):
    from deepbatch.layers.quantization.fp8 import quantize_fp8_channels

    return quantize_fp8_channels(w)


def _block(w):
    from deepbatch.layers.quantization.fp8 import quantize_fp8_blocks

    return quantize_fp8_blocks(w, (128, 128))


if __name__ == "__main__":
    main()
