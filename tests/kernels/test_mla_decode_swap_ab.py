"""The swap-AB MLA decode kernel held to ``mla_attention_ref``. Runs on the CPU through the Triton
interpreter; the bf16 test at DeepSeek-V2-Lite's shapes needs a GPU, and a compile-only test
checks what Triton builds for an H200."""

import os

import torch

# The interpreter on the CPU (the interpreter's bf16 is not faithful: bf16 runs on the GPU only).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"

import subprocess
import sys

import pytest

pytest.importorskip("triton")

from deepbatch.kernels.mla_decode import mla_attention_ref  # noqa: E402
from deepbatch.kernels.mla_decode_swap_ab import mla_decode_swap_ab  # noqa: E402
from test_mla_decode import MIXED, _bad_inputs, make_batch, on_cpu  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=2e-3, rtol=2e-3)}

# (q_len, seq_len): lengths ending mid-tile and mid-block, exactly one tile, one past it, a single
# key, a sequence with no query row, and one with a query row but nothing cached.
DECODES = [(1, 150), (1, 1), (1, 129), (0, 5), (1, 64), (1, 17), (1, 0), (1, 65)]


def run_both(batch, max_seq_len, **kw):
    q = batch["q_latent"]
    poisoned = torch.full(q.shape, float("nan"), dtype=q.dtype, device=q.device)
    # A copy: on the CPU ``.cpu()`` is the same tensor, and the kernel would overwrite the reference.
    ref = mla_attention_ref(**on_cpu(batch), out=poisoned.cpu().clone(), max_q_len=1)
    out = mla_decode_swap_ab(**batch, max_seq_len=max_seq_len, out=poisoned, **kw)
    return out.cpu(), ref


def assert_matches(out, ref, dtype):
    """Rows the reference wrote match; the others (no query row, prefill chunks, padding past
    ``query_start_loc[-1]``) stay NaN in both."""
    written = ~ref.isnan().all(-1)
    assert out.isnan().all(-1).equal(~written)
    torch.testing.assert_close(out[written], ref[written], **TOL[dtype])


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("dims", [(16, 64, 16), (20, 48, 8), (4, 32, 8)],
                         ids=["h16-r64-p16", "h20-r48-p8", "h4-r32-p8"])
def test_decodes_match_reference(dims, dtype, block_size):
    torch.manual_seed(1)
    batch, _, msl = make_batch(DECODES, *dims, block_size=block_size, dtype=dtype, num_pad_rows=3)
    out, ref = run_both(batch, msl)
    assert_matches(out, ref, dtype)
    assert out[int(batch["query_start_loc"][-1]):].isnan().all()  # padding rows


@pytest.mark.parametrize("tile_n", [16, 32, 128])
def test_tile_sizes_match_reference(tile_n):
    torch.manual_seed(2)
    batch, _, msl = make_batch(DECODES, 12, 48, 8, block_size=16, dtype=torch.float32, num_pad_rows=1)
    out, ref = run_both(batch, msl, tile_n=tile_n, num_warps=4, num_stages=2)
    assert_matches(out, ref, torch.float32)


def test_prefill_chunks_and_empty_sequences_write_nothing():
    """Sequences with more than one query row belong to the prefill kernels: the decode kernel
    leaves their rows alone and still computes the decodes between them."""
    torch.manual_seed(3)
    batch, _, msl = make_batch(MIXED, 4, 32, 8, block_size=16, dtype=torch.float32, num_pad_rows=2)
    out, ref = run_both(batch, msl)
    assert_matches(out, ref, torch.float32)
    assert out.isnan().any() and not out.isnan().all()
    batch, _, msl = make_batch([(0, 5), (0, 30)], 4, 32, 8, block_size=16, dtype=torch.float32, num_pad_rows=2)
    out, _ = run_both(batch, msl)
    assert out.isnan().all()


# The same checks as mla_attention's (one shared function), under this kernel's name.
@pytest.mark.parametrize("case", list(_bad_inputs()))
def test_bad_inputs_raise_value_error(case):
    batch, _, msl = make_batch(DECODES, 4, 32, 8, block_size=16, dtype=torch.float32)
    batch = _bad_inputs()[case](batch)
    with pytest.raises(ValueError, match="^mla_decode_swap_ab: "):
        mla_decode_swap_ab(**batch, max_seq_len=msl)


def test_bad_lengths_and_tiles_raise_value_error():
    batch, _, msl = make_batch(DECODES, 4, 32, 8, block_size=16, dtype=torch.float32)
    with pytest.raises(ValueError, match="^mla_decode_swap_ab: max_seq_len"):
        mla_decode_swap_ab(**batch, max_seq_len=10**6)
    for tile_n in (8, 48):
        with pytest.raises(ValueError, match="^mla_decode_swap_ab: tile_n"):
            mla_decode_swap_ab(**batch, max_seq_len=msl, tile_n=tile_n)


