"""The input checks of the MLA decode kernels (``mla_decode.py`` and its swap-AB form for
small batches, ``mla_decode_swap_ab.py``), which take the same arguments."""

from __future__ import annotations

import torch

from deepbatch.kernels.common import check_like, check_paged_metadata
from deepbatch.kernels.kv_quant import check_latent_scale

MLA_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_mla_inputs(q_latent, q_pe, latent_cache, block_tables, query_start_loc, seq_lens, max_query_len, max_seq_len,
                     out, latent_scale=None, name="mla_attention") -> bool:
    """Whether the latent cache is 8-bit, for valid inputs."""
    def fail(msg):
        raise ValueError(f"{name}: {msg}")

    if q_latent.dim() != 3 or q_pe.dim() != 3 or q_pe.shape[:2] != q_latent.shape[:2]:
        fail(f"q_latent and q_pe must be [T, H, R] and [T, H, P], got {tuple(q_latent.shape)} and {tuple(q_pe.shape)}")
    rank, rope = q_latent.shape[2], q_pe.shape[2]
    if latent_cache.dim() != 4 or latent_cache.shape[2] != 1 or latent_cache.shape[3] != rank + rope:
        fail(f"latent_cache must be [num_blocks, block_size, 1, R+P={rank + rope}], got {tuple(latent_cache.shape)}")
    if rank < 16 or rope < 1 or rank > 1024 or rope > 256:
        fail(f"R must lie in [16, 1024] and P in [1, 256], got R={rank}, P={rope}")
    if q_latent.dtype not in MLA_DTYPES:
        fail(f"q_latent dtype {q_latent.dtype} is not one of {MLA_DTYPES}")
    quantized = check_latent_scale(fail, latent_cache, latent_scale)
    # An 8-bit cache is read with the query's dtype; any other cache must have it.
    check_like(fail, "q_latent", q_latent, (("q_pe", q_pe), ("out", out)) if quantized
               else (("q_pe", q_pe), ("latent_cache", latent_cache), ("out", out)))
    if quantized:
        check_like(fail, "latent_cache", latent_cache, ())
        if latent_cache.device != q_latent.device:
            fail(f"latent_cache is on {latent_cache.device}, q_latent on {q_latent.device}")
    if out is not None and out.shape != q_latent.shape:
        fail(f"out shape {tuple(out.shape)} != q_latent shape {tuple(q_latent.shape)}")
    check_paged_metadata(fail, q_latent.device, q_latent.shape[0], latent_cache.shape[1], block_tables,
                         query_start_loc, seq_lens, max_query_len, max_seq_len)
    return quantized
