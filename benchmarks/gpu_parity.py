"""GPU correctness of the fast path on a real architecture with random weights:
greedy tokens equal between the torch and Triton attention backends, between eager steps and
CUDA graphs (decode-only and full), and between synchronous and async scheduling (fp32), and
logits within bf16 tolerance (bf16).

    python benchmarks/gpu_parity.py --model-config ../shared/bench/models/qwen3-0.6b.json
"""

from __future__ import annotations

import argparse
import json
import random

import torch

from deepbatch import LLM, SamplingParams


def prompts(n: int, vocab: int, seed: int = 0):
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(rng.randint(5, 700))]} for _ in range(n)]


def greedy(llm, ps, max_tokens):
    outs = llm.generate(ps, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-config", required=True)
    ap.add_argument("--num-prompts", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--output-json", default=None)
    ap.add_argument("--dtype", default="float32", help="of the greedy runs (bf16 may diverge late through rounding)")
    ap.add_argument("--runs", default=None, help="comma list of run names; the first is the reference")
    ap.add_argument("--skip-logits", action="store_true", help="skip the bf16 Triton-vs-torch logits check")
    args = ap.parse_args()
    report = {}
    common = dict(random_weights=True, max_model_len=2048, gpu_memory_utilization=0.3, max_num_batched_tokens=2048,
                  num_gpu_blocks_override=4096)

    configs = {
        "torch-eager": dict(attention_backend="torch", enforce_eager=True, async_scheduling=False),
        "triton-eager": dict(attention_backend="triton", enforce_eager=True, async_scheduling=False),
        # CUDA graphs for decode-only steps, then for every step (prefill chunks included).
        "triton-graphs-decode": dict(attention_backend="triton", cuda_graph_mode="decode", async_scheduling=False),
        "triton-graphs-full": dict(attention_backend="triton", cuda_graph_mode="full", async_scheduling=False),
        "triton-graphs-full-async": dict(attention_backend="triton", cuda_graph_mode="full", async_scheduling=True),
        "torch-eager-async": dict(attention_backend="torch", enforce_eager=True, async_scheduling=True),
    }
    names = args.runs.split(",") if args.runs else list(configs)
    runs = {}
    for name in names:
        llm = LLM(args.model_config, dtype=args.dtype, **common, **configs[name])
        ps = prompts(args.num_prompts, llm.engine.hf_config.vocab_size)
        runs[name] = greedy(llm, ps, args.max_tokens)
        del llm
        torch.cuda.empty_cache()
    ref_name = names[0]
    ref = runs[ref_name]
    for name, got in runs.items():
        same = sum(a == b for a, b in zip(ref, got))
        first_diff = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in zip(ref, got)]
        report[f"{args.dtype} greedy {name} == {ref_name}"] = (f"{same}/{len(ref)} sequences identical; "
                                                               f"first divergence per seq: {first_diff}")
    if args.skip_logits:
        return finish(report, args)

    # bf16: logits of one mixed step, Triton vs torch backend, same weights.
    llm = LLM(args.model_config, dtype="bfloat16", **common, attention_backend="triton", enforce_eager=True)
    runner = llm.engine.runner
    from deepbatch.layers.attention import make_backend

    ps = prompts(8, llm.engine.hf_config.vocab_size, seed=1)
    engine = llm.engine
    for i, p in enumerate(ps):
        engine.add_request(f"b{i}", p, SamplingParams(max_tokens=1, ignore_eos=True))
    out = engine.scheduler.schedule()
    batch = runner.build_batch(out)
    logits = {}
    with torch.no_grad():
        for backend in ("triton", "torch"):
            for a in runner.attn_layers:
                a.backend = make_backend(backend)
            hidden = runner.model(batch.input_ids, batch.positions, batch)
            logits[backend] = runner.model.compute_logits(hidden[batch.logits_indices]).float()
    diff = (logits["triton"] - logits["torch"]).norm() / logits["torch"].norm()
    report["bf16 logits rel. L2 (triton vs torch)"] = float(diff)
    report["bf16 argmax agreement"] = float((logits["triton"].argmax(-1) == logits["torch"].argmax(-1)).float().mean())
    finish(report, args)


def finish(report: dict, args) -> None:
    for k, v in report.items():
        print(f"{k}: {v}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
