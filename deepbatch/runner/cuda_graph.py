"""CUDA graphs for whole steps: decode-only steps, and (``cuda_graph_mode="full"``) steps that
carry prefill chunks and speculative decoding's verification steps (``ModelRunner.mixed_graphs``
says when).

A step replays the graph captured for the smallest size that holds it. Inputs live in static
buffers; padding writes no KV (slot -1) and its outputs are dropped.

Decode graphs are keyed by the batch ``B`` (one token per sequence)::

    static rows:  [ 0 .. B-1 real | B .. size-1 padding seqs (1 token, seq_len 1) | unused ]

Mixed graphs are keyed by the step's token count ``T`` and always hold ``max_num_seqs``
sequence slots. Padding tokens belong to no sequence (every padding sequence has ``q_len 0``
and starts at ``T``), so the attention kernels skip them and never write their rows; every
other op works row by row, so whatever those rows hold stays in them::

    tokens:           [ r0 chunk | r1 | r2 chunk | ... | padding up to size ]
    query_start_loc:  [0, q0, q0+1, ..., T, T, T, ..., T]      (max_num_seqs + 1 entries)

Verification graphs (speculative decoding with ``k`` drafts) are mixed graphs cut to a verify
step's shape: keyed by the batch ``B`` like decode graphs, ``B * (k + 1)`` tokens, ``B`` sequence
slots, and the tile shapes of ``max_query_len = k + 1``. A step of ``B`` requests with up to
``k + 1`` tokens each would otherwise pad to the next mixed size and to ``max_num_seqs`` slots,
with the long-chunk tiles (320 tokens at batch 64 and ``k = 4`` run as 512).

This works because the Triton attention kernels size their grids from shapes only
(``num_tokens // BLOCK_Q + num_seqs`` programs, the idle ones return at once) and take the tile
shapes from ``max_query_len``, which a mixed graph fixes at its size. All graphs share one memory
pool, captured largest first so smaller ones reuse its blocks. Attention is captured with
``max_seq_len = max_model_len``, so kernels read each sequence's true length at run time.
"""

from __future__ import annotations

import logging
import time

import torch

from deepbatch.core.forward_batch import ForwardBatch

