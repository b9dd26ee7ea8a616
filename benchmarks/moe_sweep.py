"""Fused-MoE grouped-GEMM launch settings on the GPU: for a decode-sized and a prefill-sized
batch, time both grouped GEMMs (gate/up, then down) for every (block_m, block_n, block_k,
num_warps, num_stages) and report TFLOP/s and weight bandwidth beside the wrapper's choice.

    python benchmarks/moe_sweep.py --tokens 256,8192 --output-json moe-sweep.json

Shapes default to DeepSeek-V2-Lite (64 experts, top-6, hidden 2048, expert intermediate 1408).
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch

from deepbatch.bench.timing import device_time_us
from deepbatch.kernels import fused_moe as fm
from deepbatch.kernels import moe_align as ma
from deepbatch.kernels.silu_and_mul import silu_and_mul


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="256,8192")
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=1408)
    ap.add_argument("--align-only", action="store_true",
                    help="instead: time the one-launch pair sort (kernels/moe_align.py) per chunk and warps")
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()
    if args.align_only:
        return align_sweep(args)
    dev, dtype = "cuda", torch.bfloat16
    e, k, hdim, inter = args.experts, args.top_k, args.hidden, args.intermediate
    w13 = torch.randn(e, 2 * inter, hdim, device=dev, dtype=dtype) * 0.02
    w2 = torch.randn(e, hdim, inter, device=dev, dtype=dtype) * 0.02
    weight_bytes = (w13.numel() + w2.numel()) * w13.element_size()
    report = {"args": vars(args), "cases": []}

    for t in (int(x) for x in args.tokens.split(",")):
        g = torch.Generator(dev).manual_seed(t)
        x = torch.randn(t, hdim, device=dev, dtype=dtype, generator=g)
        ids = torch.rand(t, e, device=dev, generator=g).topk(k, dim=-1).indices
        wts = torch.rand(t, k, device=dev, generator=g)
        ref = fm.fused_moe(x, w13, w2, wts, ids)
        flops = 2 * t * k * (2 * inter * hdim + hdim * inter)
        rows = [{"setting": "wrapper default", "us": device_time_us(lambda: fm.fused_moe(x, w13, w2, wts, ids), 20)}]
        per_expert = t * k / e
        for bm, bn, bk, warps, stages in itertools.product((16, 32, 64, 128), (64, 128), (64,), (4, 8), (3, 4)):
            if bm > 2 * max(16, per_expert):  # tiles mostly padding at this batch
                continue
            sorted_ids, expert_ids, num_padded = ma.sort_pairs_by_expert(ids, e, bm)
            gate_up = torch.empty(t * k, 2 * inter, dtype=dtype, device=dev)
            down = torch.empty(t * k, hdim, dtype=dtype, device=dev)

            def run():
                fm._launch(x, w13, gate_up, wts, sorted_ids, expert_ids, num_padded, k, False, bm, bn, bk, warps,
                           stages)
                act = silu_and_mul(gate_up)
                fm._launch(act, w2, down, wts, sorted_ids, expert_ids, num_padded, 1, True, bm, bn, bk, warps,
                           stages)
                return down.view(t, k, hdim).sum(1)

            name = f"block_m={bm} block_n={bn} block_k={bk} warps={warps} stages={stages}"
            try:
                us = device_time_us(run, 20)
                ok = torch.allclose(run().float(), ref.float(), atol=2e-2, rtol=2e-2)
            except Exception as exc:  # shared memory or registers exceeded
                rows.append({"setting": name, "error": str(exc)[:120]})
                continue
            rows.append({"setting": name, "us": us, "matches": ok})
        for row in rows:
            if "us" in row:
                row["TFLOP/s"] = flops / row["us"] / 1e6
                row["TB/s"] = weight_bytes / row["us"] / 1e6
        rows.sort(key=lambda row: row.get("us", float("inf")))
        print(f"\n{t} tokens x top-{k} of {e} experts, H={hdim}, I={inter}: {flops / 1e9:.1f} GFLOP, "
              f"{weight_bytes / 1e9:.2f} GB of expert weights")
        for row in rows[:15] + [r for r in rows[15:] if r["setting"] == "wrapper default"]:
            if "us" in row:
                print(f"{row['setting']:<56} {row['us']:>9.1f} us {row['TFLOP/s']:>6.1f} TFLOP/s "
                      f"{row['TB/s']:>5.2f} TB/s {'' if row.get('matches', True) else 'MISMATCH'}")
        report["cases"].append({"tokens": t, "rows": rows})
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=1)


def align_sweep(args):
    """The pair sort at each token count (up to its MAX_PAIRS), per (chunk, num_warps), each
    checked against the torch sort."""

    report = {"args": vars(args), "cases": []}
    for t in (int(x) for x in args.tokens.split(",")):
        if t * args.top_k > ma.MAX_PAIRS:
            continue
        g = torch.Generator("cuda").manual_seed(t)
        ids = torch.rand(t, args.experts, device="cuda", generator=g).topk(args.top_k, dim=-1).indices
        want = ma.sort_pairs_by_expert(ids, args.experts, 16)
        rows = [{"setting": "torch sort", "us": device_time_us(lambda: ma.sort_pairs_by_expert(ids, args.experts, 16), 50)}]
        for chunk, warps in itertools.product((64, 128, 256, 512, 1024), (4, 8, 16)):
            name = f"chunk={chunk} warps={warps}"
            try:
                got = ma.moe_align(ids, args.experts, 16, chunk=chunk, num_warps=warps)
                us = device_time_us(lambda: ma.moe_align(ids, args.experts, 16, chunk=chunk, num_warps=warps), 50)
            except Exception as exc:  # registers or shared memory exceeded
                rows.append({"setting": name, "error": str(exc)[:120]})
                continue
            rows.append({"setting": name, "us": us, "matches": all(torch.equal(a, b) for a, b in zip(got, want))})
        rows.sort(key=lambda row: row.get("us", float("inf")))
        print(f"\npair sort, {t} tokens x top-{args.top_k} of {args.experts} experts")
        for row in rows:
            print(f"{row['setting']:<24} " + (f"{row['us']:>8.1f} us {'' if row.get('matches', True) else 'MISMATCH'}"
                                             if "us" in row else f"failed: {row['error']}"))
        report["cases"].append({"tokens": t, "rows": rows})
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
