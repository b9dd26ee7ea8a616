"""Speculative decoding with DeepSeek-V3's multi-token-prediction layer (``{"method": "mtp"}``) on
a tiny V3 checkpoint that carries one (random weights): output token for token equal to decoding
without drafts through chunked prefill, preemption and async steps; and every draft equal to an
independent reference, transformers' DeepSeek-V3 decoder layer (the checkpoint's MTP block) run
over the whole sequence on transformers' own final hidden states, chained on its own outputs."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

from deepbatch import LLM, SamplingParams
from spec_steps_common import alternate_draft_steps

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))

K = 3


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from test_deepseek import build_v3_mtp_checkpoint

    root = tmp_path_factory.mktemp("mtp")
    path, _, extra = build_v3_mtp_checkpoint(str(root))
    return path, str(root / "deeper"), extra


def prompts(lengths=(6, 21, 40, 3)):
    rng = random.Random(4)
    return [{"prompt_token_ids": [rng.randrange(3, 300) for _ in range(n)]} for n in lengths]


COMMON = dict(dtype="float32", device="cpu", max_model_len=128, max_num_batched_tokens=24)
SPEC = {"method": "mtp", "num_speculative_tokens": K, "cost_model": False}


def rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def reference_drafts(target, deeper, extra, tokens: list[int], k: int) -> list[int]:
    """The MTP layer's greedy drafts after ``tokens``, recomputed from scratch with transformers."""
    cfg = target.config
    L, eps = cfg.num_hidden_layers, cfg.rms_norm_eps
    mtp = f"model.layers.{L}."
    layer, rotary = deeper.model.layers[L], deeper.model.rotary_emb
    with torch.no_grad():
        hidden = target.model(torch.tensor([tokens])).last_hidden_state[0]  # final norm applied
        prev, nxt = hidden[:-1], list(tokens[1:])  # position p: h[p] and the token after it
        drafts = []
        for _ in range(k):
            e = rms(target.model.embed_tokens(torch.tensor(nxt)), extra[mtp + "enorm.weight"], eps)
            x = torch.cat([e, rms(prev, extra[mtp + "hnorm.weight"], eps)], -1) @ extra[mtp + "eh_proj.weight"].T
            m = x.shape[0]
            pos = torch.arange(m)[None]
            mask = torch.full((m, m), float("-inf")).triu(1)[None, None]
            out = layer(x[None], attention_mask=mask, position_ids=pos,
                        position_embeddings=rotary(x[None], pos))
            out = (out[0] if isinstance(out, tuple) else out)[0]
            logits = target.lm_head(rms(out[-1], extra[mtp + "shared_head.norm.weight"], eps))
            drafts.append(int(logits.argmax()))
            # The next draft: the layer's own output stands in for the target's hidden state.
            prev, nxt = torch.cat([prev, out[-1:]]), nxt + [drafts[-1]]
    return drafts


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_drafts_are_the_mtp_layers_and_the_output_is_the_targets(checkpoint, monkeypatch, preemption):
    from transformers import AutoModelForCausalLM

    path, deeper_path, extra = checkpoint
    ps = prompts()
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(path, **COMMON).generate(ps, params, use_tqdm=False)]
    # A pool of 9 blocks preempts: the MTP cache is dropped and caught up again, from hidden-state
    # rows recomputed, or swapped out and back in with their blocks.
    swap = dict(swap_space=0.01, preemption_mode="swap") if preemption == "swap" else {}
    llm = LLM(path, **COMMON, num_gpu_blocks_override=9, speculative_config=SPEC, **swap)
    engine = llm.engine
    choices = alternate_draft_steps(engine, monkeypatch)
    seen = []
    propose = engine.proposer.propose

    def recording(running, spec_cost=None):
        propose(running, spec_cost)
        seen.extend((list(r.all_token_ids), list(r.spec_token_ids)) for r in running if r.spec_token_ids)

    engine.proposer.propose = recording
    got = [o.outputs[0].token_ids for o in llm.generate(ps, params, use_tqdm=False)]
    assert got == want
    assert engine.scheduler.num_preemptions > 0 and False in choices
    assert len(seen) > 20 and any(len(d) == K for _, d in seen)

    target = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    deeper = AutoModelForCausalLM.from_pretrained(deeper_path, dtype=torch.float32).eval()
    deeper.config._attn_implementation = "eager"
    for tokens, drafts in random.Random(0).sample(seen, 20):
        assert drafts == reference_drafts(target, deeper, extra, tokens, len(drafts)), len(tokens)


def test_sampled_requests_write_what_they_write_without_drafts(checkpoint):
    # Drafts drawn as the target draws each place (``draw_drafts``): a seeded request keeps its
    # tokens; an unseeded one is seeded by the engine and runs through the same draws.
    path, _, _ = checkpoint
    ps = prompts()
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=8, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=0.7, top_k=30, seed=2, max_tokens=16, ignore_eos=True)]
    want = [o.outputs[0].token_ids for o in LLM(path, **COMMON).generate(ps, params * 2, use_tqdm=False)]
    llm = LLM(path, **COMMON, speculative_config=SPEC)
    got = [o.outputs[0].token_ids for o in llm.generate(ps, params * 2, use_tqdm=False)]
    assert got == want
    unseeded = llm.generate(ps, SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 16 for o in unseeded)
    assert llm.engine.stats.spec_num_draft_tokens > 0


def test_a_checkpoint_without_mtp_layers_is_refused(tmp_path):
    from test_deepseek import build_deepseek_checkpoint

    path = build_deepseek_checkpoint("v3", str(tmp_path / "v3"))
    with pytest.raises(ValueError, match="method mtp needs a checkpoint with multi-token-prediction layers"):
        LLM(path, **COMMON, speculative_config=SPEC)