def test_module_imports_without_triton():
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "from deepbatch.kernels import mla_decode_swap_ab as m\n"
        "try:\n"
        "    m.mla_decode_swap_ab(*(None,) * 8)\n"
        "except RuntimeError as e:\n"
        "    assert 'Triton is not installed' in str(e)\n"
        "else:\n"
        "    raise AssertionError('no error')\n"
    )
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=ROOT)


# Compiles the kernel for an H200 (sm_90) at DeepSeek-V2-Lite's shapes with the wrapper's default
# launch settings, with the argument specializations a launch would get (pointers and strides
# divisible by 16), for the latent cache type in argv[1] (bf16, or an 8-bit one with its scales). Run in a fresh interpreter with the Triton interpreter off: a process that has
# run kernels under it cannot build for a real target. Exit code 3: no NVIDIA backend here.
_COMPILE_SM90 = r"""
import re, sys
import torch
from triton.backends import backends
if "nvidia" not in backends:
    sys.exit(3)
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from deepbatch.kernels import mla_decode_swap_ab as m

kernel = m._mla_decode_swap_ab_kernel
tile_n, warps, stages = m._default_tiles(512, 64, 2, torch.device("cpu"))  # off CUDA: an H200's limits
cache = sys.argv[1]
const = dict(KV_RANK=512, ROPE_DIM=64, BLOCK_R=512, BLOCK_P=64, BLOCK_SIZE=16, BLOCK_H=16, TILE_N=tile_n,
             PRECISION="tf32", KV_SCALED=cache != "bf16", KV_LIMIT=448.0 if cache == "fp8e4nv" else 127.0)
types = {"scale_log2e": "fp32", "block_tables_ptr": "*i32", "query_start_loc_ptr": "*i32", "seq_lens_ptr": "*i32",
         "cache_ptr": "*" + cache, "scale_ptr": "*bf16" if cache == "bf16" else "*fp32"}
sig, attrs = {}, {}
for i, name in enumerate(kernel.arg_names):
    sig[name] = "constexpr" if name in const else types.get(name, "*bf16" if name.endswith("_ptr") else "i32")
    if name not in const and name not in ("scale_log2e", "stride_qlh", "stride_bt"):
        attrs[(i,)] = [["tt.divisibility", 16]]
src = ASTSource(fn=kernel, signature=sig, constexprs=const, attrs=attrs)
k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
ttgir = k.asm["ttgir"]
print("warpgroup dots", len(re.findall(r"ttng\.warp_group_dot ", ttgir)), "mma.sync dots",
      len(re.findall(r"= tt\.dot ", ttgir)), "shared", k.metadata.shared)
"""


@pytest.mark.parametrize("cache", ["bf16", "fp8e4nv", "i8"])
def test_compiles_to_warpgroup_mma_for_sm90(cache):
    """The point of the kernel: at the default settings the output dot (M = R = 512) becomes a
    Hopper warpgroup MMA (the 16-row tile of ``mla_decode`` builds only ``mma.sync``), and their
    shared memory leaves room for two programs per SM of an H200 (227 KiB); an 8-bit latent
    widened in registers keeps both."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-c", _COMPILE_SM90, cache], env=env, cwd=ROOT, capture_output=True,
                          text=True)
    if proc.returncode == 3:
        pytest.skip("Triton has no NVIDIA backend")
    assert proc.returncode == 0, proc.stderr[-3000:]
    words = proc.stdout.split()
    counts = dict(zip(("warpgroup", "mma.sync", "shared"), map(int, (words[2], words[5], words[7]))))
    assert counts["warpgroup"] >= 1, proc.stdout
    assert counts["shared"] <= 232448 // 2, proc.stdout


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("launch", [{}, dict(tile_n=32, num_warps=4, num_stages=3),
                                    dict(tile_n=64, num_warps=4, num_stages=2)],
                         ids=["default", "t32-w4-s3", "t64-w4-s2"])
def test_gpu_bf16_deepseek_dims(launch):
    """DeepSeek-V2-Lite's MLA: 16 heads, R = 512, P = 64, block 16, against the float32 reference."""
    gen = torch.Generator().manual_seed(6)
    torch.manual_seed(6)
    lens = [(1, 4096), (1, 3001), (1, 777), (1, 1), (0, 100), (1, 0)]
    lens += [(1, int(torch.randint(1, 2049, (1,), generator=gen))) for _ in range(32)]
    batch, _, msl = make_batch(lens, 16, 512, 64, block_size=16, dtype=torch.bfloat16, device="cuda",
                               num_pad_rows=2)
    q = batch["q_latent"]
    out = mla_decode_swap_ab(**batch, max_seq_len=msl, **launch,
                             out=torch.full(q.shape, float("nan"), dtype=q.dtype, device=q.device))
    ref = mla_attention_ref(**on_cpu(batch, torch.float32), out=torch.full(q.shape, float("nan")))
    out = out.float().cpu()
    assert out.isnan().all(-1).equal(ref.isnan().all(-1))
    written = ~ref.isnan().all(-1)
    rel = (out[written] - ref[written]).norm() / ref[written].norm()
    assert rel < 2e-2, rel
    torch.testing.assert_close(out[written], ref[written], atol=2e-2, rtol=2e-2)
