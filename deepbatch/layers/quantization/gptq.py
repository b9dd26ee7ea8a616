"""GPTQ checkpoints (``quant_method: "gptq"``, 4 bits, symmetric, ``checkpoint_format: "gptq"``,
the layout AutoGPTQ, optimum and GPTQModel write by default). Per layer::

    qweight  int32 [K // 8, N]        packed along K: nibble i of word r holds input channel 8r + i
    qzeros   int32 [K // g, N // 8]   packed along N: nibble i of word c holds output channel 8c + i;
                                      the stored value is the zero point minus one (8 is stored as 7)
    scales   fp16  [K // g, N]
    g_idx    int32 [K]                the group of each input channel
    W[n, k] = (q(k, n) - (z(k // g, n) + 1)) * scales[k // g, n]

``qweight`` is already ``w4a16.py``'s layout; the zero points are unpacked and incremented.
``group_size: -1`` is one group over all of K (scales ``[1, N]``, whole on every rank).

Only the trivial ``g_idx`` (``k // g``) is loaded: an act-order (``desc_act``) checkpoint that
permuted the groups would need its activations permuted too, and is refused at load.
"""

from __future__ import annotations

import torch

from deepbatch.kernels.w4a16_gemm import unpack_int4
from deepbatch.layers.quantization.base import require_option
from deepbatch.layers.quantization.w4a16 import (
    PACK,
    RANDOM_BITS,
    RANDOM_SCALES,
    W4A16Config,
    W4A16LinearMethod,
    check_group_size,
    checkpoint_param,
    checkpoint_shape,
)


def trivial_g_idx(k: int, group_size: int | None, device=None) -> torch.Tensor:
    """The ``g_idx`` of a checkpoint without act-order: input channel ``k`` in group ``k // g``."""
    return torch.arange(k, dtype=torch.int32, device=device) // (group_size or k)


class GPTQLinearMethod(W4A16LinearMethod):
    name = "gptq"
    fmt = "gptq"

    def create_weights(self, layer, in_features, out_sizes, dtype):
        g = self.check_shape(in_features, out_sizes, packed_output=True)
        k, n = in_features, sum(out_sizes)
        # group_size -1: the one group's tensors are whole on every rank of a row-parallel layer.
        group_dim = None if self.group_size is None else 0
        layer.qweight = checkpoint_param((k // PACK, n), torch.int32, RANDOM_BITS,
                                         output_dim=1, input_dim=0, input_unit=PACK)
        layer.qzeros = checkpoint_param((k // g, n // PACK), torch.int32, 7,
                                        output_dim=1, output_unit=PACK, input_dim=group_dim, input_unit=g)
        layer.scales = checkpoint_param((k // g, n), torch.float32, RANDOM_SCALES,
                                        output_dim=1, input_dim=group_dim, input_unit=g)
        layer.g_idx = checkpoint_param((k,), torch.int32, self._random_g_idx, input_dim=0)
        layer.g_idx.custom_loader = self._load_g_idx

    def _load_g_idx(self, layer, param, loaded, shard):
        """Every projection of a merged layer carries the same ``g_idx``: checked, not stacked."""
        k = checkpoint_shape(layer, shard)[1]
        if loaded.dim() != 1 or loaded.shape[0] != k:
            raise ValueError(f"quantization gptq: checkpoint g_idx of shape {tuple(loaded.shape)} for a layer of "
                             f"{k} input features")
        if not torch.equal(loaded.to(torch.int32), trivial_g_idx(k, self.group_size, loaded.device)):
            raise ValueError("quantization gptq: checkpoint g_idx is not k // group_size: an act-order (desc_act) "
                             "checkpoint with permuted groups, which is not supported; quantize with "
                             "desc_act false (or static_groups true)")
        layer._load(param, loaded.to(torch.int32), None)  # a row-parallel layer keeps its rank's slice

    def _random_g_idx(self, layer, param, generator):
        param.copy_(trivial_g_idx(param.shape[0], self.group_size, param.device))

    def convert(self, layer):
        qzeros = layer.qzeros.data
        # unpack_int4 unpacks along rows: the transposed tensor's rows are its packed dim.
        zeros = unpack_int4(qzeros.t().contiguous()).t().to(torch.float32) + 1
        return layer.qweight.data, layer.scales.data, zeros


class GPTQConfig(W4A16Config):
    name = "gptq"

    # Calibration and runtime settings that do not change what the tensors mean.
    _INFORMATIONAL = frozenset({
        "act_group_aware", "backend", "batch_size", "block_name_to_quantize", "cache_block_outputs",
        "damp_auto_increment", "damp_percent", "dataset", "exllama_config", "max_input_length", "meta",
        "model_file_base_name", "model_name_or_path", "model_seqlen", "module_name_preceding_first_block",
        "pad_token_id", "static_groups", "tokenizer", "true_sequential", "use_cuda_fp16", "use_exllama",
    })
    _KNOWN = frozenset({"quant_method", "bits", "group_size", "sym", "desc_act", "checkpoint_format", "format",
                        "lm_head", "dynamic", "pack_dtype", "modules_in_block_to_quantize"}) | _INFORMATIONAL

    @classmethod
    def from_hf(cls, qc: dict) -> GPTQConfig:
        cls.check_options(qc)
        if qc.get("sym", True) is not True:
            raise ValueError("quantization_config: gptq sym false (asymmetric) is not supported: the v1 format's "
                             "zero-minus-one zero points wrap for a zero point of 0")
        for key in ("checkpoint_format", "format"):
            require_option("gptq", qc, key, "gptq", "; gptq_v2, marlin and other repacked layouts are not")
        require_option("gptq", qc, "pack_dtype", "int32")
        if qc.get("lm_head"):
            raise ValueError("quantization_config: gptq lm_head true (a quantized lm_head) is not supported")
        if qc.get("dynamic"):
            raise ValueError("quantization_config: gptq dynamic (per-module overrides) is not supported")
        if qc.get("modules_in_block_to_quantize"):
            raise ValueError("quantization_config: gptq modules_in_block_to_quantize is not supported")
        if qc.get("desc_act", False) not in (True, False):
            raise ValueError(f"quantization_config: gptq desc_act must be true or false, got {qc['desc_act']!r}")
        # desc_act true is checked at load: its g_idx must still be the trivial one.
        group_size = check_group_size("gptq", qc.get("group_size", 128), allow_whole_k=True)
        return cls(GPTQLinearMethod(group_size))

    def describe(self) -> str:
        groups = "one group per channel" if self.group_size is None else f"group_size {self.group_size}"
        return f"gptq (W4A16, {groups}, symmetric)"
