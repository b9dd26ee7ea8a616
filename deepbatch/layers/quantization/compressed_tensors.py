"""compressed-tensors checkpoints (``quant_method: "compressed-tensors"``, as llm-compressor
writes them), parsed by the ``compressed-tensors`` package itself (an optional dependency,
imported only when such a checkpoint loads). Two schemes, one config group targeting ``Linear``:

* FP8_DYNAMIC, ``float-quantized``: e4m3 weights with one scale per output channel and
  activations quantized per token at run time: ``fp8.Fp8ChannelLinearMethod`` (``weight`` e4m3
  ``[N, K]``, ``weight_scale`` ``[N, 1]``).
* W4A16, ``pack-quantized``: int4 weights, one scale (and, asymmetric, one zero point) per group of
  input channels::

      weight_packed      int32 [N, K // 8]      eight values per word along K, value + 8 stored
                                                (element i of a word at bits 4i .. 4i + 3)
      weight_scale             [N, K // g]
      weight_zero_point  int32 [N // 8, K // g] asymmetric only: packed along N, the same way
      weight_shape       int64 [2]              the unpacked [N, K]: checked, not kept
      W[n, k] = (q(n, k) - zp(n, k // g)) * weight_scale[n, k // g]    (q, zp signed, -8..7)

  ``weight_packed`` is ``w4a16.py``'s layout transposed (its stored ``q + 8`` is the unsigned
  nibble, the zero point ``zp + 8``); the zero points are unpacked by the package's own
  ``unpack_from_int32``.

``ignore`` is matched the package's way (exact names, ``re:`` patterns) against the checkpoint's
projection names. Anything else (bit widths, strategies, static or output activation scales,
sparsity, transforms, a KV cache scheme, other formats or targets) is refused naming it.
"""

from __future__ import annotations

import torch

from deepbatch.layers.quantization.base import (
    LinearMethod,
    QuantizationConfig,
    ignored_by,
    refuse_option,
    refuse_unknown_options,
)
from deepbatch.layers.quantization.w4a16 import (
    PACK,
    RANDOM_BITS,
    RANDOM_SCALES,
    W4A16LinearMethod,
    check_group_size,
    checkpoint_param,
    checkpoint_shape,
    w4a16_weight_bits,
)

_FMT = "compressed-tensors"
_PREFIX = f"quantization_config: {_FMT}"
_SCALE_DTYPES = (None, torch.float16, torch.bfloat16, torch.float32)
# Keys that the package's model leaves to its ModelCompressor; read here to refuse what they enable.
_EXTRA_KEYS = {"sparsity_config", "transform_config", "version"}


def _package():
    try:
        import compressed_tensors.quantization as ctq
    except ImportError as e:
        raise ImportError("a compressed-tensors checkpoint needs the compressed-tensors package: "
                          "pip install 'deepbatch[quant]'") from e
    return ctq


