"""``deepbatch bench throughput``: one offline workload through deepbatch, then (optionally) the
HF peers on the same weights in the same process, printed as one table against the roofline.

    deepbatch bench throughput --workload nano-x4 --model-config qwen3-0.6b.json --random-weights \
        --peers hf-static --output-json out.json

KV cache formats: ``--kv-cache-dtype fp8|fp8_e5m2|int8`` stores the cache in 8 bits; the roofline
then uses the cache's real bytes per token (scales included), so each run is measured against
its own ceiling.

Memory under pressure: ``--workload kv-2x`` queues requests whose contexts add up to twice the
KV capacity (cap the pool with ``--num-gpu-blocks-override``); compare ``--swap-space``,
``--preemption-mode`` and ``--admission``. The run reports preemptions by mode, KV accounting and
the GPU allocator view (``bench/memory_report.py``).
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import time
from dataclasses import replace

import torch

from deepbatch.bench.roofline import H200_FLOPS, model_cost, workload_ceiling
from deepbatch.bench.timing import release_gpu_memory
from deepbatch.layers.quantization import get_quantization_config
from deepbatch.models.config_checks import kv_sliding_window
from deepbatch.bench.memory_report import KVSampler, format_memory
from deepbatch.bench.workloads import KV_SIZED, TEXT_WORKLOADS, WORKLOADS, make_workload
from deepbatch.engine_args import add_engine_args, engine_kwargs_from_args


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", choices=WORKLOADS, required=True)
    p.add_argument("--model-config", default=None,
                   help="a config.json to build with random weights (takes the place of --model)")
    p.add_argument("--num-requests", type=int, default=None, help="run only the first N requests")
    p.add_argument("--peers", default="", help="comma list of hf-static, hf-continuous")
    p.add_argument("--peer-requests", type=int, default=None, help="run the peers on the first N requests only")
    p.add_argument("--peer-batch-size", type=int, default=256)
    p.add_argument("--sampling", type=json.loads, default={}, metavar="JSON",
                   help='SamplingParams fields for every request on top of the workload\'s, e.g. '
                        '\'{"repetition_penalty": 1.1, "frequency_penalty": 0.5}\'')
    p.add_argument("--seed-per-request", action="store_true",
                   help="give request i the seed i (each its own generator, as users send them)")
    # The engine's own flags, as `deepbatch serve` has them, but admission_batch_size keeps
    # LLM(...)'s default: an offline run is for throughput.
    add_engine_args(p, positional_model=False, cli_defaults={"admission_batch_size": None})
    p.add_argument("--output-json", default=None)
    p.add_argument("--profile", action="store_true", help="print where the host's time goes (cProfile)")


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except Exception:
        return "unknown"


def spec_report(engine, before: tuple[int, int, int]) -> dict | None:
    """Speculative decoding over the timed run: drafts, acceptance rate and the mean acceptance
    length (tokens per drafting request-step: the accepted drafts and the one after them)."""
    if engine.config.speculative_config is None:
        return None
    s = engine.stats
    drafts, draft_tokens, accepted = (s.spec_num_drafts - before[0], s.spec_num_draft_tokens - before[1],
                                      s.spec_num_accepted_tokens - before[2])
    return {"drafts": drafts, "draft_tokens": draft_tokens, "accepted_tokens": accepted,
            "acceptance_rate": accepted / max(draft_tokens, 1), "mean_acceptance_length": 1 + accepted / max(drafts, 1)}


def run(args: argparse.Namespace) -> dict:
    import logging

    from deepbatch import LLM, SamplingParams

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    model = args.model_config or args.model
    kwargs = engine_kwargs_from_args(args)
    kwargs.update(model=model, random_weights=args.random_weights or bool(args.model_config))
    if kwargs["max_model_len"] is None:
        # Long enough for the workload's longest request (its lengths do not depend on the
        # vocabulary; the KV-sized workloads use short requests).
        longest = (0 if args.workload in KV_SIZED or args.workload in TEXT_WORKLOADS  # those fit 4,096
                   else make_workload(args.workload, 32000, args.num_requests).max_len)
        kwargs["max_model_len"] = max(4096, longest)
    llm = LLM(**kwargs)
    device = llm.engine.config.device
    engine = llm.engine
    cfg = engine.hf_config
    w = make_workload(args.workload, cfg.vocab_size, args.num_requests, engine.kv_cache.capacity_tokens,
                      engine.tokenizer)
    params = [SamplingParams(**{"temperature": w.temperature, **args.sampling, "max_tokens": n, "ignore_eos": True,
                                **({"seed": i} if args.seed_per_request else {})})
              for i, n in enumerate(w.output_lens)]
    prompts = [{"prompt_token_ids": p} for p in w.prompts]

    # Warm-up outside the timing (kernel compilation, allocator); it leaves no learned state.
    expected_output_len = engine.scheduler.expected_output_len
    llm.generate(prompts[:4], [SamplingParams(max_tokens=8, ignore_eos=True)] * min(4, len(prompts)), use_tqdm=False)
    engine.kv_cache.pool.reset_prefix_cache()
    engine.scheduler.num_preemptions = 0
    engine.scheduler.expected_output_len = expected_output_len
    sampler = KVSampler(engine)
    steps0 = engine.stats.num_steps
    spec0 = (engine.stats.spec_num_drafts, engine.stats.spec_num_draft_tokens, engine.stats.spec_num_accepted_tokens)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    prof = None
    if args.profile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=True)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    memory = sampler.finish()
    if prof is not None:
        import pstats

        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)
        pstats.Stats(prof).sort_stats("cumulative").print_stats(40)
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    assert n_out == w.num_output_tokens, (n_out, w.num_output_tokens)
    dtype_bytes = torch.tensor([], dtype=engine.config.model.dtype).element_size()
    # The cache's real bytes per token, as allocated (8-bit K/V and any scales beside them).
    kv_bytes_per_token = engine.runner.kv_bytes_per_block() / engine.config.cache.block_size
    quant = get_quantization_config(cfg, args.quantization)
    cost = replace(model_cost(cfg, dtype_bytes, weight_bits=quant.weight_bits() if quant else None),
                   kv_bytes_per_token=kv_bytes_per_token)
    # The roofline is the H200's; it means nothing for a CPU run.
    flops = H200_FLOPS * (quant.compute_speedup() if quant else 1.0)
    ceiling = (workload_ceiling(cost, [len(p) for p in w.prompts], w.output_lens, flops=flops,
                                max_batch=args.max_num_seqs, window=kv_sliding_window(cfg),
                                kv_capacity_tokens=engine.kv_cache.capacity_tokens)
               if device.startswith("cuda") else None)
    ours = {"name": "deepbatch", "seconds": dt, "requests": w.num_requests, "output_tokens": n_out,
            "sampling": args.sampling, "seed_per_request": args.seed_per_request,
            "async_scheduling": engine.async_scheduling,
            "prompt_tokens": w.num_prompt_tokens, "steps": engine.stats.num_steps - steps0,
            "spec_decode": spec_report(engine, spec0),
            "preemptions": engine.scheduler.num_preemptions, "kv_blocks": engine.num_blocks,
            "kv_capacity_tokens": engine.kv_cache.capacity_tokens,
            "kv_cache_dtype": args.kv_cache_dtype, "kv_bytes_per_token": kv_bytes_per_token,
            "weights": quant.describe() if quant else str(engine.config.model.dtype).removeprefix("torch."),
            "weight_bytes": sum(p.numel() * p.element_size() for p in engine.runner.model.parameters())
            if hasattr(engine.runner, "model") else None,
            "prefix_hit_rate": engine.kv_cache.num_hit_tokens / max(engine.kv_cache.num_queried_tokens, 1),
            "admission": args.admission, "swap_space_gib": args.swap_space, "mla_prefill": args.mla_prefill,
            "memory": memory}
    results = [ours]
    # Printed now: a peer that runs out of time must not take the engine's figure with it.
    frac = f", {n_out / dt / ceiling:.1%} of the {ceiling:,.0f} ceiling" if ceiling else ""
    print(f"deepbatch: {w.num_requests / dt:.2f} req/s, {n_out / dt:,.0f} out tok/s in {dt:.1f} s{frac}", flush=True)

    peers = [p for p in args.peers.split(",") if p]
    if peers:
        hf_config, hf_dtype, state = _export_weights(llm)
        # Every reference to the engine must go (the KV sampler wraps its step), or its KV cache
        # keeps the GPU memory the peer needs.
        del llm, engine, sampler, outs
        release_gpu_memory()
        if device.startswith("cuda"):
            logging.getLogger(__name__).info("GPU memory left to the peers: %.1f GiB allocated by torch",
                                             torch.cuda.memory_allocated() / 2**30)
        hf = _hf_model(hf_config, hf_dtype, state, device)
        del state
        pw = w.head(args.peer_requests) if args.peer_requests else w
        from deepbatch.bench import peers as peer_mod

        for p in peers:
            try:
                if p == "hf-static":
                    results.append(peer_mod.hf_static(hf, pw, args.peer_batch_size, device))
                elif p == "hf-continuous":
                    results.append(peer_mod.hf_continuous(hf, pw, device))
                else:
                    raise ValueError(f"unknown peer {p!r}")
            except Exception as e:  # a peer that cannot run is reported, not fatal
                results.append({"name": p, "error": f"{type(e).__name__}: {e}"[:300]})

    for r in results:
        if "seconds" in r:
            r["output_tok_s"] = r["output_tokens"] / r["seconds"]
            r["total_tok_s"] = (r["output_tokens"] + r["prompt_tokens"]) / r["seconds"]
            r["req_s"] = r["requests"] / r["seconds"]
    ours["ceiling_output_tok_s"] = ceiling
    ours["fraction_of_ceiling"] = ours["output_tok_s"] / ceiling if ceiling else None
    report = {
        "workload": args.workload, "model": model or "default", "device": _device_name(device),
        "commit": _git_commit(), "torch": torch.__version__, "python": platform.python_version(),
        "results": results,
    }
    print_table(report)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=2)
    return report


def _export_weights(llm):
    """``(hf_config, dtype, state_dict)``: deepbatch's weights under HF's names, on the CPU."""
    engine = llm.engine
    ours = engine.runner.model
    state = {}
    for name, p in ours.named_parameters():
        weights = p.detach().cpu()
        state.update(ours.export_weights(name, weights) if hasattr(ours, "export_weights") else {name: weights})
    return engine.hf_config, engine.config.model.dtype, state


def _hf_model(cfg, dtype, state, device):
    """An HF model of the same architecture holding ``state``. Built on ``device``: random
    initialisation of a 16B-parameter model takes minutes on the CPU and a second on a GPU."""
    from transformers import AutoModelForCausalLM

    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    missing, unexpected = hf.load_state_dict(state, strict=False)
    if unexpected:
        raise RuntimeError(f"weights HF does not know: {unexpected[:5]}")
    hf.tie_weights()
    return hf.eval()


def _device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name()
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def print_table(report: dict) -> None:
    rows = report["results"]
    ours = rows[0]
    print(f"\nworkload {report['workload']}  model {report['model']}  device {report['device']}  "
          f"commit {report['commit']}")
    print(f"{'engine':<22}{'req/s':>8}{'out tok/s':>12}{'total tok/s':>13}{'seconds':>10}{'ours / it':>11}")
    for r in rows:
        if "error" in r:
            print(f"{r['name']:<22}  failed: {r['error']}")
            continue
        ratio = ours["output_tok_s"] / r["output_tok_s"]
        print(f"{r['name']:<22}{r['req_s']:>8.2f}{r['output_tok_s']:>12.0f}{r['total_tok_s']:>13.0f}{r['seconds']:>10.1f}{ratio:>10.2f}x")
    ceiling = ours["ceiling_output_tok_s"]
    roof = (f"roofline ceiling {ceiling:.0f} out tok/s; deepbatch at {100 * ours['fraction_of_ceiling']:.1f}%; "
            if ceiling else "")
    print(f"{roof}{ours['steps']} steps, {ours['preemptions']} preemptions, KV {ours['kv_capacity_tokens']} tokens "
          f"({ours.get('kv_cache_dtype', 'auto')}, {ours.get('kv_bytes_per_token', 0) / 1024:.2f} KiB per token), "
          f"prefix hit rate {100 * ours['prefix_hit_rate']:.1f}%")
    if "memory" in ours:
        print(format_memory(ours["memory"]))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="deepbatch bench throughput", description=__doc__.splitlines()[0])
    add_arguments(p)
    run(p.parse_args(argv))


if __name__ == "__main__":
    main()
