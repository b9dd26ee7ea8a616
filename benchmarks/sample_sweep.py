"""Top-k / top-p / min-p / seeded sampling on the GPU, for every batch size and vocab asked: the
torch path of the sampler (temperature, ``_top_k_top_p``'s sort, softmax, min-p, then
``torch.multinomial``), the one-program-per-row kernel (kernels/sample_top_k_top_p.py), the
rejection kernels (kernels/sample_rejection.py, the sampler's choice), and temperature-only
Gumbel-max (kernels/sample.py) over the same logits as the floor; and how often the two kernels'
ids equal the torch reference's (the same kept set and the same Philox draws).

    python benchmarks/sample_sweep.py --output-json sample-sweep.json

Logits are ``randn * scale`` (scale 3 puts most of the mass on a few dozen tokens, as a model's
do); every row samples at temperature 0.8.
"""

from __future__ import annotations

import argparse
import json

import torch

from deepbatch.bench.timing import device_time_us
from deepbatch.kernels.sample import gumbel_sample
from deepbatch.kernels.sample_rejection import sample_rejection
from deepbatch.kernels.sample_top_k_top_p import sample_top_k_top_p, sample_top_k_top_p_ref
from deepbatch.sampling.sampler import _top_k_top_p

# name -> (top_k, top_p, min_p, seeded); -1 / 1.0 / 0.0 / False turn each off
CONFIGS = {
    "seed": (-1, 1.0, 0.0, True),
    "minp0.05": (-1, 1.0, 0.05, False),
    "k50": (50, 1.0, 0.0, False),
    "p0.95": (-1, 0.95, 0.0, False),
    "p0.5": (-1, 0.5, 0.0, False),
    "k50+p0.9": (50, 0.9, 0.0, False),
    "k20+p0.95+seed": (20, 0.95, 0.0, True),
    "k1000+p0.95+minp0.05": (1000, 0.95, 0.05, False),
}


def torch_path(logits, temperature, top_k, top_p, min_p):
    """The sampler's torch path for sampled rows, ending in torch.multinomial."""
    scaled = logits.float() / temperature.unsqueeze(1)
    # the sampler passes the vocab size for "top-k off"
    k = torch.where(top_k > 0, top_k, logits.shape[1]).long()
    scaled = _top_k_top_p(scaled, k, top_p)
    probs = scaled.softmax(dim=-1)
    probs = probs.masked_fill(probs < min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values, 0.0)
    return torch.multinomial(probs, 1).squeeze(1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,64,256")
    ap.add_argument("--vocab", default="32000,151936")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"any of {list(CONFIGS)}")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--scale", type=float, default=3.0)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--block", type=int, default=1024)
    ap.add_argument("--num-boundaries", type=int, default=16)
    ap.add_argument("--num-warps", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=3, help="rejection rounds before the per-row kernel")
    ap.add_argument("--rejection-block", type=int, default=4096)
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("sample_sweep.py times CUDA kernels: no GPU here")
    dev, dtype = "cuda", getattr(torch, args.dtype)
    report = {"args": vars(args), "device": torch.cuda.get_device_name(), "cases": []}
    print(f"{'S':>4} {'V':>7} {'config':>22} {'torch us':>9} {'per-row us':>10} {'reject us':>9} {'T-only us':>9} "
          f"{'same ids':>8} {'same ids':>8}")
    for V in (int(v) for v in args.vocab.split(",")):
        for S in (int(s) for s in args.rows.split(",")):
            g = torch.Generator(dev).manual_seed(S * V)
            logits = (torch.randn(S, V, device=dev, generator=g) * args.scale).to(dtype)
            temperature = torch.full((S,), 0.8, device=dev)
            seeds = torch.arange(S, dtype=torch.int64, device=dev)
            positions = torch.zeros(S, dtype=torch.int64, device=dev)
            for name in args.configs.split(","):
                k, p, mp, sd = CONFIGS[name]
                seeded = torch.full((S,), sd, dtype=torch.bool, device=dev)
                top_k = torch.full((S,), k, dtype=torch.int32, device=dev)
                top_p = torch.full((S,), p, device=dev)
                min_p = torch.full((S,), mp, device=dev)
                params = (logits, temperature, top_k, top_p, min_p, seeds, positions, seeded, 1234, 0)

                def kernel(params=params):
                    return sample_top_k_top_p(*params, block=args.block, num_boundaries=args.num_boundaries,
                                              num_warps=args.num_warps)

                def rejection(params=params, k=k, p=p, mp=mp):
                    return sample_rejection(*params, max_top_k=max(k, 0), any_top_p=p < 1.0, any_min_p=mp > 0,
                                            rounds=args.rounds,
                                            block=args.rejection_block)

                def torch_sampler(params=params):
                    return torch_path(*params[:5])

                def floor(logits=logits, inv_t=1.0 / temperature):
                    return gumbel_sample(logits, inv_t, 1234, 0)

                torch_us = device_time_us(torch_sampler, args.reps)
                kernel_us = device_time_us(kernel, args.reps)
                rejection_us = device_time_us(rejection, args.reps)
                floor_us = device_time_us(floor, args.reps)
                ref = sample_top_k_top_p_ref(*params)
                same = (kernel() == ref).float().mean().item()
                same_rejection = (rejection() == ref).float().mean().item()
                row = {"rows": S, "vocab": V, "config": name, "torch_us": torch_us, "kernel_us": kernel_us,
                       "rejection_us": rejection_us, "temperature_only_us": floor_us,
                       "same_ids_as_reference": same, "rejection_same_ids_as_reference": same_rejection}
                report["cases"].append(row)
                print(f"{S:>4} {V:>7} {name:>22} {torch_us:>9.1f} {kernel_us:>10.1f} {rejection_us:>9.1f} "
                      f"{floor_us:>9.1f} {same:>8.3f} {same_rejection:>8.3f}", flush=True)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
