"""What a throughput run did to memory: preemptions by mode, KV accounting sampled during the
run and at its end, the swap space and its cost model, and the GPU allocator view at the end.

    sampler = KVSampler(engine)        # wraps engine.step for the run
    ... run ...
    report = sampler.finish()          # restores engine.step; returns the "memory" dict
"""

from __future__ import annotations

from dataclasses import asdict

from deepbatch.metrics.allocator import gpu_allocator_view
from deepbatch.scheduler.preemption import RECOMPUTE, SWAP


class KVSampler:
    """Samples ``KVCacheManager.stats`` every ``every`` engine steps (the stats walk every running
    request's blocks, too slow for every step of a timed run) and counts preemptions by mode from
    the moment it is created."""

    def __init__(self, engine, every: int = 8):
        self.engine = engine
        self.every = every
        self.samples: list = []
        self._steps = 0
        self.peak_running = 0
        self.held_tokens_per_seq: list[float] = []  # KV tokens the running sequences hold, per sequence
        self._modes0 = dict(engine.scheduler.preemptor.num_preemptions_by_mode)
        self._step = engine.step

        def step(*args, **kwargs):
            out = self._step(*args, **kwargs)
            self._steps += 1
            running = engine.scheduler.running
            self.peak_running = max(self.peak_running, len(running))
            if self._steps % self.every == 0:
                stats = engine.kv_cache.stats(running)
                self.samples.append(stats)
                if running:
                    bs = engine.config.cache.block_size
                    self.held_tokens_per_seq.append(stats.used_blocks * bs / len(running))
            return out

        engine.step = step

    def finish(self) -> dict:
        engine = self.engine
        del engine.step  # back to the class's method
        preemptor = engine.scheduler.preemptor
        modes = {m: preemptor.num_preemptions_by_mode[m] - self._modes0[m] for m in (SWAP, RECOMPUTE)}
        busy = [s for s in self.samples if s.used_blocks]
        peak = max(busy, key=lambda s: s.token_usage, default=None)
        alloc = gpu_allocator_view()
        cost = preemptor.cost_model
        return {
            "preemptions_swap": modes[SWAP],
            "preemptions_recompute": modes[RECOMPUTE],
            "kv_samples": len(self.samples),
            "peak_running": self.peak_running,
            # Blocks in use (prefix-cache hits shared between sequences count once) per running sequence.
            "kv_tokens_held_per_seq_mean": (sum(self.held_tokens_per_seq) / len(self.held_tokens_per_seq)
                                            if self.held_tokens_per_seq else 0.0),
            "kv_tokens_held_per_seq_max": max(self.held_tokens_per_seq, default=0.0),
            "kv_peak": asdict(peak) if peak else None,
            "kv_mean_token_usage": sum(s.token_usage for s in busy) / len(busy) if busy else 0.0,
            "kv_mean_internal_fragmentation": sum(s.internal_fragmentation for s in busy) / len(busy) if busy else 0.0,
            "kv_final": asdict(engine.kv_cache.stats(engine.scheduler.running)),
            "swap": None if cost is None else {
                "host_blocks": preemptor.host_pool.num_blocks, "mode": preemptor.mode,
                "prefill_tokens_per_s": cost.prefill_tokens_per_s, "host_link_bytes_per_s": cost.host_link_bytes_per_s,
                "kv_bytes_per_block": cost.kv_bytes_per_block},
            "gpu_allocator": alloc.as_dict() if alloc is not None else None,
        }


def format_memory(mem: dict) -> str:
    lines = [f"preemptions by mode: swap {mem['preemptions_swap']}, recompute {mem['preemptions_recompute']}"]
    peak = mem["kv_peak"]
    if peak:
        lines.append(f"KV (sampled every few steps): peak token usage {100 * peak['token_usage']:.1f}% "
                     f"(internal fragmentation {100 * peak['internal_fragmentation']:.1f}% there); mean token usage "
                     f"{100 * mem['kv_mean_token_usage']:.1f}%, mean internal fragmentation "
                     f"{100 * mem['kv_mean_internal_fragmentation']:.1f}%")
    fin = mem["kv_final"]
    lines.append(f"peak running sequences {mem['peak_running']}; KV tokens held per running sequence "
                 f"{mem['kv_tokens_held_per_seq_mean']:,.0f} mean, {mem['kv_tokens_held_per_seq_max']:,.0f} max")
    lines.append(f"KV at the end: {fin['used_blocks']} used / {fin['free_blocks']} free blocks "
                 f"({fin['cached_free_blocks']} prefix-only), token usage {100 * fin['token_usage']:.1f}%")
    sw = mem["swap"]
    if sw:
        lines.append(f"swap space: {sw['host_blocks']} host blocks, mode {sw['mode']}; cost model prefill "
                     f"{sw['prefill_tokens_per_s']:.0f} tok/s, host link {sw['host_link_bytes_per_s'] / 1e9:.2f} GB/s")
    a = mem["gpu_allocator"]
    if a:
        lines.append(f"GPU allocator at the end: reserved {a['reserved_bytes'] / 2**30:.2f} GiB, allocated "
                     f"{a['allocated_bytes'] / 2**30:.2f} GiB, largest free segment "
                     f"{a['largest_free_segment_bytes'] / 2**20:.1f} MiB, fragmentation {a['fragmentation_ratio']:.3f}")
    return "\n".join(lines)
