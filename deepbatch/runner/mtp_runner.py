"""DeepSeek-V3/R1's multi-token-prediction (MTP) layer as the drafter of speculative decoding
(``method: mtp``), from the checkpoint's own weights (``model.mtp_layers``).

The MTP layer at position p reads the target's final hidden state there and the embedding of the
token after it, and predicts the token after that::

    x_p = eh_proj([ enorm(embed(t[p+1])) | hnorm(h[p]) ]) -> decoder layer (MLA, MoE)
    draft ~ head(shared_head.norm(x_p))                            the token at p + 2

So the target's hidden states must outlive its forward: the runner writes every forward's
hidden states into a cache laid out like the KV cache (one row per token slot, a tensor beside the
layers' caches, so swap copies carry it), and the MTP layer reads a request's rows by its block
table. Its own attention keeps a latent cache of its own blocks (``spec_decode/mtp.py`` holds
them per request). Drafts after the first chain the layer on itself, as DeepSeek's MTP modules
are chained: its output at the previous position (before the final norm) stands in for the
target's hidden state, and the previous draft for the token. The embedding and the head are the
target's (V3 shares them). A draft is drawn as the draft model's are (``draw_drafts``: the
argmax for a greedy request). The hidden-state rows and the MTP layer's latent are counted beside
each target block when the pool is sized.
"""

from __future__ import annotations

import numpy as np
import torch

from deepbatch.config import EngineConfig
from deepbatch.runner.draft_model_runner import packed_batch
from deepbatch.runner.model_runner import block_bytes
from deepbatch.sampling.draft_rows import draw_drafts
from deepbatch.sampling.host_copy import arrays_to_device
from deepbatch.sampling.sampler import Sampler


class MTPRunner:
    """``target_runner``: this process's ``ModelRunner``. Under tensor parallelism every rank
    holds one over its shard of the layer; rank 0's is given ``peers``, which asks the workers'
    to run each forward with it (``RunnerCallMessage``): the forward's collectives must meet."""

    def __init__(self, config: EngineConfig, target_runner, max_model_len: int, peers=None):
        model = target_runner.model
        layers = getattr(getattr(model, "model", None), "mtp_layers", None)
        if not layers:
            raise ValueError("speculative_config: method mtp needs a checkpoint with multi-token-prediction layers "
                             "(DeepSeek-V3/R1: model.layers.{num_hidden_layers}.*, num_nextn_predict_layers >= 1); "
                             f"this {type(model).__name__} has none")
        self.target = target_runner
        self.model = model
        self.layer = layers[0]
        self.device = torch.device(config.device)
        self.dtype = config.model.dtype
        self.block_size = config.cache.block_size
        self.hidden_size = model.config.hidden_size
        self._specs = self.layer.self_attn.cache_specs(self.dtype)
        self.kv_caches: list[torch.Tensor] = []
        self.hidden_cache: torch.Tensor | None = None
        self.peers = peers
        self._out: torch.Tensor | None = None  # the last forward's layer outputs, where chained drafts read
        self.sampler = Sampler(target_runner.sampler.vocab_size, self.device,
                               max_num_seqs=config.scheduler.max_num_seqs)

    def kv_bytes_per_block(self) -> int:
        """The MTP layer's latent and the target's hidden-state rows of one block."""
        return block_bytes([self._specs], self.block_size) + self.swapped_bytes_per_block()

    def swapped_bytes_per_block(self) -> int:
        """What a swapped target block carries beside its KV: its tokens' hidden-state rows."""
        return self.block_size * self.hidden_size * self.dtype.itemsize

    def init_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches = [torch.zeros((num_blocks, self.block_size, *shape), dtype=dtype, device=self.device)
                          for shape, dtype in self._specs]
        self.layer.self_attn.bind(self.kv_caches, self.target.backend)
        hidden = torch.zeros((num_blocks, self.block_size, self.hidden_size), dtype=self.dtype, device=self.device)
        # Beside the layers' caches (the swap pool copies every tensor there; nothing binds it).
        self.target.kv_caches.append([hidden])
        self.hidden_cache = hidden.view(-1, self.hidden_size)
        self.target.hidden_cache = self.hidden_cache

    @torch.no_grad()
    def forward(self, seqs: list[tuple[list[int], int, list[int], bool]], slots: np.ndarray | None = None,
                chain: list[int] | None = None, rows: list | None = None) -> list[int]:
        """The MTP layer over packed sequences (``packed_batch``: each entry's tokens are the
        tokens after its positions), each token beside the hidden state at its position: the
        target's at these KV ``slots`` (one per token), or for a chained draft the layer's own
        output at row ``chain[i]`` of the previous forward (one token per entry). Returns, for each
        entry with ``sample``, the draft (drawn for ``rows`` as ``sampling/draft_rows.py``'s
        ``draw_drafts`` says, the argmax without them); a tensor-parallel worker returns none."""
        if self.peers is not None:
            self.peers("forward", seqs, slots, chain)
        # Pinned copies that queue behind the device's work (``sampling/host_copy.py``).
        if slots is not None:
            hidden = self.hidden_cache[arrays_to_device([np.asarray(slots, dtype=np.int64)], self.device)[0]]
        else:
            hidden = self._out[arrays_to_device([np.asarray(chain, dtype=np.int64)], self.device)[0]]
        batch = packed_batch(seqs, self.block_size, self.device)
        stack = self.model.model
        layer = self.layer
        embedded = layer.enorm(stack.embed_tokens(batch.input_ids))
        x = layer.eh_proj(torch.cat([embedded, layer.hnorm(hidden.to(embedded.dtype))], dim=-1))
        x, residual = layer(x, None, stack.rotary.at(batch.positions), batch)
        last = batch.logits_indices
        normed, out = layer.shared_head.norm(x[last], residual[last])
        self._out = out
        logits = self.model.compute_logits(normed)
        if logits is None:  # a tensor-parallel worker: rank 0 draws
            return []
        return draw_drafts(self.sampler, logits, rows)
