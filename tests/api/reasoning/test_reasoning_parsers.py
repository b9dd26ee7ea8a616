"""deepseek_r1 and qwen3 reasoning parsers, whole and streamed in several delta splits."""

from __future__ import annotations

import random

import pytest

from deepbatch.api.reasoning import REASONING_PARSERS, get_reasoning_parser

R1 = get_reasoning_parser("deepseek_r1")
QWEN3 = get_reasoning_parser("qwen3")
TAGS = ("<think>", "</think>")

R1_CALLS = ("\n\n<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{}\n```"
            "<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
QWEN3_CALL = '\n\n<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>'

# (output as the model writes it, expected reasoning, expected content)
R1_CASES = {
    # The template opened the thinking in the prompt: only the closing tag is generated.
    "closed": ("Okay, the user asks for 2 + 2. That is 4.\n</think>\n\n2 + 2 = **4**.",
               "Okay, the user asks for 2 + 2. That is 4.\n", "\n\n2 + 2 = **4**."),
    # Older templates leave the opening tag to the model.
    "opening_tag_generated": ("<think>\nHmm, Paris.\n</think>\n\nThe capital of France is Paris.",
                              "\nHmm, Paris.\n", "\n\nThe capital of France is Paris."),
    "cut_off_while_thinking": ("Let me think about this carefully. First, x < y and", 
                               "Let me think about this carefully. First, x < y and", None),
    "cut_off_in_the_tag": ("So the answer is 4.</thi", "So the answer is 4.</thi", None),
    "empty_reasoning": ("</think>\n\nHi!", None, "\n\nHi!"),
    "nothing_after": ("Done thinking.</think>", "Done thinking.", None),
    "unicode_and_angle_brackets": ("東京 café 🚀 < /think> <think>\n</think>a < b </think> c",
                                   "東京 café 🚀 < /think> <think>\n", "a < b </think> c"),
    "tool_call_after": ("Need the weather.\n</think>" + R1_CALLS, "Need the weather.\n", R1_CALLS),
}

QWEN3_CASES = {
    "thinking": ("<think>\nThe user wants 2 + 2, which is 4.\n</think>\n\n2 + 2 = 4.",
                 "\nThe user wants 2 + 2, which is 4.\n", "\n\n2 + 2 = 4."),
    # enable_thinking=False: the template closed an empty block in the prompt.
    "thinking_disabled": ("2 + 2 = 4. Note that x < y and <b>bold</b>.", None,
                          "2 + 2 = 4. Note that x < y and <b>bold</b>."),
    "cut_off_while_thinking": ("<think>\nLet me think about this carefully. First,", 
                               "\nLet me think about this carefully. First,", None),
    "empty_block": ("<think>\n\n</think>\n\nHi!", "\n\n", "\n\nHi!"),
    "text_before_the_block": ("\n<think>hmm</think>ok", "hmm", "\nok"),
    "tool_call_after": ("<think>\nNeed the weather.\n</think>" + QWEN3_CALL, "\nNeed the weather.\n", QWEN3_CALL),
    "unicode": ("<think>東京 café 🚀 a < b</think>答案 </think> 4", "東京 café 🚀 a < b", "答案 </think> 4"),
    "ends_in_partial_opening_tag": ("The tag is <thi", None, "The tag is <thi"),
}

CASES = [(R1, k, *v) for k, v in R1_CASES.items()] + [(QWEN3, k, *v) for k, v in QWEN3_CASES.items()]
IDS = [f"{c[0].__name__}-{c[1]}" for c in CASES]


def tokenizer_for(parser, request):
    return request.getfixturevalue("deepseek_tokenizer" if parser is R1 else "qwen3_tokenizer")


def token_deltas(tokenizer, text: str) -> list[str]:
    """The deltas the engine's detokenizer would produce (DecodeStream, special tokens kept)."""
    from tokenizers.decoders import DecodeStream

    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    stream = DecodeStream(skip_special_tokens=False)
    pieces = [p for p in (stream.step(tokenizer._tokenizer, i) for i in ids) if p]
    assert "".join(pieces) == text
    return pieces


def splits(text: str, tokenizer) -> dict[str, list[str]]:
    out = {"whole": [text], "per_char": list(text), "per_token": token_deltas(tokenizer, text)}
    for seed, max_len in enumerate((2, 3, 5, 9, 17)):
        rnd = random.Random(seed)
        pieces, i = [], 0
        while i < len(text):
            n = rnd.randint(1, max_len)
            pieces.append(text[i : i + n])
            i += n
        out[f"random{seed}_max{max_len}"] = pieces
    return out


def stream(parser, pieces: list[str]):
    deltas, previous = [], ""
    for piece in pieces:
        current = previous + piece
        deltas.append(parser.extract_reasoning_streaming(previous, current, piece))
        previous = current
    deltas.append(parser.finish_streaming())
    return [d for d in deltas if d is not None]


@pytest.mark.parametrize("parser,case,output,reasoning,content", CASES, ids=IDS)
def test_extract(parser, case, output, reasoning, content, request):
    assert parser(tokenizer_for(parser, request)).extract_reasoning(output) == (reasoning, content)


@pytest.mark.parametrize("parser,case,output,reasoning,content", CASES, ids=IDS)
def test_streaming_concatenates_to_extract(parser, case, output, reasoning, content, request):
    tokenizer = tokenizer_for(parser, request)
    for name, pieces in splits(output, tokenizer).items():
        deltas = stream(parser(tokenizer), pieces)
        for d in deltas:
            assert d.content or d.reasoning_content, name
            assert not d.tool_calls
        got_reasoning = "".join(d.reasoning_content or "" for d in deltas) or None
        got_content = "".join(d.content or "" for d in deltas) or None
        assert (got_reasoning, got_content) == (reasoning, content), name


SPLIT_TAGS = {
    # deltas -> what each returns, (reasoning, content) or None
    R1: (["abc </th", "ink", ">def", " ghi"], [("abc ", None), None, (None, "def"), (None, " ghi")]),
    QWEN3: (["<th", "ink>abc </th", "ink", ">def", " ghi"], [None, ("abc ", None), None, (None, "def"), (None, " ghi")]),
}


@pytest.mark.parametrize("parser", [R1, QWEN3])
def test_tag_split_across_deltas_and_inside_one(parser, request):
    pieces, expected = SPLIT_TAGS[parser]
    p = parser(tokenizer_for(parser, request))
    got, previous = [], ""
    for piece in pieces:
        d = p.extract_reasoning_streaming(previous, previous + piece, piece)
        got.append(None if d is None else (d.reasoning_content, d.content))
        previous += piece
    assert got == expected
    assert p.finish_streaming() is None
    text = ("<think>" if parser is QWEN3 else "") + "x</think>y"
    both = parser(tokenizer_for(parser, request)).extract_reasoning_streaming("", text, text)
    assert (both.reasoning_content, both.content) == ("x", "y")


@pytest.mark.parametrize("parser", [R1, QWEN3])
def test_is_reasoning_end(parser, request):
    tokenizer = tokenizer_for(parser, request)
    p = parser(tokenizer)
    assert p.end_token == "</think>" and p.start_token == "<think>"
    assert p.end_token_id == tokenizer.convert_tokens_to_ids("</think>")
    thinking = tokenizer("<think>\nstill thinking", add_special_tokens=False)["input_ids"]
    done = tokenizer("<think>\nthought</think>\n\nanswer", add_special_tokens=False)["input_ids"]
    assert not p.is_reasoning_end(thinking)
    assert p.is_reasoning_end(done)
    assert not p.is_reasoning_end([])


@pytest.mark.parametrize("parser", [R1, QWEN3])
def test_tokenizer_without_think_tokens(parser, plain_tokenizer):
    with pytest.raises(ValueError, match="</think>"):
        parser(plain_tokenizer)
    with pytest.raises(ValueError):
        parser(None)


def test_registry():
    assert set(REASONING_PARSERS) == {"deepseek_r1", "qwen3"}
    with pytest.raises(ValueError, match="deepseek_r1"):
        get_reasoning_parser("nope")


def test_bare_tokenizers_tokenizer(qwen3_tokenizer, plain_tokenizer):
    p = QWEN3(qwen3_tokenizer._tokenizer)
    assert (p.start_token_id, p.end_token_id) == tuple(qwen3_tokenizer.convert_tokens_to_ids(["<think>", "</think>"]))
    with pytest.raises(ValueError):
        QWEN3(plain_tokenizer._tokenizer)
