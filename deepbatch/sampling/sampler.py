"""Logits -> next tokens, on the device, for the whole batch at once.

Order of operations (vLLM's): grammar bitmask (structured outputs; ``structured_output/``) ->
logit bias -> min_tokens (ban EOS/stop ids; a constrained row's ban is in its bitmask) ->
penalties (from per-request counts kept on the device: ``penalty_state.py``) -> logprobs (of the
processed logits, before temperature, so a constrained row's are over the tokens its grammar
allows) -> greedy argmax, or temperature -> top-k -> top-p -> min-p -> sample. Sampling draws
``argmax(p / q)`` with ``q ~ Exp(1)``, which samples from ``p`` without a host sync; seeded
requests take their ``q`` row from a pure function of (seed, choice, output position)
(``seeded_noise.py``: Philox keyed by the seed, the kernels' own stream), so their output does not
depend on what else is in the batch, on preemption, or on which path samples it.

A fault in one request's sampling is that request's: when the batched pass raises, each row is
sampled alone and the rows that still raise come back as errors in ``SamplerOutput.errors``
(the engine ends those requests); a row whose raw logits hold a NaN is reported the same way.
Only the other rows' tokens are used.

With ``fused`` on (the default on CUDA; ``--no-fused-sampler`` turns it off) a GPU batch samples
in Triton kernels that never sort the vocabulary: temperature-only batches in one read of the
logits (``kernels/sample.py``, ``argmax(l / T + Gumbel)``), every other sampled batch (top-k,
top-p, min-p, seeds) through ``kernels/sample_rejection.py`` (the tokens of
``kernels/sample_top_k_top_p.py``, drawn by rejection in parallel passes), and penalties in one pass
(``kernels/apply_penalties.py``). The torch path stays as the reference and the CPU path.
"""

from __future__ import annotations

import logging
import torch

from deepbatch.core.request import Request
from deepbatch.kernels.apply_penalties import apply_penalties
from deepbatch.kernels.common import triton
from deepbatch.kernels.logprobs_topk import logprobs_topk
from deepbatch.kernels.sample import counters_used, gumbel_sample
from deepbatch.kernels.sample_rejection import sample_rejection
from deepbatch.sampling.host_copy import table_to_device
from deepbatch.sampling.param_rows import StepParams
from deepbatch.sampling.pending_sample import PendingSample
from deepbatch.sampling.penalty_state import PenaltyState
from deepbatch.sampling.seeded_noise import seeded_exponential, stream_position
from deepbatch.structured_output.bitmask import apply_grammar_bitmask, remember_samples, warm_up_bitmask

logger = logging.getLogger(__name__)


