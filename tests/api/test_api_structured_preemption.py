"""Structured outputs on a server squeezed so that the engine chunks prefills and preempts: a step
budget of 32 tokens (every prompt here is longer, so each prefill spans steps) and KV blocks for a
fraction of the sequences sent at once, so running ones lose their blocks and are recomputed.
The grammar state of a sequence must survive both: every choice still validates against its
schema, streamed and not, with n=2."""

from __future__ import annotations

import asyncio

from apitest_server import MODEL, get_server
from apitest_streams import collect_async
from apitest_structured import constraint_fields, schema_problem

BUDGET = 32
SERVERS = {"structured_tight": dict(args=["--num-gpu-blocks-override", "32", "--max-num-batched-tokens", str(BUDGET)])}
NAMES = ["person", "nested", "refs", "array_of_objects", "one_of", "matrix"]
MAX_TOKENS = 160


def test_schemas_hold_through_chunked_prefill_and_preemption():
    server = get_server("structured_tight")
    before = server.metric("vllm:num_preemptions_total")

    async def one(client, name: str, stream: bool):
        ask = [{"role": "user", "content": f"Reply with a JSON value for '{name}'."}]
        kwargs = dict(model=MODEL, messages=ask, max_tokens=MAX_TOKENS, n=2, temperature=0.6, top_p=0.9, seed=2,
                      extra_body=constraint_fields(name))
        if stream:
            kwargs["stream_options"] = {"include_usage": True}
            chunks = [c async for c in await client.chat.completions.create(**kwargs, stream=True)]
            choices = await collect_async(_replay(chunks))
            return [(c.content, c.finish_reason) for _, c in sorted(choices.items())], chunks[-1].usage
        out = await client.chat.completions.create(**kwargs)
        return [(c.message.content, c.finish_reason) for c in sorted(out.choices, key=lambda c: c.index)], out.usage

    async def run():
        client = server.async_client()
        try:
            keys = [(name, stream) for name in NAMES for stream in (False, True)]
            return dict(zip(keys, await asyncio.gather(*(one(client, *key) for key in keys))))
        finally:
            await client.close()

    results = asyncio.run(run())
    for (name, stream), (choices, usage) in results.items():
        assert usage.prompt_tokens > BUDGET  # its prefill could not run in one step
        assert len(choices) == 2
        for text, reason in choices:
            assert reason == "stop", (name, stream, reason, text)
            problem = schema_problem(name, text)
            assert problem is None, (name, stream, problem)
    assert server.metric("vllm:num_preemptions_total") > before


async def _replay(chunks):
    for chunk in chunks:
        yield chunk
