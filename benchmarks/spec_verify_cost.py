"""Where a verification step's time goes at small batches: the same greedy requests decoded by
plain asynchronous steps, plain synchronous steps, and verification steps of k drafts that are
never right (one token per step in every run), with the host's time split by phase.

    python benchmarks/spec_verify_cost.py --model-config benchmarks/models/qwen3-0.6b.json \
        --output-json spec-verify-cost.json

A verification step differs from a decode step in three ways, and each run isolates one: it is
synchronous (the proposer drafts from committed tokens, so the host cannot schedule the next
step while this one runs), its forward carries k + 1 tokens per request (a graph of the mixed
kind, not a decode graph), and it samples k + 1 rows per request. The phases are host seconds per
step: ``propose``, ``schedule``, ``launch`` (building the batch and queuing the forward and the
sampler), ``wait`` (``PendingSample.resolve``: the device's remaining work and the copy back) and
``process`` (committing tokens). ``replays`` time the decode graph of each batch alone with CUDA
events: the device's share of a plain step.

Random weights: only shapes and counts matter here.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

import torch

from deepbatch import LLM, SamplingParams
from deepbatch.bench.timing import release_gpu_memory
from deepbatch.sampling.pending_sample import PendingSample

from spec_decode_curve import SetAcceptanceProposer


class Phases:
    """Host seconds spent in named methods, patched on their objects for the runs in between."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self._undo: list = []

    def wrap(self, owner, attr: str, name: str) -> None:
        inner = getattr(owner, attr)

        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return inner(*a, **kw)
            finally:
                self.seconds[name] += time.perf_counter() - t0

        setattr(owner, attr, timed)
        self._undo.append((owner, attr, inner))

    def restore(self) -> None:
        for owner, attr, inner in reversed(self._undo):
            setattr(owner, attr, inner)
        self._undo.clear()


def instrument(llm: LLM) -> Phases:
    e, ph = llm.engine, Phases()
    if e.proposer is not None:
        ph.wrap(e.proposer, "propose", "propose")
    ph.wrap(e.scheduler, "schedule", "schedule")
    ph.wrap(e.runner, "launch", "launch")
    ph.wrap(PendingSample, "resolve", "wait")
    ph.wrap(e.outputs, "process", "process")
    return ph


def replay_ms(llm: LLM, kind: str, size: int, iters: int = 200) -> float | None:
    """Milliseconds per replay of a decode graph, its static inputs as the last decode step of that
    size left them (a mixed graph's inputs may be left by a step of another size: replaying them
    as they are can read past its sequences, so only decode graphs are timed)."""
    graphs = llm.engine.runner.graphs
    gs = getattr(graphs, kind, None) if graphs is not None else None
    if gs is None or size not in gs.graphs:
        return None
    for _ in range(10):
        gs.replay(size)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        gs.replay(size)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def run(llm: LLM, name: str, batch: list, params: SamplingParams, rows: list, base: float | None) -> float:
    llm.generate(batch, params, use_tqdm=False)  # same shape, untimed: kernels compiled, graphs warm
    steps0 = llm.engine.stats.num_steps
    ph = instrument(llm)
    t0 = time.perf_counter()
    llm.generate(batch, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    ph.restore()
    steps = llm.engine.stats.num_steps - steps0
    row = {"run": name, "batch": len(batch), "steps": steps, "ms_per_step": round(1e3 * seconds / steps, 4),
           **{f"{k}_ms": round(1e3 * v / steps, 4) for k, v in sorted(ph.seconds.items())}}
    if base is not None:
        row["vs_plain_async"] = round(seconds / base, 3)
    rows.append(row)
    print(row, flush=True)
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-config", required=True)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--max-num-seqs", type=int, default=256, help="as in spec_decode_curve.py (mixed graphs' seats)")
    ap.add_argument("--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()
    k = args.num_speculative_tokens
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    prompts = [[100 + (7 * i + 13 * j) % 20_000 for j in range(args.prompt_len)] for i in range(max(sizes))]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    common = dict(random_weights=True, dtype=args.dtype, max_model_len=args.prompt_len + args.max_tokens + 16,
                  gpu_memory_utilization=0.3, seed=0, max_num_seqs=args.max_num_seqs)
    rows, replays, base, reference = [], [], {}, {}
    llm = LLM(args.model_config, **common)
    for b in sizes:
        batch = [{"prompt_token_ids": p} for p in prompts[:b]]
        llm.engine.async_scheduling = True
        base[b] = run(llm, "plain, async", batch, params, rows, None)
        outs = llm.generate(batch, params, use_tqdm=False)
        reference.update({tuple(p): o.outputs[0].token_ids for p, o in zip(prompts[:b], outs)})
        llm.engine.async_scheduling = False
        run(llm, "plain, sync", batch, params, rows, base[b])
        llm.engine.async_scheduling = True
    for b in sizes:
        replays.append({"graph": "decode", "size": b, "ms": replay_ms(llm, "decode", b)})
    for r in replays:
        print(r, flush=True)
    llm.engine.shutdown()
    del llm
    release_gpu_memory()
    spec = {"method": "ngram", "num_speculative_tokens": k, "cost_model": False}
    llm = LLM(args.model_config, **common, speculative_config=spec)
    proposer = SetAcceptanceProposer(llm.engine.config.speculative_config, llm.engine.max_model_len, reference,
                                     llm.engine.hf_config.vocab_size)
    proposer.p = 0.0
    llm.engine.proposer = proposer
    for b in sizes:
        run(llm, f"verify k={k}, no draft right", [{"prompt_token_ids": p} for p in prompts[:b]], params, rows, base[b])
    llm.engine.shutdown()
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"model_config": args.model_config, "k": k, "max_num_seqs": args.max_num_seqs,
                       "rows": rows, "replays": replays}, f, indent=1)


if __name__ == "__main__":
    main()