class Sampler:
    def __init__(self, vocab_size: int, device: str | torch.device, fused: bool | None = None,
                 fault_request_id: str | None = None, max_num_seqs: int = 256):
        """``fused`` picks the one-pass Gumbel-max kernel for the batches it covers: None uses it on
        CUDA when Triton is installed, True wherever Triton runs (the interpreter on the CPU),
        False never. ``fault_request_id`` (testing only) makes sampling raise for that request."""
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.fused = fused
        self.fault_request_id = fault_request_id
        # The kernel's Philox stream: the process seed (the engine seeds torch before building
        # the runner) and a counter offset that each call moves past the counters it used. Host
        # ints, so a step never waits on the device for its random state.
        self._philox_seed = torch.initial_seed() % 2 ** 63
        self._philox_offset = 0
        self.penalties = PenaltyState(self.device, reserved_rows=max_num_seqs)

    @torch.no_grad()
    def sample(self, logits: torch.Tensor, requests: list[Request], step: StepParams | None = None) -> PendingSample:
        """``logits``: float32 ``[len(requests), V]`` (V may exceed the tokenizer's vocab);
        ``step``: the rows' sampling parameters, gathered from the persistent batch
        (``sampling/param_rows.py``), or built from ``requests`` when not given. Queues the
        sampling on the device and returns without waiting for it. Never raises for one
        request's sake: such rows come back as errors (module docstring). Under async scheduling
        a request's newest token may still be pending: the penalties' counts on the device
        already hold it (``penalty_state.py``), so they need no synchronous step."""
        params = [r.sampling_params for r in requests]
        # Read on the host with the sampled ids (no extra sync): a NaN anywhere in a row's raw
        # logits ends that request, whatever token the NaN would have turned into.
        # (amax propagates NaN: one pass, no [S, V] mask written as isnan().any() would.)
        nan_rows = logits.amax(dim=-1).isnan()
        # Host work (matchers, bitmask fill) while the device still runs the forward.
        apply_grammar_bitmask(logits, requests)
        try:
            sampled, logprobs = self._sample_batch(logits, requests, step)
            pending = PendingSample(sampled, logprobs, params, None, nan_rows, self._fused_enabled(logits))
            remember_samples(pending, requests)
        except Exception as batch_error:  # noqa: BLE001 - isolated per row below
            logger.warning("sampling a batch of %d failed (%s: %s); sampling its rows one by one",
                           len(requests), type(batch_error).__name__, batch_error)
        else:
            # Only once the step's ids are final: a batch that fails is counted row by row below.
            self.penalties.record(sampled, requests)
            return pending
        rows, row_logprobs, errors = [], [], {}
        for i, r in enumerate(requests):
            try:
                token, lp = self._sample_batch(logits[i : i + 1], [r])
            except Exception as e:  # noqa: BLE001 - this request's fault ends this request
                errors[i] = f"sampling failed: {type(e).__name__}: {e}"[:500]
                token, lp = torch.zeros(1, dtype=torch.long, device=logits.device), None
            rows.append(token.view(1).long())
            row_logprobs.append(lp)
        logprobs = None
        if any(p.logprobs is not None for p in params):
            logprobs = torch.cat([lp if lp is not None else torch.zeros_like(logits[:1]) for lp in row_logprobs])
        sampled = torch.cat(rows)
        pending = PendingSample(sampled, logprobs, params, errors, nan_rows, self._fused_enabled(logits))
        remember_samples(pending, requests)
        self.penalties.record(sampled, requests, skip=errors)
        return pending

    def _sample_batch(self, logits: torch.Tensor, requests: list[Request],
                      step: StepParams | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        params = [r.sampling_params for r in requests]
        if self.fault_request_id is not None and any(
            self.fault_request_id in (r.request_id, r.parent_id) for r in requests
        ):
            raise RuntimeError(f"injected sampling fault for request {self.fault_request_id}")
        logits = self._apply_logit_bias(logits, requests)
        logits = self._apply_min_tokens(logits, requests)
        if any(p.needs_penalties for p in params):
            logits = self._apply_penalties(logits, requests)

        # Logprobs are of the processed logits (PendingSample takes their log-softmax values).
        logprobs = logits if any(p.logprobs is not None for p in params) else None

        step = step or StepParams.of(params, self.device)
        if step.all_greedy:
            sampled = logits.argmax(dim=-1)
        elif not self._fused_enabled(logits):
            sampled = self._sample(logits, requests, step)
        elif step.temperature_only(logits.shape[1]):
            sampled = gumbel_sample(logits, step.column("inv_temperature"), self._philox_seed,
                                    self._next_offset(logits))
        else:
            sampled = self._sample_filtered(logits, requests, step)
        return sampled, logprobs

    def warm_up(self) -> None:
        """Compile the sampling kernels for float32 logits of this vocab before the first request
        (compiling mid-traffic stalls a server); a no-op where the kernels are not used."""
        logits = torch.zeros(1, self.vocab_size, device=self.device)
        if self._fused_enabled(logits):
            gumbel_sample(logits, torch.ones(1, device=self.device), self._philox_seed, 0)
            one = torch.ones(1, device=self.device)
            zero = torch.zeros(1, dtype=torch.int64, device=self.device)
            for k in (50, 0):  # the kernel variants with and without a top-k floor
                sample_rejection(logits, one, zero.int() + k, one * 0.9, one * 0, zero, zero, zero.bool(),
                                 self._philox_seed, 0, max_top_k=k, any_top_p=True, any_min_p=True)
            logprobs_topk(logits, zero, 5)
            state = torch.zeros(1, self.vocab_size, dtype=torch.int32, device=self.device)
            apply_penalties(logits, logits.clone(), zero, zero, state, state.bool(), one, one, one)
            warm_up_bitmask(self.vocab_size, self.device)

    # -- logits processors ------------------------------------------------------------------

    def _apply_logit_bias(self, logits, requests):
        rows, cols, vals = [], [], []
        for i, r in enumerate(requests):
            for tok, bias in (r.sampling_params.logit_bias or {}).items():
                if tok < logits.shape[1]:
                    rows.append(i), cols.append(tok), vals.append(bias)
        if rows:
            logits = logits.clone()
            logits.index_put_(
                (torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device)),
                torch.tensor(vals, device=logits.device, dtype=logits.dtype),
                accumulate=True,
            )
        return logits

    def _apply_min_tokens(self, logits, requests):
        rows, cols = [], []
        for i, r in enumerate(requests):
            p = r.sampling_params
            if r.num_output_tokens >= p.min_tokens:
                continue
            # A row its grammar masked this step has its min_tokens ban in that mask.
            if r.structured_output is None or not r.structured_output.constrains_next_token:
                banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(p._eos_token_ids))
                for tok in banned:
                    rows.append(i), cols.append(tok)
        if rows:
            logits = logits.clone()
            logits[torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device)] = float("-inf")
        return logits

    def _apply_penalties(self, logits, requests):
        return self.penalties.apply(logits, requests, kernel=self._fused_enabled(logits))

    def forget(self, request_id: str) -> None:
        """The request ended: free its penalty state."""
        self.penalties.forget(request_id)

    # -- sampling ---------------------------------------------------------------------------

    def _fused_enabled(self, logits: torch.Tensor) -> bool:
        return self.fused if self.fused is not None else logits.is_cuda and triton is not None

    def _next_offset(self, logits: torch.Tensor) -> int:
        """The Philox counter offset for a kernel call over ``logits``, moved past its counters."""
        offset = self._philox_offset
        self._philox_offset = (offset + counters_used(*logits.shape)) % 2 ** 62
        return offset

    def _sample_filtered(self, logits, requests, step: StepParams):
        """Top-k, top-p, min-p and seeds (``kernels/sample_rejection.py``: the tokens of
        ``kernels/sample_top_k_top_p.py`` in parallel passes); greedy rows take the argmax."""
        column = step.column
        seeds = column("seed")
        # The one per-row value that moves every step: the seeded rows' stream positions (read
        # for those rows only, so a batch without seeds passes its zero seeds instead).
        positions = seeds
        if step.any_seeded:
            positions = self._to_device([[stream_position(r.num_output_tokens, r.index) for r in requests]],
                                        torch.int64)[0]
        return sample_rejection(logits, column("temperature"), column("top_k").int(), column("top_p"),
                                column("min_p"), seeds, positions, column("seeded").bool(), self._philox_seed,
                                self._next_offset(logits), **step.hints(logits.shape[1]))

    def _filtered_probs(self, logits, step: StepParams) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's distribution after temperature, top-k, top-p and min-p, and which rows are
        greedy (their probs are those of temperature 1)."""
        hints = step.hints(logits.shape[1])
        temperature = step.column("temperature")
        greedy = temperature == 0.0
        scaled = logits / torch.where(greedy, 1.0, temperature).unsqueeze(1)
        if hints["max_top_k"] or hints["any_top_p"]:
            top_k = step.column("top_k")
            scaled = _top_k_top_p(scaled, torch.where(top_k > 0, top_k, logits.shape[1]), step.column("top_p"))
        probs = scaled.softmax(dim=-1)
        if hints["any_min_p"]:
            min_p = step.column("min_p")
            probs = probs.masked_fill(probs < min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values, 0.0)
        return probs, greedy

    def _sample(self, logits, requests, step: StepParams):
        params = [r.sampling_params for r in requests]
        probs, greedy = self._filtered_probs(logits, step)
        q = torch.empty_like(probs).exponential_()
        seeded = [i for i, p in enumerate(params) if p.seed is not None and not p.greedy]
        if seeded:
            keys = [(params[i].seed, stream_position(requests[i].num_output_tokens, requests[i].index)) for i in seeded]
            q[torch.tensor(seeded, device=q.device)] = seeded_exponential(keys, q.shape[1], q.device)
        sampled = (probs / q).argmax(dim=-1)
        return torch.where(greedy, logits.argmax(dim=-1), sampled)

    def _to_device(self, rows: list[list[float]], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return table_to_device(rows, dtype, self.device)


def _top_k_top_p(logits: torch.Tensor, k: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Mask all but each row's top-k logits and the smallest prefix whose mass reaches top-p."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[1], device=logits.device).unsqueeze(0)
    mask = ranks >= k.unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(mask, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # Drop a token when the mass before it already reaches top_p (the first token always stays).
    mass_before = probs.cumsum(dim=-1) - probs
    sorted_logits = sorted_logits.masked_fill(mass_before >= p.unsqueeze(1), float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