class CompressedTensorsW4A16Method(W4A16LinearMethod):
    name = "compressed-tensors-w4a16"
    fmt = "compressed-tensors"

    def __init__(self, group_size: int, symmetric: bool):
        super().__init__(group_size)
        self.symmetric = symmetric

    def create_weights(self, layer, in_features, out_sizes, dtype):
        g = self.check_shape(in_features, out_sizes, packed_output=not self.symmetric)
        k, n = in_features, sum(out_sizes)
        layer.weight_packed = checkpoint_param((n, k // PACK), torch.int32, RANDOM_BITS,
                                               output_dim=0, input_dim=1, input_unit=PACK)
        layer.weight_scale = checkpoint_param((n, k // g), torch.float32, RANDOM_SCALES,
                                              output_dim=0, input_dim=1, input_unit=g)
        if not self.symmetric:
            layer.weight_zero_point = checkpoint_param((n // PACK, k // g), torch.int32, 8, output_dim=0,
                                                       output_unit=PACK, input_dim=1, input_unit=g)
        layer.weight_shape = checkpoint_param((2,), torch.int64, _random_weight_shape)
        layer.weight_shape.custom_loader = _load_weight_shape

    def convert(self, layer):
        from compressed_tensors.compressors import unpack_from_int32

        scales = layer.weight_scale.data
        if self.symmetric:
            zeros = torch.full(scales.shape, 8.0, device=scales.device)
        else:
            zp = unpack_from_int32(layer.weight_zero_point.data, 4, torch.Size(scales.shape), packed_dim=0)
            zeros = zp.to(torch.float32) + 8
        return layer.weight_packed.data.t(), scales.t(), zeros.t()


def _load_weight_shape(layer, param, loaded, shard):
    """Metadata, the same for every rank: it must name the projection the other tensors fill."""
    want = checkpoint_shape(layer, shard)
    got = tuple(int(v) for v in loaded.flatten().tolist())
    if got != want:
        raise ValueError(f"quantization compressed-tensors: checkpoint weight_shape {list(got)} for a projection "
                         f"of shape {list(want)}")
    param.data.copy_(torch.tensor(got))


def _random_weight_shape(layer, param, generator):
    param.copy_(torch.tensor(checkpoint_shape(layer, None)))


def _check(where: str, args, **allowed) -> None:
    """Each field of quantization args ``args`` must hold one of its allowed values."""
    if args is None:
        raise ValueError(f"{_PREFIX} {where} are missing")
    for field, ok in allowed.items():
        value = getattr(args, field)
        value = getattr(value, "value", value)
        if value not in ok:
            refuse_option(_FMT, f"{where} {field}", value, f"supported: {', '.join(repr(v) for v in ok)}")


def _check_keys(where: str, raw, model) -> None:
    """The package's models ignore keys they do not know; a key this version does not know is
    refused rather than silently dropped."""
    if isinstance(raw, dict):
        refuse_unknown_options(f"{_FMT} {where}", raw, model.model_fields)


def _fp8_dynamic(scheme) -> LinearMethod:
    from deepbatch.layers.quantization.fp8 import Fp8ChannelLinearMethod

    _check("weights", scheme.weights, num_bits=(8,), type=("float",), strategy=("channel",), symmetric=(True,),
           dynamic=(False,), group_size=(None,), block_structure=(None,), actorder=(None,))
    if scheme.input_activations is None:
        raise ValueError(f"{_PREFIX} float-quantized weights without input_activations (FP8 weight-only) are not "
                         "supported; FP8_DYNAMIC is")
    _check("input_activations", scheme.input_activations, num_bits=(8,), type=("float",), strategy=("token",),
           symmetric=(True,), dynamic=(True,), group_size=(None,))
    return Fp8ChannelLinearMethod()


def _w4a16(scheme) -> CompressedTensorsW4A16Method:
    w = scheme.weights
    _check("weights", w, num_bits=(4,), type=("int",), strategy=("group",), dynamic=(False,),
           block_structure=(None,), actorder=(None, "weight", "static"))
    if w.scale_dtype not in _SCALE_DTYPES:
        refuse_option(_FMT, "weights scale_dtype", w.scale_dtype, "a 16- or 32-bit float")
    if scheme.input_activations is not None:
        raise ValueError(f"{_PREFIX} pack-quantized weights with input_activations (activations quantized too) "
                         "are not supported; W4A16 is")
    group_size = check_group_size(_FMT, w.group_size)
    return CompressedTensorsW4A16Method(group_size, bool(w.symmetric))


class CompressedTensorsConfig(QuantizationConfig):
    name = "compressed-tensors"

    def __init__(self, method: LinearMethod, ignore: tuple[str, ...], scheme: str):
        self._method = method
        self.ignore = ignore
        self.scheme = scheme

    @classmethod
    def from_hf(cls, qc: dict) -> CompressedTensorsConfig:
        ctq = _package()
        _check_keys("top-level", {k: v for k, v in qc.items() if k not in _EXTRA_KEYS}, ctq.QuantizationConfig)
        for key in ("sparsity_config", "transform_config"):
            if qc.get(key):
                raise ValueError(f"{_PREFIX} {key} is not supported (sparse or transformed weights)")
        if qc.get("kv_cache_scheme") is not None:
            raise ValueError(f"{_PREFIX} kv_cache_scheme is not supported (set the KV cache dtype instead)")
        for name, group in (qc.get("config_groups") or {}).items():
            _check_keys(f"config_groups.{name}", group, ctq.QuantizationScheme)
            for part in ("weights", "input_activations", "output_activations"):
                _check_keys(f"config_groups.{name}.{part}", group.get(part) if isinstance(group, dict) else None,
                            ctq.QuantizationArgs)
        try:
            config = ctq.QuantizationConfig.model_validate(qc)
        except ValueError as e:  # pydantic's ValidationError is one
            raise ValueError(f"{_PREFIX}: {e}") from None
        status = getattr(config.quantization_status, "value", config.quantization_status)
        if status != "compressed":
            refuse_option(_FMT, "quantization_status", status,
                          "only 'compressed': the packed tensors llm-compressor saves")
        if len(config.config_groups) != 1:
            raise ValueError(f"{_PREFIX}: {len(config.config_groups)} config_groups "
                             f"({', '.join(config.config_groups)}) are not supported (one scheme for every Linear)")
        (group_name, scheme), = config.config_groups.items()
        if list(scheme.targets) != ["Linear"]:
            refuse_option(_FMT, f"config_groups.{group_name} targets", scheme.targets, "only ['Linear']")
        if scheme.output_activations is not None:
            raise ValueError(f"{_PREFIX} config_groups.{group_name} output_activations are not supported")
        fmt = scheme.format or config.format
        if fmt == "float-quantized":
            method = _fp8_dynamic(scheme)
            desc = "FP8_DYNAMIC (W8A8, per-channel weights, dynamic per-token activations)"
        elif fmt == "pack-quantized":
            method = _w4a16(scheme)
            kind = "symmetric" if method.symmetric else "asymmetric"
            desc = f"W4A16 (pack-quantized, group_size {method.group_size}, {kind})"
        else:
            refuse_option(_FMT, "format", fmt, "'float-quantized' FP8_DYNAMIC or 'pack-quantized' W4A16")
        ignore = tuple(config.ignore or ())
        return cls(method, ignore, desc)

    def linear_method(self) -> LinearMethod:
        return self._method

    def _matches(self, name: str) -> bool:
        from compressed_tensors.utils.match import match_name

        return any(match_name(name, target) for target in self.ignore)

    def is_ignored(self, module_name: str) -> bool:
        return bool(self.ignore) and ignored_by(module_name, self._matches, self.name)

    def weight_bits(self) -> float:
        if isinstance(self._method, CompressedTensorsW4A16Method):
            return w4a16_weight_bits(self._method.group_size)
        return 8.0  # e4m3 and one float32 per output row: a few bits per thousand weights

    def compute_speedup(self) -> float:
        # FP8_DYNAMIC runs on FP8 tensor cores (W8A8); W4A16's products run in 16 bits.
        return 1.0 if isinstance(self._method, CompressedTensorsW4A16Method) else 2.0

    def describe(self) -> str:
        return f"compressed-tensors {self.scheme}"
