"""``deepbatch bench serve-vs-offline``: the same requests offline (``LLM.generate``) and through
a real ``deepbatch serve`` process at saturation, in one run; prints what share of the offline
engine's output throughput the server delivers.

    deepbatch bench serve-vs-offline benchmarks/models/qwen3-0.6b.json --num-prompts 1000 \\
        --random-input-len 1000 --random-output-len 250 --num-client-processes 4

Every engine flag after the model (``--max-num-seqs``, ``--kv-cache-dtype``, ...) is given to
both the offline engine and the server. Each side runs in a process of its own, one after the
other, so each has the whole GPU: the offline engine first, then one server per ``--variants``
entry (``process``: the engine core in its own process, the default; ``apiN``: the same with N
API processes, ``--api-server-count N``; ``thread``: the engine stepped on a thread of the API
process, ``DEEPBATCH_ENGINE_PROCESS=0``; ``offline-core``: no server, the offline engine again
with its core in a process of its own, ``DEEPBATCH_LLM_ENGINE_PROCESS=1``). The load is
``deepbatch bench serve`` with every request sent at once (streamed, token-id prompts,
``ignore_eos``), from ``--num-client-processes`` processes so the client is never the limit.
``--single-stream N`` adds N requests one at a time per server for TTFT and TPOT at no load;
``--disconnect R`` measures how fast each server lets go of streams whose clients left.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

from deepbatch.engine_args import add_engine_args

_VARIANT_ENV = {"process": {"DEEPBATCH_ENGINE_PROCESS": "1"}, "thread": {"DEEPBATCH_ENGINE_PROCESS": "0"}}


# The offline engine over its core process, compared with the offline run in this process.
OFFLINE_CORE = "offline-core"


def _variant(name: str) -> tuple[dict[str, str], list[str]]:
    """A variant's environment and extra server flags; ValueError for an unknown one."""
    if name == OFFLINE_CORE:
        return {"DEEPBATCH_LLM_ENGINE_PROCESS": "1"}, []
    if name in _VARIANT_ENV:
        return _VARIANT_ENV[name], []
    if name.startswith("api") and name[3:].isdigit() and int(name[3:]) >= 1:
        return _VARIANT_ENV["process"], ["--api-server-count", name[3:]]
    raise ValueError(f"--variants: unknown {name!r}; choose from process, thread, apiN (N API processes), "
                     f"{OFFLINE_CORE}")


def _bench_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--random-input-len", type=int, default=1000)
    p.add_argument("--random-output-len", type=int, default=250)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--workload-seed", type=int, default=0, help="the prompts' seed")
    p.add_argument("--vocab-size", type=int, default=None, help="prompt token ids are drawn below this "
                   "(default: the model's vocabulary)")
    p.add_argument("--variants", default="process", help="comma-separated: process, thread, apiN (e.g. api2: "
                   f"--api-server-count 2), {OFFLINE_CORE} (the offline engine over its core process)")
    p.add_argument("--num-client-processes", type=int, default=4)
    p.add_argument("--single-stream", type=int, default=0, metavar="N")
    p.add_argument("--disconnect", type=int, default=0, metavar="R",
                   help="R rounds of --disconnect-streams running streams whose clients all leave at once: "
                        "milliseconds until the engine holds none (bench/disconnect_probe.py)")
    p.add_argument("--disconnect-streams", type=int, default=16)
    p.add_argument("--port", type=int, default=8199)
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds one request may take")
    p.add_argument("--output-json", default=None)
    p.add_argument("--offline-only", default=None, help=argparse.SUPPRESS)  # the offline child's result file
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    """For ``deepbatch bench serve-vs-offline --help``: the bench's flags, then the engine's."""
    for action in _bench_parser()._actions:
        if action.help != argparse.SUPPRESS:
            p._add_action(action)
    add_engine_args(p, positional_model=True)


