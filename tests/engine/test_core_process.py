"""The engine core's messages, end to end on the real engine: a request's output rebuilt in the
API process from the per-step deltas (``OutputAssembler`` over ``StepOutputs`` decoded from
the wire) equals what the same engine returns in one process: text (stop strings take text
back), token ids, logprobs, prompt logprobs, n > 1, finish reasons. Aborts, refusals and the
waiting counts the queue bounds read travel the same way."""

from __future__ import annotations

import threading

import zmq

from deepbatch import SamplingParams
from deepbatch.core.errors import InvalidRequestError
from deepbatch.engine.output_assembler import OutputAssembler, refusal_error
from deepbatch.engine.core_messages import Abort, Shutdown, StepOutputs, decode_core_message
from deepbatch.engine.core_process import EngineCore, _Added, _Refused

PROMPTS = ["The capital of France is", "Write a short poem about the sea.", "1, 2, 3, 4,"]
PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=24, logprobs=2, prompt_logprobs=1),
    SamplingParams(temperature=0.8, top_p=0.9, seed=7, n=2, max_tokens=20),
    SamplingParams(temperature=0.0, max_tokens=40, stop=[" 9"], include_stop_str_in_output=False),
]


def run_core(engine, commands_before, commands_after_first=()) -> tuple[dict, list[StepOutputs]]:
    """Run an EngineCore on ``engine`` in a thread until every request has finished; returns the
    rebuilt final outputs by request id, and every message."""
    ctx = zmq.Context.instance()
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push = ctx.socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{port}")
    core = EngineCore(engine, push)
    assembler = OutputAssembler()
    open_ids = set()
    for cmd in commands_before:
        if isinstance(cmd, _Added):
            r = cmd.requests[0]
            assembler.add(r.parent_id, r.prompt, r.prompt_token_ids, r.tenant)
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
                out = assembler.apply(delta)
                if out.finished:
                    finals[out.request_id] = out
                    open_ids.discard(out.request_id)
    finally:
        core.inbox.put(Shutdown())
        thread.join(30)
        pull.close(0)
        push.close(0)
    assert not thread.is_alive()
    return finals, messages


def test_outputs_rebuilt_from_deltas_equal_the_engines_own(smollm_llm):
    engine = smollm_llm.engine
    expected = smollm_llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    adds = [_Added(engine.make_requests(f"core-{i}", p, sp)) for i, (p, sp) in enumerate(zip(PROMPTS, PARAMS))]
    finals, messages = run_core(engine, adds)
    for i, want in enumerate(expected):
        got = finals[f"core-{i}"]
        assert got.finished and got.prompt_token_ids == want.prompt_token_ids
        assert len(got.outputs) == len(want.outputs) == PARAMS[i].n
        for g, w in zip(got.outputs, want.outputs):
            assert (g.index, g.text, g.token_ids, g.finish_reason, g.stop_reason) == \
                (w.index, w.text, w.token_ids, w.finish_reason, w.stop_reason)
            assert g.logprobs == w.logprobs
        assert got.prompt_logprobs == want.prompt_logprobs
    assert finals["core-0"].outputs[0].logprobs and finals["core-0"].prompt_logprobs
    assert finals["core-2"].outputs[0].finish_reason == "stop"  # the stop string was met
    # One message per engine iteration, each carrying only what is new: no token crosses twice.
    sent = sum(len(c.token_ids) for m in messages for d in m.outputs for c in d.completions)
    assert sent == sum(len(c.token_ids) for out in expected for c in out.outputs)


def test_an_abort_a_refusal_and_the_queue_counts(smollm_llm):
    engine = smollm_llm.engine
    long = _Added(engine.make_requests("long", "Once upon a time", SamplingParams(max_tokens=200, ignore_eos=True)))
    short = _Added(engine.make_requests("short", "Hello", SamplingParams(max_tokens=3)))
    refused = _Refused("refused", InvalidRequestError("max_tokens", "too many", "context_length_exceeded"), 2, 10)
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
    assert messages[-1].num_waiting == 0 and messages[-1].snapshot is not None


def test_text_taken_back_by_a_stop_string_is_cut_at_the_offset():
    from deepbatch.engine.core_messages import CompletionDelta, OutputDelta

    assembler = OutputAssembler()
    assembler.add("r", "p", [1], "default")
    first = assembler.apply(OutputDelta("r", [CompletionDelta(0, 0, "Hello wor", 0, [5, 6], None, None)], False, 0,
                                        None, None, None))
    # The stop string "or" ends the request: the core resends from character 7 on (nothing).
    out = assembler.apply(OutputDelta("r", [CompletionDelta(0, 7, "", 2, [7], "stop", "or")], True, 0, None, None,
                                      None))
    assert first.outputs[0].text == "Hello wor" and first.outputs[0].token_ids == [5, 6]
    assert out.outputs[0].text == "Hello w" and out.outputs[0].token_ids == [5, 6, 7] and out.finished
    assert out.outputs[0].stop_reason == "or" and out.prompt_token_ids == [1]


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
