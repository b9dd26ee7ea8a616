"""The engine core's messages, end to end on the real engine: a request's output rebuilt in the
API process from the per-step deltas (``OutputAssembler`` over ``StepOutputs`` decoded from
the wire, detokenized there, stop strings found there and sent back as ``FinishSample``) equals
what the same engine returns in one process: text, token ids, logprobs, prompt logprobs, n > 1,
finish reasons. Aborts, refusals and the waiting counts the queue bounds read travel the same way."""

from __future__ import annotations

import contextlib
import threading

import zmq

from deepbatch import SamplingParams
from deepbatch.core.errors import InvalidRequestError
from deepbatch.engine.output_assembler import OutputAssembler, refusal_error
from deepbatch.engine.core_messages import (
    Abort, FinishSample, SetStepDelay, Shutdown, StepOutputs, decode_client_message, decode_core_message, encode,
)
from deepbatch.engine.core_process import EngineCore, _Added, _Refused

PROMPTS = ["The capital of France is", "Write a short poem about the sea.", "1, 2, 3, 4,"]
PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=24, logprobs=2, prompt_logprobs=1),
    SamplingParams(temperature=0.8, top_p=0.9, seed=7, n=2, max_tokens=20),
    SamplingParams(temperature=0.0, max_tokens=40, stop=[" 9"], include_stop_str_in_output=False),
]


@contextlib.contextmanager
def as_core(engine):
    """``engine`` as the core process builds it (``LLMEngine(config, detokenize=False)``): no
    text, no stop strings; restored after (the engine is shared by the module's tests)."""
    detokenizer, engine.outputs.detokenizer = engine.outputs.detokenizer, None
    try:
        yield engine
    finally:
        engine.outputs.detokenizer = detokenizer


def run_core(engine, commands_before, commands_after_first=(), core: EngineCore | None = None
             ) -> tuple[dict, list[StepOutputs]]:
    """Run an EngineCore on ``engine`` (or ``core``, given its outputs socket here) in a thread
    until every request has finished; returns the rebuilt final outputs by request id, and every
    message."""
    ctx = zmq.Context.instance()
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push = ctx.socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{port}")
    if core is None:
        core = EngineCore(engine, push)
    else:
        core.outputs[0].close(0)
        core.outputs = [push]
    assembler = OutputAssembler(engine.tokenizer)
    open_ids = set()
    for cmd in commands_before:
        if isinstance(cmd, _Added):
            r = cmd.requests[0]
            assembler.add(r.parent_id, r.prompt, r.prompt_token_ids, r.tenant, r.sampling_params)
            open_ids.add(r.parent_id)
        elif isinstance(cmd, _Refused):
            open_ids.add(cmd.request_id)
        core.inbox.put(cmd)
    thread = threading.Thread(target=core.run, daemon=True)
    thread.start()
    finals, messages, pending_after = {}, [], list(commands_after_first)
    try:
        while open_ids:
            assert pull.poll(120_000), "no message from the engine core in 120 s"
            message = decode_core_message(pull.recv())
            assert isinstance(message, StepOutputs)
            messages.append(message)
            for cmd in pending_after:
                core.inbox.put(cmd)
            pending_after = []
            for delta in message.outputs:
                if delta.refusal is not None:
                    finals[delta.request_id] = refusal_error(delta.refusal)
                    open_ids.discard(delta.request_id)
                    continue
                out, finishes = assembler.apply(delta)
                for finish in finishes:  # as the API process sends them back
                    core.inbox.put(decode_client_message(encode(finish)))
                if out.finished:
                    finals[out.request_id] = out
                    open_ids.discard(out.request_id)
    finally:
        core.inbox.put(Shutdown())
        thread.join(30)
        pull.close(0)
        push.close(0)
    assert not thread.is_alive()
    # Nothing is left tracked: a parent ended by a FinishSample (a stop string found on the API
    # side) is let go like one the core ended itself, so its id is free again.
    assert not engine.outputs.parents and not engine.has_unfinished_requests()
    return finals, messages


