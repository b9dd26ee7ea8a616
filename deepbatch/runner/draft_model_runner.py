"""The draft model of speculative decoding (``method: draft_model``): its weights, its paged KV
cache and one greedy forward over packed sequences.

The draft is a small model sharing the target's tokenizer (SmolLM2-135M drafting a larger
SmolLM2 or Llama; a Qwen2.5-0.5B drafting a Qwen2.5-7B). Its cache has the same number of blocks
as the target's, each holding what the draft's layers keep per token; the engine sizes the
target's pool with those bytes included, so the two together fit the memory budget. Block ids of
the two pools are unrelated: which request holds which draft block is the proposer's business
(``spec_decode/draft_model.py``). The cache stores the model dtype (no 8-bit draft cache: the
draft's bytes per token are small beside the target's). Under tensor parallelism the draft is
built outside the ranks' group, so it runs whole in rank 0's process and never communicates; its
drafts reach the other ranks in the step messages, as prompt lookup's do.

Verification draws every position as the request would (``sampling/draft_rows.py``), so the
method is lossless whatever the drafts. The draft draws each draft as the target will draw the
token in its place (``draw_drafts``): the argmax for a greedy request, and for a sampled one the
same temperature, filters and noise, so that a draft distribution near the target's drafts the
target's own draw.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import torch

from deepbatch.config import EngineConfig
from deepbatch.core.forward_batch import ForwardBatch
from deepbatch.layers.attention import make_backend
from deepbatch.models.loader import build_model, load_hf_config, load_tokenizer, max_model_len_of, resolve_model
from deepbatch.runner.cuda_graph import CudaGraphs, capture_or_none
from deepbatch.runner.model_runner import block_bytes, layer_cache_specs
from deepbatch.sampling.host_copy import arrays_to_device
from deepbatch.sampling.draft_rows import draw_drafts
from deepbatch.sampling.sampler import Sampler

logger = logging.getLogger(__name__)


def check_vocabularies(target_tokenizer, draft_tokenizer, target_vocab: int, draft_vocab: int,
                       draft_name: str) -> None:
    """A draft whose token ids mean other strings than the target's cannot draft for it: refuse
    it at start-up. Where both ship a tokenizer they must map every token to the same id; where
    either has none, the embedding widths must agree. Widths may differ with equal tokenizers
    (checkpoints pad their embeddings differently): only the ids both share are drafted."""
    if target_tokenizer is not None and draft_tokenizer is not None:
        target, draft = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
        if target != draft:
            differ = sum(1 for t, i in target.items() if draft.get(t) != i) + len(set(draft) - set(target))
            raise ValueError(f"speculative_config: the draft model {draft_name!r} has another vocabulary than the "
                             f"target ({differ} of {len(target)} tokens differ); a draft must share the "
                             f"target's tokenizer")
    elif draft_vocab != target_vocab:
        raise ValueError(f"speculative_config: the draft model {draft_name!r} has {draft_vocab} token ids and the "
                         f"target {target_vocab}; a draft must share the target's tokenizer")


class DraftModelRunner:
    def __init__(self, config: EngineConfig, target_hf_config, target_tokenizer, max_model_len: int):
        spec = config.speculative_config
        self.device = torch.device(config.device)
        self.dtype = config.model.dtype
        self.block_size = config.cache.block_size
        self.max_model_len = max_model_len
        model_config = dataclasses.replace(config.model, model=spec.model, tokenizer=None, quantization=None,
                                           max_model_len=max_model_len)
        source = resolve_model(spec.model)
        hf_config = load_hf_config(source, model_config.cache_dir)
        draft_tokenizer = load_tokenizer(source, None, model_config.cache_dir)
        check_vocabularies(target_tokenizer, draft_tokenizer, target_hf_config.vocab_size, hf_config.vocab_size,
                           spec.model)
        if max_model_len > max_model_len_of(hf_config, None):
            logger.warning("draft model: max_model_len %d exceeds its %d positions", max_model_len,
                           max_model_len_of(hf_config, None))
        self.model = build_model(model_config, source, hf_config, config.device, max_model_len)
        self.input_vocab = hf_config.vocab_size
        # Drafts are ids the target can sample.
        self.draft_vocab = min(hf_config.vocab_size, target_hf_config.vocab_size)
        self.sampler = Sampler(self.draft_vocab, self.device, max_num_seqs=config.scheduler.max_num_seqs)
        backend = config.attention_backend
        if backend == "auto":
            backend = "triton" if self.device.type == "cuda" else "torch"
        self.backend = make_backend(backend)
        self.attn_layers = self.model.attention_layers()
        self._specs = [layer_cache_specs(a, self.dtype) for a in self.attn_layers]
        self.kv_caches: list[list[torch.Tensor]] = []
        self.num_blocks = 0
        self.max_num_seqs = config.scheduler.max_num_seqs
        self.enforce_eager = config.enforce_eager
        self.graphs: CudaGraphs | None = None

    def kv_bytes_per_block(self) -> int:
        """Bytes of one draft block over every layer."""
        return block_bytes(self._specs, self.block_size)

    def swapped_bytes_per_block(self) -> int:
        """What a swapped target block carries of the draft's: nothing (a preempted request's
        draft cache is dropped and caught up again)."""
        return 0

    def init_kv_cache(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.kv_caches = [[torch.zeros((num_blocks, self.block_size, *shape), dtype=dtype, device=self.device)
                           for shape, dtype in specs] for specs in self._specs]
        for a, caches in zip(self.attn_layers, self.kv_caches):
            a.bind(caches, self.backend)
        if self.device.type == "cuda":
            self._warm_up_kernels()
            if not self.enforce_eager:
                self._capture_graphs()

    def _capture_graphs(self) -> None:
        """Decode graphs (one token per sequence): the forwards after the first draft's are
        always such, and the first one usually is (the one token the target added past the
        cached drafts). A forward with a longer catch-up runs eagerly."""
        graphs = CudaGraphs(self.model, self.max_num_seqs, -(-self.max_model_len // self.block_size),
                            self.max_model_len, self.device)
        self.graphs = capture_or_none(graphs, "the draft model")

    def _warm_up_kernels(self) -> None:
        """Compile the Triton variants drafting meets (a catch-up chunk of each tile class beside
        one-token drafts over a long context) before the first request, as the target does. The
        blocks written hold nothing yet: a request writes every position before it reads it."""
        context = min(self.max_model_len, 1024, self.num_blocks * self.block_size)
        blocks = list(range(-(-context // self.block_size)))
        for chunk in (0, 2, 8, 16, 32, 64, 512):
            if chunk > context:
                continue
            seqs = [([0], context - 1, blocks, True)] + ([([0] * chunk, 0, blocks, True)] if chunk else [])
            self.forward(seqs)
        self.sampler.warm_up()
        torch.cuda.synchronize(self.device)

    @torch.no_grad()
    def forward(self, seqs: list[tuple[list[int], int, list[int], bool]], rows: list | None = None) -> list[int]:
        """One forward over packed sequences (``packed_batch``); for each entry with ``sample``,
        the draft's token after its last one, in order: drawn for ``rows`` (``draw_drafts``, one
        per sampled entry), the argmax without them."""
        batch = packed_batch(seqs, self.block_size, self.device)
        # An id past the draft's embedding (a target that pads its vocabulary wider and sampled a
        # padded id) would index out of range; it only makes the drafts worse.
        batch.input_ids.clamp_(max=self.input_vocab - 1)
        logits_idx = batch.logits_indices
        hidden = self.graphs.run(batch) if self.graphs is not None else None
        if hidden is None:
            hidden = self.model(batch.input_ids, batch.positions, batch)
        if not len(logits_idx):
            return []
        logits = self.model.compute_logits(hidden[logits_idx])
        return draw_drafts(self.sampler, logits[:, :self.draft_vocab], rows)


def packed_batch(seqs: list[tuple[list[int], int, list[int], bool]], block_size: int,
                 device: torch.device) -> ForwardBatch:
    """A drafter's forward over packed sequences. Each entry ``(tokens, start, blocks, sample)``
    runs ``tokens`` at positions ``start, start+1, ...`` of a sequence whose cache blocks are
    ``blocks`` (covering every position written), writing their KV; the logits rows are the
    last of each entry with ``sample``."""
    q_lens = [len(t) for t, _, _, _ in seqs]
    qsl = np.concatenate([[0], np.cumsum(q_lens)])
    ids = np.fromiter((i for t, _, _, _ in seqs for i in t), dtype=np.int64, count=int(qsl[-1]))
    positions = np.concatenate([np.arange(s, s + len(t)) for t, s, _, _ in seqs])
    tables = np.zeros((len(seqs), max(len(b) for _, _, b, _ in seqs)), dtype=np.int32)
    for i, (_, _, blocks, _) in enumerate(seqs):
        tables[i, :len(blocks)] = blocks
    row = np.repeat(np.arange(len(seqs)), q_lens)
    slots = tables[row, positions // block_size].astype(np.int64) * block_size + positions % block_size
    seq_lens = [s + len(t) for t, s, _, _ in seqs]
    logits_idx = [int(qsl[i + 1]) - 1 for i, (_, _, _, sample) in enumerate(seqs) if sample]

    # One pinned copy for all of them (``sampling/host_copy.py``).
    input_ids, positions_d, slots_d, qsl_d, seq_lens_d, tables_d, logits_d = arrays_to_device(
        [ids, positions.astype(np.int64, copy=False), slots, qsl.astype(np.int32), np.asarray(seq_lens, dtype=np.int32),
         tables, np.asarray(logits_idx, dtype=np.int64)], device)
    return ForwardBatch(
        input_ids=input_ids, positions=positions_d, slot_mapping=slots_d, query_start_loc=qsl_d, seq_lens=seq_lens_d,
        block_tables=tables_d, logits_indices=logits_d, max_query_len=max(q_lens), max_seq_len=max(seq_lens))
