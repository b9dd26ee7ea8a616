"""The output processor is the one place a request is declared finished: stop ids, EOS, lengths,
stop strings and grammars, with the scheduler's state and the runner's per-request state freed
there. Driven over a real scheduler and the embedded model's tokenizer; the expected text comes
from the tokenizer's own ``decode``."""

from __future__ import annotations

from dataclasses import replace

import pytest

from deepbatch.config import SchedulerConfig
from deepbatch.core.request import Request, RequestStatus
from deepbatch.core.sampling_params import SamplingParams
from deepbatch.engine.output_processor import EngineStats, OutputProcessor, StepResult
from deepbatch.kv_cache.manager import KVCacheManager
from deepbatch.scheduler.scheduler import Scheduler

EOS = 2


@pytest.fixture(scope="module")
def tokenizer(smollm_llm):
    return smollm_llm.engine.tokenizer


class Harness:
    """A scheduler and an output processor wired as the engine wires them; ``run`` feeds one
    scripted token per step to each running request."""

    def __init__(self, tokenizer, max_model_len: int = 4096):
        kv = KVCacheManager(64, 16, enable_caching=False)
        self.sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512), kv, max_model_len)
        self.released: list[str] = []
        self.stats = EngineStats()
        self.proc = OutputProcessor(self.sched, tokenizer, max_model_len, self.stats, release=self.released.append)

    def add(self, rid: str, params: SamplingParams, prompt=(5, 6, 7)) -> list[Request]:
        params, n = replace(params, _eos_token_ids=frozenset({EOS})), params.n
        reqs = [Request(rid if n == 1 else f"{rid}-{i}", list(prompt), params, params.max_tokens, parent_id=rid,
                        index=i) for i in range(n)]
        self.proc.add(reqs)
        for r in reqs:
            self.sched.add_request(r)
        return reqs

    def step(self, script: dict[str, int]) -> StepResult:
        out = self.sched.schedule()
        self.sched.advance(out, pending=True)  # as under async scheduling: tokens are pending
        sampled = [s.request for s in out.scheduled if s.samples]
        result = StepResult()
        self.proc.process(sampled, [script[r.request_id] for r in sampled], None, None, 0.0, result)
        return result

    def run(self, tokens: dict[str, list[int]], max_steps: int = 50):
        outputs = {}
        for i in range(max_steps):
            if not self.sched.has_unfinished():
                break
            script = {rid: seq[min(i, len(seq) - 1)] for rid, seq in tokens.items()}
            for o in self.proc.collect(self.step(script).touched):
                outputs[o.request_id] = o
        return outputs


def ids_of(tokenizer, text: str) -> list[int]:
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    return ids


def test_a_stop_id_after_min_tokens_finishes_once_and_frees_everything(tokenizer):
    h = Harness(tokenizer)
    (r,) = h.add("a", SamplingParams(max_tokens=20, stop_token_ids=[99], min_tokens=3))
    # 99 comes at the 2nd token (before min_tokens: ignored) and again at the 4th.
    out = h.run({"a": [40, 99, 41, 99, 42]})["a"]
    assert out.finished and out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == 99
    assert out.outputs[0].token_ids == [40, 99, 41, 99]
    assert r.status == RequestStatus.FINISHED_STOPPED and not r.block_ids
    assert h.sched.kv_cache.pool.num_free_blocks == h.sched.kv_cache.num_blocks
    assert h.released == ["a"] and h.stats.finished_by_reason == {"stop": 1}
    assert "a" not in h.proc.parents


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_eos_stops_unless_ignored_and_length_ends_the_rest(tokenizer, ignore_eos):
    h = Harness(tokenizer)
    h.add("a", SamplingParams(max_tokens=5, ignore_eos=ignore_eos))
    out = h.run({"a": [40, EOS, 41]})["a"].outputs[0]
    if ignore_eos:
        assert (out.finish_reason, out.token_ids) == ("length", [40, EOS, 41, 41, 41])
    else:
        assert (out.finish_reason, out.stop_reason, out.token_ids) == ("stop", None, [40, EOS])


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_across_tokens_truncates_the_text(tokenizer, include):
    h = Harness(tokenizer)
    head, tail = ids_of(tokenizer, "Hello world"), ids_of(tokenizer, " STOP here and more")
    h.add("a", SamplingParams(max_tokens=40, stop=["STOP here"], include_stop_str_in_output=include))
    out = h.run({"a": head + tail})["a"].outputs[0]
    full = tokenizer.decode(out.token_ids)
    assert "STOP here" in full and out.finish_reason == "stop" and out.stop_reason == "STOP here"
    expected = full[: full.index("STOP here") + (len("STOP here") if include else 0)]
    assert out.text == expected
    assert len(out.token_ids) < len(head + tail)  # stopped at the token that completed the string


def test_a_stop_id_and_a_stop_string_on_one_token_report_the_id(tokenizer):
    h = Harness(tokenizer)
    stop_tok = ids_of(tokenizer, " end")
    assert len(stop_tok) == 1
    h.add("a", SamplingParams(max_tokens=10, stop=["end"], stop_token_ids=stop_tok))
    out = h.run({"a": [40, stop_tok[0]]})["a"].outputs[0]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_tok[0])


def test_a_token_of_an_aborted_request_is_dropped(tokenizer):
    h = Harness(tokenizer)
    h.add("a", SamplingParams(max_tokens=10))
    h.add("b", SamplingParams(max_tokens=10))
    out = h.sched.schedule()
    h.sched.advance(out, pending=True)
    aborted = h.proc.abort("a")  # while its step is in flight
    assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
    result = StepResult()
    sampled = [s.request for s in out.scheduled if s.samples]
    h.proc.process(sampled, [40] * len(sampled), None, None, 0.0, result)
    assert list(result.touched) == ["b"]
    assert h.proc.abort("a") is None
    assert h.released == ["a"]


def test_samples_of_one_parent_are_reported_together(tokenizer):
    h = Harness(tokenizer)
    h.add("p", SamplingParams(max_tokens=6, n=2, stop_token_ids=[99]))
    finished = {}
    for i in range(10):
        # p-0 stops at its 2nd token, p-1 runs to its length.
        for o in h.proc.collect(h.step({"p-0": [40, 99][min(i, 1)], "p-1": 41}).touched, finished_only=True):
            finished[o.request_id] = (i, o)
    step, out = finished["p"]
    assert step == 5  # only when the longer sample is done
    assert [c.finish_reason for c in out.outputs] == ["stop", "length"]
    assert [len(c.token_ids) for c in out.outputs] == [2, 6]


def test_a_detokenizer_fault_after_a_stop_keeps_the_reason(tokenizer):
    h = Harness(tokenizer)
    h.add("a", SamplingParams(max_tokens=3))
    update = h.proc.detokenizer.update

    def failing(request, token_ids):
        if request.num_output_tokens == 3:
            raise ValueError("cannot decode")
        return update(request, token_ids)

    h.proc.detokenizer.update = failing
    out = h.run({"a": [40]})["a"]
    assert out.outputs[0].finish_reason == "length" and "detokenization failed" in out.error
