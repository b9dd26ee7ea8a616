"""The two GPU paths of a W4A16 linear layer (``w4a16.py``'s ``apply``): the fused 4-bit GEMM below
``W4A16_DEQUANT_MIN_TOKENS`` tokens, and at or above it the weight dequantized by
``kernels/int4_dequant.py`` and multiplied by ``F.linear``. Both are held to the torch reference
(``w4a16_matmul_ref``) and to each other, on layers built and converted by the AWQ (zero points)
and GPTQ (symmetric) formats. On the CPU the kernels run in the Triton interpreter, switched on by
patching the layer's kernel test; the bf16 test needs a GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from deepbatch.kernels import int4_dequant, w4a16_gemm
from deepbatch.layers.linear import Linear
from deepbatch.layers.quantization import quantization_scope, w4a16
from deepbatch.layers.quantization.awq import AWQConfig
from deepbatch.layers.quantization.gptq import GPTQConfig

CONFIGS = {
    "awq": {"quant_method": "awq", "version": "gemm", "bits": 4, "group_size": 64, "zero_point": True},
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 64, "sym": True, "desc_act": False},
}
TOL = {torch.float32: {"atol": 1e-4, "rtol": 1e-4}, torch.float16: {"atol": 1e-2, "rtol": 1e-2},
       torch.bfloat16: {"atol": 3e-2, "rtol": 2e-2}}


def w4a16_layer(fmt: str, in_features: int, out_features: int, dtype: torch.dtype, seed: int = 0) -> Linear:
    """A linear layer holding the format's own random checkpoint tensors, converted as a loaded
    checkpoint is. AWQ's zero points are random (its ``init_random`` writes 8 everywhere)."""
    config = (AWQConfig if fmt == "awq" else GPTQConfig).from_hf(CONFIGS[fmt])
    with quantization_scope(config):
        layer = Linear(in_features, out_features)
    g = torch.Generator().manual_seed(seed)
    layer.quant_method.init_random(layer, g)
    if fmt == "awq":
        layer.qzeros.copy_(torch.randint(-2**31, 2**31, layer.qzeros.shape, generator=g, dtype=torch.int64))
    layer.params_dtype = dtype
    layer.process_weights_after_loading()
    assert layer.zeros.dtype == dtype
    return layer


@pytest.fixture
def path_calls(monkeypatch):
    """Run the GPU paths on CPU tensors (in the interpreter) and record which one each call took."""
    calls = []
    fused, dequantize = w4a16_gemm.w4a16_matmul, int4_dequant.dequantize_int4

    def fused_spy(*args, **kwargs):
        calls.append("fused")
        return fused(*args, **kwargs)

    def dequantize_spy(*args, **kwargs):
        calls.append("dequantize")
        return dequantize(*args, **kwargs)

    monkeypatch.setattr(w4a16, "_use_kernels", lambda x: True)
    monkeypatch.setattr(w4a16_gemm, "w4a16_matmul", fused_spy)
    monkeypatch.setattr(int4_dequant, "dequantize_int4", dequantize_spy)
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("fmt", ["awq", "gptq"])
def test_both_paths_match_the_reference(fmt, dtype, path_calls, monkeypatch):
    layer = w4a16_layer(fmt, 256, 192, dtype)
    x = torch.randn(3, 5, 256, generator=torch.Generator().manual_seed(1)).to(dtype)  # 15 tokens
    monkeypatch.setattr(w4a16, "W4A16_DEQUANT_MIN_TOKENS", 16)
    fused = layer(x)
    monkeypatch.setattr(w4a16, "W4A16_DEQUANT_MIN_TOKENS", 15)  # the threshold itself dequantizes
    dequantized = layer(x)
    assert path_calls == ["fused", "dequantize"]
    assert fused.shape == dequantized.shape == (3, 5, 192) and dequantized.dtype == dtype

    x2 = x.reshape(15, 256)
    want = w4a16_gemm.w4a16_matmul_ref(x2, layer.qweight, layer.scales, layer.zeros, 64).view(3, 5, 192)
    torch.testing.assert_close(fused, want, **TOL[dtype])
    torch.testing.assert_close(dequantized, want, **TOL[dtype])
    # The dequantize path multiplies the reference's own weight, bit for bit.
    weight = w4a16_gemm.dequantize_int4_ref(layer.qweight, layer.scales, layer.zeros, 64)
    assert torch.equal(dequantized, F.linear(x2, weight).view(3, 5, 192))


def test_group_over_all_of_k(path_calls, monkeypatch):
    # GPTQ's group_size -1: one group per output channel, the per-channel path of both kernels.
    config = GPTQConfig.from_hf({**CONFIGS["gptq"], "group_size": -1})
    with quantization_scope(config):
        layer = Linear(200, 48)
    layer.quant_method.init_random(layer, torch.Generator().manual_seed(2))
    layer.process_weights_after_loading()
    x = torch.randn(4, 200, generator=torch.Generator().manual_seed(3))
    monkeypatch.setattr(w4a16, "W4A16_DEQUANT_MIN_TOKENS", 4)
    want = w4a16_gemm.w4a16_matmul_ref(x, layer.qweight, layer.scales, layer.zeros, 200)
    torch.testing.assert_close(layer(x), want, **TOL[torch.float32])
    assert path_calls == ["dequantize"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("fmt", ["awq", "gptq"])
def test_gpu_bf16_both_paths(fmt):
    layer = w4a16_layer(fmt, 4096, 1024, torch.bfloat16).cuda()
    for m in (64, w4a16.W4A16_DEQUANT_MIN_TOKENS):  # the fused path, then the dequantize path
        x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
        want = w4a16_gemm.w4a16_matmul_ref(x, layer.qweight, layer.scales, layer.zeros, 64)
        torch.testing.assert_close(layer(x), want, **TOL[torch.bfloat16])
    # Same tokens through both paths: the first 64 rows of the large batch against the small one.
    x = torch.randn(w4a16.W4A16_DEQUANT_MIN_TOKENS, 4096, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(layer(x)[:64], layer(x[:64]), **TOL[torch.bfloat16])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_dequant_path_keeps_no_weight_and_replays_in_a_cuda_graph():
    layer = w4a16_layer("awq", 4096, 1024, torch.bfloat16).cuda()
    x = torch.randn(w4a16.W4A16_DEQUANT_MIN_TOKENS, 4096, device="cuda", dtype=torch.bfloat16)
    layer(x)  # compiles the kernel
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    y = layer(x)
    torch.cuda.synchronize()
    # Only the output stays allocated; the 8 MiB bf16 weight was scratch.
    assert torch.cuda.memory_allocated() - before < 2 * y.numel() * y.element_size()

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = layer(x)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(captured, layer(x), **TOL[torch.bfloat16])
