"""Engine arguments come from the config dataclasses alone: every argument is a flag of each
engine command and a keyword of ``LLM(...)``, both build the same config through one builder, and
each value lands in the config field written out by hand below."""

from __future__ import annotations

import argparse
import functools
import inspect
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import deepbatch.llm
from deepbatch import engine_args
from deepbatch.cli import build_parser
from deepbatch.engine_args import engine_config_from_args
from deepbatch.config import SpeculativeConfig, default_device
from deepbatch.engine_args import engine_config, flags_markdown, llm_parameters

REPO = Path(__file__).resolve().parents[1]

# A value other than the default for every engine argument, and the config field it must land
# in. An argument added to the config fails test_every_argument_has_a_case until it is here.
CASES = {
    "model": ("m.gguf", ("model", "model")),
    "dtype": ("float16", ("model", "dtype")),
    "max_model_len": (1024, ("model", "max_model_len")),
    "seed": (5, ("model", "seed")),
    "random_weights": (True, ("model", "random_weights")),
    "tokenizer": ("tok/", ("model", "tokenizer")),
    "quantization": ("fp8", ("model", "quantization")),
    "block_size": (32, ("cache", "block_size")),
    "gpu_memory_utilization": (0.5, ("cache", "gpu_memory_utilization")),
    "enable_prefix_caching": (False, ("cache", "enable_prefix_caching")),
    "num_gpu_blocks_override": (99, ("cache", "num_gpu_blocks_override")),
    "swap_space": (1.5, ("cache", "swap_space")),
    "swap_prefill_tokens_per_s": (1000.0, ("cache", "swap_prefill_tokens_per_s")),
    "swap_host_link_bytes_per_s": (2e9, ("cache", "swap_host_link_bytes_per_s")),
    "kv_cache_dtype": ("int8", ("cache", "kv_cache_dtype")),
    "calculate_kv_scales": (True, ("cache", "calculate_kv_scales")),
    "max_num_seqs": (8, ("scheduler", "max_num_seqs")),
    "max_num_batched_tokens": (512, ("scheduler", "max_num_batched_tokens")),
    "scheduling_policy": ("priority", ("scheduler", "policy")),
    "priority_aging_s": (3.0, ("scheduler", "priority_aging_s")),
    "tenant_max_running": (4, ("scheduler", "tenant_max_running")),
    "tenant_max_tokens_per_minute": (100, ("scheduler", "tenant_max_tokens_per_minute")),
    "static_batch_size": (3, ("scheduler", "static_batch_size")),
    "admission": ("predictive", ("scheduler", "admission")),
    "kv_watermark": (0.05, ("scheduler", "kv_watermark")),
    "slo_ttft_ms": (100.0, ("scheduler", "slo_ttft_ms")),
    "slo_tpot_ms": (20.0, ("scheduler", "slo_tpot_ms")),
    "admission_batch_size": (16, ("scheduler", "admission_batch_size")),
    "admission_max_delay_ms": (10.0, ("scheduler", "admission_max_delay_ms")),
    "preemption_mode": ("recompute", ("scheduler", "preemption_mode")),
    "device": ("cuda", ("device",)),
    "attention_backend": ("torch", ("attention_backend",)),
    "enforce_eager": (True, ("enforce_eager",)),
    "cuda_graph_mode": ("decode", ("cuda_graph_mode",)),
    "mla_prefill": ("absorbed", ("model", "mla_prefill")),
    "fused_sampler": (False, ("fused_sampler",)),
    "async_scheduling": (False, ("async_scheduling",)),
    "tensor_parallel_size": (2, ("parallel", "tensor_parallel_size")),
    "distributed_timeout_s": (7.0, ("parallel", "distributed_timeout_s")),
    "speculative_config": ('{"method": "ngram", "num_speculative_tokens": 4}', ("speculative_config",)),
}
# What a value becomes in the config where it is not itself.
STORED = {"dtype": torch.float16, "speculative_config": SpeculativeConfig(num_speculative_tokens=4)}
INTERNAL = ("cache_dir", "cpu_kv_cache_bytes", "fault_inject_sample_request")


def commands() -> dict[str, argparse.ArgumentParser]:
    def sub(parser):
        return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices

    top = sub(build_parser())
    return {"serve": top["serve"], "generate": top["generate"], "chat": top["chat"], "doctor": top["doctor"],
            "bench throughput": sub(top["bench"])["throughput"]}


