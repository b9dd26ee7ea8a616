"""The router's picture of which replica holds which prompt prefix, and the choice it makes.

Prompts are seen as the engine's prefix cache sees them: chained hashes of full KV blocks
(``deepbatch.kv_cache.manager.hash_block``), so block i's hash names the whole prefix up to it.
Per replica the index keeps the hashes of the prompts routed there, least recently used first,
bounded by that replica's KV blocks (what its cache can hold at most), so a prefix the engine
must have evicted ages out of the picture too.

Choice, for a request with block hashes h[0..n):
1. the replica whose picture matches the longest run h[0..k) (k >= 1) wins, ties to the less
   loaded; with no match, the tenant's last replica (a session sticks);
2. unless that replica has more than ``imbalance_margin`` requests in flight beyond the least
   loaded one: then load decides, and the busy replica is the last resort;
3. with no winner, every replica is a candidate: first those within the margin of the least
   loaded, the one holding the fewest blocks first (new prefixes spread over the replicas'
   caches instead of piling up on one), then the rest by load.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import TypeVar

from deepbatch.kv_cache.manager import _ROOT_HASH, hash_block

R = TypeVar("R", bound=Hashable)

# Before a replica has reported its KV blocks; large enough never to forget a live prefix.
DEFAULT_CAPACITY_BLOCKS = 1 << 20
MAX_SESSIONS = 100_000


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """The chained hashes of the full blocks of ``token_ids``, as the engine's prefix cache
    computes them."""
    hashes: list[int] = []
    parent = _ROOT_HASH
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, tuple(token_ids[start:start + block_size]))
        hashes.append(parent)
    return hashes


class PrefixIndex:
    def __init__(self, imbalance_margin: int = 8, session_affinity: bool = True, rng: random.Random | None = None):
        self.imbalance_margin = imbalance_margin
        self.session_affinity = session_affinity
        self._blocks: dict[Hashable, OrderedDict[int, None]] = {}
        self._capacity: dict[Hashable, int] = {}
        self._sessions: OrderedDict[str, Hashable] = OrderedDict()
        self._rng = rng or random.Random()

    def num_blocks(self, replica: Hashable) -> int:
        blocks = self._blocks.get(replica)
        return len(blocks) if blocks is not None else 0

    def set_capacity(self, replica: Hashable, num_blocks: int) -> None:
        self._capacity[replica] = max(1, num_blocks)
        self._evict(replica)

    def match(self, replica: Hashable, hashes: Sequence[int]) -> int:
        """How many leading blocks of the prompt the replica is thought to hold."""
        blocks = self._blocks.get(replica)
        if not blocks:
            return 0
        n = 0
        for h in hashes:
            if h not in blocks:
                break
            n += 1
        return n

    def record(self, replica: Hashable, hashes: Sequence[int], tenant: str | None = None) -> None:
        """The prompt was routed to ``replica``: its blocks are there now (or soon)."""
        blocks = self._blocks.setdefault(replica, OrderedDict())
        for h in hashes:
            blocks[h] = None
            blocks.move_to_end(h)
        self._evict(replica)
        if tenant is not None and self.session_affinity:
            self._sessions[tenant] = replica
            self._sessions.move_to_end(tenant)
            if len(self._sessions) > MAX_SESSIONS:
                self._sessions.popitem(last=False)

    def remove(self, replica: Hashable) -> None:
        self._blocks.pop(replica, None)
        self._capacity.pop(replica, None)
        for tenant in [t for t, r in self._sessions.items() if r == replica]:
            del self._sessions[tenant]

    def retain(self, replicas) -> None:
        """Forget replicas that are gone."""
        live = set(replicas)
        for replica in [r for r in self._blocks if r not in live]:
            self.remove(replica)

    def _evict(self, replica: Hashable) -> None:
        blocks = self._blocks.get(replica)
        if blocks is None:
            return
        capacity = self._capacity.get(replica, DEFAULT_CAPACITY_BLOCKS)
        while len(blocks) > capacity:
            blocks.popitem(last=False)

    def rank(self, candidates: Sequence[R], hashes: Sequence[int], loads: dict[R, int | None],
             tenant: str | None = None) -> list[list[R]]:
        """Candidates in ranks of one, most preferred first (Ray Serve's ``choose_replicas``
        shape: the first rank whose replica has room gets the request). ``loads`` are requests
        in flight; None where unknown."""
        if not candidates:
            return []

        def load(r: R) -> int:
            value = loads.get(r)
            return 0 if value is None else value

        # Shuffled first, so that the stable sorts leave equals in random order.
        shuffled = list(candidates)
        self._rng.shuffle(shuffled)
        best, best_len = None, 0
        for r in sorted(shuffled, key=load):
            n = self.match(r, hashes)
            if n > best_len:
                best, best_len = r, n
        if best is None and tenant is not None and self.session_affinity:
            session = self._sessions.get(tenant)
            if session in candidates:
                best = session
        least = min(load(r) for r in shuffled)
        near = sorted((r for r in shuffled if load(r) - least <= self.imbalance_margin),
                      key=lambda r: (self.num_blocks(r), load(r)))
        order = near + sorted((r for r in shuffled if load(r) - least > self.imbalance_margin), key=load)
        if best is not None:
            order.remove(best)
            busy = loads.get(best) is not None and load(best) - least > self.imbalance_margin
            order = order + [best] if busy else [best] + order
        return [[r] for r in order]
