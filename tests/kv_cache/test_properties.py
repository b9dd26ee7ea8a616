"""Property-based tests of KVCacheManager + BlockPool, driven only through the manager's interface
(get_computed_blocks / allocate_slots / free), the way the scheduler drives them.

Prompts come from a two-token vocabulary so that requests share prefixes (and whole blocks) often,
which is where the prefix cache's reference counting can go wrong.

Besides the pool's own invariants, the machine keeps an "echo" KV cache: a dict slot -> token id
that stands in for the model's paged KV tensors. Whenever tokens are computed, their ids are
written to their slots, exactly where the model would write their K/V. If the manager ever hands
two owners the same block for different contents, or reuses a referenced block, or serves a prefix
hit whose KV was overwritten, some request's context stops reading back as its own tokens.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from deepbatch.core.request import Request
from deepbatch.core.sampling_params import SamplingParams
from deepbatch.kv_cache.manager import KVCacheManager

VOCAB = (0, 1)
ROOT_HASH = 0  # the manager's parent hash of a request's first block


def make_request(i: int, prompt: list[int], max_tokens: int = 8) -> Request:
    return Request(f"r{i}", list(prompt), SamplingParams(max_tokens=max_tokens), max_tokens, arrival_time=float(i))


class KVCacheMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.mgr: KVCacheManager | None = None
        self.live: dict[str, Request] = {}
        self.running: set[str] = set()  # live requests that hold blocks; the rest wait with none
        self.kv: dict[int, int] = {}  # echo KV: slot -> token id written there
        self.next_id = 0
        self.seen: list[list[int]] = []  # token lists of every request so far, to share prefixes

    # -- helpers -------------------------------------------------------------------------------

    @property
    def bs(self) -> int:
        return self.mgr.block_size

    def slot(self, r: Request, pos: int) -> int:
        return r.block_ids[pos // self.bs] * self.bs + pos % self.bs

    def write(self, r: Request, start: int, end: int) -> None:
        """The model computing tokens [start, end) of ``r``: their KV lands in their slots."""
        for pos in range(start, end):
            self.kv[self.slot(r, pos)] = r.all_token_ids[pos]

    def pick(self, data, ids) -> Request:
        return self.live[data.draw(st.sampled_from(sorted(ids)), label="request")]

    def waiting_ids(self) -> set[str]:
        return set(self.live) - self.running

    def schedulable(self) -> list[str]:
        # A request whose newest token is computed must first get a sampled token.
        return [i for i, r in self.live.items() if r.num_computed_tokens < r.num_tokens]

    def snapshot(self):
        pool = self.mgr.pool
        return (pool.num_free_blocks, [b.ref_cnt for b in pool.blocks], pool.num_cached_blocks)

    def schedule(self, r: Request, num_tokens: int) -> None:
        """One scheduler step for ``r``: prefix lookup when it is waiting, then allocate_slots for
        a chunk of ``num_tokens`` (capped at what it still has to compute)."""
        pool = self.mgr.pool
        hits: list[int] = []
        num_hit = 0
        waiting = r.request_id not in self.running
        if waiting:
            assert r.block_ids == [] and r.num_computed_tokens == 0
            hits, num_hit = self.mgr.get_computed_blocks(r)
            self.check_hits(r, hits, num_hit)
        num_new = min(num_tokens, r.num_tokens - r.num_computed_tokens - num_hit)
        assert num_new >= 1  # the last token is never a hit, so there is always work
        before = self.snapshot()
        free_before = {b for b in range(pool.num_blocks) if pool.is_free(b)}
        old_blocks = list(r.block_ids)

        new = self.mgr.allocate_slots(r, num_new, hits)

        if hits:
            event("prefix hit")
        if new is None:
            event("no room")
            # "No room" must change nothing: the scheduler preempts someone and retries.
            assert self.snapshot() == before
            assert r.block_ids == old_blocks
            return
        start = r.num_computed_tokens + num_hit
        # New blocks come from the free queue; hits are attached before them, in order.
        assert set(new) <= free_before
        assert r.block_ids == old_blocks + hits + new
        assert len(r.block_ids) == self.mgr.blocks_needed(start + num_new)
        r.num_computed_tokens = start + num_new
        self.running.add(r.request_id)
        self.write(r, start, start + num_new)

    def check_hits(self, r: Request, hits: list[int], num_hit: int) -> None:
        pool = self.mgr.pool
        bs = self.bs
        assert num_hit == len(hits) * bs
        assert num_hit <= r.num_tokens - 1, "the last token is never a hit"
        assert len(set(hits)) == len(hits)
        if not self.mgr.enable_caching:
            assert hits == []
        parent = ROOT_HASH
        for i, b in enumerate(hits):
            tokens = tuple(r.all_token_ids[i * bs : (i + 1) * bs])
            assert pool.blocks[b].key == (parent, tokens), "a hit must hold exactly this request's tokens"
            assert pool.blocks[b].block_hash == r.block_hashes[i]
            # And the KV really there (not just the bookkeeping) is those tokens.
            assert [self.kv.get(b * bs + j) for j in range(bs)] == list(tokens)
            parent = pool.blocks[b].block_hash
        # The hit is the longest cached prefix: the next block (if it may be a hit) is not cached.
        i = len(hits)
        if i < (r.num_tokens - 1) // bs and self.mgr.enable_caching:
            tokens = tuple(r.all_token_ids[i * bs : (i + 1) * bs])
            assert pool.lookup(r.block_hashes[i], parent, tokens) is None, "a cached block was missed"

    # -- rules ---------------------------------------------------------------------------------

    @initialize(
        num_blocks=st.integers(2, 12),
        block_size=st.sampled_from([1, 2, 4]),
        caching=st.sampled_from([True, True, True, False]),
    )
    def setup(self, num_blocks, block_size, caching):
        self.mgr = KVCacheManager(num_blocks, block_size, enable_caching=caching)

    @rule(prompt=st.lists(st.sampled_from(VOCAB), min_size=1, max_size=10))
    def add_request(self, prompt):
        r = make_request(self.next_id, prompt)
        self.live[r.request_id] = r
        self.seen.append(r.all_token_ids)  # the same list: it grows as the request decodes
        self.next_id += 1

    @precondition(lambda self: self.seen)
    @rule(data=st.data(), tail=st.lists(st.sampled_from(VOCAB), max_size=6))
    def add_request_sharing_a_prefix(self, data, tail):
        # A prefix of an earlier request's tokens (prompt and outputs): the prefix cache's case.
        tokens = data.draw(st.sampled_from(self.seen), label="earlier tokens")
        n = data.draw(st.integers(1, len(tokens)), label="prefix length")
        self.add_request(tokens[:n] + tail)

    @precondition(lambda self: self.schedulable())
    @rule(data=st.data(), chunk=st.integers(1, 8))
    def schedule_chunk(self, data, chunk):
        self.schedule(self.pick(data, self.schedulable()), chunk)

    @precondition(
        lambda self: any(
            r.num_tokens - r.num_computed_tokens == 1 for i, r in self.live.items() if i in self.running
        )
    )
    @rule(data=st.data())
    def decode(self, data):
        ids = [i for i in self.running if self.live[i].num_tokens - self.live[i].num_computed_tokens == 1]
        self.schedule(self.pick(data, ids), 1)

    @precondition(lambda self: any(self.live[i].num_computed_tokens == self.live[i].num_tokens for i in self.running))
    @rule(data=st.data(), token=st.sampled_from(VOCAB))
    def append_token(self, data, token):
        ids = [i for i in self.running if self.live[i].num_computed_tokens == self.live[i].num_tokens]
        self.pick(data, ids).append_output_token(token)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free_request(self, data):
        r = self.pick(data, self.live)
        self.mgr.free(r)
        assert r.block_ids == []
        del self.live[r.request_id]
        self.running.discard(r.request_id)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def preempt(self, data):
        # Preemption by recompute, as the scheduler does it: free and start over from token 0.
        r = self.pick(data, self.running)
        self.mgr.free(r)
        r.num_computed_tokens = 0
        self.running.discard(r.request_id)

    # -- invariants ----------------------------------------------------------------------------

    @invariant()
    def blocks_are_referenced_xor_free(self):
        if self.mgr is None:
            return
        pool = self.mgr.pool
        for b in pool.blocks:
            assert b.ref_cnt >= 0
            assert (b.ref_cnt > 0) != pool.is_free(b.block_id), f"block {b.block_id}"

    @invariant()
    def ref_cnt_counts_owners(self):
        if self.mgr is None:
            return
        owners = Counter(b for r in self.live.values() for b in r.block_ids)
        for b in self.mgr.pool.blocks:
            assert b.ref_cnt == owners[b.block_id], f"block {b.block_id}"

    @invariant()
    def no_request_holds_a_block_twice(self):
        for r in self.live.values():
            assert len(set(r.block_ids)) == len(r.block_ids), r.block_ids

    @invariant()
    def free_plus_referenced_is_everything(self):
        if self.mgr is None:
            return
        pool = self.mgr.pool
        referenced = sum(1 for b in pool.blocks if b.ref_cnt > 0)
        assert pool.num_free_blocks + referenced == pool.num_blocks

    @invariant()
    def cache_map_points_back(self):
        if self.mgr is None:
            return
        pool = self.mgr.pool
        # The map itself is private; reading it is the only way to see a dangling entry.
        for h, b in pool._cached.items():
            assert pool.blocks[b].block_hash == h
        cached = [b for b in pool.blocks if b.block_hash is not None]
        assert len(cached) == pool.num_cached_blocks
        for b in cached:
            assert b.key is not None
            assert pool.lookup(b.block_hash, *b.key) == b.block_id
            # Published KV is exactly the tokens its key claims (nobody overwrote it since).
            tokens = b.key[1]
            assert [self.kv.get(b.block_id * self.bs + j) for j in range(self.bs)] == list(tokens)
        if not self.mgr.enable_caching:
            assert pool.num_cached_blocks == 0

    @invariant()
    def blocks_cover_exactly_the_computed_tokens(self):
        if self.mgr is None:
            return
        for i, r in self.live.items():
            if i in self.running:
                assert len(r.block_ids) == self.mgr.blocks_needed(r.num_computed_tokens)
            else:
                assert r.block_ids == [] and r.num_computed_tokens == 0

    @invariant()
    def every_context_reads_back_its_own_tokens(self):
        if self.mgr is None:
            return
        for i in self.running:
            r = self.live[i]
            got = [self.kv.get(self.slot(r, p)) for p in range(r.num_computed_tokens)]
            assert got == r.all_token_ids[: r.num_computed_tokens], f"request {i}"

    def teardown(self):
        if self.mgr is None:
            return
        for r in list(self.live.values()):
            self.mgr.free(r)
        pool = self.mgr.pool
        assert pool.num_free_blocks == pool.num_blocks
        assert all(b.ref_cnt == 0 for b in pool.blocks)


KVCacheMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)
TestKVCacheManager = KVCacheMachine.TestCase


@settings(max_examples=150, deadline=None)
@given(
    data=st.data(),
    block_size=st.sampled_from([1, 2, 4]),
    prompts=st.lists(st.lists(st.sampled_from(VOCAB), min_size=1, max_size=12), min_size=1, max_size=8),
)
def test_any_order_of_frees_returns_every_block(data, block_size, prompts):
    mgr = KVCacheManager(num_blocks=24, block_size=block_size)
    pool = mgr.pool
    held = []
    for i, prompt in enumerate(prompts):
        r = make_request(i, prompt)
        hits, num_hit = mgr.get_computed_blocks(r)
        if mgr.allocate_slots(r, r.num_tokens - num_hit, hits) is None:
            continue  # the pool is full; the others still share blocks in all sorts of ways
        r.num_computed_tokens = r.num_tokens
        held.append(r)
    num_cached = pool.num_cached_blocks

    for r in data.draw(st.permutations(held), label="free order"):
        blocks = list(r.block_ids)
        mgr.free(r)
        still_held = {b for other in held for b in other.block_ids}
        for b in blocks:
            # A block shared with a request not yet freed must stay out of the free queue.
            assert pool.is_free(b) == (b not in still_held)

    assert pool.num_free_blocks == pool.num_blocks
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    # Freeing keeps cached KV for later hits; it evicts nothing.
    assert pool.num_cached_blocks == num_cached
    assert pool.num_cached_free_blocks == num_cached


def test_identical_prompt_hits_every_block_but_the_one_with_the_last_token():
    mgr = KVCacheManager(num_blocks=8, block_size=4)
    a = make_request(0, [1, 0, 1, 1, 0, 0, 1, 0, 1, 1])  # 10 tokens: blocks 0-1 full, block 2 partial
    assert mgr.get_computed_blocks(a) == ([], 0)
    mgr.allocate_slots(a, a.num_tokens)
    b = make_request(1, a.prompt_token_ids)
    hits, num_hit = mgr.get_computed_blocks(b)
    assert hits == a.block_ids[:2] and num_hit == 8
    # With the prompt exactly two blocks long, the second block holds the last token: no hit.
    c = make_request(2, a.prompt_token_ids[:8])
    hits, num_hit = mgr.get_computed_blocks(c)
    assert hits == a.block_ids[:1] and num_hit == 4


def test_free_queues_a_requests_blocks_tail_first():
    # A request's later blocks are only useful to a prompt that shares all of its earlier ones,
    # so they should be evicted first: after a free, the pool hands out the tail block first.
    mgr = KVCacheManager(num_blocks=3, block_size=2)
    r = make_request(0, [0, 1, 1, 0, 1, 1])
    mgr.allocate_slots(r, r.num_tokens)
    blocks = list(r.block_ids)
    mgr.free(r)
    assert mgr.pool.allocate(3) == blocks[::-1]
