"""Host time per decode step of building the step's inputs and the sampler's per-row parameters,
on the CPU (no model, no GPU): ``runner/step_inputs.py`` over the persistent batch, then what the
sampler does on the host before its kernels (``sampling/param_rows.py``: gather the step's rows,
decide the path, read the kernel hints).

Each step every request decodes one token; ``--churn N`` requests end and N new ones take their
rows after each step (the steady state of a saturated server has about one new request every
few steps). Run against another tree (``PYTHONPATH=<tree>``) to compare: a tree from before the
parameter rows (3c78c02 and earlier) is measured through its sampler's own per-batch path
(``_filter_params`` behind its batch memo for filtered rows, the temperature copy for the
one-pass kernel).

    python benchmarks/host_step_inputs.py --batch-sizes 8,256 --churn 0,2 --sampling top_p,temp,greedy
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

from deepbatch.core.request import Request
from deepbatch.core.sampling_params import SamplingParams
from deepbatch.core.scheduler_output import ScheduledRequest, SchedulerOutput
from deepbatch.runner.persistent_batch import PersistentBatch
from deepbatch.runner.step_inputs import step_inputs
from deepbatch.sampling.sampler import Sampler

SAMPLING = {"top_p": dict(temperature=0.6, top_p=0.95), "temp": dict(temperature=0.6), "greedy": dict(temperature=0.0)}
VOCAB, BLOCK_SIZE = 151_936, 16


def sampler_host_work(sampler: Sampler, pool: PersistentBatch, inputs, requests: list[Request]) -> None:
    """What ``Sampler.sample`` does on the host to choose its path and feed its kernels."""
    if hasattr(inputs, "sample_rows"):
        from deepbatch.sampling.param_rows import StepParams

        step = StepParams.gather(pool.params, inputs.sample_rows, inputs.sample_rows_device)
        if not step.all_greedy:
            if step.temperature_only(VOCAB):
                step.column("inv_temperature")
            else:
                step.hints(VOCAB)
                step.column("temperature")
        return
    params = [r.sampling_params for r in requests]  # a tree before the parameter rows
    if all(p.greedy for p in params):
        return
    if all(p.top_p >= 1.0 and p.top_k <= 0 and p.min_p <= 0.0 and p.seed is None for p in params if not p.greedy):
        sampler._to_device([[0.0 if p.greedy else 1.0 / p.temperature for p in params]])
    elif sampler._filters.get(requests, VOCAB) is None:
        sampler._filters.put(requests, sampler._filter_params(requests, VOCAB), VOCAB)


def measure(batch_size: int, churn: int, sampling: str, steps: int, warm: int) -> float:
    """Median host microseconds per step."""
    rng = random.Random(0)
    pool = PersistentBatch(batch_size, torch.device("cpu"), 128)
    sampler = Sampler(VOCAB, "cpu")
    count = iter(range(10**9))

    def new_request() -> Request:
        n = rng.randrange(100, 1000)
        r = Request(f"r{next(count)}", list(range(n)), SamplingParams(**SAMPLING[sampling], max_tokens=2000), 2000)
        r.block_ids = list(range(-(-(n + 1000) // BLOCK_SIZE)))
        r.num_computed_tokens = n - 1
        return r

    requests = [new_request() for _ in range(batch_size)]
    times = []
    for _ in range(warm + steps):
        out = SchedulerOutput([ScheduledRequest(r, 1) for r in requests])
        t0 = time.perf_counter()
        inputs = step_inputs(out, BLOCK_SIZE, pool, torch.device("cpu"))
        sampler_host_work(sampler, pool, inputs, requests)
        times.append(time.perf_counter() - t0)
        for r in requests:
            r.all_token_ids.append(1)
            r.output_token_ids.append(1)
            r.num_computed_tokens += 1
        for _ in range(churn):
            i = rng.randrange(batch_size)
            pool.release(requests[i].request_id)
            requests[i] = new_request()
    times = sorted(times[warm:])
    return times[len(times) // 2] * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", default="8,256")
    ap.add_argument("--churn", default="0,2")
    ap.add_argument("--sampling", default=",".join(SAMPLING))
    ap.add_argument("--steps", type=int, default=350)
    ap.add_argument("--repeats", type=int, default=3, help="runs per setting; the median of their medians")
    ap.add_argument("--output-json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    for sampling in args.sampling.split(","):
        for b in map(int, args.batch_sizes.split(",")):
            for c in map(int, args.churn.split(",")):
                runs = sorted(measure(b, c, sampling, args.steps, 50) for _ in range(args.repeats))
                rows.append(dict(sampling=sampling, batch_size=b, churn=c, host_us=round(runs[len(runs) // 2], 1)))
                print(f"{sampling:7s} batch {b:4d} churn {c}: {rows[-1]['host_us']:7.1f} us per step")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
