"""MLA prefill on the GPU, the two forms side by side on one prefill step's shapes (default: 8
fresh prompts of 1,024 tokens, DeepSeek-V2-Lite's 16 heads, R=512, P=64, Dn=Dv=128, bf16):

- absorbed: the latent-space Triton kernel as the wrapper launches it (with ``--absorbed-grid``
  also its tall-tile launch for every block_m, tile_n, num_warps, num_stages), with its
  attention TFLOP/s (2 x (2R + P) per visible key and head);
- expanded, in parts: the ``kv_b_proj`` GEMM over the step's tokens, the absorbed context-only
  launch (no context here: the cost of a launch whose programs return at once), and the
  expanded kernel (``kernels/mla_prefill.py``) for every (block_m, tile_n, num_warps,
  num_stages), each checked against the default setting, with its attention TFLOP/s
  (2 x (Dn + P + Dv) per visible key and head).

    python benchmarks/mla_prefill_sweep.py --prompts 8 --prompt-len 1024 --output-json mla-prefill.json
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch

from deepbatch.bench.timing import device_time_us
from deepbatch.kernels import mla_decode as mla
from deepbatch.kernels.mla_prefill import mla_prefill


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
    ap.add_argument("--quick", action="store_true", help="one setting of each kernel (a smoke run)")
    ap.add_argument("--absorbed-grid", action="store_true", help="sweep the absorbed kernel's settings too")
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
    grid = [(32, 32, 8, 2)]
    if args.absorbed_grid and not args.quick:
        grid = itertools.product((32, 64), (16, 32, 64), (4, 8), (1, 2))
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

    # The expanded path's parts, as layers/mla.py runs them on a step without cached context.
    c_kv = cache[block_tables.flatten().long()].flatten(0, 2)[:t, :r]
    kv = torch.nn.functional.linear(c_kv, w_kv_b).view(t, h, dn + dv)
    k_nope, v = kv.split([dn, dv], dim=-1)
    k_pe = torch.randn(t, r + p, device=dev, dtype=dtype)[:, r:]
    o = torch.randn(t, h, dv, device=dev, dtype=dtype)
    lse = torch.empty(t, h, device=dev, dtype=torch.float32)
    rows.append({"setting": "expanded: kv_b_proj GEMM",
                 "us": device_time_us(lambda: torch.nn.functional.linear(c_kv, w_kv_b), 10)})
    rows.append({"setting": "expanded: absorbed context-only launch (no context)",
                 "us": device_time_us(lambda: mla.mla_attention(q_lat, q_pe, cache, block_tables, qsl, seq_lens,
                                                                scale, n, n, out=out, context_lse=lse), 10)})
    lse.fill_(float("-inf"))

    def expanded(**kw):
        return mla_prefill(q_nope, q_pe, k_nope, k_pe, v, qsl, scale, n, o, lse, **kw)

    want = expanded().clone()
    settings = [(None, None, None, None)]
    if not args.quick:
        settings += [s for s in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4)) if s[1] <= s[0]]
    for bm, tile_n, warps, stages in settings:
        name = ("expanded: kernel, wrapper default" if bm is None
                else f"expanded: kernel, block_m={bm} tile_n={tile_n} warps={warps} stages={stages}")
        kw = dict(block_m=bm, tile_n=tile_n, num_warps=warps, num_stages=stages)
        try:
            us = device_time_us(lambda: expanded(**kw), 10)
            ok = torch.allclose(expanded(**kw).float(), want.float(), atol=2e-2, rtol=2e-2)
        except Exception as e:  # shared memory or registers exceeded
            rows.append({"setting": name, "error": str(e)[:120]})
            continue
        rows.append({"setting": name, "us": us, "matches": ok,
                     "TFLOP/s": pairs * 2 * (dn + p + dv) / us / 1e6})

    print(f"MLA prefill: {b} prompts x {n} tokens, {h} heads, R={r}, P={p}, Dn={dn}, Dv={dv}")
    for row in sorted(rows, key=lambda row: (not row["setting"].startswith("expanded"), row.get("us", 1e18))):
        if "us" in row:
            tf = f"{row['TFLOP/s']:7.1f} TFLOP/s" if "TFLOP/s" in row else ""
            bad = "" if row.get("matches", True) else " MISMATCH"
            print(f"{row['setting']:<64} {row['us']:>9.1f} us {tf}{bad}")
        else:
            print(f"{row['setting']:<64} failed: {row['error']}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
