"""Weights from a GGUF file, dequantized with the ``gguf`` package and renamed to HF names.

llama.cpp's converter permutes the rows of q/k projections of ``llama`` models (it stores rotary
pairs interleaved); ``_unpermute`` undoes that so the weights fit HF's rotate-half layout.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import numpy as np
import torch

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.fullmatch(gguf_name)
    if m is None or m.group(2) not in _LAYER_NAMES:
        raise ValueError(f"GGUF tensor {gguf_name!r} has no known HF name")
    return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFWeights:
    """The tensors of one GGUF file as ``(hf_name, float32 tensor)`` pairs; the file is parsed
    once and its length is known up front (for the progress bar)."""

    def __init__(self, path: str, config):
        from gguf import GGUFReader

        self.reader = GGUFReader(path)
        self.arch = str(self.reader.fields["general.architecture"].contents())
        self.n_head = config.num_attention_heads
        self.n_kv = getattr(config, "num_key_value_heads", None) or self.n_head

    def __len__(self) -> int:
        return len(self.reader.tensors)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        from gguf.quants import dequantize

        for t in self.reader.tensors:
            name = hf_name(t.name)
            w = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
            w = w.reshape(tuple(reversed([int(d) for d in t.shape])))
            if self.arch == "llama" and name.endswith("q_proj.weight"):
                w = _unpermute(w, self.n_head)
            elif self.arch == "llama" and name.endswith("k_proj.weight"):
                w = _unpermute(w, self.n_kv)
            yield name, torch.from_numpy(np.array(w, dtype=np.float32, order="C"))
