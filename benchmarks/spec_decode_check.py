"""Speculative decoding (prompt lookup, a draft model, DeepSeek's MTP layer) on the GPU: greedy output, and seeded
sampled output (top-p, some with logprobs), with and without drafts, the same random-weight
model and prompts, through the Triton kernels and CUDA graphs (verification steps run in the
mixed graphs); reports how many outputs agree, the drafts and the acceptance.

    python benchmarks/spec_decode_check.py --model-config benchmarks/models/qwen3-0.6b.json
    python benchmarks/spec_decode_check.py --methods mtp --dtype bfloat16 --model-config <cut V3 config>

Prompts repeat a random segment, so prompt lookup finds drafts; a random-weight model need not
continue the pattern, so the acceptance here says nothing about real text. fp32 by default: in
bf16 a verification step's sums may round differently from one-token steps and flip near-ties.
"""

from __future__ import annotations

import argparse
import json
import random
import time

from deepbatch import LLM, SamplingParams
from deepbatch.bench.timing import release_gpu_memory

def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-config", required=True)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--methods", default="ngram,draft", help="ngram, draft (the target's config drafting for "
                    "itself: the same random weights), mtp (a config with num_nextn_predict_layers)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.4)
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()
    rng = random.Random(0)
    prompts = []
    for _ in range(args.num_prompts):
        segment = [rng.randrange(100, 20_000) for _ in range(rng.randint(8, 40))]
        prompts.append({"prompt_token_ids": (segment * rng.randint(2, 6))[: rng.randint(40, 200)]})
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    # Seeded rows draw with noise keyed by the output position: the same tokens with drafts.
    seeded = [SamplingParams(temperature=0.8, top_p=0.95, seed=i, max_tokens=args.max_tokens, ignore_eos=True,
                             logprobs=2 if i % 2 else None) for i in range(args.num_prompts)]
    common = dict(random_weights=True, dtype=args.dtype, max_model_len=1024,
                  gpu_memory_utilization=args.gpu_memory_utilization, seed=0)
    report = {}
    outputs = {}
    # The draft model is the target's own config with the same seed: the same random weights, so
    # its greedy drafts are the target's tokens (through other batches: a bf16 near-tie may flip).
    specs = {"ngram": {"method": "ngram", "num_speculative_tokens": 4},
             "draft": {"method": "draft_model", "model": args.model_config, "num_speculative_tokens": 4},
             "mtp": {"method": "mtp", "num_speculative_tokens": 2}}
    methods = args.methods.split(",")
    for name, extra in [("plain", {})] + [(m, {"speculative_config": specs[m]}) for m in methods]:
        llm = LLM(args.model_config, **common, **extra)
        llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        outputs[name] = [o.outputs[0].token_ids for o in outs]
        outputs[name + "-seeded"] = [o.outputs[0].token_ids for o in llm.generate(prompts, seeded, use_tqdm=False)]
        s = llm.engine.stats
        report[name] = {"seconds": round(seconds, 3), "steps": s.num_steps, "drafts": s.spec_num_drafts,
                        "draft_tokens": s.spec_num_draft_tokens, "accepted_tokens": s.spec_num_accepted_tokens,
                        "accepted_per_position": s.spec_accepted_per_position}
        llm.engine.shutdown()
        del llm
        release_gpu_memory()
    for name in methods:
        report[f"{name}_greedy_equal"] = sum(a == b for a, b in zip(outputs["plain"], outputs[name]))
        report[f"{name}_seeded_equal"] = sum(a == b for a, b in zip(outputs["plain-seeded"], outputs[name + "-seeded"]))
    report["num_prompts"] = len(prompts)
    print(json.dumps(report, indent=1))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
