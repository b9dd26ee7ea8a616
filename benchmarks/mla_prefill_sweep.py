"""MLA prefill on the GPU, the two forms side by side on one prefill step's shapes (default: 8
fresh prompts of 1,024 tokens, DeepSeek-V2-Lite's 16 heads, R=512, P=64, Dn=Dv=128, bf16):

- absorbed: the latent-space Triton kernel's tall-tile launch for every (block_m, tile_n,
  num_warps, num_stages), with its attention TFLOP/s (2 x (2R + P) per visible key and head);
- expanded, in parts: gathering the latents, the ``kv_b_proj`` GEMM, assembling the keys, and
  SDPA per request (``layers.mla.causal_attention``), so the slow part of that path shows.

    python benchmarks/mla_prefill_sweep.py --prompts 8 --prompt-len 1024 --output-json mla-prefill.json
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch

from deepbatch.bench.timing import device_time_us
from deepbatch.kernels import mla_decode as mla
from deepbatch.layers.mla import causal_attention


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--num-heads", type=int, default=16)
    ap.add_argument("--kv-lora-rank", type=int, default=512)
    ap.add_argument("--rope-dim", type=int, default=64)
    ap.add_argument("--nope-dim", type=int, default=128)
    ap.add_argument("--v-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--output-json", default=None)
    ap.add_argument("--quick", action="store_true", help="one absorbed setting (a smoke run)")
    args = ap.parse_args()
    dev, dtype = ("cuda", torch.bfloat16) if torch.cuda.is_available() else ("cpu", torch.float32)
    b, n, h, r, p, bs = args.prompts, args.prompt_len, args.num_heads, args.kv_lora_rank, args.rope_dim, args.block_size
    dn, dv = args.nope_dim, args.v_dim
    t = b * n
    blocks = -(-n // bs)
    cache = torch.randn(b * blocks, bs, 1, r + p, device=dev, dtype=dtype)
    block_tables = torch.randperm(b * blocks, device=dev, dtype=torch.int32).view(b, blocks)
    qsl = torch.arange(0, t + 1, n, device=dev, dtype=torch.int32)
    seq_lens = torch.full((b,), n, device=dev, dtype=torch.int32)
    q_lat = torch.randn(t, h, r, device=dev, dtype=dtype)
    q_pe = torch.randn(t, h, p, device=dev, dtype=dtype)
    q_nope = torch.randn(t, h, dn, device=dev, dtype=dtype)
    w_kv_b = torch.randn(h * (dn + dv), r, device=dev, dtype=dtype) * r ** -0.5
    scale = (dn + p) ** -0.5
    pairs = b * n * (n + 1) // 2 * h  # visible (query, key) pairs over all heads
    rows = []

    out = torch.empty_like(q_lat)
    block_h = min(16, 1 << (h - 1).bit_length())
    rows.append({"setting": "absorbed, wrapper default",
                 "us": device_time_us(lambda: mla.mla_attention(q_lat, q_pe, cache, block_tables, qsl, seq_lens, scale,
                                                                n, n), 10)})
    grid = [(32, 32, 8, 2)] if args.quick else itertools.product((32, 64), (16, 32, 64), (4, 8), (1, 2))
    for bm, tile_n, warps, stages in grid:
        def run():
            mla._launch(q_lat, q_pe, cache, block_tables, qsl, seq_lens, scale, out, None, block_h, bm, 0,
                        mla._INT32_MAX, 1, tile_n=tile_n, num_warps=warps, num_stages=stages)
        name = f"absorbed, block_m={bm} tile_n={tile_n} warps={warps} stages={stages}"
        try:
            rows.append({"setting": name, "us": device_time_us(run, 10)})
        except Exception as e:  # shared memory or registers exceeded
            rows.append({"setting": name, "error": str(e)[:120]})
    for row in rows:
        if "us" in row:
            row["TFLOP/s"] = pairs * 2 * (2 * r + p) / row["us"] / 1e6

    # The expanded path's parts, as layers/mla.py runs them for one group of requests.
    ids = block_tables.flatten().long()
    latent = cache[ids].flatten(0, 2)
    c_kv, k_pe = latent.split([r, p], dim=-1)
    kv = torch.nn.functional.linear(c_kv, w_kv_b).view(-1, h, dn + dv)
    k_nope, v = kv.split([dn, dv], dim=-1)
    key = torch.cat((k_nope, k_pe.unsqueeze(1).expand(-1, h, -1)), dim=-1)
    query = torch.cat((q_nope, q_pe), dim=-1)

    def sdpa_all():
        for i in range(b):
            causal_attention(query[i * n:(i + 1) * n], key[i * blocks * bs:i * blocks * bs + n],
                             v[i * blocks * bs:i * blocks * bs + n], scale)

    parts = {
        "expanded: gather latents": lambda: cache[ids].flatten(0, 2),
        "expanded: kv_b_proj GEMM": lambda: torch.nn.functional.linear(c_kv, w_kv_b),
        "expanded: assemble keys": lambda: torch.cat((k_nope, k_pe.unsqueeze(1).expand(-1, h, -1)), dim=-1),
        "expanded: SDPA per request (causal)": sdpa_all,
        "expanded: SDPA, one request with a masked (chunked) context": lambda: causal_attention(
            query[: n // 2], key[:n], v[:n], scale),
    }
    for name, fn in parts.items():
        rows.append({"setting": name, "us": device_time_us(fn, 10)})
    rows[-2]["TFLOP/s"] = pairs * 2 * (dn + p + dv) / rows[-2]["us"] / 1e6

    print(f"MLA prefill: {b} prompts x {n} tokens, {h} heads, R={r}, P={p}, Dn={dn}, Dv={dv}")
    for row in sorted(rows, key=lambda row: (not row["setting"].startswith("expanded"), row.get("us", 1e18))):
        if "us" in row:
            tf = f"{row['TFLOP/s']:7.1f} TFLOP/s" if "TFLOP/s" in row else ""
            print(f"{row['setting']:<64} {row['us']:>9.1f} us {tf}")
        else:
            print(f"{row['setting']:<64} failed: {row['error']}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
