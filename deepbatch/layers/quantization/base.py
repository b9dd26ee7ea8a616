"""What every weight format shares: the linear method interface, the unquantized method, and the
sharding metadata each parameter carries.

A linear layer does not know its format. At construction it asks the quantization scope
(``quantization_scope`` in ``build_model``) for a ``LinearMethod``; the method creates the layer's
parameters (a bf16 ``weight``, or e4m3 ``weight`` + ``weight_scale_inv``, or packed int4
``qweight`` + ``scales`` + ``qzeros`` ...), turns what the checkpoint gave into the layout its kernel
reads (``process_weights_after_loading``) and runs the product (``apply``). The model files stay the
same for every format.

Each parameter says how it is cut under tensor parallelism and inside merged projections, so the
layers' loaders need no per-format code::

    output_dim, output_unit   the dim that runs over output features, and how many features one
                              index there covers (1; 128 for a block scale; 8 for AWQ's packing)
    input_dim, input_unit     the same for input features (group size for group scales, 8 for
                              GPTQ's packing); None: the tensor does not depend on that side
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Collection, Iterator
from typing import NoReturn

import torch
import torch.nn.functional as F
from torch import nn


def shard_param(data: torch.Tensor, *, output_dim: int | None = None, input_dim: int | None = None,
                output_unit: int = 1, input_unit: int = 1) -> nn.Parameter:
    """A frozen parameter that carries its sharding metadata (see the module docstring)."""
    p = nn.Parameter(data, requires_grad=False)
    p.output_dim, p.input_dim = output_dim, input_dim
    p.output_unit, p.input_unit = output_unit, input_unit
    return p


def moe_param(data: torch.Tensor, role: str, unit: int = 1) -> nn.Parameter:
    """A fused-MoE parameter: ``role`` "gate_up" (``[E, 2I, ...]``, gate rows then up rows) or
    "down" (``[E, ..., I]``), with ``unit`` intermediate features per index of its ``I`` dim."""
    p = nn.Parameter(data, requires_grad=False)
    p.moe_role, p.moe_unit = role, unit
    return p


class LinearMethod:
    """How one linear layer holds and applies its weight. One instance may serve many layers: the
    state lives in the layer's parameters."""

    name = "unquantized"
    # Formats whose tensors need every output part of a merged layer to start on a unit boundary
    # (block scales, packed columns) check that in ``create_weights``.

    def create_weights(self, layer: nn.Module, in_features: int, out_sizes: list[int], dtype: torch.dtype) -> None:
        """Register the parameters on ``layer`` for an ``[sum(out_sizes), in_features]`` weight
        (this rank's share), made of the parts ``out_sizes`` (one part unless merged)."""
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Turn the loaded checkpoint tensors into the layout ``apply`` reads (once, after loading)."""

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``x @ W^T`` for ``x [..., in_features]``, without the bias, in ``x``'s dtype."""
        raise NotImplementedError

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        """The weight as ``[out_features, in_features]`` floats (after loading): for code that
        needs the matrix itself (MLA's absorbed ``kv_b_proj``), and for tests."""
        raise NotImplementedError

    @torch.no_grad()
    def init_random(self, layer: nn.Module, generator: torch.Generator) -> None:
        """Fill the parameters with seeded random weights of a sensible scale (benchmarks), in this
        format's own layout: the stored tensors have the shapes and dtypes a checkpoint would give."""
        raise NotImplementedError


class UnquantizedLinearMethod(LinearMethod):
    def create_weights(self, layer, in_features, out_sizes, dtype):
        out = sum(out_sizes)
        layer.weight = shard_param(torch.empty(out, in_features, dtype=dtype), output_dim=0, input_dim=1)

    def apply(self, layer, x):
        return F.linear(x, layer.weight)

    def dequantize(self, layer):
        return layer.weight

    @torch.no_grad()
    def init_random(self, layer, generator):
        layer.weight.normal_(0.0, 0.02, generator=generator)


