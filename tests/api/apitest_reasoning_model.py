"""A tiny Llama checkpoint that thinks out loud on cue: whatever it is asked, greedy decoding (and
sampling: the margins are huge) writes ``<think>`` + ``REASONING`` + ``</think>`` + ``CONTENT``
and then its end-of-sequence token.

The weights make a bigram model: every layer's output projections are zero, so the residual
stream is the token's embedding, and each token of the recorded chain has a one-hot embedding
whose logits row points at the next token of the chain. The chain starts at the last token of
the chat template's generation prompt. The tokenizer is a byte-level BPE trained on the spot, with
the think tags as added special tokens, as in the Qwen3 and DeepSeek-R1 tokenizers.
"""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path

REASONING = "Let me think about it carefully."
CONTENT = "The answer is four"
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
_CORPUS = [REASONING, CONTENT] * 4 + ["user assistant system\nWhat is 2 + 2? yes no maybe", "Answer in one word."]


def build_thinking_checkpoint(path: str | Path) -> Path:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path = Path(path)
    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    raw.train_from_iterator(_CORPUS, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>")
    tok.chat_template = CHAT_TEMPLATE
    vocab = tok.get_vocab()

    def ids(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)

    prompt_end = ids("assistant\n")[-1]
    chain = [prompt_end, vocab["<think>"], *ids(REASONING), vocab["</think>"], *ids(CONTENT), vocab["<|im_end|>"]]
    if len(set(chain)) != len(chain):  # a bigram model has one successor per token
        raise AssertionError(f"the recorded chain repeats a token: {chain}")

    hidden = 64
    config = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=False, bos_token_id=vocab["<|im_start|>"], eos_token_id=vocab["<|im_end|>"],
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.zero_()  # layers add nothing: the last hidden state is the token's embedding
        embed = model.model.embed_tokens.weight
        head = model.lm_head.weight
        embed.zero_()
        head.zero_()
        for k, (token, following) in enumerate(pairwise(chain)):
            embed[token, k] = 1.0
            head[following, k] = 10.0
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path