def test_outputs_rebuilt_from_deltas_equal_the_engines_own(smollm_llm):
    engine = smollm_llm.engine
    expected = smollm_llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    adds = [_Added(engine.make_requests(f"core-{i}", p, sp)) for i, (p, sp) in enumerate(zip(PROMPTS, PARAMS))]
    with as_core(engine):
        finals, messages = run_core(engine, adds)
    for i, want in enumerate(expected):
        got = finals[f"core-{i}"]
        assert got.finished and got.prompt_token_ids == want.prompt_token_ids
        assert len(got.outputs) == len(want.outputs) == PARAMS[i].n
        for g, w in zip(got.outputs, want.outputs):
            assert (g.index, g.text, g.token_ids, g.finish_reason, g.stop_reason) == \
                (w.index, w.text, w.token_ids, w.finish_reason, w.stop_reason)
            # Equal up to rounding: the core samples a step or two past a stop string, so later
            # steps' batches (and their float sums) differ from the one-process run's.
            assert (g.logprobs is None) == (w.logprobs is None)
            for a, b in zip(g.logprobs or [], w.logprobs or []):
                assert list(a) == list(b) and [x.rank for x in a.values()] == [x.rank for x in b.values()]
                assert all(abs(x.logprob - y.logprob) < 1e-4 for x, y in zip(a.values(), b.values()))
            assert len(g.logprobs or []) == len(w.logprobs or [])
        assert got.prompt_logprobs == want.prompt_logprobs
    assert finals["core-0"].outputs[0].logprobs and finals["core-0"].prompt_logprobs
    assert finals["core-2"].outputs[0].stop_reason == " 9"  # the stop string was met, on this side
    # One message per engine iteration, each carrying only what is new: no token crosses twice.
    # The core samples on until the FinishSample reaches it: a step or two past the stop string.
    sent = {d.request_id: 0 for m in messages for d in m.outputs}
    for m in messages:
        for d in m.outputs:
            sent[d.request_id] += sum(len(c.token_ids) for c in d.completions)
    for i, want in enumerate(expected):
        wanted = sum(len(c.token_ids) for c in want.outputs)
        assert wanted <= sent[f"core-{i}"] <= wanted + (2 if PARAMS[i].stop else 0)


def test_an_abort_a_refusal_and_the_queue_counts(smollm_llm):
    engine = smollm_llm.engine
    long = _Added(engine.make_requests("long", "Once upon a time", SamplingParams(max_tokens=200, ignore_eos=True)))
    short = _Added(engine.make_requests("short", "Hello", SamplingParams(max_tokens=3)))
    refused = _Refused("refused", InvalidRequestError("max_tokens", "too many", "context_length_exceeded"), 2, 10)
    with as_core(engine):
        finals, messages = run_core(engine, [long, short, refused], commands_after_first=[Abort(["long"])])
    assert finals["long"].outputs[0].finish_reason == "abort" and len(finals["long"].outputs[0].token_ids) < 200
    assert finals["short"].outputs[0].finish_reason == "length"
    error = finals["refused"]
    assert isinstance(error, InvalidRequestError) and error.param == "max_tokens"
    assert error.code == "context_length_exceeded" and "too many" in str(error)
    # Applied counts cover the refused request too, so the API process's queue estimate drains.
    assert messages[-1].applied_seqs == 1 + 1 + 2
    assert messages[-1].applied_tokens == len(long.requests[0].prompt_token_ids) + len(
        short.requests[0].prompt_token_ids) + 10
    assert messages[-1].waiting_after == (0, 0) and messages[-1].snapshot is not None


def test_a_step_delay_slows_every_step_from_the_message_on(smollm_llm):
    """``SetStepDelay`` (a canary broken on purpose): read by the input thread, slept before each
    step by the loop; every step's span then covers the delay (a sleep's lower bound)."""
    engine = smollm_llm.engine
    add = _Added(engine.make_requests("slow", "Hello", SamplingParams(max_tokens=3, ignore_eos=True)))
    core = EngineCore(engine, zmq.Context.instance().socket(zmq.PUSH))
    assert not core._take(decode_client_message(encode(SetStepDelay(0.25))), 0)
    assert core.step_delay_s == 0.25
    with as_core(engine):
        finals, messages = run_core(engine, [add], core=core)
    assert len(finals["slow"].outputs[0].token_ids) == 3
    stepped = [m for m in messages if m.outputs]
    assert len(stepped) >= 3 and all(m.end - m.start >= 0.25 for m in stepped)


def test_a_stop_string_ends_the_sample_at_its_token_on_the_api_side(smollm_llm):
    from deepbatch.engine.core_messages import CompletionDelta, OutputDelta

    tokenizer = smollm_llm.engine.tokenizer
    ids = tokenizer.encode("Hello world. Stop here, please go on", add_special_tokens=False)
    assembler = OutputAssembler(tokenizer)
    assembler.add("r", "p", [1], "default", SamplingParams(stop=[" here"], logprobs=0))
    outs, finishes = [], []
    for i, token in enumerate(ids):  # the core knows no stop strings: it sends every token
        delta = CompletionDelta(0, i, [token], None, None, i, [{token: (-1.0, 1)}])
        out, sent = assembler.apply(OutputDelta("r", [delta], False, 0, None, None, None))
        outs.append(out)
        finishes += sent
    # The core's answer to the FinishSample: the sample stopped, after a token it sampled meanwhile.
    last = CompletionDelta(0, len(ids), [ids[0]], "stop", " here", len(ids), [{ids[0]: (-1.0, 1)}])
    final, sent = assembler.apply(OutputDelta("r", [last], True, 0, None, None, None))
    stop_at = next(i for i, out in enumerate(outs) if out.outputs[0].finish_reason is not None)
    c = outs[stop_at].outputs[0]
    assert c.text == "Hello world. Stop" and c.token_ids == ids[:stop_at + 1]
    assert (c.finish_reason, c.stop_reason) == ("stop", " here") and len(c.logprobs) == stop_at + 1
    assert tokenizer.decode(ids[:stop_at + 1]).endswith(" here") and stop_at < len(ids) - 1
    assert finishes == [FinishSample("r", 0, " here")] and sent == []
    assert outs[-1].outputs[0] == c and not outs[-1].finished  # later tokens are dropped
    assert final.finished and final.outputs[0] == c and final.prompt_token_ids == [1]
    assert [o.outputs[0].text for o in outs[:2]] == ["Hello", "Hello world"]