logger = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Decode graph batch sizes: 1, 2, 4, 8, then every 16 up to ``max_num_seqs``."""
    sizes = [s for s in (1, 2, 4, 8) if s <= max_num_seqs]
    sizes += list(range(16, max_num_seqs + 1, 16))
    if sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


def mixed_capture_sizes(max_num_batched_tokens: int) -> list[int]:
    """Mixed graph token counts: powers of two from 16 to 256, then every 256 up to the budget.
    A step pads to the next size, so compute-bound prefill steps waste at most 255 tokens."""
    sizes = [s for s in (16, 32, 64, 128) if s < max_num_batched_tokens]
    sizes += list(range(256, max_num_batched_tokens + 1, 256))
    if not sizes or sizes[-1] != max_num_batched_tokens:
        sizes.append(max_num_batched_tokens)
    return sizes


class _GraphSet:
    """Graphs of one kind of step, their static inputs and outputs. ``sizes`` are token counts;
    ``query_len`` is a verification graph's ``k + 1`` (sequences of up to that many tokens), None
    for the other kinds."""

    def __init__(self, model, sizes: list[int], mixed: bool, max_num_seqs: int, max_blocks_per_seq: int,
                 max_model_len: int, device: torch.device, query_len: int | None = None):
        self.model = model
        self.sizes = sizes
        self.mixed = mixed  # sequences of any length, laid out by query_start_loc
        self.query_len = query_len
        self.max_model_len = max_model_len
        max_tokens = sizes[-1]
        # A decode graph of size B holds B sequences, a verification graph size / (k + 1); every
        # other mixed graph holds all the seats.
        self.num_seq_slots = self.seats(max_tokens) if query_len or not mixed else max_num_seqs
        n, s = max_tokens, self.num_seq_slots
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=device)
        if mixed:
            self.query_start_loc = torch.zeros(s + 1, dtype=torch.int32, device=device)
            self.seq_lens = torch.zeros(s, dtype=torch.int32, device=device)
        else:
            self.query_start_loc = torch.arange(s + 1, dtype=torch.int32, device=device)
            self.seq_lens = torch.ones(s, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(s, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def seats(self, size: int) -> int:
        """The sequence slots of graph ``size``."""
        if self.query_len:
            return size // self.query_len
        return self.num_seq_slots if self.mixed else size

    def batch(self, size: int) -> ForwardBatch:
        seqs = self.seats(size)
        return ForwardBatch(
            input_ids=self.input_ids[:size],
            positions=self.positions[:size],
            slot_mapping=self.slot_mapping[:size],
            query_start_loc=self.query_start_loc[: seqs + 1],
            seq_lens=self.seq_lens[:seqs],
            block_tables=self.block_tables[:seqs],
            logits_indices=self.query_start_loc[1 : seqs + 1].long() - 1,
            # A mixed graph takes the tile shapes of a batch with a chunk as long as the graph:
            # the kernels then launch both their short- and long-chunk variants.
            max_query_len=(self.query_len or size) if self.mixed else 1,
            max_seq_len=self.max_model_len,
        )

    def capture(self, size: int, pool, stream: torch.cuda.Stream, warmups: int) -> None:
        batch = self.batch(size)
        # Warm up on a side stream (compiles kernels, settles allocator state) before capture.
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(warmups):
                self.model(batch.input_ids, batch.positions, batch)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            self.outputs[size] = self.model(batch.input_ids, batch.positions, batch)
        self.graphs[size] = graph

    def size_for(self, batch: ForwardBatch) -> int | None:
        if self.query_len:  # the smallest graph with a seat for each sequence (each fits its k + 1)
            if not self.graphs or batch.max_query_len > self.query_len or batch.num_seqs > self.num_seq_slots:
                return None
            return next(s for s in self.sizes if self.seats(s) >= batch.num_seqs)
        n = batch.num_tokens if self.mixed else batch.num_seqs
        if not self.graphs or n > self.sizes[-1] or batch.num_seqs > self.num_seq_slots:
            return None
        return next(s for s in self.sizes if s >= n)

    def run(self, batch: ForwardBatch, size: int) -> torch.Tensor:
        self.prepare(batch, size)
        return self.replay(size)[: batch.num_tokens]

    def replay(self, size: int) -> torch.Tensor:
        self.graphs[size].replay()
        return self.outputs[size]

    def prepare(self, batch: ForwardBatch, size: int) -> None:
        """Copy the step into the static inputs of graph ``size`` and mark the rest padding."""
        t, b = batch.num_tokens, batch.num_seqs
        width = batch.block_tables.shape[1]
        self.input_ids[:t].copy_(batch.input_ids, non_blocking=True)
        self.positions[:t].copy_(batch.positions, non_blocking=True)
        self.slot_mapping[:t].copy_(batch.slot_mapping, non_blocking=True)
        self.slot_mapping[t:size].fill_(-1)
        self.seq_lens[:b].copy_(batch.seq_lens, non_blocking=True)
        if self.mixed:
            self.query_start_loc[: b + 1].copy_(batch.query_start_loc, non_blocking=True)
            self.query_start_loc[b + 1 :].fill_(t)  # padding sequences: q_len 0
            self.seq_lens[b:].fill_(0)
        else:
            self.seq_lens[b:size].fill_(1)
        self.block_tables[:b, :width].copy_(batch.block_tables, non_blocking=True)


class CudaGraphs:
    """Decode graphs and, when ``mixed``, graphs for steps that carry prefill chunks; with
    ``verify_query_len`` (``k + 1``), verification graphs as well."""

    def __init__(self, model, max_num_seqs: int, max_blocks_per_seq: int, max_model_len: int, device: torch.device,
                 max_num_batched_tokens: int | None = None, verify_query_len: int | None = None):
        self.decode = _GraphSet(model, capture_sizes(max_num_seqs), False, max_num_seqs, max_blocks_per_seq,
                                max_model_len, device)
        self.mixed = self.verify = None
        if max_num_batched_tokens is not None:
            self.mixed = _GraphSet(model, mixed_capture_sizes(max_num_batched_tokens), True, max_num_seqs,
                                   max_blocks_per_seq, max_model_len, device)
            # No step runs more tokens than the budget (nor did the memory profile).
            q = verify_query_len or 1
            sizes = [b * q for b in capture_sizes(max_num_seqs) if b * q <= max_num_batched_tokens]
            if q > 1 and sizes:
                self.verify = _GraphSet(model, sizes, True, max_num_seqs, max_blocks_per_seq, max_model_len, device,
                                        verify_query_len)

    @torch.no_grad()
    def capture(self) -> None:
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        # Largest first across both kinds, so that every later graph fits in the pool's blocks.
        sets = [g for g in (self.decode, self.mixed, self.verify) if g is not None]
        order = sorted(((s, g) for g in sets for s in g.sizes), key=lambda x: -x[0])
        for size, graphs in order:
            # Decode and verification graphs warm up twice (the first call of a shape also tunes
            # cuBLAS); the other mixed ones once: their kernels were compiled by the larger sizes
            # before them.
            once = graphs is self.mixed and size != order[0][0]
            graphs.capture(size, pool, stream, warmups=1 if once else 2)
        torch.cuda.synchronize()
        mixed = f" and {len(self.mixed.sizes)} mixed (up to {self.mixed.sizes[-1]} tokens)" if self.mixed else ""
        if self.verify is not None:
            mixed += f" and {len(self.verify.sizes)} verification ({self.verify.query_len} tokens a sequence)"
        logger.info("captured %d decode CUDA graphs (batch 1..%d)%s in %.1f s", len(self.decode.sizes),
                    self.decode.sizes[-1], mixed, time.perf_counter() - t0)

    def run(self, batch: ForwardBatch) -> torch.Tensor | None:
        """Hidden states ``[T, hidden]`` of the step through a graph, or None when no graph
        holds it (the caller runs it eagerly)."""
        if batch.max_query_len == 1:
            choices = (self.decode,)
        else:  # a verification-shaped step takes the tighter graph when one holds it
            choices = (self.verify, self.mixed)
        for graphs in choices:
            size = graphs.size_for(batch) if graphs is not None else None
            if size is not None:
                return graphs.run(batch, size)
        return None


def capture_or_none(graphs: CudaGraphs, what: str) -> CudaGraphs | None:
    """``graphs`` captured, or None (logged) where capture fails: that costs speed, never
    correctness; ``what`` then runs eagerly."""
    try:
        graphs.capture()
    except Exception:
        logger.exception("CUDA graph capture failed; %s runs eagerly", what)
        torch.cuda.synchronize()
        return None
    return graphs
