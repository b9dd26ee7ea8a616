"""Starting and stopping tensor-parallel workers: a plain script without a main guard runs TP=2
(workers are forked) with TP=1's tokens and says nothing of failures on its way out; when workers
must be spawned, that script fails with an error naming the guard and a log file holding the
worker's own output; a process that runs threads (torch's intra-op pool) starts its workers from
the fork server; an engine that is dropped or shut down stops its workers cleanly."""

from __future__ import annotations

import gc
import logging
import multiprocessing
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

from deepbatch import LLM, SamplingParams
from deepbatch.executor import launch

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15]]

# No `if __name__ == "__main__":`, no shutdown: the LLM is built at the top level and left to
# the interpreter's exit.
SCRIPT = """\
import multiprocessing
import sys
{preamble}
from deepbatch import LLM, SamplingParams
llm = LLM(sys.argv[1], dtype="float32", device="cpu", tensor_parallel_size=2, distributed_timeout_s=30)
outs = llm.generate([{{"prompt_token_ids": p}} for p in {prompts}],
                    SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
print("TOKENS", [o.outputs[0].token_ids for o in outs], flush=True)
"""


def run_script(tmp_path, checkpoint: str, preamble: str = "") -> subprocess.CompletedProcess:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT.format(preamble=preamble, prompts=PROMPTS))
    logs = tmp_path / "tmp"
    logs.mkdir()
    env = {**os.environ, "TMPDIR": str(logs), "TOKENIZERS_PARALLELISM": "false"}
    env.pop("PYTEST_CURRENT_TEST", None)
    return subprocess.run([sys.executable, str(script), checkpoint], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)


def tp1_tokens(path: str) -> list[list[int]]:
    llm = LLM(path, dtype="float32", device="cpu")
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY,
                                                         use_tqdm=False)]


def test_script_without_main_guard_runs_tp2_and_exits_quietly(tp_checkpoints, tmp_path):
    path = tp_checkpoints["llama"]
    proc = run_script(tmp_path, path)
    assert proc.returncode == 0, proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith("TOKENS "))
    assert eval(line[len("TOKENS "):]) == tp1_tokens(path)
    for word in ("dead", "failed", "Traceback", "exited"):
        assert word not in proc.stderr, proc.stderr
    # A clean stop leaves no worker logs behind.
    assert os.listdir(tmp_path / "tmp") == []


def test_spawned_workers_without_main_guard_name_the_guard_and_the_log(tp_checkpoints, tmp_path):
    # The program's own choice of spawn is honoured, as a CUDA context or macOS would force it.
    proc = run_script(tmp_path, tp_checkpoints["llama"], 'multiprocessing.set_start_method("spawn", force=True)')
    assert proc.returncode != 0
    assert "TOKENS" not in proc.stdout
    err = proc.stderr
    assert 'if __name__ == "__main__":' in err and "'spawn' start method" in err, err
    log = re.search(r"Its output is in (\S+)", err).group(1)
    assert log.startswith(str(tmp_path / "tmp")) and os.path.isfile(log)
    # The log holds the worker's own account: the script ran again inside it and was stopped.
    text = open(log).read()
    assert "a worker process imported the main module" in text and "script.py" in text


def test_dropping_the_engine_stops_its_workers_cleanly(tp_checkpoints, caplog):
    caplog.set_level(logging.INFO)
    llm = LLM(tp_checkpoints["qwen3"], dtype="float32", device="cpu", tensor_parallel_size=2, distributed_timeout_s=30)
    workers = llm.engine.runner._workers
    procs, log_dir = list(workers.procs), workers.log_dir
    assert workers.method in ("fork", "forkserver")  # never spawned: this process holds no CUDA context
    assert any(log_dir in r.getMessage() for r in caplog.records)  # the log location is announced
    llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False)
    assert os.path.getsize(workers.log_path(1)) > 0  # the worker writes its own log
    del llm, workers
    gc.collect()
    for p in procs:
        p.join(10)
        assert p.exitcode == 0
    assert not os.path.exists(log_dir)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


