"""``deepbatch bench throughput --workload kv-2x`` end to end on the CPU with a tiny random model:
recompute-only, swap, and predictive admission each finish the workload and report preemptions
by mode, KV accounting and the swap cost model in the table and the JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deepbatch.bench import throughput

TINY = str(Path(__file__).resolve().parent / "tiny-qwen3.json")
# 64 blocks x 16 = 1024 tokens; kv-2x queues 4 requests of 256 + 256 tokens.
BASE = ["--workload", "kv-2x", "--model-config", TINY, "--device", "cpu", "--num-gpu-blocks-override", "64"]


@pytest.mark.parametrize("mode, flags", [
    ("recompute", []),
    ("swap", ["--swap-space", "0.01", "--preemption-mode", "swap"]),
    ("predictive", ["--admission", "predictive"]),
])
def test_kv_2x_modes(tmp_path, capsys, mode, flags):
    out = tmp_path / "out.json"
    throughput.main(BASE + flags + ["--output-json", str(out)])
    ours = json.loads(out.read_text())["results"][0]
    mem = ours["memory"]
    assert ours["requests"] == 4 and ours["output_tokens"] == 4 * 256
    assert ours["mla_prefill"] == "expanded"  # the engine default, recorded with the run
    assert mem["preemptions_swap"] + mem["preemptions_recompute"] == ours["preemptions"]
    assert mem["kv_final"]["num_blocks"] == 64 and mem["kv_peak"]["token_usage"] > 0.5
    if mode == "recompute":
        assert mem["preemptions_recompute"] > 0 and mem["swap"] is None
    elif mode == "swap":
        assert mem["preemptions_swap"] > 0 and mem["preemptions_recompute"] == 0
        assert mem["swap"]["host_blocks"] > 0 and mem["swap"]["host_link_bytes_per_s"] > 0
    else:
        assert ours["preemptions"] == 0  # admission waited for room instead
    assert mem["gpu_allocator"] is None
    text = capsys.readouterr().out
    assert "preemptions by mode: swap" in text and "KV at the end" in text


def test_peer_runs_after_the_engine_is_released(tmp_path, monkeypatch):
    """The HF peer runs in the same process: by then no engine (and so no KV cache) may be
    alive, or on a GPU the peer has no memory left."""
    import gc
    import weakref

    from deepbatch.bench import peers
    from deepbatch.engine.llm_engine import LLMEngine

    real = peers.hf_static
    alive = []
    # Engines of other tests (session fixtures) may be alive; only the benchmark's own counts.
    before = weakref.WeakSet(o for o in gc.get_objects() if type(o) is LLMEngine)

    def hf_static(*args, **kwargs):
        gc.collect()
        alive.append(sum(type(o) is LLMEngine and o not in before for o in gc.get_objects()))
        return real(*args, **kwargs)

    monkeypatch.setattr(peers, "hf_static", hf_static)
    out = tmp_path / "out.json"
    throughput.main(BASE + ["--peers", "hf-static", "--peer-requests", "2", "--peer-batch-size", "2",
                            "--output-json", str(out)])
    results = json.loads(out.read_text())["results"]
    assert alive == [0]
    assert results[1]["name"].startswith("hf-static") and "error" not in results[1]
    assert results[1]["output_tokens"] == 2 * 256


def test_peer_model_holds_the_engines_weights(tiny_checkpoints):
    """The HF peer is built from deepbatch's own weights: its logits on a prompt equal those of
    HF loading the same checkpoint from disk."""
    import torch
    from transformers import AutoModelForCausalLM

    from deepbatch import LLM

    llm = LLM(tiny_checkpoints["llama"], dtype="float32", device="cpu")
    cfg, dtype, state = throughput._export_weights(llm)
    peer = throughput._hf_model(cfg, dtype, state, "cpu")
    ref = AutoModelForCausalLM.from_pretrained(tiny_checkpoints["llama"], dtype=torch.float32).eval()
    ids = torch.tensor([[1, 17, 42, 99, 7]])
    with torch.no_grad():
        torch.testing.assert_close(peer(ids).logits, ref(ids).logits)
