"""Fixtures for tensor-parallel tests: tiny HF checkpoints (Llama and Qwen3 from the shared
fixture, DeepSeek-V2 built here) and one intra-op thread per rank (two ranks share the cores)."""

from __future__ import annotations

import multiprocessing.util
import os
import sys
import tempfile

import pytest
import torch

# The HF reference helpers live beside the model tests.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models"))


@pytest.fixture(autouse=True, scope="package")
def one_thread():
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


@pytest.fixture(autouse=True)
def worker_logs_in_tmp_path(tmp_path, monkeypatch):
    """A failed engine keeps its workers' log directory (under the temp dir): keep those of the
    tests that fail engines on purpose inside the test's own directory. multiprocessing's own
    temp dir (the fork server's socket lives there) is made first, in the real temp dir: it is
    made once per process and must outlive this test."""
    multiprocessing.util.get_temp_dir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))


@pytest.fixture(scope="package")
def tp_checkpoints(tiny_checkpoints, tmp_path_factory):
    from test_deepseek import build_deepseek_checkpoint

    root = tmp_path_factory.mktemp("tiny-tp")
    return {
        "llama": tiny_checkpoints["llama"],  # 4 query heads, 2 KV heads: one of each kind per rank
        "qwen3": tiny_checkpoints["qwen3"],  # 1 KV head: replicated on both ranks
        "deepseek_v2": build_deepseek_checkpoint("v2", str(root / "deepseek_v2")),  # MLA + MoE
    }
