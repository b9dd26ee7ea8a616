"""Speculative decoding's speed-up against the acceptance rate, at batch 1, 8, 64 and 256: what a
verification step costs and where drafts pay, measured apart from any drafter's quality.

    python benchmarks/spec_decode_curve.py --model-config benchmarks/models/qwen3-0.6b.json \
        --output-json spec-decode-curve.json

A test drafter sets the acceptance: each request's drafts are the continuation the engine wrote
without speculation (a first, plain run of the same greedy requests), each position right with
probability p and otherwise a wrong token, so the expected accepted run is p + p^2 + ... + p^k.
Every configuration runs the same requests with the same output lengths (``ignore_eos``), and the
engine without speculation runs in the same call; each timed run follows an untimed one of the
same shape (compiled kernels, a settled cost model). ``cost_model: false`` runs every draft
(the raw curve; at p = 0 at batch 1 its time per token over the plain run's is what a
verification step of k drafts costs against a decode step); the default runs with the cost model,
which must stay near the plain run where drafts do not pay (at saturation: >= 0.97x).

Random weights: the model's text means nothing, only the shapes and the acceptance count.
"""

from __future__ import annotations

import argparse
import json
import random
import time

from deepbatch import LLM, SamplingParams
from deepbatch.bench.timing import release_gpu_memory
from deepbatch.spec_decode.room import draft_room


class SetAcceptanceProposer:
    """Drafts the reference continuation, each position right with probability ``p``."""

    def __init__(self, config, max_model_len: int, reference: dict[tuple[int, ...], list[int]], vocab: int):
        self.config, self.max_model_len = config, max_model_len
        self.reference, self.vocab, self.p = reference, vocab, 1.0
        self.rng = random.Random(0)

    def propose(self, running: list, spec_cost=None) -> None:
        for r in running:
            ref = self.reference[tuple(r.prompt_token_ids)]
            n = r.num_output_tokens
            right = ref[n:n + draft_room(r, self.config.num_speculative_tokens, self.max_model_len)]
            r.spec_token_ids = [t if self.rng.random() < self.p else (t + 1) % self.vocab for t in right]
        if spec_cost is not None:
            spec_cost.limit(running)

    def forget(self, request_id: str) -> None:
        """Nothing is kept per request."""


def counts(llm: LLM) -> tuple[int, int, int, int]:
    s = llm.engine.stats
    return s.spec_num_drafts, s.spec_num_draft_tokens, s.spec_num_accepted_tokens, s.num_steps


def timed(llm: LLM, prompts: list, params: SamplingParams) -> tuple[float, list[list[int]], tuple]:
    """The second of two runs: its time, outputs, and what it added to ``counts``."""
    llm.generate(prompts, params, use_tqdm=False)  # same shape, untimed
    before = counts(llm)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    return seconds, [o.outputs[0].token_ids for o in outs], tuple(a - c for a, c in zip(counts(llm), before))

def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-config", required=True)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch-sizes", default="1,8,64,256")
    ap.add_argument("--acceptance", default="0,0.5,0.8,0.95,1")
    ap.add_argument("--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--configs", default="every,cost", help="every: every draft runs; cost: the cost model")
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 20_000) for _ in range(args.prompt_len)] for _ in range(max(sizes))]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    common = dict(random_weights=True, dtype=args.dtype, max_model_len=args.prompt_len + args.max_tokens + 16,
                  gpu_memory_utilization=0.3, seed=0, max_num_seqs=max(sizes))
    plain = LLM(args.model_config, **common)
    rows, reference = [], {}
    base = {}
    for b in sizes:
        batch = [{"prompt_token_ids": p} for p in prompts[:b]]
        seconds, outs, _ = timed(plain, batch, params)
        base[b] = seconds
        reference.update({tuple(p): o for p, o in zip(prompts[:b], outs)})
        rows.append({"batch": b, "config": "off", "p": None, "seconds": round(seconds, 4),
                     "out_tok_s": round(b * args.max_tokens / seconds, 1)})
        print(rows[-1], flush=True)
    plain.engine.shutdown()
    del plain
    release_gpu_memory()
    for cost_model in [c == "cost" for c in args.configs.split(",")]:
        spec = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens, "cost_model": cost_model}
        llm = LLM(args.model_config, **common, speculative_config=spec)
        engine = llm.engine
        proposer = SetAcceptanceProposer(engine.config.speculative_config, engine.max_model_len, reference,
                                         engine.hf_config.vocab_size)
        engine.proposer = proposer
        for b in sizes:
            batch = [{"prompt_token_ids": p} for p in prompts[:b]]
            for p in (float(x) for x in args.acceptance.split(",")):
                proposer.p = p
                seconds, outs, (drafts, drafted, accepted, steps) = timed(llm, batch, params)
                rows.append({
                    "batch": b, "config": "cost model" if cost_model else "every draft", "p": p,
                    "seconds": round(seconds, 4), "out_tok_s": round(b * args.max_tokens / seconds, 1),
                    "speedup": round(base[b] / seconds, 3), "steps": steps,
                    "acceptance_rate": round(accepted / drafted, 3) if drafted else None,
                    "mean_acceptance_length": round(1 + accepted / drafts, 2) if drafts else None,
                    "same_tokens": sum(o == reference[tuple(q)] for o, q in zip(outs, prompts[:b])),
                })
                print(rows[-1], flush=True)
        del engine, proposer
        llm.engine.shutdown()
        del llm
        release_gpu_memory()
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"model_config": args.model_config, "k": args.num_speculative_tokens,
                       "prompt_len": args.prompt_len, "max_tokens": args.max_tokens, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
