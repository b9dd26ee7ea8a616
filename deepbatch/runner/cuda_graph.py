"""CUDA graphs for decode steps.

A decode-only step (every request runs one token) of batch ``B`` replays the graph captured
for the smallest capture size ``>= B``. Inputs live in static buffers; padding rows write no KV
(slot -1) and attend to one token, and their outputs are dropped::

    static rows:  [ 0 .. B-1 real | B .. size-1 padding | unused up to max size ]

All graphs share one memory pool, captured largest first so smaller ones reuse its blocks.
Attention is captured with ``max_seq_len = max_model_len``, so kernels size their grids for the
longest possible context and read each sequence's true length from ``seq_lens`` at run time.
"""

from __future__ import annotations

import logging
import time

import torch

from deepbatch.runner.forward_batch import ForwardBatch

logger = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8) if s <= max_num_seqs]
    sizes += list(range(16, max_num_seqs + 1, 16))
    if sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


class DecodeCudaGraphs:
    def __init__(self, model, max_num_seqs: int, max_blocks_per_seq: int, max_model_len: int, device: torch.device):
        self.model = model
        self.sizes = capture_sizes(max_num_seqs)
        self.max_size = self.sizes[-1]
        self.max_model_len = max_model_len
        n = self.max_size
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def _batch(self, size: int) -> ForwardBatch:
        return ForwardBatch(
            input_ids=self.input_ids[:size],
            positions=self.positions[:size],
            slot_mapping=self.slot_mapping[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            logits_indices=self.query_start_loc[1 : size + 1].long() - 1,
            max_query_len=1,
            max_seq_len=self.max_model_len,
        )

    @torch.no_grad()
    def capture(self) -> None:
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        for size in reversed(self.sizes):
            batch = self._batch(size)
            # Warm up on a side stream (compiles kernels, settles allocator state) before capture.
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self.model(batch.input_ids, batch.positions, batch)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self.model(batch.input_ids, batch.positions, batch)
            self.graphs[size] = graph
        torch.cuda.synchronize()
        logger.info("captured %d decode CUDA graphs (batch 1..%d) in %.1f s", len(self.sizes), self.max_size,
                    time.perf_counter() - t0)

    def can_run(self, batch: ForwardBatch) -> bool:
        return batch.max_query_len == 1 and batch.num_seqs <= self.max_size and bool(self.graphs)

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states ``[B, hidden]`` of a decode-only batch."""
        b = batch.num_seqs
        size = next(s for s in self.sizes if s >= b)
        width = batch.block_tables.shape[1]
        self.input_ids[:b].copy_(batch.input_ids, non_blocking=True)
        self.positions[:b].copy_(batch.positions, non_blocking=True)
        self.slot_mapping[:b].copy_(batch.slot_mapping, non_blocking=True)
        self.slot_mapping[b:size].fill_(-1)
        self.seq_lens[:b].copy_(batch.seq_lens, non_blocking=True)
        self.seq_lens[b:size].fill_(1)
        self.block_tables[:b, :width].copy_(batch.block_tables, non_blocking=True)
        self.graphs[size].replay()
        return self.outputs[size][:b]
