"""FP8 (e4m3) quantization of activations, and the block dequantization of FP8 weights.

Two checkpoint formats feed the W8A8 FP8 GEMMs (``kernels/w8a8_fp8_gemm.py``):

* block-wise, as DeepSeek-V3/R1 ship it: the weight ``[N, K]`` is stored in ``float8_e4m3fn``
  with one float32 ``weight_scale_inv [ceil(N/128), ceil(K/128)]`` per 128 x 128 block. Despite its
  name it is the dequantization factor: ``W = w_q * weight_scale_inv`` (multiply, never divide).
  Activations are quantized on the fly per token and per group of 128 columns, so the GEMM can
  apply one activation scale and one weight scale per 128-long stretch of K.
* per-channel (compressed-tensors' FP8_DYNAMIC, online FP8): one weight scale per output row and
  one activation scale per token (``group_size = K``), applied once after the whole dot product.

Every scale here is a dequantization factor: ``x ~ x_q * scale``. Activations use the full
e4m3 range: ``scale = max(amax, 1e-10) / 448`` (the floor keeps an all-zero group finite), and
``x_q = clamp(x / scale, -448, 448)`` rounded to nearest even. The kernel divides with correct
rounding (``div_rn``) as torch does, and rounds ``x / scale`` onto the e4m3 grid in float32 itself
before the cast, so the cast only ever sees values the format holds: the Triton interpreter's
float32 -> fp8 conversion truncates instead of rounding. In the interpreter the kernel reproduces
:func:`per_token_group_quant_fp8_ref` bit for bit; on an H200, 13 of 3.7 million bf16 elements
landed one e4m3 step from torch's result (the scales were not compared in that run). On a GPU the
extra rounding costs a few ALU operations in a memory-bound kernel.
"""

from __future__ import annotations

import torch

from deepbatch.kernels.common import jit as _jit, tl, triton

FP8_E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
FP8_DTYPE = torch.float8_e4m3fn
SCALE_FLOOR = 1e-10  # an all-zero group gets this amax instead of a zero scale
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def native_fp8_supported(device: torch.device) -> bool:
    """Whether the Triton FP8 kernels can run on ``device``: e4m3 needs compute capability 8.9
    (Ada, Hopper) on CUDA; off CUDA they run in the interpreter. Older GPUs take the torch path."""
    device = torch.device(device)
    if device.type != "cuda":
        return True
    return torch.cuda.get_device_capability(device) >= (8, 9)


def require_native_fp8(name: str, device: torch.device) -> None:
    if triton is None:
        raise RuntimeError(f"{name}: Triton is not installed; use {name}_ref")
    if not native_fp8_supported(device):
        cap = torch.cuda.get_device_capability(device)
        raise RuntimeError(f"{name}: float8_e4m3fn needs a GPU of compute capability 8.9 or newer, "
                           f"{device} is {cap[0]}.{cap[1]}; use {name}_ref")


# -- torch ------------------------------------------------------------------------------------


def _check_group_quant_input(x: torch.Tensor, group_size: int) -> None:
    def fail(msg):
        raise ValueError(f"per_token_group_quant_fp8: {msg}")

    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size <= 0:
        fail(f"group_size must be a positive int, got {group_size!r}")
    if not torch.is_tensor(x) or x.dim() != 2:
        fail(f"x must be a 2-D tensor [M, K], got {tuple(x.shape) if torch.is_tensor(x) else type(x).__name__}")
    if x.dtype not in _FLOAT_DTYPES:
        fail(f"x must be one of {_FLOAT_DTYPES}, got {x.dtype}")