def _split(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The bench's own flags, and the engine flags (model first) for both sides."""
    bench, engine_argv = _bench_parser().parse_known_args(argv)
    check = argparse.ArgumentParser(prog="deepbatch bench serve-vs-offline")
    add_engine_args(check, positional_model=True)
    check.parse_args(engine_argv)  # a bad engine flag fails here, before anything starts
    return bench, engine_argv


def _load_args(bench: argparse.Namespace, vocab_size: int, base_url: str = "http://127.0.0.1:1",
               num_prompts: int | None = None, single: bool = False) -> argparse.Namespace:
    """``deepbatch bench serve``'s arguments for this workload: every request at once."""
    from deepbatch.bench import serve as bench_serve

    p = argparse.ArgumentParser()
    bench_serve.add_arguments(p)
    argv = ["--base-url", base_url, "--workload", "random", "--num-prompts", str(num_prompts or bench.num_prompts),
            "--request-rate", "inf", "--random-input-len", str(bench.random_input_len),
            "--random-output-len", str(bench.random_output_len), "--random-range-ratio", str(bench.random_range_ratio),
            "--seed", str(bench.workload_seed), "--vocab-size", str(vocab_size), "--prompt-type", "ids",
            "--timeout", str(bench.timeout), "--disable-tqdm", "--no-plots"]
    if single:
        argv += ["--max-concurrency", "1"]
    else:
        argv += ["--num-client-processes", str(bench.num_client_processes)]
    return p.parse_args(argv)


def _vocab_size(bench: argparse.Namespace, engine_argv: list[str]) -> int:
    if bench.vocab_size:
        return bench.vocab_size
    from deepbatch.models.loader import load_hf_config, resolve_model

    return int(load_hf_config(resolve_model(engine_argv[0]), None).vocab_size)


# -- offline ----------------------------------------------------------------------------------------


def run_offline(bench: argparse.Namespace, engine_argv: list[str]) -> dict:
    """In this process: the workload through ``LLM.generate``; output tokens per second."""
    from deepbatch import LLM, SamplingParams
    from deepbatch.bench.serve_workloads import build_requests
    from deepbatch.engine_args import engine_kwargs_from_args

    p = argparse.ArgumentParser()
    add_engine_args(p, positional_model=True)
    llm = LLM(**engine_kwargs_from_args(p.parse_args(engine_argv)))
    reqs = build_requests(_load_args(bench, _vocab_size(bench, engine_argv)), float("inf"))
    prompts = [{"prompt_token_ids": list(r.prompt)} for r in reqs]
    params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in reqs]
    warm = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm.generate(prompts[:8], warm, use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"requests": len(outs), "output_tokens": n_out, "seconds": seconds, "output_throughput": n_out / seconds}


def _offline_in_child(bench_argv: list[str], engine_argv: list[str], out_dir: str, name: str = "offline",
                      env: dict[str, str] | None = None) -> dict:
    path = os.path.join(out_dir, f"{name}.json")
    cmd = [sys.executable, "-m", "deepbatch.bench.serve_offline", "--offline-only", path, *bench_argv, *engine_argv]
    subprocess.run(cmd, check=True, env={**os.environ, **(env or {})})
    with open(path) as f:
        return json.load(f)


# -- through a server -------------------------------------------------------------------------------


def _get(url: str) -> int:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return resp.status


