"""The CLI without a model: flags build the same EngineConfig as ``LLM(...)``, ``generate`` prints
the completion, ``chat`` keeps the conversation until EOF, and ``generate`` imports no server
dependency."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest

import deepbatch.llm
from deepbatch import cli
from deepbatch.core.outputs import CompletionOutput, RequestOutput


class FakeLLM:
    instances: list[FakeLLM] = []

    def __init__(self, config):
        self.config = config
        self.calls: list = []
        FakeLLM.instances.append(self)

    @classmethod
    def from_config(cls, config):
        return cls(config)

    def generate(self, prompt, params, use_tqdm=True):
        self.calls.append(("generate", prompt, params))
        return [RequestOutput("r", prompt, [1], [CompletionOutput(0, f" <{prompt}>", [2], "length")], True)]

    def chat(self, messages, params, use_tqdm=True):
        self.calls.append(("chat", [dict(m) for m in messages], params))
        return [RequestOutput("r", None, [1], [CompletionOutput(0, f"reply {len(messages)}", [2], "stop")], True)]


@pytest.fixture
def fake_llm(monkeypatch):
    FakeLLM.instances.clear()
    monkeypatch.setattr(deepbatch.llm, "LLM", FakeLLM)
    return FakeLLM


def run_cli(argv, stdin: str = "") -> tuple[int, str]:
    out = io.StringIO()
    old = sys.stdin, sys.stdout
    sys.stdin, sys.stdout = io.StringIO(stdin), out
    try:
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
    finally:
        sys.stdin, sys.stdout = old
    return e.value.code, out.getvalue()


def test_engine_config_matches_llm(monkeypatch):
    captured = []
    monkeypatch.setattr(deepbatch.llm, "LLMEngine", lambda config: captured.append(config))
    argv = ["serve", "some/model.gguf", "--max-model-len", "1024", "--max-num-seqs", "8",
            "--max-num-batched-tokens", "512", "--no-enable-prefix-caching", "--gpu-memory-utilization", "0.5",
            "--dtype", "float32", "--device", "cpu", "--block-size", "32", "--num-gpu-blocks-override", "99",
            "--scheduling-policy", "priority", "--seed", "5", "--mla-prefill", "expanded"]
    args = cli.build_parser().parse_args(argv)
    config = cli.engine_config_from_args(args)
    deepbatch.llm.LLM.from_config(config)
    # The same settings given to LLM(...) as keywords build the same config.
    deepbatch.llm.LLM("some/model.gguf", max_model_len=1024, max_num_seqs=8, max_num_batched_tokens=512,
                      enable_prefix_caching=False, gpu_memory_utilization=0.5, dtype="float32", device="cpu",
                      block_size=32, num_gpu_blocks_override=99, scheduling_policy="priority", seed=5,
                      mla_prefill="expanded")
    assert captured == [config, config]
    assert config.model.model == "some/model.gguf" and config.cache.enable_prefix_caching is False
    assert (config.scheduler.max_num_seqs, config.scheduler.max_num_batched_tokens) == (8, 512)
    assert config.model.mla_prefill == "expanded"
    # --model is the same as the positional MODEL; neither means the embedded default.
    def model_of(argv):
        return cli.engine_config_from_args(cli.build_parser().parse_args(argv)).model.model

    assert model_of(["serve", "--model", "m.gguf"]) == "m.gguf"
    assert model_of(["serve"]) is None


def test_serve_flags():
    args = cli.build_parser().parse_args(
        ["serve", "--host", "127.0.0.1", "--port", "9", "--served-model-name", "a", "b", "--api-key", "k",
         "--max-queued-requests", "3", "--shutdown-timeout", "0", "--enable-prefix-caching"])
    assert (args.host, args.port, args.served_model_name, args.api_key) == ("127.0.0.1", 9, ["a", "b"], "k")
    assert (args.max_queued_requests, args.shutdown_timeout, args.enable_prefix_caching) == (3, 0.0, True)


def test_generate_prints_completion(fake_llm):
    code, out = run_cli(["generate", "Hello", "--max-tokens", "7", "--temperature", "0.5"])
    assert (code, out) == (0, " <Hello>\n")
    (llm,) = fake_llm.instances
    kind, prompt, params = llm.calls[0]
    assert (kind, prompt, params.max_tokens, params.temperature) == ("generate", "Hello", 7, 0.5)
    code, out = run_cli(["generate", "Hi", "--chat"])
    assert code == 0 and out == "reply 1\n"
    assert fake_llm.instances[-1].calls[0][1] == [{"role": "user", "content": "Hi"}]


def test_chat_keeps_the_conversation_until_eof(fake_llm):
    code, out = run_cli(["chat", "--system", "Be brief"], stdin="Hi\n\nAnd then?\n")
    assert code == 0
    assert out.splitlines() == ["reply 2", "reply 4"]
    (llm,) = fake_llm.instances
    assert [m["role"] for m in llm.calls[1][1]] == ["system", "user", "assistant", "user"]
    assert llm.calls[1][1][2]["content"] == "reply 2"


def test_generate_needs_no_server_dependencies():
    code = ("import sys; from deepbatch import cli; cli.build_parser(); "
            "print(sorted(m for m in ('fastapi', 'uvicorn', 'prometheus_client') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_bad_model_path_is_a_clean_error(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "x", "--model", "/no/such/model.gguf"])
    assert e.value.code == 2
    assert "deepbatch: error:" in capsys.readouterr().err