class FusedMoEMethod:
    """How a fused-MoE layer holds and runs its stacked experts: ``gate_up_proj [E, 2I, H]`` and
    ``down_proj [E, H, I]`` (this rank's ``I``), plus whatever tensors the format adds. A
    parameter's ``moe_unit`` is how many intermediate features one index of its ``I`` dim covers."""

    name = "unquantized"

    def create_weights(self, layer: nn.Module, num_experts: int, hidden: int, intermediate: int,
                       dtype: torch.dtype) -> None:
        layer.gate_up_proj = moe_param(torch.empty(num_experts, 2 * intermediate, hidden, dtype=dtype), "gate_up")
        layer.down_proj = moe_param(torch.empty(num_experts, hidden, intermediate, dtype=dtype), "down")

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        pass

    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        from deepbatch.kernels.fused_moe import fused_moe, fused_moe_ref, triton

        if x.is_cuda and triton is not None:
            return fused_moe(x, layer.gate_up_proj, layer.down_proj, topk_weights, topk_ids)
        return fused_moe_ref(x, layer.gate_up_proj, layer.down_proj, topk_weights, topk_ids)

    def dequantize(self, layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """``(w13 [E, 2I, H], w2 [E, H, I])`` as floats (tests, debugging)."""
        return layer.gate_up_proj, layer.down_proj

    @torch.no_grad()
    def init_random(self, layer: nn.Module, generator: torch.Generator) -> None:
        layer.gate_up_proj.normal_(0.0, 0.02, generator=generator)
        layer.down_proj.normal_(0.0, 0.02, generator=generator)


class QuantizationConfig:
    """A checkpoint's (or ``--quantization``'s) format: which method each linear layer and each
    fused-MoE block gets."""

    name = "none"

    def linear_method(self) -> LinearMethod:
        raise NotImplementedError

    def moe_method(self) -> FusedMoEMethod | None:
        """The fused-MoE experts' method, or None where the format does not cover experts (the
        MoE layer then refuses to build)."""
        return None

    def is_ignored(self, module_name: str) -> bool:
        """Layers the checkpoint left unquantized (``ignore`` / ``modules_to_not_convert``)."""
        return False

    def describe(self) -> str:
        return self.name

    def weight_bits(self) -> float:
        """Stored bits per weight of a quantized linear layer, its scales and zero points included
        (the roofline's bytes per step, the doctor's weight estimate)."""
        raise NotImplementedError

    def compute_speedup(self) -> float:
        """How much faster than 16-bit its GEMMs can compute at best: 2 for FP8 tensor cores,
        1 for weight-only formats (their products run in 16 bits)."""
        return 1.0


def refuse_option(fmt: str, option: str, value, supported: str) -> NoReturn:
    """A checkpoint's quantization_config option whose value this format cannot load, named with
    what it can (``fmt`` may name a part of the config too, as "compressed-tensors weights")."""
    raise ValueError(f"quantization_config: {fmt} {option} {value!r} is not supported ({supported})")


def refuse_unknown_options(fmt: str, qc: dict, known: Collection[str]) -> None:
    """An option outside ``known`` may change what the tensors mean: refused rather than ignored."""
    unknown = sorted(set(qc) - set(known))
    if unknown:
        raise ValueError(f"quantization_config: {fmt} option(s) {unknown} are not supported")


def require_option(fmt: str, qc: dict, option: str, only, note: str = "") -> None:
    """``qc[option]``, where given, must be ``only``; ``note`` says why in the refusal."""
    value = qc.get(option, only)
    if value != only:
        refuse_option(fmt, option, value, f"only {only!r}{note}")


# Merged layers and the checkpoint projections they hold, for matching per-projection ignore lists.
MERGED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def ignored_by(module_name: str, matches: Callable[[str], bool], fmt: str) -> bool:
    """Whether the checkpoint left ``module_name`` unquantized, by the checkpoint's own names: a
    merged layer (q|k|v, gate|up) is when all its projections are, and one whose projections
    differ cannot be built (one layer holds one format)."""
    prefix, _, leaf = module_name.rpartition(".")
    parts = MERGED_PARTS.get(leaf)
    if parts is None:
        return matches(module_name)
    names = [f"{prefix}.{p}" if prefix else p for p in parts]
    hits = [matches(n) for n in names]
    if any(hits) and not all(hits):
        kept = [n for n, h in zip(names, hits) if not h]
        raise ValueError(f"quantization {fmt}: the checkpoint leaves some projections of {module_name} unquantized "
                         f"but not {', '.join(kept)}; one merged layer cannot mix formats")
    return all(hits)


UNQUANTIZED = UnquantizedLinearMethod()
UNQUANTIZED_MOE = FusedMoEMethod()

_scope: contextvars.ContextVar[QuantizationConfig | None] = contextvars.ContextVar("deepbatch_quantization",
                                                                                     default=None)


@contextlib.contextmanager
def quantization_scope(config: QuantizationConfig | None) -> Iterator[None]:
    """Layers built inside take their methods from ``config`` (None: unquantized)."""
    token = _scope.set(config)
    try:
        yield
    finally:
        _scope.reset(token)


def current_quantization() -> QuantizationConfig | None:
    return _scope.get()


def current_linear_method() -> LinearMethod:
    config = _scope.get()
    return UNQUANTIZED if config is None else config.linear_method()


def current_moe_method() -> FusedMoEMethod:
    config = _scope.get()
    if config is None:
        return UNQUANTIZED_MOE
    method = config.moe_method()
    if method is None:
        raise ValueError(f"quantization {config.describe()}: mixture-of-experts layers are not supported in this "
                         "format")
    return method