def test_text_that_cannot_be_decoded_fails_that_sample_alone(smollm_llm):
    from deepbatch.engine.core_messages import CompletionDelta, OutputDelta

    assembler = OutputAssembler(smollm_llm.engine.tokenizer)
    assembler.add("r", "p", [1], "default", SamplingParams(n=2))
    bad, update = 7, assembler._detokenizer.update

    def failing(sample, token_ids):  # as a tokenizer that cannot take a token would
        if bad in token_ids:
            raise ValueError("cannot decode")
        return update(sample, token_ids)

    assembler._detokenizer.update = failing
    out, finishes = assembler.apply(OutputDelta("r", [CompletionDelta(0, 0, [bad], None, None),
                                                      CompletionDelta(1, 0, [19556], None, None)],
                                                False, 0, None, None, None))
    assert [c.finish_reason for c in out.outputs] == ["error", None] and "detokenization failed" in out.error
    assert len(finishes) == 1 and finishes[0].index == 0 and "detokenization failed" in finishes[0].error
    assert out.outputs[1].text and not out.finished


def test_a_request_with_a_compiled_grammar_crosses_without_it(smollm_llm):
    # The API process compiles a grammar to refuse a bad one early; the core compiles its own.
    from deepbatch.core.sampling_params import StructuredOutputsParams
    from deepbatch.engine.core_messages import AddRequest, decode_client_message, encode, wire_params

    params = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(json={"type": "object"}))
    compiled = smollm_llm.engine.prepare_structured_output(params)
    assert compiled._compiled_grammar is not None
    message = decode_client_message(encode(AddRequest("r", [1, 2], None, wire_params(compiled), 0, "t", 1.0)))
    assert message.params == params and message.params._compiled_grammar is None
    (request,) = smollm_llm.engine.make_requests("r", {"prompt_token_ids": [1, 2]}, message.params)
    assert request.structured_output is not None  # the core's own grammar


def test_api_processes_sharing_a_core_each_get_their_own_requests(smollm_llm):
    """Several API processes (--api-server-count): each step's outputs go to the one that sent
    each request, an id held by one is refused to another, and one cannot abort another's."""
    import time

    from deepbatch.engine.core_messages import AddRequest, decode_client_message, encode

    engine = smollm_llm.engine
    ctx = zmq.Context.instance()
    pulls, pushes = [], []
    for _ in range(2):
        pull = ctx.socket(zmq.PULL)
        port = pull.bind_to_random_port("tcp://127.0.0.1")
        push = ctx.socket(zmq.PUSH)
        push.connect(f"tcp://127.0.0.1:{port}")
        pulls.append(pull)
        pushes.append(push)
    core = EngineCore(engine, pushes)

    def send(message, client):  # as the input thread takes it off the wire
        core._take(decode_client_message(encode(message)), client)

    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    for request_id, client in (("a", 0), ("b", 1), ("c", 1), ("a", 1)):
        send(AddRequest(request_id, [1, 2, 3, 4], None, params, 0, "t", time.monotonic()), client)
    send(Abort(["c"]), 0)  # c is API process 1's
    thread = threading.Thread(target=core.run, daemon=True)
    thread.start()
    received: list[list[StepOutputs]] = [[], []]
    finished: list[dict] = [{}, {}]
    try:
        while len(finished[0]) < 1 or len(finished[1]) < 3:
            for client, pull in enumerate(pulls):
                while pull.poll(100):
                    message = decode_core_message(pull.recv())
                    received[client].append(message)
                    for delta in message.outputs:
                        if delta.finished:
                            finished[client].setdefault(delta.request_id, []).append(delta)
            assert thread.is_alive()
    finally:
        core.inbox.put(Shutdown())
        thread.join(30)
        for s in pulls + pushes:
            s.close(0)
    assert set(finished[0]) == {"a"} and set(finished[1]) == {"a", "b", "c"}
    assert {d.request_id for m in received[0] for d in m.outputs} == {"a"}
    (mine,) = finished[0]["a"]
    last = mine.completions[0]  # the last delta: the tokens after its offset
    assert mine.refusal is None and last.token_offset + len(last.token_ids) == 6 and last.finish_reason == "length"
    (duplicate,) = finished[1]["a"]
    assert duplicate.refusal is not None and duplicate.refusal[3] == "duplicate_request_id"
    for request_id in ("b", "c"):  # the abort from the other process did nothing
        (delta,) = finished[1][request_id]
        assert delta.completions[0].finish_reason == "length"
    # Each process's queue estimate counts what it sent, the refused duplicate included.
    assert received[0][-1].applied_seqs == 1 and received[1][-1].applied_seqs == 3
    assert core._owner == {}
