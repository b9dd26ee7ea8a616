"""Temperature sampling in one read of the logits: the Gumbel-max trick.

The torch sampler scales by the temperature, takes a float32 softmax, draws ``q ~ Exp(1)``,
divides and takes the argmax: five passes over ``[S, V]`` (about 155 MB each for 256 rows of a
152k vocab). ``argmax(softmax(l / T) / q) == argmax(l / T - log q)``, and ``-log q`` is
Gumbel(0, 1), so::

    token = argmax_v (l_v / T + g_v),    g_v = -log(-log u_v),    u_v ~ U(0, 1)

draws from the same distribution while reading each logit once and writing one id per row. A
row whose inverse temperature is 0 is greedy: the plain argmax of its logits, no draws.

The uniforms are Philox (``tl.rand4x``): a function of (seed, counter) with no generator state,
so the same seed and offset give the same ids and a launch can be replayed in a CUDA graph. One
Philox evaluation feeds four logits: element ``v`` of row ``r`` takes lane ``v % 4`` of counter
``offset + r * ceil(V / 4) + v // 4``. The draws therefore do not depend on the tiling, and a call
uses :func:`counters_used` counters from ``offset``; the caller advances ``offset`` past them.

Each program reduces one tile of a row to its (max, index); a torch argmax over the few tiles of a
row finishes it. Ties go to the lowest index, as in ``torch.argmax``. A ``-inf`` logit is never
drawn while its row has a finite one; a row of all ``-inf`` gives index 0 (``torch.argmax``'s
answer). NaN logits are not supported; one counts as ``+inf``, so its row still gets an id inside
the vocabulary.

The tile's index is the smallest column holding its maximum: two reductions (max, then min) whose
results do not depend on the order of the elements. A reduction that carries indices
(``tl.max(..., return_indices=True)``) is not safe after a reshape: the compiler may let a reshape
that only feeds reductions reorder its elements, and then the indices name other elements.
"""

from __future__ import annotations

import torch
from deepbatch.kernels.common import jit as _jit, tl, triton

# -log(u) is clamped to [E_MIN, E_MAX] so the Gumbel noise stays finite: u == 0 would make it
# -inf (a row's only finite logit could lose to its -inf ones), and -log(u) rounding to 0 just
# below u == 1 would make it +inf (and -inf + inf a NaN). The bounds sit outside the values
# -log(u) takes otherwise: about 2**-24 at the largest u (1 - 2**-24), 21.5 at the smallest
# nonzero one (2**-31).
_E_MIN = 2.0 ** -25
_E_MAX = 32.0