def _start_server(engine_argv: list[str], bench: argparse.Namespace, variant: str, log_path: str) -> subprocess.Popen:
    env, flags = _variant(variant)
    cmd = [sys.executable, "-m", "deepbatch.cli", "serve", *engine_argv, "--host", "127.0.0.1",
           "--port", str(bench.port), "--max-queued-requests", "0", *flags]
    log = open(log_path, "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env})
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.close()
            with open(log_path, errors="replace") as f:  # its end, here: the log may not outlive the run
                tail = "".join(f.readlines()[-40:])
            raise RuntimeError(f"the {variant} server exited with {proc.returncode}; the end of {log_path}:\n{tail}")
        try:
            if _get(f"http://127.0.0.1:{bench.port}/health") == 200:
                if flags:  # the first API process answers; the others bind the port within moments
                    time.sleep(3)
                return proc
        except OSError:
            pass
        time.sleep(1)
    _stop(proc)
    raise RuntimeError(f"the {variant} server was not ready in 900 s; see {log_path}")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def run_server(bench: argparse.Namespace, engine_argv: list[str], variant: str, vocab_size: int, out_dir: str) -> dict:
    from deepbatch.bench import serve as bench_serve

    proc = _start_server(engine_argv, bench, variant, os.path.join(out_dir, f"server-{variant}.log"))
    url = f"http://127.0.0.1:{bench.port}"
    try:
        # A few requests first, so the timed run meets a warm server (as the offline side does).
        bench_serve.run(_load_args(bench, vocab_size, url, num_prompts=8, single=True))
        load = bench_serve.run(_load_args(bench, vocab_size, url))
        result = {k: v for k, v in load.items() if k != "requests"}
        if bench.single_stream:
            single = bench_serve.run(_load_args(bench, vocab_size, url, num_prompts=bench.single_stream, single=True))
            result["single_stream"] = {k: v for k, v in single.items() if k.endswith("_ms")}
        if bench.disconnect:
            from deepbatch.bench.disconnect_probe import probe

            result["disconnect"] = probe(url, rounds=bench.disconnect, streams=bench.disconnect_streams,
                                         vocab_size=vocab_size, timeout=bench.timeout)
    finally:
        _stop(proc)
    return result


# -- the comparison ---------------------------------------------------------------------------------


def run(argv: list[str]) -> dict:
    bench, engine_argv = _split(argv)
    if bench.offline_only:
        result = run_offline(bench, engine_argv)
        with open(bench.offline_only, "w") as f:
            json.dump(result, f)
        return result
    variants = [v.strip() for v in bench.variants.split(",") if v.strip()]
    for v in variants:
        _variant(v)  # an unknown one fails before the offline run
    vocab = _vocab_size(bench, engine_argv)
    out_dir = tempfile.mkdtemp(prefix="deepbatch-serve-vs-offline-")
    offline = _offline_in_child(_bench_only(argv, engine_argv), engine_argv, out_dir)
    print(f"offline: {offline['output_throughput']:,.0f} output tok/s ({offline['output_tokens']} tokens in "
          f"{offline['seconds']:.1f} s)", flush=True)
    servers = {}
    for variant in variants:
        if variant == OFFLINE_CORE:
            servers[variant] = _offline_in_child(_bench_only(argv, engine_argv), engine_argv, out_dir, variant,
                                                 _variant(variant)[0])
            tok_s = servers[variant]["output_throughput"]
            servers[variant]["vs_offline"] = ratio = tok_s / offline["output_throughput"]
            print(f"offline, engine core process: {tok_s:,.0f} output tok/s, "
                  f"{100 * ratio:.1f}% of offline in one process", flush=True)
            continue
        servers[variant] = run_server(bench, engine_argv, variant, vocab, out_dir)
        ratio = servers[variant]["output_throughput"] / offline["output_throughput"]
        servers[variant]["vs_offline"] = ratio
        print(f"server ({variant}): {servers[variant]['output_throughput']:,.0f} output tok/s, "
              f"{100 * ratio:.1f}% of offline; failed {servers[variant].get('failed', 0)}", flush=True)
        if "disconnect" in servers[variant]:
            d = servers[variant]["disconnect"]
            print(f"server ({variant}): {d['streams']} streams whose clients left were let go in {d['mean_ms']:.1f} ms "
                  f"on average, {d['max_ms']:.1f} ms at most ({d['rounds']} rounds)", flush=True)
    result = {"engine_args": engine_argv, "num_prompts": bench.num_prompts, "input_len": bench.random_input_len,
              "output_len": bench.random_output_len, "offline": offline, "servers": servers, "logs": out_dir}
    if bench.output_json:
        with open(bench.output_json, "w") as f:
            json.dump(result, f, indent=1)
    return result


def _bench_only(argv: list[str], engine_argv: list[str]) -> list[str]:
    """``argv`` less the engine flags (which parse_known_args left in order, as a subsequence)."""
    rest, i = [], 0
    for arg in argv:
        if i < len(engine_argv) and arg == engine_argv[i]:
            i += 1
        else:
            rest.append(arg)
    return rest


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        p = argparse.ArgumentParser(prog="deepbatch bench serve-vs-offline", description=__doc__.split("\n\n")[0])
        add_arguments(p)
        p.print_help()
        return
    try:
        run(argv)
    except ValueError as e:
        print(f"deepbatch bench serve-vs-offline: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
