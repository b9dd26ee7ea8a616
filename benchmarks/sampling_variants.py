"""What each sampling option costs: one engine, one workload, run once per variant of what the
requests carry, each beside temperature-only sampling: a temperature-only run before every two
variants and one at the end, and each variant compared with the mean of the two around it (the
machine's speed drifts by several percent over a call).

    python benchmarks/sampling_variants.py --model-config benchmarks/models/qwen3-0.6b.json \
        --num-requests 512 --output-json sampling-variants.json

The workload is ``nano-x4`` (prompts 100 to 1,024 tokens, outputs 100 to 1,024, temperature
0.6, ``ignore_eos``), so every variant produces the same number of tokens. Only the deepbatch
package's public API is used: ``PYTHONPATH=<older tree>`` times an older commit the same way.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from deepbatch import LLM, SamplingParams
from deepbatch.bench.workloads import make_workload

PENALTIES = {"repetition_penalty": 1.1, "frequency_penalty": 0.5, "presence_penalty": 0.5}
# name -> (SamplingParams fields, a seed per request)
VARIANTS = {
    "temperature": ({}, False),
    "top_p": ({"top_p": 0.95}, False),
    "top_k": ({"top_k": 50}, False),
    "min_p": ({"min_p": 0.05}, False),
    "seed": ({}, True),
    "top_p+seed": ({"top_p": 0.95}, True),
    "penalties": (PENALTIES, False),
    "logprobs": ({"logprobs": 5}, False),
    "all": ({"top_p": 0.95, "top_k": 50, "min_p": 0.05, **PENALTIES, "logprobs": 5}, True),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-config", required=True, help="a config.json, built with random weights")
    ap.add_argument("--workload", default="nano-x4")
    ap.add_argument("--num-requests", type=int, default=512)
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"any of {list(VARIANTS)}")
    ap.add_argument("--engine-args", type=json.loads, default={}, metavar="JSON", help="more LLM(...) keywords")
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()

    w = make_workload(args.workload, 32000, args.num_requests)
    llm = LLM(args.model_config, random_weights=True, max_model_len=max(4096, w.max_len), **args.engine_args)
    w = make_workload(args.workload, llm.engine.hf_config.vocab_size, args.num_requests)
    prompts = [{"prompt_token_ids": p} for p in w.prompts]
    # Warm-up outside the timing: every variant's path once (kernel compilation, allocator).
    for fields, seeded in VARIANTS.values():
        warm = SamplingParams(**{"temperature": w.temperature, **fields, "max_tokens": 8, "ignore_eos": True,
                                 **({"seed": 1} if seeded else {})})
        llm.generate(prompts[:8], [warm] * len(prompts[:8]), use_tqdm=False)

    names = [v for v in args.variants.split(",") if v]
    others = [v for v in names if v != "temperature"]
    order = []
    for i in range(0, len(others), 2):
        order += ["temperature"] + others[i:i + 2]
    order.append("temperature")
    report = {"args": vars(args), "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "workload": w.name, "requests": w.num_requests, "output_tokens": w.num_output_tokens, "runs": []}
    print(f"{'variant':>12} {'out tok/s':>10} {'seconds':>8}", flush=True)
    for name in order:
        fields, seeded = VARIANTS[name]
        params = [SamplingParams(**{"temperature": w.temperature, **fields, "max_tokens": n, "ignore_eos": True,
                                    **({"seed": i} if seeded else {})})
                  for i, n in enumerate(w.output_lens)]
        llm.engine.kv_cache.pool.reset_prefix_cache()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        n_out = sum(len(o.outputs[0].token_ids) for o in outs)
        assert n_out == w.num_output_tokens, (name, n_out, w.num_output_tokens)
        report["runs"].append({"variant": name, "fields": fields, "seed_per_request": seeded,
                               "seconds": dt, "output_tok_s": n_out / dt})
        print(f"{name:>12} {n_out / dt:>10.0f} {dt:>8.2f}", flush=True)

    runs = report["runs"]
    base = [r["output_tok_s"] for r in runs if r["variant"] == "temperature"]
    report["temperature_tok_s"] = base
    print(f"\ntemperature-only runs: {', '.join(f'{b:.0f}' for b in base)} out tok/s")
    for i, r in enumerate(runs):
        if r["variant"] == "temperature":
            continue
        before = next(x for x in reversed(runs[:i]) if x["variant"] == "temperature")["output_tok_s"]
        after = next(x for x in runs[i + 1:] if x["variant"] == "temperature")["output_tok_s"]
        r["vs_temperature"] = r["output_tok_s"] / ((before + after) / 2)
        print(f"{r['variant']:>12} {r['vs_temperature']:.3f} of temperature-only")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
