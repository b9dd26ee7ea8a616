"""Engine counters for readers on other threads (metrics, ``/stats``, queue bounds).

The engine thread copies them into a frozen ``EngineSnapshot`` after each iteration; readers
only ever see a whole snapshot and never touch scheduler state.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

from deepbatch.kv_cache.manager import KVCacheStats
from deepbatch.metrics.allocator import AllocatorView, gpu_allocator_view
from deepbatch.scheduler.preemption import RECOMPUTE, SWAP

# The KV accounting and the allocator view walk every running request's blocks or the
# allocator's segments: too much to repeat on every step.
_SLOW_REFRESH_S = 1.0


@dataclass(frozen=True)
class EngineSnapshot:
    """Engine counters, copied by the engine thread after each iteration so that readers on other
    threads never touch scheduler state."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0  # tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # tokens found there
    num_preemptions: int = 0
    num_prompt_tokens: int = 0  # prompt tokens computed (prefix hits excluded, recompute included)
    num_generation_tokens: int = 0
    num_steps: int = 0
    # KV accounting (``KVCacheManager.stats``), refreshed at most once a second: it walks every
    # running request's blocks, which is too much work to repeat on every step.
    kv_stats: KVCacheStats | None = None
    kv_stats_time: float = 0.0
    # The SLO controller's report (``SLOController.report``, replaced, never mutated); None when off.
    controller: Mapping | None = None
    # Preemptions by mode (they sum to num_preemptions) and the host swap pool.
    num_preemptions_swap: int = 0
    num_preemptions_recompute: int = 0
    num_swapped: int = 0  # preempted requests whose KV waits in the host swap space
    swap_blocks_total: int = 0
    swap_free_blocks: int = 0
    # The GPU caching allocator (None without CUDA), refreshed with kv_stats.
    allocator: AllocatorView | None = None
    # Speculative decoding (EngineStats' spec_* counters); None when it is off.
    spec_decode: tuple[int, int, int, tuple[int, ...]] | None = None


def take_snapshot(engine, previous: EngineSnapshot, refresh: bool = False) -> EngineSnapshot:
    """The engine's counters now (call on the engine thread); the slow parts are carried over
    from ``previous`` until they are ``_SLOW_REFRESH_S`` old, or ``refresh`` asks for them (an
    engine going idle publishes no later snapshot, so its last one must be current)."""
    now = time.monotonic()
    kv_stats, kv_time, allocator = previous.kv_stats, previous.kv_stats_time, previous.allocator
    if refresh or kv_stats is None or now - kv_time >= _SLOW_REFRESH_S:
        kv_stats, kv_time = engine.kv_cache.stats(engine.scheduler.running), now
        allocator = gpu_allocator_view()
    scheduler, kv, stats = engine.scheduler, engine.kv_cache, engine.stats
    preemptor = scheduler.preemptor
    host = preemptor.host_pool
    return EngineSnapshot(
        kv_stats=kv_stats, kv_stats_time=kv_time, allocator=allocator,
        num_preemptions_swap=preemptor.num_preemptions_by_mode[SWAP],
        num_preemptions_recompute=preemptor.num_preemptions_by_mode[RECOMPUTE], num_swapped=preemptor.num_swapped,
        swap_blocks_total=host.num_blocks if host else 0, swap_free_blocks=host.num_free_blocks if host else 0,
        num_running=scheduler.num_running, num_waiting=scheduler.num_waiting,
        kv_cache_usage=kv.usage(), prefix_cache_queries=kv.num_queried_tokens, prefix_cache_hits=kv.num_hit_tokens,
        num_preemptions=scheduler.num_preemptions, num_prompt_tokens=stats.num_prompt_tokens,
        num_generation_tokens=stats.num_generation_tokens, num_steps=stats.num_steps,
        controller=getattr(getattr(engine, "controller", None), "report", None),
        spec_decode=(stats.spec_num_drafts, stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens,
                     tuple(stats.spec_accepted_per_position)) if getattr(engine, "proposer", None) else None,
    )


def waiting_tokens(engine) -> int:
    """Prompt tokens (and recomputed output) the waiting requests still have to prefill."""
    return sum(r.num_tokens - r.num_computed_tokens for r in getattr(engine.scheduler, "waiting", ()))


def cache_config_info(llm_engine) -> dict[str, str] | None:
    """The labels of ``vllm:cache_config_info``: the KV cache's settings, with vLLM's label names
    and ``str()`` values, and the block counts found at start-up. None for an engine without an
    ``EngineConfig``."""
    config = getattr(llm_engine, "config", None)
    if config is None:
        return None
    cache = config.cache
    host_pool = llm_engine.scheduler.preemptor.host_pool
    info = {
        "block_size": cache.block_size,
        "cache_dtype": cache.kv_cache_dtype,
        "enable_prefix_caching": cache.enable_prefix_caching,
        "gpu_memory_utilization": cache.gpu_memory_utilization,
        "num_gpu_blocks": llm_engine.num_blocks,
        "num_gpu_blocks_override": cache.num_gpu_blocks_override,
        "num_cpu_blocks": host_pool.num_blocks if host_pool is not None else 0,
        "swap_space": cache.swap_space,
    }
    return {name: str(value) for name, value in info.items()}
