"""DeepSeekMoE: a router picks ``top_k`` of ``E`` fine-grained experts per token; their gated MLPs
run as one fused grouped GEMM; always-on shared experts are added::

    out = sum_k w[t, k] * expert_{ids[t, k]}(x[t])  +  shared(x[t])

Routers, as transformers implements them:
- V2 (``softmax``): softmax over all experts; ``greedy`` top-k, or ``group_limited_greedy`` (keep the
  ``topk_group`` groups with the highest single expert score, then top-k inside them).
- V3 (``sigmoid``, ``noaux_tc``): sigmoid scores; the choice uses ``score + e_score_correction_bias``
  ranked per group by the sum of its two best, ``topk_group`` groups kept; the weights are the plain
  sigmoid scores of the chosen experts, optionally normalised to sum to 1.
Either way the weights are finally multiplied by ``routed_scaling_factor``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deepbatch.distributed.parallel_state import current_tp_group
from deepbatch.layers.quantization.base import FusedMoEMethod, current_moe_method


class TopKRouter(nn.Module):
    """Returns ``(topk_weights [T, K] float32, topk_ids [T, K] int64)``. The gate weight stays in
    float32 whatever the model dtype (transformers keeps it so): close expert scores must rank the
    same."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, scoring_func: str, topk_method: str,
                 n_group: int | None, topk_group: int | None, norm_topk_prob: bool, routed_scaling_factor: float):
        super().__init__()
        if scoring_func not in ("softmax", "sigmoid"):
            raise ValueError(f"moe: scoring_func {scoring_func!r} is not supported")
        if topk_method not in ("greedy", "group_limited_greedy", "noaux_tc"):
            raise ValueError(f"moe: topk_method {topk_method!r} is not supported")
        if topk_method != "greedy" and (not n_group or not topk_group or num_experts % n_group):
            raise ValueError(f"moe: {topk_method} needs n_group dividing {num_experts} experts and topk_group, "
                             f"got n_group={n_group}, topk_group={topk_group}")
        self.num_experts, self.top_k = num_experts, top_k
        self.scoring_func, self.topk_method = scoring_func, topk_method
        self.n_group, self.topk_group = n_group, topk_group
        self.norm_topk_prob = norm_topk_prob
        self.routed_scaling_factor = routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, dtype=torch.float32), requires_grad=False)
        self.e_score_correction_bias = None
        if topk_method == "noaux_tc":
            self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32),
                                                        requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.weight)  # [T, E]
        scores = logits.softmax(-1) if self.scoring_func == "softmax" else logits.sigmoid()
        if self.topk_method == "greedy":
            weights, ids = torch.topk(scores, self.top_k, dim=-1, sorted=False)
        elif self.topk_method == "group_limited_greedy":
            group_scores = scores.view(-1, self.n_group, self.num_experts // self.n_group).amax(-1)  # [T, G]
            scores = scores.masked_fill(~self._group_mask(group_scores), 0.0)
            weights, ids = torch.topk(scores, self.top_k, dim=-1, sorted=False)
        else:
            choice = scores + self.e_score_correction_bias
            group_scores = choice.view(-1, self.n_group, self.num_experts // self.n_group).topk(2, dim=-1)[0].sum(-1)
            choice = choice.masked_fill(~self._group_mask(group_scores), float("-inf"))
            ids = torch.topk(choice, self.top_k, dim=-1, sorted=False)[1]
            weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, ids

    def _group_mask(self, group_scores: torch.Tensor) -> torch.Tensor:
        """``[T, E]`` bool: experts whose group is among the ``topk_group`` best of the token."""
        group_idx = torch.topk(group_scores, self.topk_group, dim=-1, sorted=False)[1]
        mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)  # [T, G]
        # expand + reshape rather than repeat_interleave, which may sync to size its output.
        return mask.unsqueeze(-1).expand(-1, self.n_group, self.num_experts // self.n_group).reshape(mask.shape[0], -1)


class FusedMoE(nn.Module):
    """Routed experts with stacked weights: ``gate_up_proj [E, 2I, H]`` (gate rows, then up) and
    ``down_proj [E, H, I]``, transformers' in-memory layout. Checkpoints name each expert apart
    (``experts.{e}.gate_proj.weight`` ...); ``weight_loader`` copies one into its slice.

    Under tensor parallelism every rank holds every expert, each cut to ``I / N`` of its
    intermediate dim (gate and up rows, down columns): routing is replicated and ``forward``
    returns this rank's partial sum, which ``DeepseekMoE`` all-reduces. ``self.intermediate``
    is this rank's share."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int):
        super().__init__()
        self.tp = current_tp_group()
        self.num_experts, self.hidden = num_experts, hidden
        self.intermediate = self.tp.split(intermediate, "moe_intermediate_size")
        self.quant_method: FusedMoEMethod = current_moe_method()
        self.quant_method.create_weights(self, num_experts, hidden, self.intermediate, torch.get_default_dtype())

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: tuple[int, str] | None = None) -> None:
        """``shard``: ``None`` for a whole stacked tensor, else ``(expert, "gate_proj" | "up_proj" |
        "down_proj")`` for one expert's matrix (or its scales: the same cut, in units of the
        param's ``moe_unit`` intermediate features)."""
        unit = getattr(param, "moe_unit", 1)
        if self.intermediate % unit:
            raise ValueError(f"moe_intermediate_size: this rank's {self.intermediate} features do not split on the "
                             f"format's unit of {unit}")
        rows = self.intermediate // unit
        if shard is None:
            dst = param.data
            if param.moe_role == "gate_up":  # [E, 2I, H]: this rank's rows of the gate and of the up half
                gate, up = loaded.chunk(2, 1)
                loaded = torch.cat((self._mine(gate, 1), self._mine(up, 1)), 1)
            else:  # down [E, H, I]
                loaded = self._mine(loaded, 2)
        else:
            expert, part = shard
            dst = param.data[expert]
            if part == "gate_proj":
                dst, loaded = dst[:rows], self._mine(loaded, 0)
            elif part == "up_proj":
                dst, loaded = dst[rows:], self._mine(loaded, 0)
            else:  # down [H, I]
                loaded = self._mine(loaded, 1)
        if dst.shape != loaded.shape:
            raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} for a slice of {tuple(dst.shape)}")
        dst.copy_(loaded)

    def _mine(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        if self.tp.is_single:
            return t
        if t.shape[dim] % self.tp.world_size:
            raise ValueError(f"tensor_parallel_size: expert tensor of shape {tuple(t.shape)} does not split into "
                             f"{self.tp.world_size} along dim {dim}")
        return t.chunk(self.tp.world_size, dim)[self.tp.rank]

    def process_weights_after_loading(self) -> None:
        self.quant_method.process_weights_after_loading(self)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, topk_weights, topk_ids)


class DeepseekMoE(nn.Module):
    """Router + routed experts + shared experts. ``shared_experts`` is a gated MLP of
    ``n_shared_experts * moe_intermediate_size`` built by the model (or None) with
    ``reduce_results=False``: under tensor parallelism the routed and the shared partial sums are
    added first and all-reduced once."""

    def __init__(self, router: TopKRouter, hidden: int, intermediate: int, shared_experts: nn.Module | None):
        super().__init__()
        self.gate = router
        self.experts = FusedMoE(router.num_experts, hidden, intermediate)
        self.shared_experts = shared_experts
        self.tp = current_tp_group()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = self.gate(x)
        out = self.experts(x, topk_weights, topk_ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return self.tp.all_reduce(out)
