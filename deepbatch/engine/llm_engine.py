"""The engine: validate and enqueue requests; each ``step`` schedules, launches and commits.

    add_request -> Request(s) on the scheduler's waiting queue
    step:       out = scheduler.schedule()
                pending = runner.launch(out)                  # forward + sampling, not waited for
                scheduler.advance(out)                        # counters move on
                _commit(out, pending)                         # sampled ids: EOS, stop ids, lengths,
                                                              # detokenize, stop strings, stats

With async scheduling (the default on a GPU) the host schedules and launches step N+1 before it
waits for step N's sampled ids, so scheduling, batch building and output handling overlap the
device instead of leaving it idle between steps::

    host:    schedule N+1 | launch N+1 | commit N (wait N's ids) | advance N+1 | schedule N+2 ...
    device:  ..... step N ..........   | step N+1 .....................................

A request's token from step N is *pending* while step N+1 is scheduled: it counts as a token,
step N+1 reads its id on the device, and ``commit`` fills it in. A request that stops at step N
(EOS, stop string) was already scheduled in N+1: that one extra token is computed and dropped.
Penalties and structured outputs keep async scheduling: the sampler reads a row's pending token
from the step that sampled it, on the device for penalties and before it fills that row's
grammar bitmask for structured outputs (``structured_output/``).
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field, replace

from deepbatch.config import EngineConfig
from deepbatch.kv_cache.host_memory import check_swap_space
from deepbatch.engine.detokenizer import Detokenizer
from deepbatch.core.errors import InvalidRequestError
from deepbatch.core.outputs import CompletionOutput, RequestMetrics, RequestOutput
from deepbatch.core.request import Request, RequestStatus
from deepbatch.core.sampling_params import SamplingParams
from deepbatch.kv_cache.manager import KVCacheManager
from deepbatch.kv_cache.swap import HostBlockPool, SwapCostModel, num_host_blocks
from deepbatch.models.config_checks import kv_sliding_window
from deepbatch.models.loader import build_model, load_hf_config, load_tokenizer, max_model_len_of, resolve_model
from deepbatch.runner.kv_swap import measure_host_link_bytes_per_s
from deepbatch.runner.model_runner import ModelRunner
from deepbatch.sampling.sampler import PendingSample, SamplerOutput
from deepbatch.control.controller import make_controller
from deepbatch.scheduler.preemption import Preemptor
from deepbatch.scheduler.scheduler import Scheduler
from deepbatch.core.scheduler_output import SchedulerOutput
from deepbatch.structured_output.grammar import GrammarCache
from deepbatch.structured_output.matcher import StructuredOutputRequest

logger = logging.getLogger(__name__)


@dataclass
class EngineStats:
    """Monotonic counters since start (the metrics exporter reads deltas of these)."""

    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_steps: int = 0
    finished_by_reason: dict[str, int] = field(default_factory=dict)


class LLMEngine:
    def __init__(self, config: EngineConfig):
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
        self.num_blocks = self.runner.profile_num_blocks()
        swap = self._swap_cost_model()  # measured before the KV cache takes the memory
        self.runner.init_kv_cache(self.num_blocks)
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
        self.detokenizer = Detokenizer(self.tokenizer)
        self.eos_token_ids = self._eos_token_ids()
        # Compiled grammars over the logits' width; xgrammar is imported on the first use.
        self.grammars = GrammarCache(self.tokenizer, self.hf_config.vocab_size, self.eos_token_ids)
        self.stats = EngineStats()
        self._children: dict[str, list[Request]] = {}  # parent id -> its n samples
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

    def _swap_cost_model(self) -> tuple[int, SwapCostModel] | None:
        """Host blocks and cost model for ``swap_space`` (None when it is 0). Refuses a swap space
        the cgroup or the host cannot hold."""
        cache = self.config.cache
        if cache.swap_space <= 0:
            return None
        swap_bytes = int(cache.swap_space * 2**30)
        check_swap_space(swap_bytes)
        per_block = self.runner.kv_bytes_per_block()
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
            out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True, **kwargs)
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
        grammar = self.grammars.prepare(params)  # compiled here unless attached by prepare_structured_output
        params = replace(params, _eos_token_ids=self.eos_token_ids)
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
        raise InvalidRequestError("prompt", f"a prompt is a string, a list of token ids or a dict, got {type(prompt).__name__}")

    def add_request(self, request_id, prompt, params: SamplingParams, priority: int = 0, tenant: str = "default",
                    arrival_time: float | None = None) -> str:
        return self.enqueue(self.make_requests(request_id, prompt, params, priority, tenant, arrival_time))

    def enqueue(self, requests: list[Request]) -> str:
        """Queue the samples of one parent request (from ``make_requests``); returns its id."""
        parent = requests[0].parent_id
        if parent in self._children:
            raise InvalidRequestError("request_id", f"request id {parent!r} is already in use")
        self._children[parent] = requests
        for r in requests:
            self.scheduler.add_request(r)
        return parent

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """End a request (all its samples) now and free its KV blocks."""
        children = self._children.pop(request_id, None)
        if children is None:
            return None
        for r in children:
            if not r.is_finished:
                self.scheduler.finish_request(r.request_id, RequestStatus.FINISHED_ABORTED)
                self._on_finished(r)
        return self._output(request_id, children)

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
        touched: dict[str, None] = {}
        pipelined = self.async_scheduling
        if not pipelined and self._inflight is not None:
            self._commit(*self._inflight, touched)  # drain before running synchronously
            self._inflight = None
            return self._collect(touched, finished_only)
        started = time.monotonic()
        out = self.scheduler.schedule()
        for r in out.finished:
            self._on_finished(r)
            touched[r.parent_id] = None
        pending = None
        if out.is_empty:
            if out.blocks_to_swap_out:  # a step may preempt by swap and schedule nothing
                self.runner.swap_blocks(out)
        else:
            self.stats.num_steps += 1
            for s in out.scheduled:
                r = s.request
                if r.num_computed_tokens < r.num_prompt_tokens:  # before advance: prompt tokens run now
                    self.stats.num_prompt_tokens += min(s.num_new_tokens, r.num_prompt_tokens - r.num_computed_tokens)
            pending = self.runner.launch(out)
        if not pipelined:
            self.scheduler.advance(out, pending=False)
            if pending is not None:
                self._commit(out, pending, started, touched)
            return self._collect(touched, finished_only)
        if self._inflight is not None:
            self._commit(*self._inflight, touched)  # waits for the previous step only
        self.scheduler.advance(out, pending=True)
        self._inflight = (out, pending, started) if pending is not None else None
        return self._collect(touched, finished_only)

    def _commit(self, out: SchedulerOutput, pending: PendingSample, started: float, touched: dict[str, None]) -> None:
        """Take a launched step's sampled tokens: stop checks, detokenize, timestamps."""
        sampler_out: SamplerOutput = pending.resolve()
        sampling = [s.request for s in out.scheduled if s.samples]
        now = time.monotonic()
        first_token, done = [], []
        errors = sampler_out.errors or {}
        for i, (r, token) in enumerate(zip(sampling, sampler_out.token_ids)):
            if r.is_finished:
                continue  # stopped or aborted while this step ran; its token is dropped
            touched[r.parent_id] = None
            if i in errors:
                self._fail_request(r, errors[i])
                continue
            self.stats.num_generation_tokens += 1
            finished = self.scheduler.commit_token(r, token)
            if r.first_token_time is None:
                r.first_token_time = now
                first_token.append(r)
            r.last_token_time = now
            if sampler_out.logprobs is not None and r.logprobs is not None:
                r.logprobs.append(sampler_out.logprobs[i])
            try:
                stop = self.detokenizer.update(r, [token])
            except Exception as e:  # noqa: BLE001 - a token this request's text cannot take ends it alone
                message = f"detokenization failed: {type(e).__name__}: {e}"[:500]
                if finished:  # it had just finished (length, stop id): it keeps its reason
                    r.error = message
                    self._on_finished(r)
                else:
                    self._fail_request(r, message)
                continue
            if stop is not None and not r.is_finished:
                r.stop_reason = stop
                self.scheduler.finish_request(r.request_id, RequestStatus.FINISHED_STOPPED)
                finished = True
            if not r.is_finished and r.structured_output is not None:
                error = r.structured_output.advance(r.output_token_ids)
                if error is not None:
                    self._fail_request(r, error, r.structured_output.error_code)
                    continue
                if r.structured_output.is_terminated:  # the grammar took a stop token: complete
                    self.scheduler.finish_request(r.request_id, RequestStatus.FINISHED_STOPPED)
                    finished = True
            if finished:
                self._on_finished(r)
                done.append(r)
        if self.controller is not None:
            # Under async scheduling a step's time runs from the previous commit, not from
            # when it was scheduled (it waited behind the step before it).
            started = max(started, self._last_commit)
            self.controller.observe_step(now - started, out.num_scheduled_tokens, len(out.scheduled), first_token, done)
            self._last_commit = now

    def _fail_request(self, r: Request, message: str, code: str | None = None) -> None:
        """End one request with an error (its own fault); the engine and the rest go on."""
        logger.warning("request %s failed: %s", r.request_id, message)
        r.error = message
        r.error_code = code
        self.scheduler.finish_request(r.request_id, RequestStatus.FINISHED_ERROR)
        self._on_finished(r)

    def _on_finished(self, r: Request) -> None:
        self.runner.forget(r.request_id)
        if r.structured_output is not None:
            r.structured_output.release()
            r.structured_output = None
        reason = r.finish_reason or "abort"
        self.stats.finished_by_reason[reason] = self.stats.finished_by_reason.get(reason, 0) + 1

    def _collect(self, parent_ids, finished_only: bool = False) -> list[RequestOutput]:
        outputs = []
        for pid in parent_ids:
            children = self._children.get(pid)
            if children is None or (finished_only and not all(r.is_finished for r in children)):
                continue
            o = self._output(pid, children)
            if o.finished:
                del self._children[pid]
            outputs.append(o)
        return outputs

    @staticmethod
    def _output(parent_id: str, children: list[Request]) -> RequestOutput:
        first = children[0]
        completions = [
            CompletionOutput(r.index, r.output_text, r.output_token_ids[: r.num_output_tokens - r.num_pending_tokens],
                             r.finish_reason, r.stop_reason,
                             list(r.logprobs) if r.logprobs is not None else None)
            for r in children
        ]
        failed = [r for r in children if r.error]
        return RequestOutput(
            request_id=parent_id,
            prompt=first.prompt,
            prompt_token_ids=first.prompt_token_ids,
            outputs=completions,
            finished=all(r.is_finished for r in children),
            num_cached_tokens=max(first.num_cached_tokens, 0),
            error=failed[0].error if failed else None,
            error_code=failed[0].error_code if failed else None,
            metrics=RequestMetrics(first.arrival_time, first.first_scheduled_time, first.first_token_time,
                                   max((r.finished_time or 0.0) for r in children) or None,
                                   sum(r.num_preemptions for r in children)),
            tenant=first.tenant,
        )
