"""Application arguments: engine flags go through `deepbatch serve`'s own parser, so they mean
and fail as they do there; bad arguments are errors naming them."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from deepbatch.cli import build_parser, engine_config_from_args
from deepbatch.serve_ray.args import AppArgs, engine_namespace
from deepbatch.serve_ray.cli import app_args_from_cli


def test_engine_args_build_the_same_config_as_the_command_line():
    argv = ["--max-num-seqs", "4", "--no-enable-prefix-caching", "--kv-cache-dtype", "int8", "--enforce-eager",
            "--max-model-len", "512", "--scheduling-policy", "fair",
            "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}']
    expected = engine_config_from_args(build_parser().parse_args(["serve", *argv]))
    given = {"max_num_seqs": 4, "enable-prefix-caching": False, "--kv-cache-dtype": "int8", "enforce_eager": True,
             "max_model_len": "512", "scheduling_policy": "fair",
             "speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}  # a mapping, as YAML gives it
    assert engine_config_from_args(engine_namespace(given)) == expected
    assert expected.speculative_config.num_speculative_tokens == 2


@pytest.mark.parametrize("args, message", [
    ({"max_num_seqs": "many"}, "argument --max-num-seqs: invalid int value: 'many'"),
    ({"kv_cache_dtype": "fp4"}, "argument --kv-cache-dtype: invalid choice: 'fp4'"),
    ({"port": 9000}, "unknown engine argument 'port'"),
    ({"max-num-seq": 4}, "unknown engine argument 'max-num-seq'"),
])
def test_bad_engine_args_name_the_flag(args, message):
    with pytest.raises(ValueError) as e:
        engine_namespace(args)
    assert message in str(e.value)


def test_app_args_take_json_strings_as_serve_run_passes_them():
    args = AppArgs.model_validate({"num_replicas": "2", "engine_args": '{"max_num_seqs": 8}',
                                   "canary": '{"engine_args": {"kv_cache_dtype": "int8"}, "num_replicas": 1}',
                                   "model": "/models/x.gguf", "autoscaling": '{"max_replicas": 6}'})
    assert args.num_replicas == 2 and args.autoscaling == {"max_replicas": 6}
    assert args.stable_engine_args() == {"max_num_seqs": 8, "model": "/models/x.gguf"}
    assert args.canary_engine_args() == {"max_num_seqs": 8, "model": "/models/x.gguf", "kv_cache_dtype": "int8"}


@pytest.mark.parametrize("args, field", [
    ({"num_replicas": 0}, "num_replicas"),
    ({"router": "random"}, "router"),
    ({"replicas": 2}, "replicas"),
    ({"canary": {"num_replica": 1}}, "canary.num_replica"),
    ({"engine_args": "{not json"}, "engine_args"),
])
def test_bad_app_args_name_the_field(args, field):
    with pytest.raises(ValidationError) as e:
        AppArgs.model_validate(args)
    assert field in str(e.value)


def test_cli_flags_become_app_args():
    ns = build_parser().parse_args(["serve", "/models/m.gguf", "--max-num-seqs", "16", "--port", "9000",
                                    "--api-key", "k", "--shutdown-timeout", "5"])
    ns.replicas = 3  # the flag `deepbatch serve --replicas` adds
    args = app_args_from_cli(ns)
    assert args.num_replicas == 3 and args.model == "/models/m.gguf" and args.api_key == "k"
    assert args.graceful_shutdown_timeout_s == 5.0
    assert args.stable_engine_args() == {"max_num_seqs": 16, "model": "/models/m.gguf"}


def test_the_engine_the_server_and_the_cli_do_not_import_ray():
    import subprocess
    import sys

    code = ("import sys, deepbatch.cli, deepbatch.llm, deepbatch.api.server, deepbatch.engine.async_engine; "
            "deepbatch.cli.build_parser(); print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_example_serve_config_is_valid_and_builds():
    pytest.importorskip("ray.serve", reason="ray[serve] is not installed")
    from pathlib import Path

    import yaml
    from ray.serve.schema import ServeDeploySchema

    from deepbatch.serve_ray.app import build_app

    path = Path(__file__).resolve().parents[2] / "deploy" / "ray" / "serve-config.yaml"
    config = ServeDeploySchema.model_validate(yaml.safe_load(path.read_text()))
    [application] = config.applications
    assert application.import_path == "deepbatch.serve_ray.app:app"
    build_app(application.args)  # engine flags, canary, rollout spec: all checked here
