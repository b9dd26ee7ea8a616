"""Rotary position embedding with the scalings transformers defines (llama3, yarn, linear, ...).

The inverse frequencies come from transformers' own ``ROPE_INIT_FUNCTIONS`` so that every
scaling variant matches the reference implementation; cos/sin are tabulated once for all
positions up to ``max_position`` and indexed by each token's position.
"""

from __future__ import annotations

import torch
from torch import nn

from deepbatch.kernels.rotary import neox_tables, rotary, rotate_neox, triton


def rope_parameters(config) -> dict:
    """The model's rope settings in transformers v5 form (``rope_type``, ``rope_theta``, ...)."""
    params = getattr(config, "rope_parameters", None)
    if params:
        return dict(params)
    params = dict(getattr(config, "rope_scaling", None) or {})
    params.setdefault("rope_type", params.pop("type", "default"))
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return params


def compute_inv_freq(config, head_dim: int) -> tuple[torch.Tensor, float]:
    params = rope_parameters(config)
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        base = params["rope_theta"]
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        return inv_freq, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"rope_type {rope_type!r} is not supported")
    return ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")


class RotaryEmbedding(nn.Module):
    """Neox-style rotation (``rotate_half``) over the first ``rotary_dim`` dims of each head."""

    def __init__(self, config, head_dim: int, max_position: int, rotary_dim: int | None = None):
        super().__init__()
        self.rotary_dim = rotary_dim or head_dim
        inv_freq, attention_scaling = compute_inv_freq(config, self.rotary_dim)
        # Tabulated in fp32 on the CPU (transformers' init functions return CPU tensors), then moved.
        t = torch.arange(max_position, dtype=torch.float, device="cpu")
        freqs = torch.outer(t, inv_freq.float().cpu()).to(torch.get_default_device())  # [P, rot/2]
        self.register_buffer("cos", freqs.cos() * attention_scaling, persistent=False)
        self.register_buffer("sin", freqs.sin() * attention_scaling, persistent=False)

    def at(self, positions: torch.Tensor) -> "RotaryAt":
        """The rotation at ``positions`` ([T]); every layer of a forward applies the same one,
        so the table lookup runs once per forward, not once per layer."""
        return RotaryAt(self.cos[positions], self.sin[positions], self.rotary_dim)  # [T, rot/2] each

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.at(positions)(q, k)


class RotaryAt:
    """cos/sin gathered for one forward's positions: the half tables, ``[T, rot/2]`` float32 each.

    On CUDA the Triton kernel reads them as they are and rotates q and k in place; elsewhere the
    torch reference runs on ``rotate_half``'s full layout, built once per dtype and shared by
    every layer."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int):
        self.cos, self.sin, self.rotary_dim = cos, sin, rotary_dim
        self._cast: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, q: torch.Tensor, k: torch.Tensor, q_norm=None, k_norm=None) -> tuple[torch.Tensor, torch.Tensor]:
        """``q [T, Hq, D]``, ``k [T, Hk, D]`` rotated; ``q_norm``/``k_norm`` (RMSNorm modules over the
        head dim, Qwen3's) are applied to each head first, in the same kernel on CUDA."""
        if q.is_cuda and triton is not None:
            if q_norm is not None and self.rotary_dim == q.shape[-1] == k.shape[-1]:
                return rotary(q, k, self.cos, self.sin, self.rotary_dim, q_norm.weight, k_norm.weight, q_norm.eps)
            if q_norm is not None:
                q, k = q_norm(q), k_norm(k)
            return rotary(q, k, self.cos, self.sin, self.rotary_dim)
        if q_norm is not None:
            q, k = q_norm(q), k_norm(k)
        cast = self._cast.get(q.dtype)
        if cast is None:
            cast = self._cast[q.dtype] = neox_tables(self.cos, self.sin, q.dtype)
        cos, sin = cast
        return rotate_neox(q, cos, sin, self.rotary_dim), rotate_neox(k, cos, sin, self.rotary_dim)