def cli_flags(name: str, value) -> list[str]:
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        return [flag if value else "--no-" + flag[2:]]
    if name == "static_batch_size":
        return ["--scheduling", "static", flag, str(value)]
    return [flag, str(value)]


def at(config, path):
    return functools.reduce(getattr, path, config)


@pytest.fixture
def captured(monkeypatch):
    """The configs LLM(...) hands its engine, without loading a model."""
    configs = []
    monkeypatch.setattr(deepbatch.llm, "LLMEngine", configs.append)
    return configs


def test_every_argument_has_a_case():
    assert {a.name for a in engine_args.engine_args()} == set(CASES)


def test_llm_signature_is_the_engine_arguments():
    """LLM.__init__ is written out for IDEs; it must match the config's arguments exactly."""
    written = list(inspect.signature(deepbatch.llm.LLM.__init__).parameters.values())[1:]
    assert {p.name: (p.kind, p.default) for p in written} == {p.name: (p.kind, p.default) for p in llm_parameters()}
    doc = inspect.getdoc(deepbatch.llm.LLM.__init__)
    for a in engine_args.engine_args():
        assert re.search(rf"^    {a.name}\b", doc, re.MULTILINE), a.name


@pytest.mark.parametrize("name", sorted(CASES))
def test_cli_and_llm_put_each_argument_in_its_field(name, captured):
    value, path = CASES[name]
    expected = STORED.get(name, value)
    by_llm = deepbatch.llm.LLM(**{"admission_batch_size": 1, name: value})  # the CLI's default
    (config,) = captured
    assert by_llm is not None and at(config, path) == expected
    assert engine_config(**{"admission_batch_size": 1, name: value}) == config
    for argv in (["serve", *cli_flags(name, value)], ["generate", "hi", *cli_flags(name, value)]):
        assert engine_config_from_args(build_parser().parse_args(argv)) == config, argv


def test_every_command_has_every_flag_with_its_default():
    for command, parser in commands().items():
        actions = {a.dest: a for a in parser._actions}
        for a in engine_args.engine_args():
            action = actions[a.name]
            assert set(a.flags) <= set(action.option_strings), (command, a.name)
            expected = None if command == "bench throughput" and a.name == "admission_batch_size" else a.cli_default
            assert action.default == expected, (command, a.name)
            assert (tuple(action.choices) if action.choices else None) == a.choices, (command, a.name)
            if a.type is bool:
                assert isinstance(action, argparse.BooleanOptionalAction), (command, a.name)


@pytest.mark.parametrize("argv, path, expected", [
    (["serve", "m.gguf"], ("model", "model"), "m.gguf"),
    (["doctor", "m.gguf"], ("model", "model"), "m.gguf"),
    (["serve", "--model", "m.gguf"], ("model", "model"), "m.gguf"),
    (["serve"], ("model", "model"), None),
    (["generate", "hi", "-tp", "2"], ("parallel", "tensor_parallel_size"), 2),
    (["serve", "--enforce-eager"], ("enforce_eager",), True),
    (["serve", "--no-enable-prefix-caching"], ("cache", "enable_prefix_caching"), False),
    (["serve", "--scheduling", "static"], ("scheduler", "static_batch_size"), 8),
    (["serve", "--static-batch-size", "3"], ("scheduler", "static_batch_size"), None),
    (["serve", "--scheduling", "continuous", "--static-batch-size", "3"], ("scheduler", "static_batch_size"), None),
    (["serve", "--device", "cuda"], ("scheduler", "admission_batch_size"), 1),
    (["serve", "--device", "cuda"], ("model", "dtype"), torch.bfloat16),
    (["serve", "--device", "cpu"], ("model", "dtype"), torch.float32),
    (["serve"], ("device",), default_device()),
])
def test_the_flags_in_use_keep_their_meaning(argv, path, expected):
    assert at(engine_config_from_args(build_parser().parse_args(argv)), path) == expected


