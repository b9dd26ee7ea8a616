"""What every kernel file shares: the optional Triton import and the checks of a paged batch's
metadata (the same for every attention kernel that reads the cache through block tables)."""

from __future__ import annotations

from collections.abc import Callable

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # torch references stay usable without Triton (CPU-only installs)
    triton = tl = None


_H100_SHARED_MEMORY = 232448  # bytes a block may opt in to on an H100/H200 (227 KiB)
_shared_memory_cache: dict[int, int] = {}


def max_shared_memory(device: torch.device) -> int:
    """Shared memory one program may use on ``device`` (bytes). Launch settings tuned on an H200
    check it so that a GPU with less (an A100 has 163 KiB, consumer parts about 100 KiB) gets the
    smaller defaults instead of a compile error. Off CUDA (the interpreter) it answers as an H200,
    so CPU tests take the same paths."""
    if device.type != "cuda" or triton is None:
        return _H100_SHARED_MEMORY
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _shared_memory_cache:
        try:
            props = triton.runtime.driver.active.utils.get_device_properties(index)
            _shared_memory_cache[index] = int(props["max_shared_mem"])
        except Exception:  # an unexpected driver API: assume a small part
            _shared_memory_cache[index] = 101376
    return _shared_memory_cache[index]


_num_sms_cache: dict[torch.device, int] = {}


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device``; off CUDA those of an H100/H200, so that launch
    choices under the interpreter are the ones a GPU makes."""
    if device.type != "cuda":
        return 132
    if device not in _num_sms_cache:
        _num_sms_cache[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _num_sms_cache[device]


def jit(fn=None, *, do_not_specialize: tuple[str, ...] = ()):
    """``triton.jit`` when Triton is installed; else the plain function (never launched).

    ``do_not_specialize`` names integer arguments that change from step to step (batch sizes,
    lengths, block-table widths). Triton otherwise compiles a variant per value class (equal to 1,
    divisible by 16, other): a server would stall for seconds mid-traffic the first time a batch
    fell into a new class. Only shape constants and ``tl.constexpr`` values should pick variants."""
    if fn is None:
        return lambda f: jit(f, do_not_specialize=do_not_specialize)
    if triton is None:
        return fn
    return triton.jit(fn, do_not_specialize=list(do_not_specialize)) if do_not_specialize else triton.jit(fn)


def check_like(fail: Callable[[str], None], ref_name: str, ref: torch.Tensor,
               others: tuple[tuple[str, torch.Tensor | None], ...]) -> None:
    """Each tensor (None is skipped) has ``ref``'s dtype and device and a contiguous last dim."""
    for name, t in ((ref_name, ref), *others):
        if t is None:
            continue
        if t.dtype != ref.dtype:
            fail(f"{name} dtype {t.dtype} != {ref_name} dtype {ref.dtype}")
        if t.stride(-1) != 1:
            fail(f"{name} needs a contiguous last dimension, strides {t.stride()}")
        if t.device != ref.device:
            fail(f"{name} is on {t.device}, {ref_name} on {ref.device}")


def check_paged_metadata(
    fail: Callable[[str], None],
    device: torch.device,
    num_tokens: int,
    block_size: int,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
) -> None:
    """``seq_lens [B]``, ``query_start_loc [B+1]``, ``block_tables [B, max_blocks]`` int32 on
    ``device``, and host-side maxima that fit them."""
    num_seqs = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    max_blocks = block_tables.shape[1] if block_tables.dim() == 2 else -1
    for name, t, shape in (
        ("seq_lens", seq_lens, (num_seqs,)),
        ("query_start_loc", query_start_loc, (num_seqs + 1,)),
        ("block_tables", block_tables, (num_seqs, max_blocks)),
    ):
        if t.dtype != torch.int32 or tuple(t.shape) != shape:
            fail(f"{name} must be int32 of shape {shape} (B = len(seq_lens)), got {t.dtype} {tuple(t.shape)}")
        if t.stride(-1) != 1:
            fail(f"{name} needs a contiguous last dimension, strides {t.stride()}")
        if t.device != device:
            fail(f"{name} is on {t.device}, the query on {device}")
    if max_query_len < 0 or max_query_len > num_tokens:
        fail(f"max_query_len {max_query_len} outside [0, T={num_tokens}]")
    if max_seq_len > max_blocks * block_size:
        fail(f"max_seq_len {max_seq_len} exceeds block_tables capacity {max_blocks} blocks x {block_size} tokens")
