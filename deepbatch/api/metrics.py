"""Prometheus metrics with vLLM's names and meanings, plus the periodic stats log line.

Two sources:
- engine state (running, waiting, KV usage, prefix cache, preemptions) is read at scrape time
  from the engine thread's published ``EngineSnapshot``; nothing here touches the scheduler;
- per-request metrics (token counters, request_success, latency histograms) are observed on the
  engine thread from every ``RequestOutput``, so they count exactly what clients are sent:
  prompt_tokens adds a request's prompt length once, when its first token is out (prefix hits
  included, as in vLLM); generation_tokens adds every token of every choice.

A request's phases split its end-to-end latency exactly (engine timestamps, monotonic):

    arrival --queue--> first scheduled --prefill--> first token --decode--> finished
    e2e = queue + prefill + decode;  time to first token = queue + prefill

The per-request histograms (prompt and generation tokens, e2e, queue, prefill, decode) count a
request once when it finishes, its n choices together; a phase it never reached is not observed.
No ``*_created`` series (vLLM turns them off too): each would be one more series per counter and
histogram, for a timestamp that dashboards do not read.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import asdict, dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector

from deepbatch.engine.engine_client import EngineClient
from deepbatch.engine.snapshot import EngineSnapshot
from deepbatch.core.outputs import RequestOutput

logger = logging.getLogger("deepbatch.stats")
MAX_TENANT_LABELS = 100

disable_created_metrics()

# vLLM's bucket boundaries, so dashboards built for vLLM read the same.
_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
_ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0]
_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                    240.0, 480.0, 960.0, 1920.0, 7680.0]
_ITERATION_TOKEN_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]


def token_count_buckets(max_model_len: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_model_len`` (vLLM's request-size buckets)."""
    buckets, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return buckets
            buckets.append(m * scale)
        scale *= 10


class _EngineCollector:
    """Gauges and engine-owned counters, computed from the snapshot when scraped."""

    def __init__(self, engine: EngineClient, model_name: str):
        self.engine = engine
        self.model_name = model_name

    def collect(self):
        snap: EngineSnapshot = self.engine.snapshot()
        labels = [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(labels, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric(labels, value)
            return c

        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.", snap.num_running)
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", snap.num_waiting)
        yield gauge("vllm:num_requests_swapped", "Number of requests swapped to CPU.", snap.num_swapped)
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", snap.kv_cache_usage)
        yield counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                      snap.prefix_cache_queries)
        yield counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                      snap.prefix_cache_hits)
        yield counter("vllm:num_preemptions", "Cumulative number of preemptions from the engine.",
                      snap.num_preemptions)
        kv = snap.kv_stats
        if kv is not None:
            yield gauge("deepbatch:kv_cache_token_usage_perc",
                        "KV slots holding a token (running requests, shared blocks once, plus prefix-cache-only "
                        "blocks) over all slots.", kv.token_usage)
            yield gauge("deepbatch:kv_cache_internal_fragmentation_perc",
                        "Allocated KV slots holding no token over allocated slots.", kv.internal_fragmentation)
            yield gauge("deepbatch:kv_cache_free_blocks", "Free KV blocks (including prefix-cache-only ones).",
                        kv.free_blocks)
            yield gauge("deepbatch:kv_cache_prefix_only_blocks",
                        "Free KV blocks that still hold reusable prefix-cache KV.", kv.cached_free_blocks)
            yield gauge("deepbatch:kv_cache_blocks_total", "KV blocks in the pool.", kv.num_blocks)
        ctl = snap.controller
        if ctl is not None:
            yield gauge("deepbatch:controller_max_num_seqs", "max_num_seqs set by the SLO controller.",
                        ctl["settings"]["max_num_seqs"])
            yield gauge("deepbatch:controller_max_num_batched_tokens",
                        "max_num_batched_tokens (and prefill chunk bound) set by the SLO controller.",
                        ctl["settings"]["max_num_batched_tokens"])
        by_mode = CounterMetricFamily("deepbatch:num_preemptions", "Preemptions by mode (swap or recompute); they "
                                      "sum to vllm:num_preemptions.", labels=["model_name", "mode"])
        by_mode.add_metric([self.model_name, "swap"], snap.num_preemptions_swap)
        by_mode.add_metric([self.model_name, "recompute"], snap.num_preemptions_recompute)
        yield by_mode
        if snap.swap_blocks_total:
            yield gauge("deepbatch:swap_space_blocks_total", "KV blocks the host swap space holds.",
                        snap.swap_blocks_total)
            yield gauge("deepbatch:swap_space_free_blocks", "Free KV blocks in the host swap space.",
                        snap.swap_free_blocks)
        if snap.spec_decode is not None:
            drafts, draft_tokens, accepted, per_position = snap.spec_decode
            yield counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", drafts)
            yield counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", draft_tokens)
            yield counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", accepted)
            by_position = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                              "Accepted tokens per draft position.", labels=["model_name", "position"])
            for j, n in enumerate(per_position):
                by_position.add_metric([self.model_name, str(j)], n)
            yield by_position
        alloc = snap.allocator
        if alloc is not None:  # only where this process uses CUDA
            yield gauge("deepbatch:gpu_memory_reserved_bytes", "Device memory the caching allocator holds.",
                        alloc.reserved_bytes)
            yield gauge("deepbatch:gpu_memory_allocated_bytes", "Device memory held by live tensors.",
                        alloc.allocated_bytes)
            yield gauge("deepbatch:gpu_memory_largest_free_segment_bytes",
                        "Largest free block inside the allocator's reserved segments.",
                        alloc.largest_free_segment_bytes)
            yield gauge("deepbatch:gpu_memory_fragmentation_ratio", "1 - allocated / reserved device memory.",
                        alloc.fragmentation_ratio)


