"""``calculate_kv_scales`` under TP=2 over gloo: each rank measures the K/V of its own heads and
the ranks take the largest, so rank 0 stores with the scales of one process even where the
largest value of a layer is in rank 1's head. The checkpoint is the rescaled tiny Llama of
tests/models/test_kv_cache_scales.py (2 KV heads: one per rank), whose K/V pass e4m3's 448."""

from __future__ import annotations

import pytest

from test_kv_cache_scales import PROMPTS, base, calibrated, calibration_prompt, hf_kv_absmax, layer_scales  # noqa: F401


def test_tp2_ranks_store_with_the_scales_of_one_process(base):  # noqa: F811 - the imported fixture
    path = base[0]
    tp1, llm1 = calibrated(path, PROMPTS[:3])
    one_process = layer_scales(llm1)
    # Rank 0 holds KV head 0: somewhere the largest |K| or |V| of a layer is in head 1, where rank
    # 0's own measurement would be smaller than the scale it must use.
    per_head = hf_kv_absmax(path, calibration_prompt(llm1))
    assert any(k[1] > k[0] or v[1] > v[0] for k, v in per_head)
    tp2, llm2 = calibrated(path, PROMPTS[:3], tensor_parallel_size=2, distributed_timeout_s=30)
    try:
        assert llm2.engine.runner.model.model.layers[0].self_attn.num_kv_heads == 1
        assert layer_scales(llm2) == {i: (pytest.approx(k, rel=1e-5), pytest.approx(v, rel=1e-5))
                                      for i, (k, v) in one_process.items()}
        assert tp2 == tp1
    finally:
        llm2.engine.shutdown()