def per_token_group_quant_fp8_ref(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x_q [M, K] float8_e4m3fn, x_s [M, ceil(K / group_size)] float32)`` with one scale per
    row and group of ``group_size`` columns (the last group may be shorter); ``group_size = K``
    gives per-token scales ``[M, 1]``."""
    _check_group_quant_input(x, group_size)
    m, k = x.shape
    num_groups = -(-k // group_size)
    pad = num_groups * group_size - k
    # Zero padding leaves each short group's amax unchanged.
    xf = torch.nn.functional.pad(x.float(), (0, pad)).view(m, num_groups, group_size)
    amax = xf.abs().amax(-1, keepdim=True)
    # A full tensor, not a Python scalar: torch would multiply by a rounded 1/448 instead.
    scale = amax.clamp(min=SCALE_FLOOR) / torch.full_like(amax, FP8_E4M3_MAX)
    x_q = (xf / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_DTYPE)
    return x_q.view(m, num_groups * group_size)[:, :k].contiguous(), scale.view(m, num_groups)


def dequantize_fp8_blocks_ref(w_q: torch.Tensor, w_s: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``w_q [N, K]`` e4m3 times its block scales ``w_s [ceil(N/bn), ceil(K/bk)]`` (each scale
    covers one ``bn x bk`` block; the last row and column of blocks may be partial): float32."""
    bn, bk = check_block_size(block, "dequantize_fp8_blocks_ref")
    if w_q.dim() != 2 or w_q.dtype != FP8_DTYPE:
        raise ValueError(f"dequantize_fp8_blocks_ref: w_q must be a 2-D {FP8_DTYPE} tensor, got "
                         f"{w_q.dtype} {tuple(w_q.shape)}")
    n, k = w_q.shape
    want = (-(-n // bn), -(-k // bk))
    if w_s.dtype != torch.float32 or tuple(w_s.shape) != want:
        raise ValueError(f"dequantize_fp8_blocks_ref: w_s must be float32 of shape {want} for w_q "
                         f"{(n, k)} and block {(bn, bk)}, got {w_s.dtype} {tuple(w_s.shape)}")
    scale = w_s.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return w_q.float() * scale


def check_block_size(block, name: str) -> tuple[int, int]:
    ok = (isinstance(block, (tuple, list)) and len(block) == 2
          and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block))
    if not ok:
        raise ValueError(f"{name}: block size must be two positive ints (bn, bk), got {block!r}")
    return int(block[0]), int(block[1])


# -- Triton -----------------------------------------------------------------------------------


@_jit
def round_to_e4m3_grid(y):
    """``y`` (float32, ``|y| <= 448``) rounded to the nearest e4m3 value, ties to even, still
    float32. e4m3 keeps 3 mantissa bits, so the step in ``[2^e, 2^(e+1))`` is ``2^(e-3)``; below
    the smallest normal ``2^-6`` it stays ``2^-9``. Adding and removing ``1.5 * 2^23`` steps leaves
    float32's own round-to-nearest-even at exactly that step."""
    bits = y.to(tl.int32, bitcast=True)
    a = tl.abs(y)
    exponent = tl.maximum((a.to(tl.int32, bitcast=True) >> 23) - 127, -6)
    step = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)
    magic = step * 12582912.0
    r = (a + magic) - magic
    return tl.where(bits < 0, -r, r)  # the sign bit, so -0.0 stays -0.0 as torch keeps it


@_jit
def _per_token_group_quant_kernel(
    x_ptr, q_ptr, s_ptr, K, num_groups, stride_x, stride_q, stride_s,
    GROUP: tl.constexpr, BLOCK: tl.constexpr, GROUPS_PER_PROGRAM: tl.constexpr,
    FP8_MAX: tl.constexpr, EPS: tl.constexpr,
):
    """One row, ``GROUPS_PER_PROGRAM`` consecutive groups as the rows of a tile ``[G, BLOCK]``
    (``BLOCK`` is ``GROUP`` rounded up to a power of two; the extra columns are masked)."""
    row = tl.program_id(0).to(tl.int64)
    groups = tl.program_id(1) * GROUPS_PER_PROGRAM + tl.arange(0, GROUPS_PER_PROGRAM)
    cols_in_group = tl.arange(0, BLOCK)
    cols = groups[:, None] * GROUP + cols_in_group[None, :]
    mask = (cols_in_group[None, :] < GROUP) & (cols < K) & (groups[:, None] < num_groups)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), 1), EPS)
    scale = tl.math.div_rn(amax, tl.full(amax.shape, FP8_MAX, tl.float32))
    y = tl.math.div_rn(x, scale[:, None])
    y = tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX)
    q = round_to_e4m3_grid(y).to(q_ptr.dtype.element_ty)
    tl.store(q_ptr + row * stride_q + cols, q, mask=mask)
    tl.store(s_ptr + row * stride_s + groups, scale, mask=groups < num_groups)


_TILE_ELEMENTS = 4096  # elements per program: enough work per program for short groups


def per_token_group_quant_fp8(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of :func:`per_token_group_quant_fp8_ref`. ``x [M, K]`` needs
    a contiguous last dimension; its rows may be strided. Returns contiguous ``x_q`` and ``x_s``."""
    _check_group_quant_input(x, group_size)
    require_native_fp8("per_token_group_quant_fp8", x.device)
    if x.stride(-1) != 1 and x.shape[1] > 1:
        raise ValueError(f"per_token_group_quant_fp8: x needs a contiguous last dimension, strides {x.stride()}")
    m, k = x.shape
    num_groups = triton.cdiv(k, group_size)
    x_q = torch.empty(m, k, dtype=FP8_DTYPE, device=x.device)
    x_s = torch.empty(m, num_groups, dtype=torch.float32, device=x.device)
    if m == 0 or k == 0:
        return x_q, x_s
    block = triton.next_power_of_2(group_size)
    groups_per_program = min(triton.next_power_of_2(num_groups), max(1, _TILE_ELEMENTS // block))
    grid = (m, triton.cdiv(num_groups, groups_per_program))
    _per_token_group_quant_kernel[grid](
        x, x_q, x_s, k, num_groups, x.stride(0), x_q.stride(0), x_s.stride(0),
        GROUP=group_size, BLOCK=block, GROUPS_PER_PROGRAM=groups_per_program,
        FP8_MAX=FP8_E4M3_MAX, EPS=SCALE_FLOOR,
        num_warps=max(1, min(16, block * groups_per_program // 512)),  # about 32 elements a thread
    )
    return x_q, x_s