def engine_stats(snap: EngineSnapshot) -> dict:
    """The JSON of ``GET /stats``: queue, KV accounting, preemptions by mode, swap space and the
    GPU allocator view (null without CUDA)."""
    kv = snap.kv_stats
    return {
        "num_requests_running": snap.num_running,
        "num_requests_waiting": snap.num_waiting,
        "num_requests_swapped": snap.num_swapped,
        "kv_cache_usage": snap.kv_cache_usage,
        "kv_cache": asdict(kv) if kv is not None else None,
        "num_preemptions": {"total": snap.num_preemptions, "swap": snap.num_preemptions_swap,
                            "recompute": snap.num_preemptions_recompute},
        "swap_space": {"blocks_total": snap.swap_blocks_total, "free_blocks": snap.swap_free_blocks},
        "gpu_allocator": snap.allocator.as_dict() if snap.allocator is not None else None,
        "prefix_cache": {"queried_tokens": snap.prefix_cache_queries, "hit_tokens": snap.prefix_cache_hits},
        "spec_decode": _spec_decode_stats(snap.spec_decode),
    }


def _spec_decode_stats(counters: tuple[int, int, int, tuple[int, ...]] | None) -> dict | None:
    """Speculative decoding's counters (null when it is off), with vLLM's two derived figures:
    the acceptance rate (accepted over draft tokens) and the mean acceptance length (1 + accepted
    over drafts: the tokens a drafting request gains per step)."""
    if counters is None:
        return None
    drafts, draft_tokens, accepted, per_position = counters
    return {"num_drafts": drafts, "num_draft_tokens": draft_tokens, "num_accepted_tokens": accepted,
            "accepted_per_position": list(per_position),
            "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else None}


@dataclass
class _Progress:
    """Bookkeeping of one request between outputs."""

    started: bool = False
    tokens: dict[int, int] = field(default_factory=dict)  # choice index -> tokens seen
    last_token_time: dict[int, float] = field(default_factory=dict)


class ServerMetrics:
    def __init__(self, engine: EngineClient, model_name: str, *, max_model_len: int = 1 << 20,
                 cache_info: dict[str, str] | None = None):
        """``max_model_len`` bounds the request-size buckets (the server passes the engine's);
        ``cache_info``: the labels of ``vllm:cache_config_info`` (none without it)."""
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        reg = self.registry
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", labels,
                                     registry=reg).labels(model_name)
        self.generation_tokens = Counter("vllm:generation_tokens", "Number of generation tokens processed.",
                                         labels, registry=reg).labels(model_name)
        self._success = Counter("vllm:request_success", "Count of successfully processed requests.",
                                labels + ["finished_reason"], registry=reg)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              labels, buckets=_TTFT_BUCKETS, registry=reg).labels(model_name)
        itl = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                        labels, buckets=_ITL_BUCKETS, registry=reg)
        self.itl = itl.labels(model_name)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             labels, buckets=_LATENCY_BUCKETS, registry=reg).labels(model_name)
        self.queue_time = Histogram("vllm:request_queue_time_seconds",
                                    "Histogram of time spent in WAITING phase for request.", labels,
                                    buckets=_LATENCY_BUCKETS, registry=reg).labels(model_name)
        self.prefill_time = Histogram("vllm:request_prefill_time_seconds",
                                      "Histogram of time spent in PREFILL phase for request.", labels,
                                      buckets=_LATENCY_BUCKETS, registry=reg).labels(model_name)
        self.decode_time = Histogram("vllm:request_decode_time_seconds",
                                     "Histogram of time spent in DECODE phase for request.", labels,
                                     buckets=_LATENCY_BUCKETS, registry=reg).labels(model_name)
        sizes = token_count_buckets(max_model_len)
        self.request_prompt_tokens = Histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                                               labels, buckets=sizes, registry=reg).labels(model_name)
        self.request_generation_tokens = Histogram("vllm:request_generation_tokens",
                                                   "Number of generation tokens processed.", labels, buckets=sizes,
                                                   registry=reg).labels(model_name)
        self.iteration_tokens = Histogram("vllm:iteration_tokens_total",
                                          "Histogram of number of tokens per engine_step.", labels,
                                          buckets=_ITERATION_TOKEN_BUCKETS, registry=reg).labels(model_name)
        if cache_info is not None:
            # An info metric as vLLM writes it: a gauge fixed at 1 whose labels are the values.
            Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", sorted(cache_info),
                  registry=reg, multiprocess_mode="mostrecent").labels(**cache_info).set(1)
        tl = labels + ["tenant"]
        self._tenant_requests = Counter("deepbatch:tenant_requests", "Finished requests per tenant.", tl, registry=reg)
        self._tenant_tokens = Counter("deepbatch:tenant_generation_tokens", "Generated tokens per tenant.", tl,
                                      registry=reg)
        self._tenant_ttft = Histogram("deepbatch:tenant_time_to_first_token_seconds", "Time to first token per tenant.",
                                      tl, buckets=_TTFT_BUCKETS, registry=reg)
        self._tenants: set[str] = set()
        self._tenant_children: dict[str, _TenantSeries] = {}  # tenant -> its label children
        self._success_children: dict[str, object] = {}  # finish reason -> its counter child
        self.model_name = model_name
        # Several API processes (--api-server-count) write their series to prometheus_client's
        # multiprocess directory, and each scrape sums them from there instead of this registry.
        multiprocess_dir = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        if multiprocess_dir:
            self._render_registry = CollectorRegistry()
            self._render_registry.register(_MergedProcesses(multiprocess_dir))
        else:
            self._render_registry = reg
            # The same intervals as inter_token_latency, under the older name dashboards still read.
            reg.register(_RenamedHistogram(itl.collect, _ITL_ALIAS, _ITL_ALIAS_DOC))
        self._render_registry.register(_EngineCollector(engine, model_name))
        self._progress: dict[str, _Progress] = {}
        engine.add_observer(self.observe)

    def _tenant_label(self, tenant: str) -> str:
        # Tenants come from a client-chosen field: cap the label set so no client can grow the
        # metrics without bound.
        if tenant in self._tenants or len(self._tenants) < MAX_TENANT_LABELS:
            self._tenants.add(tenant)
            return tenant
        return "other"

    def render(self) -> bytes:
        return generate_latest(self._render_registry)

    def _tenant_series(self, tenant: str) -> _TenantSeries:
        series = self._tenant_children.get(tenant)
        if series is None:  # labels() costs a lock and a tuple per call: once per tenant
            label = self._tenant_label(tenant)
            series = self._tenant_children[tenant] = _TenantSeries(
                self._tenant_tokens.labels(self.model_name, label), self._tenant_ttft.labels(self.model_name, label),
                self._tenant_requests.labels(self.model_name, label))
        return series

    def observe(self, outputs: list[RequestOutput]) -> None:
        """Runs after each engine iteration, with the outputs of the requests it advanced."""
        now = time.monotonic()
        # vLLM's tokens per engine step: the new tokens, plus the whole prompt of each request
        # whose first token is among them.
        step_tokens = 0
        new_tokens = 0
        itl = self.itl.observe
        for out in outputs:
            p = self._progress.get(out.request_id)
            if p is None:
                p = self._progress[out.request_id] = _Progress()
            m = out.metrics
            series = None
            for c in out.outputs:
                seen = p.tokens.get(c.index, 0)
                new = len(c.token_ids) - seen
                if new <= 0:
                    continue
                series = series or self._tenant_series(out.tenant)
                if not p.started:
                    p.started = True
                    self.prompt_tokens.inc(len(out.prompt_token_ids))
                    step_tokens += len(out.prompt_token_ids)
                    if m is not None:
                        ttft = max((m.first_token_time or now) - m.arrival_time, 0.0)
                        self.ttft.observe(ttft)
                        series.ttft.observe(ttft)
                series.tokens.inc(new)
                last = p.last_token_time.get(c.index)
                if seen and last is not None:
                    # One step can add several tokens to a choice only after coalescing; spread the gap.
                    gap = (now - last) / new
                    for _ in range(new):
                        itl(gap)  # time_per_output_token_seconds reports the same series
                p.tokens[c.index] = len(c.token_ids)
                p.last_token_time[c.index] = now
                new_tokens += new
            if out.finished:
                self._progress.pop(out.request_id, None)
                self._tenant_series(out.tenant).requests.inc()
                for c in out.outputs:
                    reason = c.finish_reason or "abort"
                    success = self._success_children.get(reason)
                    if success is None:
                        success = self._success_children[reason] = self._success.labels(self.model_name, reason)
                    success.inc()
                self.request_prompt_tokens.observe(len(out.prompt_token_ids))
                self.request_generation_tokens.observe(sum(len(c.token_ids) for c in out.outputs))
                if m is not None:
                    finished = m.finished_time or now
                    self.e2e.observe(max(finished - m.arrival_time, 0.0))
                    if m.first_scheduled_time is not None:
                        self.queue_time.observe(max(m.first_scheduled_time - m.arrival_time, 0.0))
                        if m.first_token_time is not None:
                            self.prefill_time.observe(max(m.first_token_time - m.first_scheduled_time, 0.0))
                            self.decode_time.observe(max(finished - m.first_token_time, 0.0))
        if new_tokens:
            self.generation_tokens.inc(new_tokens)
        step_tokens += new_tokens
        if step_tokens:
            self.iteration_tokens.observe(step_tokens)


