"""Scheduling policies: they order the queues and set limits; the token-budget loop stays one.

A policy gives every request a sort key. The scheduler serves running requests in key order,
preempts from the end of that order, and admits waiting requests in key order. Keys:

- ``fcfs``:     arrival time.
- ``priority``: (priority, arrival); lower priority values first. A waiting request ages: every
                ``priority_aging_s`` seconds of waiting improves its effective priority by one,
                so nothing starves. Priority preempts: a waiting request that sorts before the
                last running one takes its seat or its blocks, and one that sorts before a
                running prefill takes that prefill's share of the step's token budget.
- ``fair``:     (tenant's virtual token count, arrival). Each scheduled token advances its
                tenant's counter, so the tenant that has received the least service goes next;
                tenants share the batch equally while both have work (max-min fairness).
"""

from __future__ import annotations

from collections import deque

from deepbatch.config import SchedulerConfig
from deepbatch.core.request import Request


class Policy:
    name = "fcfs"
    # True when ``key`` and ``victim_key`` are one rank over both queues, so a waiting request may
    # outrank running ones: it then takes their seat, their blocks or their prefill budget.
    preemptive = False

    def __init__(self, config: SchedulerConfig):
        self.config = config
        # Per-tenant accounting for the limits every policy enforces.
        self.running_per_tenant: dict[str, int] = {}
        self._token_log: dict[str, deque[tuple[float, int]]] = {}

    def key(self, request: Request, now: float) -> tuple:
        return (request.arrival_time,)

    def victim_key(self, request: Request, now: float) -> tuple:
        """Running order; the last one is preempted first (lowest priority, latest arrival)."""
        return (request.priority, request.arrival_time)

    # -- limits ------------------------------------------------------------------------------

    def admissible(self, request: Request, now: float) -> bool:
        cfg = self.config
        running = self.running_per_tenant.get(request.tenant, 0)
        if cfg.tenant_max_running is not None and running >= cfg.tenant_max_running:
            return False
        if cfg.tenant_max_tokens_per_minute is not None:
            if self.tokens_last_minute(request.tenant, now) >= cfg.tenant_max_tokens_per_minute:
                return False
        return True

    def tokens_last_minute(self, tenant: str, now: float) -> int:
        log = self._token_log.get(tenant)
        if not log:
            return 0
        while log and log[0][0] < now - 60.0:
            log.popleft()
        return sum(n for _, n in log)

    # -- accounting --------------------------------------------------------------------------

    def on_admitted(self, request: Request) -> None:
        self.running_per_tenant[request.tenant] = self.running_per_tenant.get(request.tenant, 0) + 1

    def on_released(self, request: Request) -> None:
        """The request left the running set (finished or preempted)."""
        n = self.running_per_tenant.get(request.tenant, 0) - 1
        if n > 0:
            self.running_per_tenant[request.tenant] = n
        else:
            self.running_per_tenant.pop(request.tenant, None)

    def on_scheduled(self, request: Request, num_tokens: int, now: float) -> None:
        if self.config.tenant_max_tokens_per_minute is not None:
            self._token_log.setdefault(request.tenant, deque()).append((now, num_tokens))

    def on_arrival(self, request: Request, active_tenants: set[str]) -> None:
        pass


class PriorityPolicy(Policy):
    name = "priority"
    preemptive = True

    def _effective(self, request: Request, now: float) -> float:
        aging = self.config.priority_aging_s
        if not aging:
            return request.priority
        return request.priority - int((now - request.arrival_time) / aging)

    def key(self, request: Request, now: float) -> tuple:
        return (self._effective(request, now), request.arrival_time)

    def victim_key(self, request: Request, now: float) -> tuple:
        return self.key(request, now)


class FairSharePolicy(Policy):
    name = "fair"

    def __init__(self, config: SchedulerConfig):
        super().__init__(config)
        self.virtual_tokens: dict[str, float] = {}

    def key(self, request: Request, now: float) -> tuple:
        return (self.virtual_tokens.get(request.tenant, 0.0), request.arrival_time)

    def victim_key(self, request: Request, now: float) -> tuple:
        return self.key(request, now)

    def on_arrival(self, request: Request, active_tenants: set[str]) -> None:
        # A tenant coming back from idle starts level with the least-served active tenant, so
        # idle time is not banked as credit to starve others later.
        t = request.tenant
        if t in active_tenants:
            return
        floor = min((self.virtual_tokens.get(a, 0.0) for a in active_tenants), default=0.0)
        self.virtual_tokens[t] = max(self.virtual_tokens.get(t, 0.0), floor)

    def on_scheduled(self, request: Request, num_tokens: int, now: float) -> None:
        super().on_scheduled(request, num_tokens, now)
        self.virtual_tokens[request.tenant] = self.virtual_tokens.get(request.tenant, 0.0) + num_tokens


POLICIES = {"fcfs": Policy, "priority": PriorityPolicy, "fair": FairSharePolicy}


def make_policy(config: SchedulerConfig) -> Policy:
    return POLICIES[config.policy](config)