def test_shutdown_asks_workers_to_exit(tp_checkpoints, caplog):
    llm = LLM(tp_checkpoints["llama"], dtype="float32", device="cpu", tensor_parallel_size=2, distributed_timeout_s=30)
    procs = list(llm.engine.runner._procs)
    llm.engine.shutdown()
    llm.engine.shutdown()  # idempotent
    assert [p.exitcode for p in procs] == [0]  # exited on its own, not killed
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


# A script that ran a large CPU op first: torch's OpenMP pool (a thread per core) exists when the
# engine starts its workers. A forked worker would copy the pool without its threads and wait for
# them forever at its first parallel region; started from the fork server, it has a pool of its
# own. The script claims eight cores, so each rank of two runs four threads (as on a larger host).
SCRIPT_AFTER_A_TORCH_OP = """\
import os
import sys
import torch
from deepbatch import LLM, SamplingParams


def main():
    os.cpu_count = lambda: 8
    torch.set_num_threads(2)
    a = torch.randn(1024, 1024)
    (a @ a).sum()
    llm = LLM(sys.argv[1], dtype="float32", device="cpu", tensor_parallel_size=2, distributed_timeout_s=30)
    print("METHOD", llm.engine.runner._workers.method, flush=True)
    outs = llm.generate([{{"prompt_token_ids": p}} for p in {prompts}],
                        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    print("TOKENS", [o.outputs[0].token_ids for o in outs], flush=True)


if __name__ == "__main__":
    main()
"""


def test_workers_of_a_process_with_threads_come_from_the_fork_server(tp_checkpoints, tmp_path):
    path = tp_checkpoints["llama"]
    script = tmp_path / "script.py"
    script.write_text(SCRIPT_AFTER_A_TORCH_OP.format(prompts=PROMPTS))
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    env.pop("PYTEST_CURRENT_TEST", None)
    proc = subprocess.run([sys.executable, str(script), path], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "METHOD forkserver" in proc.stdout
    line = next(x for x in proc.stdout.splitlines() if x.startswith("TOKENS "))
    assert eval(line[len("TOKENS "):]) == tp1_tokens(path)


def test_workers_are_forked_only_from_a_process_without_threads_since_torch_was_imported():
    code = textwrap.dedent("""
        import threading
        import torch
        from deepbatch.executor.launch import worker_start_method
        print(worker_start_method())
        done = threading.Event()
        threading.Thread(target=done.wait).start()
        print(worker_start_method())  # a Python thread
        done.set()
        torch.set_num_threads(2)
        a = torch.randn(1024, 1024)
        (a @ a).sum()
        print(worker_start_method())  # torch's OpenMP pool
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["fork", "forkserver", "forkserver"]


def test_start_method_is_fork_unless_unsafe_or_spawn_was_chosen(monkeypatch):
    monkeypatch.setattr(multiprocessing, "get_start_method", lambda allow_none=False: None)
    assert launch.choose_start_method() == "fork"
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert launch.choose_start_method() == "spawn"
    monkeypatch.undo()
    monkeypatch.setattr(sys, "platform", "darwin")
    assert launch.choose_start_method() == "spawn"
    monkeypatch.undo()
    monkeypatch.setattr(multiprocessing, "get_start_method", lambda allow_none=False: "spawn")
    assert launch.choose_start_method() == "spawn"


def test_an_engine_started_while_importing_main_in_a_worker_names_the_guard():
    code = textwrap.dedent("""
        from deepbatch.executor.launch import check_not_importing_main
        check_not_importing_main()
    """)
    scope = {"__name__": "__mp_main__"}
    with pytest.raises(RuntimeError, match=r'if __name__ == "__main__":'):
        exec(compile(code, "script.py", "exec"), scope)
    exec(compile(code, "script.py", "exec"), {"__name__": "__main__"})  # the main process itself: fine
