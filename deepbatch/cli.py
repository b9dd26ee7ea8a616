"""``deepbatch serve | generate | chat`` (vLLM's flag names).

    deepbatch serve [MODEL] --port 8000 --max-model-len 4096 --api-key KEY
    deepbatch generate "Once upon a time" --max-tokens 32
    deepbatch chat                       # a REPL; the conversation is kept until EOF

No MODEL means the embedded SmolLM2-135M-Instruct. The server's dependencies (fastapi, uvicorn,
prometheus_client) are imported only by ``serve``, so ``generate`` and ``chat`` work without them.
"""

from __future__ import annotations

import argparse
import gc
import logging
import sys

from deepbatch import envs
from deepbatch.engine_args import add_engine_args, add_queue_args, engine_config_from_args


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deepbatch", description="An LLM serving engine for DeepSeek-family models")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    add_engine_args(serve, positional_model=True)
    serve.add_argument("--host", default="0.0.0.0", help="address to bind")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--served-model-name", nargs="+", default=None,
                       help="model name(s) clients use; the first is reported (default: the model's)")
    serve.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' on every route but /health "
                            "(default: $DEEPBATCH_API_KEY); it binds no tenant: the request's user field names it")
    serve.add_argument("--api-keys-file", default=None, metavar="PATH",
                       help="API keys bound to tenants, one per line: 'KEY TENANT [priority_ceiling=N] "
                            "[max_concurrent=N]' ('#' comments); reloaded on SIGHUP; works beside --api-key")
    add_queue_args(serve)
    serve.add_argument("--shutdown-timeout", type=float, default=30.0,
                       help="seconds in-flight requests may run after SIGTERM before they are aborted")
    serve.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                       help="send one OpenTelemetry span per request to this OTLP collector, e.g. grpc://localhost:4317 "
                            "(default: $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT; none: no tracing); "
                            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf sends over HTTP. "
                            "Needs pip install 'deepbatch[otel]'")
    serve.add_argument("--chat-template", default=None, metavar="PATH_OR_TEMPLATE",
                       help="a Jinja chat template (a file, or the template itself) that replaces the model's")
    serve.add_argument("--enable-auto-tool-choice", action="store_true",
                       help='let the model decide when to call tools (tool_choice "auto", the default when tools '
                            "are sent); needs --tool-call-parser")
    serve.add_argument("--tool-call-parser", default=None, metavar="NAME",
                       help="how tool calls read in the model's output (vLLM's names: hermes, llama3_json, "
                            'deepseek_v3, ...); tool_choice "required" and named functions need none')
    serve.add_argument("--reasoning-parser", default=None, metavar="NAME",
                       help="split the model's thinking into reasoning_content: deepseek_r1 or qwen3")
    serve.add_argument("--api-server-count", type=int, default=1, metavar="N",
                       help="API processes sharing the port in front of the one engine core (HTTP, tokenization, "
                            "detokenization and SSE spread over N processes); more than one helps when the HTTP "
                            "side is the bottleneck. Not with --replicas or DEEPBATCH_ENGINE_PROCESS=0")
    serve.add_argument("--replicas", type=int, default=None, metavar="N",
                       help="run N engine replicas behind a Ray Serve ingress with prefix-aware routing (on this "
                            "machine, or the Ray cluster RAY_ADDRESS names); needs pip install 'deepbatch[ray]'; "
                            "see docs/scale-out.md")
    serve.set_defaults(func=_serve)

    bench = sub.add_parser("bench", help="benchmarks: offline throughput, or an online serving load")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    from deepbatch.bench import serve as bench_serve
    from deepbatch.bench import throughput as bench_throughput

    for name, module, text in (("throughput", bench_throughput, "an offline workload against HF peers and the roofline"),
                               ("serve", bench_serve, "an OpenAI-API load generator against a running server")):
        p = bench_sub.add_parser(name, help=text)
        module.add_arguments(p)
        p.set_defaults(func=lambda a, m=module: (m.run(a), 0)[1])
    # Its engine flags go to two engines (offline and the server) as written, so main() hands it
    # the raw arguments; this entry is for the help listing.
    from deepbatch.bench import serve_offline as bench_serve_offline

    compare = bench_sub.add_parser("serve-vs-offline", help="the same requests offline and through a server")
    bench_serve_offline.add_arguments(compare)

    doctor = sub.add_parser("doctor", help="GPUs, memory, cgroup limits and the KV capacity of these settings")
    add_engine_args(doctor, positional_model=True)
    doctor.add_argument("--json", action="store_true")
    doctor.set_defaults(func=_doctor)

    gen = sub.add_parser("generate", help="complete one prompt and print the result")
    gen.add_argument("prompt")
    add_engine_args(gen, positional_model=False)
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.set_defaults(func=_generate)

    chat = sub.add_parser("chat", help="chat in the terminal (one line per turn; EOF ends)")
    add_engine_args(chat, positional_model=False)
    chat.add_argument("--max-tokens", type=int, default=256)
    chat.add_argument("--temperature", type=float, default=0.7)
    chat.add_argument("--system", default=None, help="a system message to start the conversation")
    chat.set_defaults(func=_chat)
    return parser


def _doctor(args: argparse.Namespace) -> int:
    from deepbatch import doctor

    return doctor.run(engine_config_from_args(args), args.json)


