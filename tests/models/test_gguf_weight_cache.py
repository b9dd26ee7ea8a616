"""The dequantized-weight cache of a GGUF file: the first load writes what dequantization gave,
later loads read exactly that back (quantized and float tensors, llama's q/k un-permutation
included) without dequantizing, and a cache that cannot be written costs only the cache."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from deepbatch.models import gguf_loader
from deepbatch.models.gguf_loader import WEIGHTS_FILE, CachedGGUFWeights, GGUFWeights

CONFIG = SimpleNamespace(num_attention_heads=4, num_key_value_heads=2)


def write_tiny_gguf(path) -> None:
    import gguf
    from gguf.quants import quantize

    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "llama")
    tensors = {
        "token_embd.weight": rng.standard_normal((16, 64)).astype(np.float32),
        "blk.0.attn_q.weight": rng.standard_normal((64, 64)).astype(np.float32),
        "blk.0.attn_k.weight": rng.standard_normal((32, 64)).astype(np.float32),
        "output_norm.weight": rng.standard_normal(64).astype(np.float32),
    }
    for name, array in tensors.items():
        if name.startswith("blk."):  # quantized, as the shipped checkpoints are
            q8 = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(name, quantize(array, q8), raw_dtype=q8)
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_the_second_load_reads_back_exactly_what_the_first_dequantized(tmp_path, monkeypatch):
    path, cache = tmp_path / "tiny.gguf", tmp_path / "cache"
    write_tiny_gguf(path)
    direct = dict(GGUFWeights(str(path), CONFIG))
    first = CachedGGUFWeights(str(path), CONFIG, str(cache))
    assert len(first) == 4 and not (cache / WEIGHTS_FILE).exists()
    first_tensors = dict(first)
    assert (cache / WEIGHTS_FILE).exists()

    def no_dequantizing(*args, **kwargs):
        raise AssertionError("a cached load dequantized the file again")

    monkeypatch.setattr(gguf_loader, "GGUFWeights", no_dequantizing)
    second = CachedGGUFWeights(str(path), CONFIG, str(cache))
    assert len(second) == 4
    second_tensors = dict(second)
    assert set(direct) == set(first_tensors) == set(second_tensors) == {
        "model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight", "model.norm.weight"}
    for name, tensor in direct.items():
        assert tensor.dtype == second_tensors[name].dtype == torch.float32
        assert torch.equal(tensor, first_tensors[name]) and torch.equal(tensor, second_tensors[name]), name


def test_a_cache_that_cannot_be_written_still_loads(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    blocked = tmp_path / "file-not-dir"
    blocked.write_text("")  # the cache directory's place is taken by a file: makedirs fails
    weights = dict(CachedGGUFWeights(str(path), CONFIG, str(blocked / "cache")))
    assert len(weights) == 4
