"""The pre-norm residual block shared by Llama-family and DeepSeek decoder layers:

    h = x + attn(norm1(x));  out = h + mlp(norm2(h))

with each residual add fused into the next norm (``RMSNorm(x, residual)``), so the block passes
``(x, residual)`` along instead of materialising every sum.
"""

from __future__ import annotations

from torch import nn


class PreNormDecoderLayer(nn.Module):
    """Subclasses set ``self_attn``, ``mlp``, ``input_layernorm`` and ``post_attention_layernorm``."""

    def forward(self, x, residual, rope, batch):
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, rope, batch)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class DecoderStack(nn.Module):
    """embed -> layers -> final norm. Subclasses set ``embed_tokens``, ``layers``, ``norm`` and
    ``rotary`` (the position encoding every layer shares)."""

    def forward(self, input_ids, positions, batch):
        x = self.embed_tokens(input_ids)
        residual = None
        rope = self.rotary.at(positions)  # one table lookup for all layers
        for layer in self.layers:
            x, residual = layer(x, residual, rope, batch)
        x, _ = self.norm(x, residual)
        return x