def _serve(args: argparse.Namespace) -> int:
    if args.api_server_count < 1:
        raise ValueError(f"--api-server-count must be at least 1, got {args.api_server_count}")
    if args.api_server_count > 1 and args.replicas is not None:
        raise ValueError("--api-server-count: not available with --replicas (each replica has its own server)")
    if args.api_server_count > 1 and not envs.DEEPBATCH_ENGINE_PROCESS:
        raise ValueError("--api-server-count needs the engine core in its own process (DEEPBATCH_ENGINE_PROCESS=1)")
    if args.replicas is not None:
        from deepbatch.serve_ray.cli import serve_replicas

        chat_flags = [flag for flag, value in (
            ("--chat-template", args.chat_template), ("--tool-call-parser", args.tool_call_parser),
            ("--enable-auto-tool-choice", args.enable_auto_tool_choice), ("--reasoning-parser", args.reasoning_parser),
        ) if value]
        if chat_flags:
            raise ValueError(f"{', '.join(chat_flags)}: not available with --replicas")

        return serve_replicas(args)
    import torch

    from deepbatch.api.auth import load_keys
    from deepbatch.api.chat_output import check_parser_flags
    from deepbatch.api.chat_template import load_chat_template
    from deepbatch.api.server import ServerConfig, run_server
    from deepbatch.engine.async_engine import AsyncEngine
    from deepbatch.engine.core_client import EngineCoreClient
    from deepbatch.metrics.tracing import default_traces_endpoint, make_tracer_provider

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s [%(name)s] %(message)s")
    config = engine_config_from_args(args)
    api_key = args.api_key or envs.DEEPBATCH_API_KEY
    load_keys(args.api_keys_file, api_key)  # a bad keys file fails now, not after the model has loaded
    # Flags that can fail do so before the model loads.
    chat_template = load_chat_template(args.chat_template) if args.chat_template is not None else None
    check_parser_flags(args.tool_call_parser, args.reasoning_parser, args.enable_auto_tool_choice)
    server_config = ServerConfig(
        host=args.host, port=args.port, served_model_names=tuple(args.served_model_name or ()),
        api_key=api_key, api_keys_file=args.api_keys_file, shutdown_timeout=args.shutdown_timeout,
        max_request_body_bytes=envs.DEEPBATCH_MAX_REQUEST_BODY_BYTES,
        log_stats_interval=envs.DEEPBATCH_LOG_STATS_INTERVAL,
        chat_template=chat_template, enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
        event_loop="auto" if envs.DEEPBATCH_ENGINE_PROCESS else "asyncio",
    )
    traces_endpoint = args.otlp_traces_endpoint or default_traces_endpoint()
    # Before the model loads: a missing OpenTelemetry install fails now.
    tracer_provider = make_tracer_provider(traces_endpoint) if traces_endpoint else None
    if tracer_provider is not None:
        logging.getLogger("deepbatch.server").info("tracing requests to %s", traces_endpoint)
    torch.manual_seed(args.seed)
    client_kwargs = dict(max_queued_requests=args.max_queued_requests or None,
                         max_queued_tokens=args.max_queued_tokens or None,
                         tokenizer_threads=envs.DEEPBATCH_TOKENIZER_THREADS)
    if args.api_server_count > 1:
        from deepbatch.api.launcher import run_api_servers

        if tracer_provider is not None:
            tracer_provider.shutdown()  # each API process makes its own
        return run_api_servers(config, server_config, args.api_server_count, traces_endpoint=traces_endpoint,
                               client_kwargs=client_kwargs, fault_inject_step=envs.DEEPBATCH_FAULT_INJECT_STEP)
    # The engine core in its own process (the default), or stepped on a thread of this one.
    engine_class = EngineCoreClient if envs.DEEPBATCH_ENGINE_PROCESS else AsyncEngine
    engine = engine_class.from_config(config, fault_inject_step=envs.DEEPBATCH_FAULT_INJECT_STEP, **client_kwargs)
    # What start-up built (modules, the tokenizer, the config) lives as long as the process: keep
    # it out of the collector's generations, so the objects every token creates are collected
    # without walking it again.
    gc.collect()
    gc.freeze()
    try:
        return run_server(engine, server_config, tracer_provider)
    finally:
        if tracer_provider is not None:
            tracer_provider.shutdown()  # sends the spans still batched


def _generate(args: argparse.Namespace) -> int:
    from deepbatch import LLM, SamplingParams

    llm = LLM.from_config(engine_config_from_args(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    if args.chat:
        out = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)
    else:
        out = llm.generate(args.prompt, params, use_tqdm=False)
    print(out[0].outputs[0].text)
    return 0


def _chat(args: argparse.Namespace) -> int:
    from deepbatch import LLM, SamplingParams

    llm = LLM.from_config(engine_config_from_args(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    system = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(system)
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            print("> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line:  # EOF
            return 0
        line = line.rstrip("\n")
        if not line.strip():
            continue
        if line.strip() == "/reset":
            messages = list(system)
            continue
        messages.append({"role": "user", "content": line})
        reply = llm.chat(messages, params, use_tqdm=False)[0].outputs[0].text
        messages.append({"role": "assistant", "content": reply})
        print(reply, flush=True)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:2] == ["bench", "serve-vs-offline"]:
        from deepbatch.bench import serve_offline

        serve_offline.main(argv[2:])
        return
    args = build_parser().parse_args(argv)
    try:
        code = args.func(args)
    except (ValueError, FileNotFoundError) as e:  # bad flags or model path: a message, not a traceback
        print(f"deepbatch: error: {e}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:
        code = 130
    sys.exit(code)


if __name__ == "__main__":
    main()
