"""MLA decode launch settings on the GPU: time the absorbed latent-attention kernel at a decode
batch for every (kv splits, tile_n, num_warps, num_stages) and report the latent bandwidth each
reaches, beside the setting the wrapper picks today (split merge included), and the swap-AB decode
kernel (deepbatch/kernels/mla_decode_swap_ab.py) for every (tile_n, num_warps, num_stages).

    python benchmarks/mla_sweep.py --batch 256 --context 1280 --output-json mla-sweep.json
    python benchmarks/mla_sweep.py --kernels swap_ab    # the swap-AB rows alone (fewer compiles)
    python benchmarks/mla_sweep.py --kv-cache-dtype fp8  # an 8-bit latent with its per-token scales

Shapes default to DeepSeek-V2-Lite (16 heads, kv_lora_rank 512, rope 64, block 16, bf16). The
bandwidth column counts the cache's real bytes: an 8-bit latent's 8 bytes of scales per token
included.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch

from deepbatch.bench.timing import device_time_us
from deepbatch.kernels import mla_decode as mla
from deepbatch.kernels.kv_quant import kv_cache_storage_dtype, quantize_latent_ref
from deepbatch.kernels.mla_decode_swap_ab import mla_decode_swap_ab


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--context", type=int, default=1280)
    ap.add_argument("--num-heads", type=int, default=16)
    ap.add_argument("--kv-lora-rank", type=int, default=512)
    ap.add_argument("--rope-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--output-json", default=None)
    ap.add_argument("--kernels", choices=("all", "mla", "swap_ab"), default="all",
                    help="which kernel's settings to sweep (the wrapper default is always timed)")
    ap.add_argument("--kv-cache-dtype", choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8"], default="auto",
                    help="time an 8-bit latent cache (per-token scales for c_kv and k_pe, as the engine writes it)")
    args = ap.parse_args()
    dev, dtype = "cuda", torch.bfloat16
    b, ctx, h, r, p, bs = args.batch, args.context, args.num_heads, args.kv_lora_rank, args.rope_dim, args.block_size
    # Ragged contexts around --context, as a decode wave of mla-moe has them.
    seq_lens = torch.randint(ctx // 2, ctx * 3 // 2, (b,), device=dev, dtype=torch.int32,
                             generator=torch.Generator(dev).manual_seed(0))
    max_len = int(seq_lens.max())
    blocks_per_seq = -(-max_len // bs)
    num_blocks = b * blocks_per_seq
    cache = torch.randn(num_blocks, bs, 1, r + p, device=dev, dtype=dtype)
    latent_scale = None
    cache_dtype = kv_cache_storage_dtype(args.kv_cache_dtype, dtype)
    if cache_dtype != dtype:
        cache, latent_scale = quantize_latent_ref(cache[..., 0, :r], cache[..., 0, r:], cache_dtype)
        cache = cache.unsqueeze(2)
    block_tables = torch.randperm(num_blocks, device=dev, dtype=torch.int32).view(b, blocks_per_seq)
    qsl = torch.arange(b + 1, device=dev, dtype=torch.int32)
    q_lat = torch.randn(b, h, r, device=dev, dtype=dtype)
    q_pe = torch.randn(b, h, p, device=dev, dtype=dtype)
    scale = (128 + p) ** -0.5
    token_bytes = (r + p) * cache.element_size() + (0 if latent_scale is None else latent_scale[0, 0].nbytes)
    latent_bytes = int(seq_lens.sum()) * token_bytes

    def attend(**kw):
        return mla.mla_attention(q_lat, q_pe, cache, block_tables, qsl, seq_lens, scale, 1, max_len,
                                 latent_scale=latent_scale, **kw)

    ref = attend(num_kv_splits=1)
    rows = [{"setting": "wrapper default", "us": device_time_us(attend, 30)}]
    block_h = min(16, 1 << (h - 1).bit_length())
    mla_settings = itertools.product((1, 2, 4), (32, 64), (4, 8), (1, 2, 3)) if args.kernels != "swap_ab" else ()
    for splits, tile_n, warps, stages in mla_settings:
        out = torch.empty_like(q_lat)

        def run():
            if splits == 1:
                mla._launch(q_lat, q_pe, cache, block_tables, qsl, seq_lens, scale, out, None, block_h, 16, 0,
                            mla._INT32_MAX, 1, tile_n=tile_n, num_warps=warps, num_stages=stages,
                            latent_scale=latent_scale)
                return out
            partial = torch.empty(splits, *q_lat.shape, dtype=torch.float32, device=dev)
            lse = torch.empty(splits, b, h, dtype=torch.float32, device=dev)
            mla._launch(q_lat, q_pe, cache, block_tables, qsl, seq_lens, scale, partial, lse, block_h, 16, 0,
                        mla._INT32_MAX, splits, tile_n=tile_n, num_warps=warps, num_stages=stages,
                        latent_scale=latent_scale)
            w = torch.exp2(lse - lse.amax(0, keepdim=True))
            return out.copy_((partial * w.unsqueeze(-1)).sum(0) / w.sum(0).unsqueeze(-1))

        name = f"splits={splits} tile_n={tile_n} warps={warps} stages={stages}"
        try:
            us = device_time_us(run, 30)
            ok = torch.allclose(run().float(), ref.float(), atol=3e-2, rtol=3e-2)
        except Exception as e:  # a setting that does not compile (shared memory, registers) is reported
            rows.append({"setting": name, "error": str(e)[:120]})
            continue
        rows.append({"setting": name, "us": us, "matches": ok})
    # Stage 1 keeps one key tile in shared memory instead of two, where two programs may share an
    # SM. Tiles that outgrow an H200's shared memory (64 keys past 2 stages, 128 keys past 1, at
    # R = 512 in bf16) fail to launch and come out as error rows.
    swap_settings = [(None, None, None), *itertools.product((32, 64, 128), (4, 8), (1, 2, 3, 4))]
    for tile_n, warps, stages in swap_settings if args.kernels != "mla" else ():
        out = torch.empty_like(q_lat)

        def run():
            return mla_decode_swap_ab(q_lat, q_pe, cache, block_tables, qsl, seq_lens, scale, max_len, out,
                                      tile_n=tile_n, num_warps=warps, num_stages=stages, latent_scale=latent_scale)

        name = "swap_ab default" if tile_n is None else f"swap_ab tile_n={tile_n} warps={warps} stages={stages}"
        try:
            us = device_time_us(run, 30)
            ok = torch.allclose(run().float(), ref.float(), atol=3e-2, rtol=3e-2)
        except Exception as e:
            rows.append({"setting": name, "error": str(e)[:120]})
            continue
        rows.append({"setting": name, "us": us, "matches": ok})
    for row in rows:
        if "us" in row:
            row["TB/s"] = latent_bytes / row["us"] / 1e6
    rows.sort(key=lambda row: row.get("us", float("inf")))
    print(f"MLA decode batch {b}, contexts {ctx // 2}..{ctx * 3 // 2}, {h} heads, R={r}, P={p}, "
          f"latent {str(cache.dtype).removeprefix('torch.')}: "
          f"{latent_bytes / 1e9:.3f} GB of latents per layer call")
    for row in rows:
        if "us" in row:
            print(f"{row['setting']:<44} {row['us']:>8.1f} us {row['TB/s']:>6.2f} TB/s "
                  f"{'' if row.get('matches', True) else 'MISMATCH'}")
        else:
            print(f"{row['setting']:<44} failed: {row['error']}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
