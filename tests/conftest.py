"""Shared fixtures: tiny random HF checkpoints built on the fly, and the embedded SmolLM2."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

# In an xdist worker, the worker's share of the cores as torch's intra-op threads, here and in the
# servers its tests start (they inherit the environment): two workers with two threads each on
# two cores contend, and the tests' small models run faster on one thread than on two even alone.
if "PYTEST_XDIST_WORKER" in os.environ:
    _workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _workers)))

import deepbatch  # noqa: E402, F401  (sets the OpenMP wait policy before torch loads)
import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import settings  # noqa: E402

if "OMP_NUM_THREADS" in os.environ:  # also where torch was imported before this file
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# Property-based tests and the schema fuzzers draw the same examples on every run (``ci``, the
# default): a red run is a real failure, and a rerun reproduces it. Long random fuzzing is opt-in:
#   HYPOTHESIS_PROFILE=fuzz python -m pytest tests/api/test_api_schema_fuzz.py tests/kv_cache
settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("fuzz", max_examples=1000, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One GGUF conversion cache for the whole run, kept out of the user's home: made by the process
# that starts the run (xdist's workers and the servers the tests start inherit it) and removed
# when that process exits, since each conversion of SmolLM2 takes half a GB of disk.
if "DEEPBATCH_CACHE_DIR" not in os.environ:
    os.environ["DEEPBATCH_CACHE_DIR"] = tempfile.mkdtemp(prefix="deepbatch-cache-")
    atexit.register(shutil.rmtree, os.environ["DEEPBATCH_CACHE_DIR"], ignore_errors=True)
# Triton reads TRITON_INTERPRET when a kernel is defined (at import), so it must be set before
# anything imports deepbatch: without a GPU every Triton kernel runs in the interpreter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

_TESTS = Path(__file__).resolve().parent
# Test files that start server processes (tests/api's own modules start a few SmolLM2 servers at
# a time, tests/serve_ray a Ray cluster): kept on one xdist worker, one after the other, so that
# their memory and start-up CPU never add up with each other's (side by side on two workers they
# made the run slower). Everything else is shared out between workers, test by test, except the
# modules below, whose module-scoped fixture is most of their cost: kept on one worker, it is
# built once rather than once per worker.
_SERVER_DIRS = (_TESTS / "api", _TESTS / "serve_ray")
_ONE_WORKER_MODULES = {_TESTS / "models" / "test_kv_cache_quality.py"}  # three engines over 4,096 tokens


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config, items):
    for item in items:
        path = Path(item.path).resolve()
        if path.parent in _SERVER_DIRS:
            item.add_marker(pytest.mark.xdist_group("servers"))
        elif path in _ONE_WORKER_MODULES:
            item.add_marker(pytest.mark.xdist_group(path.stem))


TINY_COMMON = dict(
    vocab_size=384,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    # Peaky logits keep greedy argmax away from near-ties between fp32 implementations.
    initializer_range=0.15,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)


def tiny_config(arch: str):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    if arch == "llama":
        return LlamaConfig(
            **TINY_COMMON,
            rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 128},
        )
    if arch == "qwen2":
        return Qwen2Config(**TINY_COMMON, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if arch == "qwen3":
        return Qwen3Config(**{**TINY_COMMON, "num_key_value_heads": 1}, head_dim=32,
                           rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    raise ValueError(arch)


def build_tiny_checkpoint(arch: str, path: str, seed: int = 0) -> str:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch), dtype=torch.float32)
    with torch.no_grad():
        # Random biases, so a loader that drops them is caught.
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.1)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {arch: build_tiny_checkpoint(arch, str(root / arch)) for arch in ("llama", "qwen2", "qwen3")}


@pytest.fixture(scope="session")
def smollm_llm():
    from deepbatch import LLM

    return LLM(max_model_len=1024, dtype="float32", device="cpu")
