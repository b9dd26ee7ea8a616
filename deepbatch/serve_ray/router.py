"""``PrefixAwareRouter``: Ray Serve's request-router extension point, deciding with a
``PrefixIndex`` (see prefix_index.py for the policy).

Ray runs one router per deployment handle, in the process that holds the handle (the ingress),
so each ingress replica keeps its own picture of the engine replicas. The picture is fed by
the requests this router sends (``on_request_routed``) and bounded by each replica's KV blocks
from its routing stats (``EngineReplica.record_routing_stats``); the load is Serve's own count
of requests in flight per replica. Ray's ``PrefixCacheAffinityRouter`` matches prompt text in a
shared tree actor; this one matches the engine's own block hashes, which the ingress computes
anyway, with no actor call on the routing path.
"""

from __future__ import annotations

from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from deepbatch.serve_ray.prefix_index import PrefixIndex


def _routing_key(pending_request: PendingRequest | None) -> tuple[list[int], str | None]:
    """The block hashes and tenant of an ``EngineCall`` (empty for any other call)."""
    if pending_request is None or not pending_request.args:
        return [], None
    call: Any = pending_request.args[0]
    return list(getattr(call, "block_hashes", ()) or ()), getattr(call, "session", None)


class PrefixAwareRouter(RequestRouter):
    def initialize_state(self, imbalance_margin: int = 8, session_affinity: bool = True, **kwargs) -> None:
        if kwargs:
            raise ValueError(f"PrefixAwareRouter: unknown option(s) {', '.join(sorted(kwargs))}")
        self.index = PrefixIndex(imbalance_margin=imbalance_margin, session_affinity=session_affinity)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        hashes, tenant = _routing_key(pending_request)
        by_id = {r.replica_id: r for r in candidate_replicas}
        loads = {}
        for rid, replica in by_id.items():
            loads[rid] = self.replica_queue_len_cache.get(rid)
            blocks = (replica.routing_stats or {}).get("kv_blocks")
            if isinstance(blocks, int):
                self.index.set_capacity(rid, blocks)
        ranks = self.index.rank(list(by_id), hashes, loads, tenant)
        return [[by_id[rid] for rid in rank] for rank in ranks]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        hashes, tenant = _routing_key(pending_request)
        if hashes or tenant is not None:
            self.index.record(replica_id, hashes, tenant)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.index.remove(replica_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self.index.retain(r.replica_id for r in replicas)
