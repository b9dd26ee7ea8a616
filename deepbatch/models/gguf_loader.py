"""Weights from a GGUF file, dequantized with the ``gguf`` package and renamed to HF names.

llama.cpp's converter permutes the rows of q/k projections of ``llama`` models (it stores rotary
pairs interleaved); ``_unpermute`` undoes that so the weights fit HF's rotate-half layout.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
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


# The dequantized weights of a GGUF file, kept beside its converted config and tokenizer.
WEIGHTS_FILE = "weights.safetensors"


class CachedGGUFWeights:
    """``GGUFWeights``, dequantized once: the first load writes the float32 tensors it yields to
    ``cache_dir`` as one safetensors file, and every later load reads that file instead of
    dequantizing again (20 s of a 135M model's 25 s start on two cores). A failed write costs
    only the cache."""

    def __init__(self, path: str, config, cache_dir: str):
        self.file = os.path.join(cache_dir, WEIGHTS_FILE)
        self._source = None if os.path.isfile(self.file) else GGUFWeights(path, config)
        if self._source is None:
            from safetensors import safe_open

            with safe_open(self.file, framework="pt") as f:
                self._names = list(f.keys())

    def __len__(self) -> int:
        return len(self._names) if self._source is None else len(self._source)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        if self._source is None:
            from safetensors import safe_open

            with safe_open(self.file, framework="pt") as f:
                for name in self._names:
                    yield name, f.get_tensor(name)
            return
        tensors = {}
        for name, w in self._source:
            tensors[name] = w
            yield name, w
        _save_atomically(tensors, self.file)


def _save_atomically(tensors: dict[str, torch.Tensor], file: str) -> None:
    from safetensors.torch import save_file

    directory = os.path.dirname(file)
    try:
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp")
        os.close(fd)
        try:
            save_file(tensors, tmp)
            os.replace(tmp, file)  # readers see the whole file or none
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except OSError as e:  # a read-only or full cache is no reason to fail the load
        logging.getLogger(__name__).warning("could not cache the dequantized GGUF weights in %s: %s", directory, e)


def warm_weight_cache(path: str, config, cache_dir: str) -> None:
    """Dequantize ``path`` into the cache now (once), so engines started later load fast."""
    weights = CachedGGUFWeights(path, config, cache_dir)
    if weights._source is not None:
        for _ in weights:
            pass
