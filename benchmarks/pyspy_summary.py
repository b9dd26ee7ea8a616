"""Summarize py-spy's raw (collapsed) output recorded with ``--subprocesses``: per process, the
functions with the most samples, on their own (self) and with what they call (total).

    python benchmarks/pyspy_summary.py out/serve-vs-offline-pyspy.txt --top 25
    python benchmarks/pyspy_summary.py out/serve-vs-offline-pyspy.txt --process EngineCore --under _read
"""

from __future__ import annotations

import argparse
import re
from collections import Counter, defaultdict

_PROCESS = re.compile(r'^process (\d+):"(.*)"$', re.S)


def _frames(line: str) -> tuple[list[str], int]:
    stack, _, count = line.rpartition(" ")
    frames: list[str] = []
    for part in stack.split(";"):
        # A process frame's command line may hold ";" (``python -c "a; b"``): rejoin it.
        if frames and frames[-1].startswith("process ") and not frames[-1].endswith('"'):
            frames[-1] += ";" + part
        else:
            frames.append(part)
    return frames, int(count)


def _records(path: str):
    """One stack per record: a command line with a newline in it (multiprocessing's spawned
    children) continues its record on the next line; a record ends with its sample count."""
    pending = ""
    with open(path) as f:
        for line in f:
            pending += line.rstrip("\n")
            if re.search(r" \d+$", pending):
                yield pending
                pending = ""


def summarize(path: str, top: int, process_filter: str | None, under: str | None) -> None:
    selfs: dict[str, Counter] = defaultdict(Counter)
    totals: dict[str, Counter] = defaultdict(Counter)
    samples: Counter = Counter()
    for line in _records(path):
        frames, count = _frames(line)
        # The innermost "process PID:cmdline" frame names the process that was sampled.
        procs = [i for i, fr in enumerate(frames) if _PROCESS.match(fr)]
        if not procs:
            continue
        i = procs[-1]
        pid, cmd = _PROCESS.match(frames[i]).groups()
        name = f"{pid} {cmd[:100]}"
        if process_filter and process_filter not in name:
            continue
        stack = frames[i + 1:]
        if under is not None:
            at = next((j for j, fr in enumerate(stack) if under in fr), None)
            if at is None:
                continue
            stack = stack[at:]
        samples[name] += count
        if stack:
            selfs[name][_short(stack[-1])] += count
        for fr in {_short(fr) for fr in stack}:
            totals[name][fr] += count
    for name, n in samples.most_common():
        print(f"\n=== {name}: {n} samples")
        print("  self:")
        for fr, c in selfs[name].most_common(top):
            print(f"    {100 * c / n:5.1f}%  {fr}")
        print("  total:")
        for fr, c in totals[name].most_common(top):
            print(f"    {100 * c / n:5.1f}%  {fr}")


def _short(frame: str) -> str:
    # "func (path/to/file.py:123)" -> "func (file.py)": lines split one function into many rows.
    m = re.match(r"^(.*) \((?:.*/)?([^/:]+)(?::\d+)?\)$", frame)
    return f"{m.group(1)} ({m.group(2)})" if m else frame


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path")
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--process", default=None, help="only processes whose pid/command line contains this")
    p.add_argument("--under", default=None, help="only stacks through a frame containing this, rooted there")
    a = p.parse_args()
    summarize(a.path, a.top, a.process, a.under)
