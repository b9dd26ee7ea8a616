"""Repetition, frequency and presence penalties in one read of the logits.

Row ``i`` of the batch, ``rows[i]``, is penalised from state slot ``slots[i]`` of the per-request
tensors kept on the device (``sampling/penalty_state.py``): ``counts[slot, t]`` (times the request
has sampled ``t``) and ``prompt_mask[slot, t]`` (``t`` is in its prompt). For each token::

    seen = prompt_mask or counts > 0
    x = (x / rep if x > 0 else x * rep) if seen else x          # repetition (HF, vLLM)
    x = x - freq * counts - pres * (counts > 0)                  # frequency, presence (OpenAI)

The torch version of the same math (:func:`apply_penalties_ref`) takes about ten passes over
``[rows, V]`` (the gathers of the state rows, the float conversion, each ``where``); the kernel
reads the logits, the counts and the mask once and writes the result once. It writes into ``out``
(which may be ``logits`` itself) so that a caller can keep the raw logits.
"""

from __future__ import annotations

import torch

from deepbatch.kernels.common import jit as _jit, tl, triton


def apply_penalties_ref(logits, rows, slots, counts, prompt_mask, repetition, frequency, presence):
    """``logits[rows]`` penalised (``[len(rows), V]`` float32); the other rows are not returned."""
    x = logits.index_select(0, rows).float()
    c = counts.index_select(0, slots).float()
    seen = prompt_mask.index_select(0, slots) | (c > 0)
    rep, freq, pres = (t.float().unsqueeze(1) for t in (repetition, frequency, presence))
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    return x - freq * c - pres * (c > 0).float()


@_jit
def _apply_penalties_kernel(
    logits_ptr, out_ptr, rows_ptr, slots_ptr, counts_ptr, mask_ptr, rep_ptr, freq_ptr, pres_ptr,
    vocab, stride_logits, stride_out, stride_counts, stride_mask,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0)
    row = tl.load(rows_ptr + i)
    slot = tl.load(slots_ptr + i)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    valid = cols < vocab
    x = tl.load(logits_ptr + row * stride_logits + cols, mask=valid, other=0.0).to(tl.float32)
    c = tl.load(counts_ptr + slot * stride_counts + cols, mask=valid, other=0).to(tl.float32)
    seen = (tl.load(mask_ptr + slot * stride_mask + cols, mask=valid, other=0) != 0) | (c > 0)
    rep = tl.load(rep_ptr + i)
    freq = tl.load(freq_ptr + i)
    pres = tl.load(pres_ptr + i)
    # div_rn: the correctly rounded quotient, as torch computes it
    x = tl.where(seen, tl.where(x > 0, tl.math.div_rn(x, rep), x * rep), x)
    x = x - freq * c
    x = x - tl.where(c > 0, pres, 0.0)
    tl.store(out_ptr + row * stride_out + cols, x, mask=valid)


def apply_penalties(
    logits: torch.Tensor,  # [S, V] float32
    out: torch.Tensor,  # [S, V] float32; may be logits
    rows: torch.Tensor,  # [P] int64: batch rows to penalise
    slots: torch.Tensor,  # [P] int64: their state slots
    counts: torch.Tensor,  # [slots, V] int32
    prompt_mask: torch.Tensor,  # [slots, V] bool
    repetition: torch.Tensor,  # [P] float32
    frequency: torch.Tensor,  # [P] float32
    presence: torch.Tensor,  # [P] float32
) -> torch.Tensor:
    """Writes the penalised rows ``rows`` of ``logits`` into the same rows of ``out`` (module
    docstring) and returns ``out``; its other rows are left as they are. No host sync."""
    if triton is None:
        raise RuntimeError("apply_penalties: Triton is not installed; use apply_penalties_ref")
    for name, t in (("logits", logits), ("out", out)):
        if t.dim() != 2 or t.dtype != torch.float32 or t.stride(1) != 1:
            raise ValueError(f"apply_penalties: {name} must be contiguous float32 [S, V] rows, got "
                             f"{t.dtype} {tuple(t.shape)} strides {t.stride()}")
    S, V = logits.shape
    if out.shape != (S, V):
        raise ValueError(f"apply_penalties: out {tuple(out.shape)} for logits {tuple(logits.shape)}")
    if counts.dim() != 2 or counts.shape[1] != V or counts.dtype != torch.int32 or counts.stride(1) != 1:
        raise ValueError(f"apply_penalties: counts must be int32 [slots, {V}], got {counts.dtype} "
                         f"{tuple(counts.shape)}")
    if prompt_mask.shape != counts.shape or prompt_mask.dtype != torch.bool or prompt_mask.stride(1) != 1:
        raise ValueError(f"apply_penalties: prompt_mask must be bool {tuple(counts.shape)}, got "
                         f"{prompt_mask.dtype} {tuple(prompt_mask.shape)}")
    P = rows.shape[0]
    for name, t, dtype in (("rows", rows, torch.int64), ("slots", slots, torch.int64),
                           ("repetition", repetition, torch.float32), ("frequency", frequency, torch.float32),
                           ("presence", presence, torch.float32)):
        if t.shape != (P,) or t.dtype != dtype or t.device != logits.device:
            raise ValueError(f"apply_penalties: {name} must be {dtype} [{P}] on {logits.device}, got "
                             f"{t.dtype} {tuple(t.shape)} on {t.device}")
    if P and V:
        block = min(2048, triton.next_power_of_2(V))
        _apply_penalties_kernel[(P, triton.cdiv(V, block))](
            logits, out, rows.contiguous(), slots.contiguous(), counts, prompt_mask.view(torch.uint8),
            repetition.contiguous(), frequency.contiguous(), presence.contiguous(),
            V, logits.stride(0), out.stride(0), counts.stride(0), prompt_mask.stride(0),
            BLOCK=block, num_warps=4,
        )
    return out
