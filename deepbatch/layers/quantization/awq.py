"""AWQ checkpoints in AutoAWQ's GEMM layout (``quant_method: "awq"``, ``version: "gemm"``): 4-bit
weights with a scale and a zero point per group of input channels. Per layer::

    qweight  int32 [K, N // 8]        packed along N, interleaved: nibble i of word c holds
                                      output channel 8c + AWQ_ORDER[i]
    qzeros   int32 [K // g, N // 8]   packed the same way
    scales   fp16  [K // g, N]
    W[n, k] = (q(k, n) - z(k // g, n)) * scales[k // g, n]

Loaded as they are (cut along N by column-parallel layers, whole words of eight channels; along K
by row-parallel ones, whole groups), then repacked along K into ``w4a16.py``'s layout.
"""

from __future__ import annotations

import torch

from deepbatch.kernels.w4a16_gemm import pack_int4
from deepbatch.layers.quantization.base import refuse_option
from deepbatch.layers.quantization.w4a16 import (
    PACK,
    RANDOM_BITS,
    RANDOM_SCALES,
    W4A16Config,
    W4A16LinearMethod,
    check_group_size,
    checkpoint_param,
)

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the channel (within its word's eight) each nibble holds
# The nibble that holds channel j: the inverse permutation.
AWQ_NIBBLE_OF_CHANNEL = tuple(AWQ_ORDER.index(j) for j in range(PACK))
_SHIFTS = tuple(4 * i for i in range(PACK))
# Output channels repacked at a time: bounds the scratch (unpacked nibbles, pack_int4's int64) to
# about 16 bytes per weight of the chunk.
_REPACK_COLUMNS = 1024


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """int32 ``[R, N // 8]`` in AWQ's interleaved order -> int32 ``[R, N]`` of values 0..15, in
    natural channel order."""
    shifts = torch.tensor(_SHIFTS, dtype=torch.int32, device=packed.device)
    nibbles = (packed[:, :, None] >> shifts) & 0xF  # [R, N // 8, 8]: nibble i of each word
    order = torch.tensor(AWQ_NIBBLE_OF_CHANNEL, device=packed.device)
    return nibbles[:, :, order].reshape(packed.shape[0], -1)


class AWQLinearMethod(W4A16LinearMethod):
    name = "awq"
    fmt = "awq"

    def create_weights(self, layer, in_features, out_sizes, dtype):
        g = self.check_shape(in_features, out_sizes, packed_output=True)
        k, n = in_features, sum(out_sizes)
        layer.qweight = checkpoint_param((k, n // PACK), torch.int32, RANDOM_BITS,
                                         output_dim=1, output_unit=PACK, input_dim=0)
        layer.qzeros = checkpoint_param((k // g, n // PACK), torch.int32, 8,
                                        output_dim=1, output_unit=PACK, input_dim=0, input_unit=g)
        layer.scales = checkpoint_param((k // g, n), torch.float32, RANDOM_SCALES,
                                        output_dim=1, input_dim=0, input_unit=g)

    def convert(self, layer):
        packed = layer.qweight.data
        n = packed.shape[1] * PACK
        qweight = torch.empty(packed.shape[0] // PACK, n, dtype=torch.int32, device=packed.device)
        step = _REPACK_COLUMNS // PACK
        for start in range(0, packed.shape[1], step):
            cols = unpack_awq(packed[:, start:start + step])
            qweight[:, start * PACK:start * PACK + cols.shape[1]] = pack_int4(cols)
        zeros = unpack_awq(layer.qzeros.data).to(torch.float32)
        return qweight, layer.scales.data, zeros


class AWQConfig(W4A16Config):
    name = "awq"

    # Calibration and runtime settings that do not change what the tensors mean.
    _INFORMATIONAL = frozenset({
        "backend", "batch_size", "block_name_to_quantize", "cache_block_outputs", "damp_percent", "dataset",
        "do_fuse", "exllama_config", "fuse_max_seq_len", "max_input_length", "meta", "model_seqlen",
        "module_name_preceding_first_block", "modules_to_fuse", "pad_token_id", "tokenizer", "true_sequential",
        "act_group_aware", "use_exllama",
        # transformers writes GPTQ's `sym` into AWQ configs too; zero_point decides for AWQ
        "sym",
    })
    _KNOWN = frozenset({"quant_method", "bits", "group_size", "zero_point", "version", "format",
                        "modules_to_not_convert", "desc_act", "modules_in_block_to_quantize"}) | _INFORMATIONAL

    @classmethod
    def from_hf(cls, qc: dict) -> AWQConfig:
        cls.check_options(qc)
        for key in ("version", "format"):
            value = qc.get(key, "gemm")
            if not isinstance(value, str) or value.lower() != "gemm":
                refuse_option("awq", key, value, "only 'gemm': AutoAWQ's GEMM layout")
        if qc.get("zero_point", True) is not True:
            refuse_option("awq", "zero_point", qc["zero_point"], "only true: a zero point per group")
        if qc.get("desc_act"):
            raise ValueError("quantization_config: awq desc_act true is not supported")
        if qc.get("modules_in_block_to_quantize"):
            raise ValueError("quantization_config: awq modules_in_block_to_quantize is not supported; "
                             "list the layers left unquantized in modules_to_not_convert")
        group_size = check_group_size("awq", qc.get("group_size", 128))
        ignored = qc.get("modules_to_not_convert") or ()
        if isinstance(ignored, str) or not all(isinstance(m, str) for m in ignored):
            raise ValueError(f"quantization_config: awq modules_to_not_convert must be a list of names, "
                             f"got {ignored!r}")
        return cls(AWQLinearMethod(group_size), tuple(ignored))

    def _matches(self, name: str) -> bool:
        # As transformers reads it: a layer is left out when any entry is a substring of its name.
        return any(m in name for m in self.ignored)

    def describe(self) -> str:
        return f"awq (W4A16 GEMM, group_size {self.group_size}, zero points)"