def gumbel_sample_ref(
    logits: torch.Tensor,  # [S, V]
    inv_temperature: torch.Tensor,  # [S] float32, 0 = greedy
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """The same math with torch's RNG: the same distribution as :func:`gumbel_sample`, not the
    same draws. Returns ``[S]`` int64 ids."""
    x = logits.float()
    u = torch.rand(x.shape, generator=generator, device=x.device)
    gumbel = -(-u.log()).clamp(_E_MIN, _E_MAX).log()
    inv_t = inv_temperature.float().unsqueeze(1)
    return torch.where(inv_t == 0, x, x * inv_t + gumbel).argmax(dim=-1)


@_jit(do_not_specialize=("seed", "offset"))
def _gumbel_max_kernel(
    logits_ptr, inv_temp_ptr, best_val_ptr, best_idx_ptr,
    vocab, stride_row, seed: tl.int64, offset: tl.int64,
    BLOCK: tl.constexpr,
):
    # seed and offset change every step: typed int64 so that neither their values nor their
    # width (a small offset would otherwise pass as int32) ever picks a new variant.
    row = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    QUADS: tl.constexpr = BLOCK // 4
    quad = tile * QUADS + tl.arange(0, QUADS)  # [QUADS]: one Philox counter each
    lane = tl.arange(0, 4)[None, :]
    cols = quad[:, None] * 4 + lane  # [QUADS, 4], contiguous in memory
    x = tl.load(logits_ptr + row * stride_row + cols, mask=cols < vocab, other=float("-inf"))
    x = x.to(tl.float32)
    inv_t = tl.load(inv_temp_ptr + row)
    if inv_t != 0.0:
        counter = offset + row * tl.cdiv(vocab, 4) + quad
        u0, u1, u2, u3 = tl.rand4x(seed, counter)
        u = tl.where(lane == 0, u0[:, None],
                     tl.where(lane == 1, u1[:, None], tl.where(lane == 2, u2[:, None], u3[:, None])))
        e = tl.clamp(-tl.log(u), 2.9802322387695312e-08, 32.0)  # [_E_MIN, _E_MAX]
        x = x * inv_t - tl.log(e)
    # (max, first index) from order-free reductions only (see the module docstring). A NaN counts
    # as +inf; the masked lanes (-inf, past the vocab) come after every column of the row, so they
    # never hold the smallest index of the maximum.
    x = tl.where(x != x, float("inf"), x)
    best = tl.max(x)
    i = tl.min(tl.where(x == best, cols, tile * BLOCK + BLOCK))
    out = row * tl.num_programs(1) + tile
    tl.store(best_val_ptr + out, best)
    tl.store(best_idx_ptr + out, i.to(tl.int64))


_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_MAX_OFFSET = 2 ** 62


def counters_used(num_rows: int, vocab: int) -> int:
    """Philox counters one call over ``[num_rows, vocab]`` takes from its ``offset``."""
    return num_rows * -(-vocab // 4)


def gumbel_sample(
    logits: torch.Tensor,  # [S, V] float32, bfloat16 or float16
    inv_temperature: torch.Tensor,  # [S] float32, 0 = greedy
    seed: int,
    offset: int,
    *,
    block: int = 4096,
) -> torch.Tensor:
    """One token per row: the argmax for greedy rows, a draw from ``softmax(logits * inv_t)``
    for the others. Returns ``[S]`` int64 ids without a host sync. ``block`` (a power of two, at
    least 4) is the tile a program reduces; it does not change the draws."""
    if triton is None:
        raise RuntimeError("gumbel_sample: Triton is not installed; use gumbel_sample_ref")
    if logits.dim() != 2 or logits.dtype not in _DTYPES:
        raise ValueError(f"gumbel_sample: logits must be [S, V] of {_DTYPES}, got {logits.dtype} "
                         f"{tuple(logits.shape)}")
    S, V = logits.shape
    if V == 0:
        raise ValueError("gumbel_sample: empty vocabulary")
    if logits.stride(1) != 1:
        raise ValueError(f"gumbel_sample: logits need a contiguous last dimension, strides {logits.stride()}")
    if inv_temperature.shape != (S,) or inv_temperature.dtype != torch.float32:
        raise ValueError(f"gumbel_sample: inv_temperature must be float32 [{S}], got "
                         f"{inv_temperature.dtype} {tuple(inv_temperature.shape)}")
    if inv_temperature.device != logits.device:
        raise ValueError(f"gumbel_sample: inv_temperature is on {inv_temperature.device}, logits on {logits.device}")
    if not 0 <= seed < 2 ** 63:
        raise ValueError(f"gumbel_sample: seed {seed} outside [0, 2**63)")
    if not 0 <= offset < _MAX_OFFSET:
        raise ValueError(f"gumbel_sample: offset {offset} outside [0, 2**62)")
    if block < 4 or block & (block - 1):
        raise ValueError(f"gumbel_sample: block must be a power of two >= 4, got {block}")

    inv_temperature = inv_temperature.contiguous()
    tiles = triton.cdiv(V, block)
    best_val = torch.empty(S, tiles, dtype=torch.float32, device=logits.device)
    best_idx = torch.empty(S, tiles, dtype=torch.int64, device=logits.device)
    if S:
        _gumbel_max_kernel[(S, tiles)](
            logits, inv_temperature, best_val, best_idx,
            V, logits.stride(0), seed, offset,
            BLOCK=block, num_warps=8 if block >= 2048 else 4,
        )
    # The first tile holding the row's max holds its lowest maximal index (tiles are in order).
    return best_idx.gather(1, best_val.argmax(dim=1, keepdim=True)).squeeze(1)
