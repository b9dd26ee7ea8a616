"""The engine: validate and enqueue requests; each ``step`` schedules, launches and commits.

    add_request -> Request(s) on the scheduler's waiting queue
    step:       out = scheduler.schedule()
                pending = runner.launch(out)                  # forward + sampling, not waited for
                scheduler.advance(out)                        # counters move on
                outputs.process(pending.resolve())            # the output processor: stop ids,
                                                              # lengths, detokenize, stop strings,
                                                              # grammars, logprobs; finished here

With async scheduling (the default on a GPU) the host schedules and launches step N+1 before it
waits for step N's sampled ids, so scheduling, batch building and output handling overlap the
device instead of leaving it idle between steps::

    host:    schedule N+1 | launch N+1 | commit N (wait N's ids) | advance N+1 | schedule N+2 ...
    device:  ..... step N ..........   | step N+1 .....................................

A request's token from step N is *pending* while step N+1 is scheduled: it counts as a token,
step N+1 reads its id on the device, and the output processor fills it in at commit. A request
that stops at step N (EOS, stop string) was already scheduled in N+1: that one extra token is
computed and dropped. Penalties and structured outputs keep async scheduling: penalties count
each step's sampled ids on the device (``sampling/penalty_state.py``), and structured outputs
read a row's pending token before filling its grammar bitmask (``structured_output/``). Under
tensor parallelism rank 0 broadcasts the sampled ids, so every rank reads pending tokens alike.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from dataclasses import replace

from deepbatch.config import EngineConfig
from deepbatch.kv_cache.host_memory import check_swap_space
from deepbatch.core.errors import InvalidRequestError
from deepbatch.core.outputs import RequestOutput
from deepbatch.core.request import Request
from deepbatch.core.sampling_params import SamplingParams
from deepbatch.engine.output_processor import EngineStats, OutputProcessor, StepResult, make_output
from deepbatch.kv_cache.manager import KVCacheManager
from deepbatch.kv_cache.swap import HostBlockPool, SwapCostModel, num_host_blocks
from deepbatch.models.config_checks import kv_sliding_window
from deepbatch.models.loader import build_model, load_hf_config, load_tokenizer, max_model_len_of, resolve_model
from deepbatch.runner.kv_swap import measure_host_link_bytes_per_s
from deepbatch.runner.model_runner import ModelRunner
from deepbatch.sampling.pending_sample import PendingSample
from deepbatch.control.controller import make_controller
from deepbatch.engine.speculation import build_draw_seeds, build_drafter, build_proposer
from deepbatch.scheduler.preemption import Preemptor
from deepbatch.scheduler.scheduler import Scheduler
from deepbatch.core.scheduler_output import SchedulerOutput
from deepbatch.structured_output.grammar import GrammarCache
from deepbatch.structured_output.matcher import StructuredOutputRequest

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig, detokenize: bool = True):
        """``detokenize`` False leaves output text and stop strings to the caller (the engine
        core process: its API processes detokenize)."""
        self.config = config
        self.source = resolve_model(config.model.model)
        self.hf_config = load_hf_config(self.source, config.model.cache_dir)
        self.tokenizer = load_tokenizer(self.source, config.model.tokenizer, config.model.cache_dir)
        native_len = max_model_len_of(self.hf_config, None)
        self.max_model_len = max_model_len_of(self.hf_config, config.model.max_model_len)
        if self.max_model_len > native_len:
            logger.warning("max_model_len %d exceeds the model's %d positions", self.max_model_len, native_len)
        if config.parallel.tensor_parallel_size > 1:
            from deepbatch.executor.tensor_parallel import TensorParallelExecutor

            # Rank 0's shard plus worker processes behind the runner's interface.
            self.runner = TensorParallelExecutor(config, self.source, self.hf_config, self.max_model_len)
        else:
            model = build_model(config.model, self.source, self.hf_config, config.device, self.max_model_len)
            self.runner = ModelRunner(config, model, self.hf_config, self.max_model_len)
        self.runner.calibrate_kv_scales()  # fp8 scales the checkpoint lacks, if asked; before any graph
        drafter = build_drafter(config, self.runner, self.hf_config, self.tokenizer, self.max_model_len)
        self.num_blocks = self.runner.profile_num_blocks(drafter.kv_bytes_per_block() if drafter is not None else 0)
        # Measured before the KV cache takes the memory; a block swaps with the drafter's rows of it.
        swap = self._swap_cost_model(drafter.swapped_bytes_per_block() if drafter is not None else 0)
        self.runner.init_kv_cache(self.num_blocks)
        # Speculative decoding drafts from the committed tokens, so a step with drafts is
        # synchronous; under async scheduling the steps the cost model keeps free of drafts stay
        # asynchronous (``_step_async``).
        self.proposer, self.spec_cost = build_proposer(config, drafter, self.num_blocks, self.max_model_len)
        self.draw_seeds = build_draw_seeds(config)
        self.kv_cache = KVCacheManager(self.num_blocks, config.cache.block_size, config.cache.enable_prefix_caching,
                                       sliding_window=kv_sliding_window(self.hf_config))
        preemptor = Preemptor(self.kv_cache)
        if swap is not None:
            num_host_blocks, cost = swap
            self.runner.init_swap_space(num_host_blocks)
            preemptor = Preemptor(self.kv_cache, HostBlockPool(num_host_blocks), cost, config.scheduler.preemption_mode)
        self.runner.capture_cuda_graphs()
        self.scheduler = Scheduler(config.scheduler, self.kv_cache, self.max_model_len, preemptor=preemptor)
        self.controller = make_controller(self.scheduler)  # None unless an SLO target is set
        # For the controller: when each launched step's call began, and the last commit. A step's
        # duration is from the later of the two to its commit: under async scheduling that is the
        # commit-to-commit interval, and it never counts time the engine sat idle.
        self._last_commit = 0.0
        self.eos_token_ids = self._eos_token_ids()
        # Compiled grammars over the logits' width; xgrammar is imported on the first use.
        self.grammars = GrammarCache(self.tokenizer, self.hf_config.vocab_size, self.eos_token_ids)
        self.stats = EngineStats()
        self.outputs = OutputProcessor(self.scheduler, self.tokenizer, self.max_model_len, self.stats,
                                       release=functools.partial(_forget, self.runner, self.proposer),
                                       detokenize=detokenize,
                                       fault_request_id=config.fault_inject_detokenize_request)
        self._ids = itertools.count()
        self.async_scheduling = (config.async_scheduling if config.async_scheduling is not None
                                 else config.parallel.tensor_parallel_size == 1 and self.runner.device.type == "cuda")
        # Launched, not committed: the step, its sampled tokens, when it was scheduled.
        self._inflight: tuple[SchedulerOutput, PendingSample, float] | None = None
        logger.info(
            "KV cache: %d blocks x %d tokens = %d tokens, %s (%.1f KiB per block)",
            self.num_blocks, config.cache.block_size, self.kv_cache.capacity_tokens,
            self.runner.describe_kv_cache(), self.runner.kv_bytes_per_block() / 1024,
        )

    def _swap_cost_model(self, extra_bytes_per_block: int = 0) -> tuple[int, SwapCostModel] | None:
        """Host blocks and cost model for ``swap_space`` (None when it is 0), each block of the KV
        and ``extra_bytes_per_block`` more. Refuses a swap space the cgroup or the host cannot hold."""
        cache = self.config.cache
        if cache.swap_space <= 0:
            return None
        swap_bytes = int(cache.swap_space * 2**30)
        check_swap_space(swap_bytes * self.config.parallel.tensor_parallel_size)  # a pool per rank
        per_block = self.runner.kv_bytes_per_block() + extra_bytes_per_block
        n = num_host_blocks(swap_bytes, per_block)
        if n < 1:
            raise ValueError(f"swap_space: {cache.swap_space} GiB holds no KV block ({per_block} bytes)")
        prefill = cache.swap_prefill_tokens_per_s or self.runner.measure_prefill_tokens_per_s(
            min(self.config.scheduler.max_num_batched_tokens, 1024 if self.runner.device.type == "cuda" else 256))
        link = cache.swap_host_link_bytes_per_s or measure_host_link_bytes_per_s(self.runner.device)
        cost = SwapCostModel(prefill, link, per_block)
        logger.info("swap space: %d host blocks (%.2f GiB); prefill %.0f tokens/s, host link %.2f GB/s: %s per "
                    "block of %d tokens", n, n * per_block / 2**30, prefill, link / 1e9,
                    "swap" if cost.prefer_swap(cache.block_size, 1) else "recompute", cache.block_size)
        return n, cost

    @property
    def model_name(self) -> str:
        return self.source.name

    def _eos_token_ids(self) -> frozenset[int]:
        ids = set()
        for src in (self.hf_config, getattr(self.tokenizer, "init_kwargs", None)):
            eos = getattr(src, "eos_token_id", None)
            if isinstance(eos, int):
                ids.add(eos)
            elif isinstance(eos, (list, tuple)):
                ids.update(eos)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return frozenset(ids)

    # -- requests ---------------------------------------------------------------------------

    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise InvalidRequestError("prompt", "this model has no tokenizer; pass prompt_token_ids")
        try:
            return self.tokenizer.encode(prompt)
        except Exception as e:  # e.g. a lone surrogate: text no tokenizer can encode
            raise InvalidRequestError("prompt", f"the prompt cannot be tokenized: {type(e).__name__}: {e}"[:300]) from e

    def apply_chat_template(self, messages: list[dict], /, add_generation_prompt: bool = True,
                            **kwargs) -> list[int]:
        # ``messages`` is positional-only so that a template variable of that name is a template
        # variable, not a second value for the argument.
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise InvalidRequestError("messages", "this model has no chat template")
        try:
            out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                     tokenize=True, **kwargs)
        except Exception as e:  # template errors are the caller's input errors
            raise InvalidRequestError("messages", f"chat template failed: {e}") from e
        return list(out["input_ids"] if hasattr(out, "keys") else out)

    def make_requests(
        self,
        request_id: str | None,
        prompt: str | list[int] | dict,
        params: SamplingParams,
        priority: int = 0,
        tenant: str = "default",
        arrival_time: float | None = None,
    ) -> list[Request]:
        """Validate and build the Request(s) of one prompt (n of them for ``params.n > 1``)."""
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
        text, ids, max_tokens = self.validate(prompt, params)
        grammar = self.grammars.prepare(params)  # compiled here unless attached by prepare_structured_output
        params = replace(params, _eos_token_ids=self.eos_token_ids)
        if self.draw_seeds is not None:
            params = self.draw_seeds(params, grammar)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        out = []
        for i in range(params.n):
            # Samples share the seed; the sampler keys each one's random stream by its index.
            rid = request_id if params.n == 1 else f"{request_id}-{i}"
            # Each sample follows the grammar with its own matcher.
            matcher = (StructuredOutputRequest(grammar, params.structured_outputs.start_after_token_ids)
                       if grammar is not None else None)
            out.append(Request(rid, ids, params, max_tokens, arrival_time=arrival, priority=priority,
                               tenant=tenant, prompt=text, parent_id=request_id, index=i,
                               structured_output=matcher))
        return out

    def validate(self, prompt: str | list[int] | dict, params: SamplingParams) -> tuple[str | None, list[int], int]:
        """The prompt's text, its token ids and the request's max_tokens, or InvalidRequestError.
        Reads only what never changes after start-up (the API process runs it too, on a frontend
        that has the tokenizer and the KV cache's size but no model)."""
        text, ids = self._prompt_ids(prompt)
        if not ids:
            raise InvalidRequestError("prompt", "the prompt is empty")
        vocab = self.hf_config.vocab_size
        # Types first, over the distinct types only: a long prompt is checked in C loops.
        if any(not issubclass(t, int) for t in set(map(type, ids))) or min(ids) < 0 or max(ids) >= vocab:
            raise InvalidRequestError("prompt", f"token ids must be integers in [0, {vocab})")
        n_prompt = len(ids)
        if n_prompt >= self.max_model_len:
            raise InvalidRequestError(
                "prompt", f"the prompt has {n_prompt} tokens; the maximum context length is {self.max_model_len} "
                "and at least one token must be generated", code="context_length_exceeded")
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - n_prompt
        if n_prompt + max_tokens > self.max_model_len:
            raise InvalidRequestError(
                "max_tokens", f"prompt ({n_prompt} tokens) + max_tokens ({max_tokens}) exceeds the maximum context "
                f"length {self.max_model_len}", code="context_length_exceeded")
        # Under a sliding window a request holds about a window of blocks, however long it is.
        if (self.kv_cache.blocks_to_fit(n_prompt + max_tokens, self.config.scheduler.max_num_batched_tokens)
                > self.kv_cache.num_blocks):
            raise InvalidRequestError(
                "max_tokens", f"prompt ({n_prompt}) + max_tokens ({max_tokens}) can never fit in the KV cache "
                f"({self.kv_cache.capacity_tokens} tokens)", code="context_length_exceeded")
        if params.logit_bias and any(t >= vocab for t in params.logit_bias):
            raise InvalidRequestError("logit_bias", f"token ids must be in [0, {vocab})")
        if any(t >= vocab for t in params.stop_token_ids):
            raise InvalidRequestError("stop_token_ids", f"token ids must be in [0, {vocab})")
        return text, ids, max_tokens

    def prepare_structured_output(self, params: SamplingParams) -> SamplingParams:
        """``params`` with its grammar compiled and attached, so that ``make_requests`` does not
        compile; the async engine runs this in a worker thread. Raises ``GrammarCompileError``."""
        grammar = self.grammars.prepare(params)
        return params if grammar is None else replace(params, _compiled_grammar=grammar)

    def _prompt_ids(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenize(prompt) if prompt else []
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self._prompt_ids(prompt["prompt"])
            raise InvalidRequestError("prompt", "a dict prompt needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, (list, tuple)):
            return None, list(prompt)
        raise InvalidRequestError("prompt", "a prompt is a string, a list of token ids or a dict, "
                                            f"got {type(prompt).__name__}")

    def add_request(self, request_id, prompt, params: SamplingParams, priority: int = 0, tenant: str = "default",
                    arrival_time: float | None = None) -> str:
        return self.enqueue(self.make_requests(request_id, prompt, params, priority, tenant, arrival_time))

    def enqueue(self, requests: list[Request]) -> str:
        """Queue the samples of one parent request (from ``make_requests``); returns its id."""
        parent = self.outputs.add(requests)
        for r in requests:
            self.scheduler.add_request(r)
        return parent

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """End a request (all its samples) now and free its KV blocks."""
        return self.outputs.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._inflight is not None

    # -- health -----------------------------------------------------------------------------

    def check_health(self) -> None:
        """Raises EngineDeadError once a tensor-parallel rank has failed (a no-op with one)."""
        self.runner.check_health()

    def add_fault_listener(self, callback) -> None:
        """``callback()`` runs, on any thread, when a rank fails between steps, so a caller that
        is idle can call ``check_health`` (the next step would raise anyway)."""
        self.runner.add_fault_listener(callback)

    def shutdown(self) -> None:
        """Stop tensor-parallel workers; idempotent, a no-op with one rank."""
        self.runner.shutdown()

    # -- the step ---------------------------------------------------------------------------

    def step(self, finished_only: bool = False) -> list[RequestOutput]:
        """One model step. Returns an output for every parent request that made progress (with
        ``finished_only``, only for those that finished: offline runs skip building the rest)."""
        return [make_output(pid, children) for pid, children in self.step_requests(finished_only)]

    def step_requests(self, finished_only: bool = False) -> list[tuple[str, list[Request]]]:
        """``step``, returning ``(parent id, its samples)`` for each parent request that made
        progress instead of building outputs (the engine core sends only what is new of them)."""
        result = StepResult()
        if self.async_scheduling:
            self._step_async(result)
        elif self._inflight is not None:  # switched to synchronous: commit the launched step first
            self._commit(*self._inflight, result)
            self._inflight = None
        else:
            self._step_sync(result)
        return self.outputs.take(result.touched, finished_only)

    def _step_sync(self, result: StepResult, drafting_arm: bool = False) -> None:
        """``drafting_arm``: an async engine runs this step synchronously for its drafts."""
        out, pending, started = self._schedule_and_launch(result)
        self.scheduler.advance(out, pending=False)
        if pending is not None:
            self._commit(out, pending, started, result, drafting_arm)

    def _step_async(self, result: StepResult) -> None:
        """Launch step N+1, then commit step N: the host's work overlaps the device's. A step
        that should run drafts (speculative decoding) needs every token committed to propose
        them and its own tokens committed before the next is scheduled: it runs synchronously,
        after the step in flight is committed."""
        if self.proposer is not None and self._wants_drafts():
            if self._inflight is not None:
                self._commit(*self._inflight, result)
                self._inflight = None
            self._step_sync(result, drafting_arm=True)
            return
        out, pending, started = self._schedule_and_launch(result, propose=False)
        if self._inflight is not None:
            self._commit(*self._inflight, result)  # waits for the previous step only
        self.scheduler.advance(out, pending=True)
        self._inflight = (out, pending, started) if pending is not None else None

    def _wants_drafts(self) -> bool:
        """Under async scheduling: whether the next step should run drafts (by the cost model;
        without one, always)."""
        if self.spec_cost is None:
            return True
        running = self.scheduler.running
        # A request whose newest token is pending decodes next as well.
        decoding = [r for r in running if r.num_tokens - r.num_computed_tokens <= 1]
        return self.spec_cost.wants_drafts(len(decoding), len(running), decoding)

    def _schedule_and_launch(self, result: StepResult,
                             propose: bool = True) -> tuple[SchedulerOutput, PendingSample | None, float]:
        started = time.monotonic()
        if self.proposer is not None:
            if propose:
                self.proposer.propose(self.scheduler.running, self.spec_cost)
            else:  # an asynchronous step: no drafts (the next step is scheduled before its tokens)
                for r in self.scheduler.running:
                    r.spec_token_ids = []
        out = self.scheduler.schedule()
        for r in out.finished:  # ended by the scheduler: can never fit in the KV cache
            self.outputs.on_finished(r)
            result.touched[r.parent_id] = None
        if out.is_empty:
            if out.blocks_to_swap_out:  # a step may preempt by swap and schedule nothing
                self.runner.swap_blocks(out)
            return out, None, started
        self.stats.num_steps += 1
        for s in out.scheduled:
            r = s.request
            if r.num_computed_tokens < r.num_prompt_tokens:  # before advance: prompt tokens run now
                self.stats.num_prompt_tokens += min(s.num_new_tokens, r.num_prompt_tokens - r.num_computed_tokens)
        return out, self.runner.launch(out), started

    def _commit(self, out: SchedulerOutput, pending: PendingSample, started: float, result: StepResult,
                drafting_arm: bool = False) -> None:
        """Hand a launched step's sampled tokens to the output processor; feed the controller."""
        sampled = pending.resolve()
        now = time.monotonic()
        first, done = len(result.first_token), len(result.done)
        self.outputs.record_prompt_logprobs(sampled.prompt_logprobs)
        self.outputs.process([s.request for s in out.scheduled if s.samples], sampled.token_ids, sampled.logprobs,
                             sampled.errors, now, result, sampled.token_rows)
        # Under async scheduling a step's time runs from the previous commit, not from when it
        # was scheduled (it waited behind the step before it).
        started = max(started, self._last_commit)
        self._last_commit = now
        if self.spec_cost is not None:
            self.spec_cost.observe_step(now - started, out.num_scheduled_tokens, len(out.scheduled),
                                        self.stats.spec_drafted_per_position, self.stats.spec_accepted_per_position,
                                        sum(s.num_spec_tokens for s in out.scheduled), drafting_arm)
        if self.controller is not None:
            self.controller.observe_step(now - started, out.num_scheduled_tokens, len(out.scheduled),
                                         result.first_token[first:], result.done[done:])


def _forget(runner: ModelRunner, proposer, request_id: str) -> None:
    """A request ended: drop its state in the runner and the proposer (a draft model's cache).
    A function of the two rather than an engine method, so the output processor holds no
    reference back to the engine: a dropped engine then frees its weights and KV cache at once,
    not whenever the cycle collector runs (the next engine built in the process may need them)."""
    runner.forget(request_id)
    if proposer is not None:
        proposer.forget(request_id)