@pytest.mark.parametrize("kwargs, expected", [
    ({"device": "cuda"}, 64),  # offline runs are for throughput: fewer steps without CUDA graphs
    ({"device": "cuda", "enforce_eager": True}, 1),
    ({"device": "cpu"}, 1),
    ({"device": "cuda", "admission_batch_size": 2}, 2),
])
def test_llm_admission_batch_size_default_depends_on_the_device(kwargs, expected, captured):
    deepbatch.llm.LLM(**kwargs)
    assert captured[0].scheduler.admission_batch_size == expected
    assert engine_config(**kwargs).scheduler.admission_batch_size == expected


def test_bench_throughput_keeps_llms_admission_default():
    parser = commands()["bench throughput"]
    args = parser.parse_args(["--workload", "nano", "--device", "cuda"])
    assert engine_config(**engine_args.engine_kwargs_from_args(args)).scheduler.admission_batch_size == 64
    args = parser.parse_args(["--workload", "nano", "--device", "cuda", "--admission-batch-size", "2"])
    assert engine_config(**engine_args.engine_kwargs_from_args(args)).scheduler.admission_batch_size == 2


def test_unknown_keyword_is_a_type_error_naming_it():
    with pytest.raises(TypeError, match="'max_num_seq'"):
        engine_config(max_num_seq=4)
    with pytest.raises(TypeError, match="'max_num_seq'"):
        deepbatch.llm.LLM(max_num_seq=4)


@pytest.mark.parametrize("kwargs, message", [
    ({"block_size": 3}, "block_size: must be a power of two"),
    ({"scheduling_policy": "lottery"}, "scheduling_policy: must be one of fcfs, priority, fair"),
    ({"quantization": "int4"}, "quantization: must be one of"),
    ({"kv_cache_dtype": "fp4"}, "kv_cache_dtype: must be one of"),
    ({"dtype": "int8"}, "dtype: unknown dtype"),
    ({"preemption_mode": "swap"}, "needs a swap space"),
    ({"tensor_parallel_size": 0}, "tensor_parallel_size: must be >= 1"),
    ({"calculate_kv_scales": "yes"}, "calculate_kv_scales: must be true or false"),
    ({"enable_prefix_caching": 0}, "enable_prefix_caching: must be true or false"),
    ({"async_scheduling": "off"}, "async_scheduling: must be true or false"),
])
def test_bad_values_are_the_configs_value_errors(kwargs, message, captured):
    with pytest.raises(ValueError, match=message):
        engine_config(**kwargs)
    with pytest.raises(ValueError, match=message):
        deepbatch.llm.LLM(**kwargs)
    assert captured == []


def test_internal_fields_are_not_arguments_and_read_the_environment(monkeypatch, tmp_path):
    names = {a.name for a in engine_args.engine_args()}
    assert names.isdisjoint(INTERNAL)
    parser = build_parser()
    for name in INTERNAL:
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", "--" + name.replace("_", "-"), "1"])
    monkeypatch.setenv("DEEPBATCH_FAULT_INJECT_SAMPLE_REQUEST", "cmpl-x")
    monkeypatch.setenv("DEEPBATCH_CACHE_DIR", str(tmp_path))
    for config in (engine_config(), engine_config_from_args(parser.parse_args(["serve"]))):
        assert config.fault_inject_sample_request == "cmpl-x" and config.model.cache_dir == str(tmp_path)


def test_a_field_neither_argument_nor_internal_is_refused():
    @dataclass(frozen=True)
    class Undeclared:
        extra: int = 0

    with pytest.raises(TypeError, match="Undeclared.extra"):
        list(engine_args._fields(Undeclared))


def test_the_docs_flag_reference_is_the_generated_one():
    text = (REPO / "docs" / "operations.md").read_text()
    block = re.search(r"<!-- engine-flags:begin[^\n]*-->\n(.*?)<!-- engine-flags:end -->", text, re.DOTALL)
    assert block, "docs/operations.md has no engine flag reference"
    assert block.group(1) == flags_markdown(), "regenerate it: python -m deepbatch.engine_args"
    for a in engine_args.engine_args():
        assert f"`{a.flags[0]}`" in block.group(1)


def test_bench_and_the_builder_import_no_server_dependency():
    code = ("import sys, deepbatch.engine_args, deepbatch.llm, deepbatch.bench.throughput; "
            "print(sorted(m for m in ('fastapi', 'uvicorn', 'pydantic') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}).stdout
    assert out.strip() == "[]"
