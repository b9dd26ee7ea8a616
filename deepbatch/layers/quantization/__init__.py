"""Weight formats as linear methods: which one a model gets is read from ``quantization_config``
in its ``config.json`` (or asked for with ``--quantization``), and every linear layer built inside
``quantization_scope`` takes its method from it.

    quant_method                        method                                   module
    "fp8" + weight_block_size           W8A8, 128x128 weight blocks (DeepSeek-V3) fp8.py, fp8_moe.py
    --quantization fp8 (16-bit ckpt)    W8A8, per-channel, quantized at load     fp8.py, fp8_moe.py
    "awq" (GEMM)                        W4A16, group-wise, zero points           awq.py
    "gptq" (4-bit)                      W4A16, group-wise                        gptq.py
    "compressed-tensors"                FP8_DYNAMIC (W8A8) or W4A16 pack-quantized compressed_tensors.py
    (the 4-bit formats share w4a16.py: one layout after loading, one kernel)

Anything else (another method, bit width, group size or option) is refused at load with an error
naming it: a checkpoint is never loaded as if it were 16-bit.
"""

from __future__ import annotations

from deepbatch.layers.quantization.base import (
    UNQUANTIZED,
    LinearMethod,
    QuantizationConfig,
    UnquantizedLinearMethod,
    current_quantization,
    quantization_scope,
)

ONLINE_METHODS = ("fp8",)  # what --quantization can apply to a 16-bit checkpoint


# quant_method -> (module, config class); imported only when a checkpoint needs it.
CHECKPOINT_METHODS = {
    "fp8": ("deepbatch.layers.quantization.fp8", "Fp8Config"),
    "awq": ("deepbatch.layers.quantization.awq", "AWQConfig"),
    "gptq": ("deepbatch.layers.quantization.gptq", "GPTQConfig"),
    "compressed-tensors": ("deepbatch.layers.quantization.compressed_tensors", "CompressedTensorsConfig"),
}


def _from_checkpoint(qc: dict) -> QuantizationConfig:
    import importlib

    method = qc.get("quant_method")
    if method not in CHECKPOINT_METHODS:
        raise ValueError(f"quantization_config: quant_method {method!r} is not supported "
                         f"(supported: {', '.join(CHECKPOINT_METHODS)})")
    module, name = CHECKPOINT_METHODS[method]
    return getattr(importlib.import_module(module), name).from_hf(qc)


def get_quantization_config(hf_config, quantization: str | None = None) -> QuantizationConfig | None:
    """The format of ``hf_config``'s checkpoint, or the online method ``quantization`` names; None
    for plain 16/32-bit weights. ``quantization`` given with a quantized checkpoint must name the
    checkpoint's own method."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is not None and not isinstance(qc, dict):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else dict(vars(qc))
    if qc:
        config = _from_checkpoint(qc)
        if quantization is not None and quantization != qc.get("quant_method"):
            raise ValueError(f"quantization: {quantization!r} asked for, but the checkpoint is already quantized "
                             f"with {qc.get('quant_method')!r}")
        return config
    if quantization is None:
        return None
    if quantization == "fp8":
        from deepbatch.layers.quantization.fp8 import online_fp8

        return online_fp8()
    raise ValueError(f"quantization: {quantization!r} cannot be applied to a 16-bit checkpoint "
                     f"(online: {', '.join(ONLINE_METHODS)}); load a checkpoint quantized in that format")


__all__ = [
    "UNQUANTIZED", "LinearMethod", "QuantizationConfig", "UnquantizedLinearMethod", "current_quantization",
    "get_quantization_config", "quantization_scope",
]
