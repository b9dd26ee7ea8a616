"""``deepbatch bench serve-vs-offline`` end to end on the CPU: the offline engine and a real server
(the engine core in its own process) get the same requests, every token is counted on both
sides, and the ratio is the two throughputs'. No speed is asserted here (benchmarks do that)."""

from __future__ import annotations

import json
from pathlib import Path

from deepbatch.bench import serve_offline

TINY = str(Path(__file__).with_name("tiny-qwen3.json"))


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_same_requests_offline_and_through_a_server(tmp_path):
    out = tmp_path / "result.json"
    argv = ["--num-prompts", "6", "--random-input-len", "24", "--random-output-len", "10",
            "--variants", "process,offline-core",
            "--num-client-processes", "2", "--single-stream", "2", "--disconnect", "2", "--disconnect-streams", "3",
            "--port", str(free_port()),
            "--output-json", str(out), TINY, "--random-weights", "--max-model-len", "512", "--device", "cpu"]
    result = serve_offline.run(argv)
    assert json.loads(out.read_text())["offline"] == result["offline"]
    offline, server = result["offline"], result["servers"]["process"]
    assert offline["requests"] == 6 and offline["output_tokens"] == 6 * 10
    assert server["completed"] == 6 and server["failed"] == 0 and server["total_output_tokens"] == 6 * 10
    assert server["vs_offline"] == server["output_throughput"] / offline["output_throughput"]
    assert server["single_stream"]["mean_ttft_ms"] > 0
    # The offline engine again over its own core process: the same tokens.
    core = result["servers"]["offline-core"]
    assert core["output_tokens"] == 6 * 10
    assert core["vs_offline"] == core["output_throughput"] / offline["output_throughput"]
    # Streams whose clients left while they ran were all aborted and let go (the probe raises if
    # any is still held).
    disconnect = server["disconnect"]
    assert disconnect["streams"] == 3 and len(disconnect["rounds_ms"]) == 2 and disconnect["aborted"] == [3, 3]
    assert 0 < disconnect["max_ms"] and disconnect["mean_ms"] <= disconnect["max_ms"]
    # The engine flags reached both sides, and nothing of the bench's own reached the engine.
    assert result["engine_args"] == [TINY, "--random-weights", "--max-model-len", "512", "--device", "cpu"]


def test_engine_flags_are_checked_before_anything_starts():
    import pytest

    with pytest.raises(SystemExit):
        serve_offline.run([TINY, "--max-num-seqs", "many"])
