"""The embedded SmolLM2-135M-Instruct (GGUF): greedy tokens equal HF transformers loading the
same GGUF file, and the model answers a factual question."""

from __future__ import annotations

import os

import torch

from deepbatch import SamplingParams
from deepbatch.models.loader import default_model_path

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "1, 2, 3, 4,",
    "The three primary colors are",
    "Water boils at a temperature of",
    "A haiku about autumn:\n",
    "Translate to French: 'Good morning, how are you today?' ->",
    "Hi",
]


def test_greedy_matches_hf_on_gguf(smollm_llm):
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                              dtype=torch.float32).eval()
    tok = smollm_llm.get_tokenizer()
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outs = smollm_llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ids = torch.tensor([tok.encode(prompt)])
        assert out.prompt_token_ids == ids[0].tolist()
        with torch.no_grad():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False)
        assert out.outputs[0].token_ids == ref[0, ids.shape[1]:].tolist(), prompt
        assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids, skip_special_tokens=True)


def test_answers_capital_of_france(smollm_llm):
    out = smollm_llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                          SamplingParams(temperature=0.0, max_tokens=32), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"  # ended on <|im_end|>, not on length


def test_stop_string_truncates(smollm_llm):
    out = smollm_llm.generate("1, 2, 3, 4,", SamplingParams(temperature=0.0, max_tokens=32, stop=["7"]),
                              use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == "7"
    assert "7" not in out.text and "6" in out.text


def test_gguf_metadata_cache_round_trips(tmp_path):
    from deepbatch.models.loader import gguf_cache_dir, load_hf_config, load_tokenizer, resolve_model

    source = resolve_model(None)
    fresh_cfg, fresh_tok = load_hf_config(source), load_tokenizer(source)
    cfg1, tok1 = load_hf_config(source, str(tmp_path)), load_tokenizer(source, None, str(tmp_path))
    cache = gguf_cache_dir(source, str(tmp_path))
    assert os.path.isfile(os.path.join(cache, "config.json"))
    assert os.path.isfile(os.path.join(cache, "tokenizer_config.json"))
    cfg2, tok2 = load_hf_config(source, str(tmp_path)), load_tokenizer(source, None, str(tmp_path))
    for cfg in (cfg1, cfg2):
        for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size",
                    "rms_norm_eps", "rope_parameters", "tie_word_embeddings", "eos_token_id"):
            assert getattr(cfg, key) == getattr(fresh_cfg, key), key
    text = "Hello, world! Ünïcödé and   spaces\n\tdone."
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    for tok in (tok1, tok2):
        assert tok.encode(text) == fresh_tok.encode(text)
        assert tok.chat_template == fresh_tok.chat_template
        assert list(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)["input_ids"]) == \
            list(fresh_tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)["input_ids"])
        assert tok.eos_token_id == fresh_tok.eos_token_id
