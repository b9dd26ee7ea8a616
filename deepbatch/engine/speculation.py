"""Speculative decoding's parts of an engine: the drafter's runner (a draft model or the MTP
layer; none for prompt lookup), the proposer that sets each request's drafts before a step, and
the cost model that caps them."""

from __future__ import annotations

import random
from dataclasses import replace

from deepbatch.config import EngineConfig
from deepbatch.control.spec_cost import SpecCostModel
from deepbatch.core.sampling_params import SamplingParams
from deepbatch.sampling.draft_rows import draws_like_target


def build_drafter(config: EngineConfig, runner, hf_config, tokenizer, max_model_len: int):
    """The draft model's or the MTP layer's runner (None for prompt lookup or without
    speculation). Build it before the KV pool is sized: a draft model's weights count as used
    memory, and each target block is sized with the drafter's block beside it
    (``kv_bytes_per_block``)."""
    spec = config.speculative_config
    if spec is None or spec.method == "ngram":
        return None
    if spec.method == "mtp":
        from deepbatch.runner.mtp_runner import MTPRunner

        if config.parallel.tensor_parallel_size > 1:  # rank 0's shard of the layer, the workers' in step
            return MTPRunner(config, runner.runner, max_model_len, peers=runner.call_drafters)
        return MTPRunner(config, runner, max_model_len)
    from deepbatch.runner.draft_model_runner import DraftModelRunner

    return DraftModelRunner(config, hf_config, tokenizer, max_model_len)


def build_proposer(config: EngineConfig, drafter, num_blocks: int, max_model_len: int):
    """``(proposer, cost model)``, each None without speculation. A drafter's cache is made here,
    so call it before the swap pool copies the caches' layout (the MTP drafter adds the target's
    hidden-state rows to it)."""
    spec = config.speculative_config
    if spec is None:
        return None, None
    if drafter is not None:
        from deepbatch.spec_decode.draft_model import DraftModelProposer
        from deepbatch.spec_decode.mtp import MTPProposer

        cls = MTPProposer if spec.method == "mtp" else DraftModelProposer
        proposer = cls(spec, drafter, max_model_len, config.scheduler.max_num_batched_tokens)
        proposer.init_kv_cache(num_blocks)
    else:
        from deepbatch.spec_decode.ngram import NgramProposer

        proposer = NgramProposer(spec, max_model_len)
    return proposer, SpecCostModel(spec.num_speculative_tokens) if spec.cost_model else None


class DrawSeeds:
    """Seeds for the requests a drafting model draws as its target will
    (``sampling/draft_rows.py``): the two draws of a place meet only under the same noise, which
    an unseeded request draws afresh each call. A request without a seed gets one here (from the
    engine's seed), which leaves its output distributed as before."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)

    def __call__(self, params: SamplingParams, grammar) -> SamplingParams:
        if params.seed is None and draws_like_target(params, grammar):
            return replace(params, seed=self.rng.getrandbits(64))
        return params


def build_draw_seeds(config: EngineConfig) -> DrawSeeds | None:
    """``DrawSeeds`` where a drafting model draws drafts (draft_model, mtp), else None."""
    spec = config.speculative_config
    return DrawSeeds(config.model.seed) if spec is not None and spec.method in ("draft_model", "mtp") else None
