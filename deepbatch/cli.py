"""``deepbatch serve | generate | chat`` (vLLM's flag names).

    deepbatch serve [MODEL] --port 8000 --max-model-len 4096 --api-key KEY
    deepbatch generate "Once upon a time" --max-tokens 32
    deepbatch chat                       # a REPL; the conversation is kept until EOF

No MODEL means the embedded SmolLM2-135M-Instruct. The server's dependencies (fastapi, uvicorn,
prometheus_client) are imported only by ``serve``, so ``generate`` and ``chat`` work without them.
"""

from __future__ import annotations

import argparse
import logging
import sys

from deepbatch import envs


def _add_engine_args(p: argparse.ArgumentParser, positional_model: bool) -> None:
    if positional_model:
        p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                       help="a .gguf file or an HF model directory (default: the embedded SmolLM2)")
    p.add_argument("--model", default=None, help="same as MODEL")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model's)")
    p.add_argument("--dtype", default="auto", help="auto (bf16 on GPU, fp32 on CPU), float32, float16, bfloat16")
    p.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="most sequences in one step")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192, help="token budget of one step")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="fraction of GPU memory to use")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV cache of shared prompt prefixes")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8"], default="auto",
                   help="KV cache storage: auto (the model dtype); fp8 (= fp8_e4m3) or fp8_e5m2 with the checkpoint's "
                        "per-layer k_scale/v_scale (else 1.0); int8 with a scale per token and KV head")
    p.add_argument("--quantization", choices=["fp8", "awq", "gptq", "compressed-tensors"], default=None,
                   help="weight format: fp8 quantizes a 16-bit checkpoint to FP8 per channel while loading; "
                        "a quantized checkpoint's format is read from its config.json (naming it here only checks it)")
    p.add_argument("--num-gpu-blocks-override", type=int, default=None, help="fix the number of KV blocks")
    p.add_argument("--swap-space", type=float, default=0.0,
                   help="host memory (GiB) for preempting by swapping KV blocks out; 0: recompute only")
    p.add_argument("--preemption-mode", choices=["auto", "swap", "recompute"], default="auto",
                   help="auto: swap or recompute each victim, whichever the cost model says is cheaper")
    p.add_argument("--swap-prefill-tokens-per-s", type=float, default=None,
                   help="prefill rate the swap-or-recompute choice assumes (default: measured at start-up)")
    p.add_argument("--swap-host-link-bytes-per-s", type=float, default=None,
                   help="host-link rate the swap-or-recompute choice assumes (default: measured at start-up)")
    p.add_argument("--scheduling-policy", default="fcfs",
                   help="fcfs, priority, or fair (per-tenant fair share; the tenant is the request's 'user')")
    p.add_argument("--priority-aging-s", type=float, default=30.0,
                   help="priority policy: a waiting request gains one priority level per this many seconds")
    p.add_argument("--tenant-max-running", type=int, default=None, help="most running requests per tenant")
    p.add_argument("--tenant-max-tokens-per-minute", type=int, default=None, help="scheduled tokens per tenant per minute")
    p.add_argument("--admission", choices=["greedy", "predictive"], default="greedy",
                   help="predictive: admit only when the expected output also fits, to avoid preemption")
    p.add_argument("--kv-watermark", type=float, default=0.01, help="fraction of KV blocks kept free at admission")
    p.add_argument("--admission-batch-size", type=int, default=1,
                   help="while decoding, admit waiting requests in groups of this many (fewer eager prefill steps)")
    p.add_argument("--admission-max-delay-ms", type=float, default=250.0,
                   help="longest a free seat waits for its admission group")
    p.add_argument("--scheduling", choices=["continuous", "static"], default="continuous",
                   help="static: fixed batches (only to compare against continuous batching)")
    p.add_argument("--static-batch-size", type=int, default=8, help="batch size of --scheduling static")
    p.add_argument("--slo-ttft-ms", type=float, default=None,
                   help="p99 time-to-first-token target; turns on the SLO controller, which tunes "
                        "--max-num-seqs and --max-num-batched-tokens (as upper limits) online")
    p.add_argument("--slo-tpot-ms", type=float, default=None,
                   help="p99 time-per-output-token target of the SLO controller")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--attention-backend", choices=["auto", "torch", "triton"], default="auto")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--cuda-graph-mode", choices=["full", "decode"], default="full",
                   help="full: graphs for steps with prefill chunks too (Triton backend); decode: decode-only steps")
    p.add_argument("--mla-prefill", choices=["absorbed", "expanded"], default="expanded",
                   help="MLA models, prefill chunks: attend over their new tokens' keys and values decompressed by "
                        "kv_b_proj (expanded, the default; 3.4x fewer FLOPs) or in the latent space (absorbed); "
                        "cached context is attended in the latent space either way")
    p.add_argument("--fused-sampler", action=argparse.BooleanOptionalAction, default=True,
                   help="sample temperature-only batches with one Triton pass over the logits (GPU; default on)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule the next step while the device runs this one (default: on for CUDA)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="shard the model over this many ranks (GPUs, or CPU processes over gloo)")
    p.add_argument("--distributed-timeout-s", type=float, default=60.0,
                   help="tensor parallel: longest a collective or a worker's step may take before the engine is "
                        "declared dead")


def engine_config_from_args(args: argparse.Namespace):
    """The frozen EngineConfig, built as ``LLM.__init__`` builds it."""
    from deepbatch.config import (CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig,
                                  default_device, resolve_dtype)

    model = getattr(args, "model_tag", None) or args.model
    device = args.device or default_device()
    return EngineConfig(
        model=ModelConfig(model, resolve_dtype(args.dtype, device), args.max_model_len, args.seed, False,
                          args.tokenizer, envs.DEEPBATCH_CACHE_DIR, quantization=args.quantization),
        cache=CacheConfig(args.block_size, args.gpu_memory_utilization, args.enable_prefix_caching,
                          args.num_gpu_blocks_override, swap_space=args.swap_space,
                          swap_prefill_tokens_per_s=args.swap_prefill_tokens_per_s,
                          swap_host_link_bytes_per_s=args.swap_host_link_bytes_per_s,
                          kv_cache_dtype=args.kv_cache_dtype),
        scheduler=SchedulerConfig(
            args.max_num_seqs, args.max_num_batched_tokens, args.scheduling_policy,
            priority_aging_s=args.priority_aging_s,
            tenant_max_running=args.tenant_max_running,
            tenant_max_tokens_per_minute=args.tenant_max_tokens_per_minute,
            static_batch_size=args.static_batch_size if args.scheduling == "static" else None,
            admission=args.admission,
            admission_batch_size=args.admission_batch_size,
            admission_max_delay_ms=args.admission_max_delay_ms,
            kv_watermark=args.kv_watermark,
            slo_ttft_ms=args.slo_ttft_ms,
            slo_tpot_ms=args.slo_tpot_ms,
            preemption_mode=args.preemption_mode,
        ),
        device=device,
        attention_backend=args.attention_backend,
        enforce_eager=args.enforce_eager,
        cuda_graph_mode=args.cuda_graph_mode,
        mla_prefill=args.mla_prefill,
        fused_sampler=args.fused_sampler,
        async_scheduling=args.async_scheduling,
        parallel=ParallelConfig(args.tensor_parallel_size, args.distributed_timeout_s),
        fault_inject_sample_request=envs.DEEPBATCH_FAULT_INJECT_SAMPLE_REQUEST,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deepbatch", description="An LLM serving engine for DeepSeek-family models")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    _add_engine_args(serve, positional_model=True)
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
    serve.add_argument("--max-queued-requests", type=int, default=1024,
                       help="waiting sequences beyond which requests get 429 (0: no limit)")
    serve.add_argument("--max-queued-tokens", type=int, default=0,
                       help="waiting prompt tokens beyond which requests get 429 (0: no limit)")
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

    doctor = sub.add_parser("doctor", help="GPUs, memory, cgroup limits and the KV capacity of these settings")
    _add_engine_args(doctor, positional_model=True)
    doctor.add_argument("--json", action="store_true")
    doctor.set_defaults(func=_doctor)

    gen = sub.add_parser("generate", help="complete one prompt and print the result")
    gen.add_argument("prompt")
    _add_engine_args(gen, positional_model=False)
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.set_defaults(func=_generate)

    chat = sub.add_parser("chat", help="chat in the terminal (one line per turn; EOF ends)")
    _add_engine_args(chat, positional_model=False)
    chat.add_argument("--max-tokens", type=int, default=256)
    chat.add_argument("--temperature", type=float, default=0.7)
    chat.add_argument("--system", default=None, help="a system message to start the conversation")
    chat.set_defaults(func=_chat)
    return parser


def _doctor(args: argparse.Namespace) -> int:
    from deepbatch import doctor

    return doctor.run(engine_config_from_args(args), args.json)


def _serve(args: argparse.Namespace) -> int:
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
    )
    traces_endpoint = args.otlp_traces_endpoint or default_traces_endpoint()
    # Before the model loads: a missing OpenTelemetry install fails now.
    tracer_provider = make_tracer_provider(traces_endpoint) if traces_endpoint else None
    if tracer_provider is not None:
        logging.getLogger("deepbatch.server").info("tracing requests to %s", traces_endpoint)
    torch.manual_seed(args.seed)
    engine = AsyncEngine.from_config(
        config, max_queued_requests=args.max_queued_requests or None, max_queued_tokens=args.max_queued_tokens or None,
        tokenizer_threads=envs.DEEPBATCH_TOKENIZER_THREADS, fault_inject_step=envs.DEEPBATCH_FAULT_INJECT_STEP,
    )
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
