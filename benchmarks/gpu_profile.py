"""Where a steady-state step's time goes on the GPU: device time per kernel family and the
host gap (wall time of a step minus the device busy time in it).

    python benchmarks/gpu_profile.py --model-config benchmarks/models/qwen3-0.6b.json --workload nano

It runs the workload's requests until ``--warm-steps`` steps have passed (decode at full batch),
then profiles ``--steps`` steps with ``torch.profiler`` and prints the kernel table.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch.profiler import ProfilerActivity, profile

from deepbatch import LLM, SamplingParams
from deepbatch.bench.workloads import make_workload


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-config", required=True)
    ap.add_argument("--workload", default="nano")
    ap.add_argument("--warm-steps", type=int, default=300)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None)
    ap.add_argument("--mla-prefill", choices=["absorbed", "expanded"], default="expanded")
    ap.add_argument("--timeline", action="store_true",
                    help="instead: run the whole workload, timing each step by kind (decode-only or mixed)")
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()
    llm = LLM(args.model_config, dtype="bfloat16", random_weights=True, max_model_len=4096,
              async_scheduling=args.async_scheduling, mla_prefill=args.mla_prefill)
    engine = llm.engine
    w = make_workload(args.workload, engine.hf_config.vocab_size, None)
    # Warm-up (Triton compilation, cuBLAS heuristics) outside what is measured.
    llm.generate([{"prompt_token_ids": p} for p in w.prompts[:8]], SamplingParams(max_tokens=8, ignore_eos=True),
                 use_tqdm=False)
    for i, (p, n) in enumerate(zip(w.prompts, w.output_lens)):
        engine.add_request(str(i), {"prompt_token_ids": p},
                           SamplingParams(temperature=w.temperature, max_tokens=n, ignore_eos=True))
    if args.timeline:
        return timeline(engine, args)
    for _ in range(args.warm_steps):
        engine.step()
    torch.cuda.synchronize()
    batch_sizes = []
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            batch_sizes.append(engine.scheduler.num_running)
            engine.step()
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    device_us = sum(e.self_device_time_total for e in events)
    rows = sorted(((e.key, e.self_device_time_total / args.steps, e.count // args.steps) for e in events),
                  key=lambda r: -r[1])
    print(f"{args.steps} steps, batch ~{sum(batch_sizes) / len(batch_sizes):.0f}: wall {wall / args.steps * 1e3:.2f} ms/step "
          f"(profiled), device busy {device_us / args.steps / 1e3:.2f} ms/step")
    print(f"{'kernel':<90} {'us/step':>9} {'calls/step':>10}")
    for key, us, calls in rows[:25]:
        print(f"{key[:90]:<90} {us:>9.1f} {calls:>10}")
    host = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    print(f"{'host op':<90} {'us/step':>9} {'calls/step':>10}")
    for e in host[:20]:
        print(f"{e.key[:90]:<90} {e.self_cpu_time_total / args.steps:>9.1f} {e.count / args.steps:>10.1f}")
    # Unprofiled timing of the next steps (the profiler slows the host).
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    n = 0
    while n < args.steps and engine.has_unfinished_requests():
        engine.step()
        n += 1
    torch.cuda.synchronize()
    plain = (time.perf_counter() - t0) / max(n, 1)
    print(f"unprofiled: {plain * 1e3:.2f} ms/step over {n} steps")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"workload": args.workload, "model_config": args.model_config, "steps": args.steps,
                       "ms_per_step_profiled": wall / args.steps * 1e3, "ms_per_step": plain * 1e3,
                       "device_busy_ms_per_step": device_us / args.steps / 1e3,
                       "kernels": [{"name": k, "us_per_step": us, "calls_per_step": c} for k, us, c in rows[:40]],
                       "host_ops": [{"name": e.key, "us_per_step": e.self_cpu_time_total / args.steps,
                                     "calls_per_step": e.count / args.steps} for e in host[:40]]},
                      f, indent=1)


def timeline(engine, args):
    """Device time per step kind: a CUDA event at each launch; the time between a launch's event
    and the next one is that step's share of the stream (its kernels plus any idle gap)."""
    runner = engine.runner
    launch = runner.launch
    steps = []  # (event, kind, tokens, seqs, host seconds in launch)

    def timed_launch(out):
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        t = time.perf_counter()
        res = launch(out)
        decode = all(s.num_new_tokens == 1 for s in out.scheduled)
        steps.append((ev, "decode" if decode else "mixed", out.num_scheduled_tokens, len(out.scheduled),
                      time.perf_counter() - t))
        return res

    runner.launch = timed_launch
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    end = torch.cuda.Event(enable_timing=True)
    end.record()
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    events = [s[0] for s in steps] + [end]
    stats = {}
    for i, (_, kind, tokens, seqs, host) in enumerate(steps):
        ms = events[i].elapsed_time(events[i + 1])
        k = stats.setdefault(kind, {"steps": 0, "device_ms": 0.0, "launch_host_ms": 0.0, "tokens": 0, "seqs": 0})
        k["steps"] += 1
        k["device_ms"] += ms
        k["launch_host_ms"] += host * 1e3
        k["tokens"] += tokens
        k["seqs"] += seqs
    print(f"wall {wall:.2f} s, {len(steps)} steps")
    for kind, k in stats.items():
        n = k["steps"]
        print(f"{kind:>7}: {n} steps, {k['device_ms'] / 1e3:.2f} s of stream time ({k['device_ms'] / n:.2f} ms/step), "
              f"launch host {k['launch_host_ms'] / n:.2f} ms/step, {k['tokens'] / n:.0f} tokens and {k['seqs'] / n:.0f} seqs per step")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"workload": args.workload, "model_config": args.model_config, "wall_s": wall, "kinds": stats},
                      f, indent=1)


if __name__ == "__main__":
    main()