@dataclass
class _TenantSeries:
    tokens: object
    ttft: object
    requests: object


_ITL_ALIAS = "vllm:time_per_output_token_seconds"
_ITL_ALIAS_DOC = "Histogram of time per output token in seconds."


def _renamed(family, name: str, documentation: str) -> HistogramMetricFamily:
    renamed = HistogramMetricFamily(name, documentation)
    renamed.samples = [s._replace(name=name + s.name[len(family.name):]) for s in family.samples]
    return renamed


class _RenamedHistogram:
    """A histogram's samples under a second name: ``vllm:time_per_output_token_seconds`` is the
    series of ``vllm:inter_token_latency_seconds`` under the name older dashboards read, so each
    interval is observed once, not twice."""

    def __init__(self, collect, name: str, documentation: str):
        self._collect, self._name, self._doc = collect, name, documentation

    def collect(self):
        for family in self._collect():
            yield _renamed(family, self._name, self._doc)


class _MergedProcesses:
    """Every API process's series from the multiprocess directory, summed (``vllm:cache_config_info``:
    the most recent), with the inter-token histogram also under its older name."""

    def __init__(self, path: str):
        self._source = MultiProcessCollector(None, path)

    def collect(self):
        for family in self._source.collect():
            yield family
            if family.name == "vllm:inter_token_latency_seconds":
                yield _renamed(family, _ITL_ALIAS, _ITL_ALIAS_DOC)


async def log_stats_periodically(engine: EngineClient, interval: float) -> None:
    """One line every ``interval`` seconds while the engine is busy (vLLM's format)."""
    last, last_t = engine.snapshot(), time.monotonic()
    while True:
        await asyncio.sleep(interval)
        snap, now = engine.snapshot(), time.monotonic()
        busy = snap.num_steps != last.num_steps or snap.num_running or snap.num_waiting
        if busy:
            dt = max(now - last_t, 1e-9)
            queries = snap.prefix_cache_queries - last.prefix_cache_queries
            hits = snap.prefix_cache_hits - last.prefix_cache_hits
            logger.info(
                "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
                "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%",
                (snap.num_prompt_tokens - last.num_prompt_tokens) / dt,
                (snap.num_generation_tokens - last.num_generation_tokens) / dt,
                snap.num_running, snap.num_waiting, 100.0 * snap.kv_cache_usage,
                100.0 * hits / queries if queries else 0.0,
            )
        last, last_t = snap, now
