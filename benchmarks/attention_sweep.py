"""Decode paged-attention launch settings on the GPU: time the one-pass kernel at a decode batch
for every (tile_n, num_warps, num_stages) and report the KV bandwidth each reaches, against the
settings the wrapper picks today. The output says which setting to make the default.

    python benchmarks/attention_sweep.py --batch 256 --context 850 --output-json sweep.json

Shapes default to qwen3-0.6b (16 query / 8 KV heads, head dim 128, block 16, bf16);
``--kv-cache-dtype fp8|int8`` times an 8-bit cache (bandwidth counts its real bytes, scales included).
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch

from deepbatch.bench.timing import device_time_us
from deepbatch.kernels import paged_attention as pa


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--context", type=int, default=850)
    ap.add_argument("--ragged", action="store_true",
                    help="context lengths uniform in [100, 2 * context - 100] (nano-x4 mixes 200 to 2,048)")
    ap.add_argument("--num-heads", type=int, default=16)
    ap.add_argument("--num-kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--kv-cache-dtype", choices=["auto", "fp8", "int8"], default="auto",
                    help="time an 8-bit cache (fp8 e4m3 with a per-layer scale, int8 with per-token scales)")
    ap.add_argument("--only-default", action="store_true", help="time the wrapper's own choice only")
    ap.add_argument("--tile-n", default="32,64,128", help="key tile lengths to try (8-bit tiles fit 256)")
    ap.add_argument("--warps", default="2,4,8")
    ap.add_argument("--stages", default="2,3,4")
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()
    dev, dtype = "cuda", torch.bfloat16
    b, ctx, hq, hkv, d, bs = args.batch, args.context, args.num_heads, args.num_kv_heads, args.head_dim, args.block_size
    max_len = 2 * ctx if args.ragged else ctx
    blocks_per_seq = -(-max_len // bs)
    num_blocks = b * blocks_per_seq
    k_cache = torch.randn(num_blocks, bs, hkv, d, device=dev, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    scales = {}
    if args.kv_cache_dtype == "fp8":
        k_cache, v_cache = k_cache.to(torch.float8_e4m3fn), v_cache.to(torch.float8_e4m3fn)
        scales = {"k_scale": 1.0, "v_scale": 1.0}
    elif args.kv_cache_dtype == "int8":
        k_cache = torch.randint(-127, 128, k_cache.shape, device=dev, dtype=torch.int8)
        v_cache = torch.randint(-127, 128, v_cache.shape, device=dev, dtype=torch.int8)
        one = torch.full((num_blocks, bs, hkv), 1 / 127, device=dev)
        scales = {"k_scale": one, "v_scale": one.clone()}
    # Shuffled blocks, as a long-running pool leaves them.
    block_tables = torch.randperm(num_blocks, device=dev, dtype=torch.int32).view(b, blocks_per_seq)
    seq_lens = torch.full((b,), ctx, device=dev, dtype=torch.int32)
    if args.ragged:
        seq_lens = torch.randint(100, 2 * ctx - 100, (b,), device=dev, dtype=torch.int32,
                                 generator=torch.Generator(dev).manual_seed(0))
    qsl = torch.arange(b + 1, device=dev, dtype=torch.int32)
    q = torch.randn(b, hq, d, device=dev, dtype=dtype)
    out = torch.empty_like(q)
    scale = d ** -0.5
    kv_bytes = int(seq_lens.sum()) * hkv * 2 * (d * k_cache.element_size() + (4 if args.kv_cache_dtype == "int8" else 0))
    # The scales as the wrapper hands them to a launch.
    kv = pa.KVScaleArgs(pa._check_inputs(q, k_cache, v_cache, block_tables, qsl, seq_lens, 1, max_len, out,
                                         scales.get("k_scale"), scales.get("v_scale")),
                        scales.get("k_scale"), scales.get("v_scale"))
    small_m = max(16, 1 << (hq // hkv - 1).bit_length())

    ref = pa.paged_attention(q, k_cache, v_cache, block_tables, qsl, seq_lens, scale, 1, max_len, num_kv_splits=1,
                             **scales)
    rows = []
    us = device_time_us(lambda: pa.paged_attention(q, k_cache, v_cache, block_tables, qsl, seq_lens, scale, 1, max_len,
                                                   out, **scales), 50)
    rows.append({"setting": "wrapper default", "us": us, "TB/s": kv_bytes / us / 1e6})
    ints = lambda text: [int(x) for x in text.split(",")]  # noqa: E731
    settings = [] if args.only_default else itertools.product(ints(args.tile_n), ints(args.warps), ints(args.stages))
    for tile_n, warps, stages in settings:
        def run():
            pa._launch(q, k_cache, v_cache, block_tables, qsl, seq_lens, scale, out, block_m=small_m, min_q_len=0,
                       max_q_len=pa._INT32_MAX, tile_n=tile_n, num_warps=warps, num_stages=stages, kv=kv)
        try:
            us = device_time_us(run, 50)
        except Exception as e:  # a setting that does not compile (shared memory) is reported
            rows.append({"setting": f"tile_n={tile_n} warps={warps} stages={stages}", "error": str(e)[:120]})
            continue
        ok = torch.allclose(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
        rows.append({"setting": f"tile_n={tile_n} warps={warps} stages={stages}", "us": us,
                     "TB/s": kv_bytes / us / 1e6, "matches": ok})
    rows.sort(key=lambda r: r.get("us", float("inf")))
    print(f"decode batch {b}, context {ctx}, {hq}/{hkv} heads, d={d}: {kv_bytes / 1e9:.2f} GB of KV per layer call")
    for r in rows:
        if "us" in r:
            print(f"{r['setting']:<34} {r['us']:>8.1f} us {r['TB/s']:>6.2f} TB/s {'' if r.get('matches', True) else 'MISMATCH'}")
        else:
            print(f"{r['setting']:<34} failed: {r['error']}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
