"""The Triton paged-attention kernels (one-pass and split-KV) held to ``paged_attention_ref``, and the
CPU backend ``paged_attention_torch`` held to it too. Runs on the CPU through the Triton interpreter."""

import os

import torch

# The interpreter on the CPU; compiled kernels on CUDA tensors wherever a GPU is present (the
# interpreter's bf16 dot and bf16 rounding are not faithful, so the bf16 tests need a GPU).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"

import subprocess
import sys

import pytest

pytest.importorskip("triton")

from deepbatch.kernels.paged_attention import paged_attention, paged_attention_ref  # noqa: E402
from deepbatch.kernels.paged_batch import choose_kv_splits  # noqa: E402
from deepbatch.kernels.paged_attention_torch import paged_attention_torch  # noqa: E402

TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=2e-3, rtol=2e-3)}

# (q_len, seq_len) per sequence: a whole prompt, decodes, chunks over a cached prefix that start
# and end mid-block, an empty sequence, and one that fits in a single partial block.
MIXED = [(7, 7), (1, 40), (19, 33), (0, 12), (1, 1), (4, 50), (1, 17), (3, 3)]
DECODES = [(1, 300), (1, 1), (1, 129), (0, 5), (1, 64), (1, 17)]


def make_batch(lens, num_heads, num_kv_heads, head_dim, block_size, dtype, device=DEVICE, num_pad_rows=0):
    """Random inputs with shuffled, non-contiguous block ids. ``query`` is a strided slice of a
    fused QKV-like tensor; ``num_pad_rows`` extra rows past the last sequence imitate CUDA-graph
    padding and must stay unwritten."""
    q_lens = [q for q, _ in lens]
    seq_lens = [s for _, s in lens]
    max_blocks = max(-(-s // block_size) for s in seq_lens) + 2
    num_blocks = len(lens) * max_blocks + 5
    ids = torch.randperm(num_blocks)[: len(lens) * max_blocks].view(len(lens), max_blocks)
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
    v_cache = torch.randn_like(k_cache)
    num_tokens = sum(q_lens) + num_pad_rows
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, dtype=dtype, device=device)
    qsl = torch.tensor([0] + q_lens, dtype=torch.int64).cumsum(0)
    return dict(
        query=qkv[:, :num_heads],
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=ids.to(torch.int32).to(device),
        query_start_loc=qsl.to(torch.int32).to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        scale=head_dim**-0.5,
    ), max(q_lens), max(seq_lens)


def on_cpu(batch, dtype=None):
    """The reference builds its masks on the CPU: it runs there (optionally upcast)."""
    return {k: (v.cpu().to(dtype or v.dtype) if v.is_floating_point() else v.cpu()) if torch.is_tensor(v) else v
            for k, v in batch.items()}


def run_both(batch, max_query_len, max_seq_len, **kw):
    poisoned = torch.full(batch["query"].shape, float("nan"), dtype=batch["query"].dtype, device=batch["query"].device)
    ref = paged_attention_ref(**on_cpu(batch), out=poisoned.cpu().clone())
    out = paged_attention(**batch, max_query_len=max_query_len, max_seq_len=max_seq_len, out=poisoned, **kw)
    return out.cpu(), ref


def assert_matches(out, ref, dtype, batch):
    # Both start as NaN: padding rows must stay NaN in both; every owned row must be written.
    torch.testing.assert_close(out, ref, equal_nan=True, **TOL[dtype])
    num_owned = int(batch["query_start_loc"][-1].cpu())
    assert not out[:num_owned].isnan().any()
    assert out[num_owned:].isnan().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads", [(4, 4, 64), (8, 2, 128), (8, 1, 64)], ids=["gqa1-d64", "gqa4-d128", "gqa8-d64"])
def test_mixed_batch_matches_reference(dtype, heads):
    torch.manual_seed(0)
    batch, mql, msl = make_batch(MIXED, *heads, block_size=16, dtype=dtype, num_pad_rows=3)
    out, ref = run_both(batch, mql, msl, num_kv_splits=1)
    assert_matches(out, ref, dtype, batch)


@pytest.mark.parametrize("block_size", [32, 128])
def test_other_block_sizes(block_size):
    torch.manual_seed(1)
    batch, mql, msl = make_batch(MIXED, 8, 2, 64, block_size=block_size, dtype=torch.float32)
    out, ref = run_both(batch, mql, msl)
    assert_matches(out, ref, torch.float32, batch)


@pytest.mark.parametrize("heads", [(2, 1, 32), (4, 2, 256)], ids=["gqa2-d32", "gqa2-d256"])
def test_other_head_dims(heads):
    torch.manual_seed(7)
    for lens, splits in (([(5, 37), (1, 20), (9, 9)], 1), ([(1, 37), (1, 20)], 3)):
        batch, mql, msl = make_batch(lens, *heads, block_size=16, dtype=torch.float32)
        out, ref = run_both(batch, mql, msl, num_kv_splits=splits)
        assert_matches(out, ref, torch.float32, batch)


def test_long_prefill_chunk_spans_several_query_tiles():
    torch.manual_seed(2)
    batch, mql, msl = make_batch([(40, 70), (1, 9)], 2, 2, 64, block_size=16, dtype=torch.float32)
    out, ref = run_both(batch, mql, msl)
    assert_matches(out, ref, torch.float32, batch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads", [(4, 4, 64), (8, 2, 128), (8, 1, 64)], ids=["gqa1-d64", "gqa4-d128", "gqa8-d64"])
def test_split_kv_decode_matches_reference(dtype, heads):
    torch.manual_seed(3)
    batch, mql, msl = make_batch(DECODES, *heads, block_size=16, dtype=dtype, num_pad_rows=2)
    # 5 splits leave trailing splits of the short sequences empty.
    out, ref = run_both(batch, mql, msl, num_kv_splits=5)
    assert_matches(out, ref, dtype, batch)


def test_decode_batch_one_pass_and_auto_choice():
    torch.manual_seed(4)
    batch, mql, msl = make_batch(DECODES, 8, 2, 64, block_size=16, dtype=torch.float32)
    for splits in (None, 1, 2):
        out, ref = run_both(batch, mql, msl, num_kv_splits=splits)
        assert_matches(out, ref, torch.float32, batch)


def test_split_choice_heuristic():
    cpu = torch.device("cpu")
    assert choose_kv_splits(num_seqs=2, num_kv_heads=8, max_seq_len=8192, device=cpu) > 1
    assert choose_kv_splits(num_seqs=256, num_kv_heads=8, max_seq_len=8192, device=cpu) == 1
    assert choose_kv_splits(num_seqs=2, num_kv_heads=8, max_seq_len=300, device=cpu) == 1


@pytest.mark.parametrize("lens", [MIXED, DECODES], ids=["mixed", "all-decode"])
@pytest.mark.parametrize("heads", [(4, 4, 64), (8, 2, 128), (8, 1, 64)], ids=["gqa1-d64", "gqa4-d128", "gqa8-d64"])
def test_torch_backend_matches_reference(lens, heads):
    torch.manual_seed(5)
    batch, mql, _ = make_batch([(q, s) for q, s in lens if q > 0], *heads, block_size=16, dtype=torch.float32,
                               device="cpu")
    ref = paged_attention_ref(**batch)
    for max_query_len in (mql, None):
        out = paged_attention_torch(**batch, max_query_len=max_query_len)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def _bad_inputs():
    def mutate(**changes):
        def f(batch):
            batch = dict(batch)
            for key, fn in changes.items():
                batch[key] = fn(batch)
            return batch
        return f

    return {
        "query-2d": mutate(query=lambda b: b["query"].flatten(1)),
        "query-dtype": mutate(query=lambda b: b["query"].half()),
        "heads-not-multiple": mutate(query=lambda b: b["query"][:, :3]),
        "head-dim-48": mutate(query=lambda b: b["query"][..., :48], k_cache=lambda b: b["k_cache"][..., :48],
                              v_cache=lambda b: b["v_cache"][..., :48]),
        "cache-shapes-differ": mutate(v_cache=lambda b: b["v_cache"][:-1]),
        "block-tables-int64": mutate(block_tables=lambda b: b["block_tables"].long()),
        "seq-lens-length": mutate(seq_lens=lambda b: b["seq_lens"][:-1]),
        "query-start-loc-length": mutate(query_start_loc=lambda b: b["query_start_loc"][:-1]),
        "strided-last-dim": mutate(query=lambda b: b["query"].transpose(1, 2).contiguous().transpose(1, 2)),
        "out-shape": mutate(out=lambda b: torch.empty(1, *b["query"].shape[1:])),
    }


@pytest.mark.parametrize("case", list(_bad_inputs()))
def test_bad_inputs_raise_value_error(case):
    batch, mql, msl = make_batch(MIXED, 4, 2, 64, block_size=16, dtype=torch.float32)
    batch = _bad_inputs()[case](batch)
    with pytest.raises(ValueError):
        paged_attention(**batch, max_query_len=mql, max_seq_len=msl)


def test_bad_lengths_raise_value_error():
    batch, mql, msl = make_batch(MIXED, 4, 2, 64, block_size=16, dtype=torch.float32)
    with pytest.raises(ValueError, match="max_seq_len"):
        paged_attention(**batch, max_query_len=mql, max_seq_len=10**6)
    for splits in (2, 0):
        with pytest.raises(ValueError, match="num_kv_splits"):
            paged_attention(**batch, max_query_len=mql, max_seq_len=msl, num_kv_splits=splits)


def test_modules_import_without_triton():
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "from deepbatch.kernels import paged_attention as pa, paged_decode_split_kv, reshape_and_cache as rc\n"
        "from deepbatch.kernels import rms_norm as rn, silu_and_mul as sm\n"
        "x = torch.randn(2, 8)\n"
        "sm.silu_and_mul_ref(x); rn.rms_norm_ref(x, torch.ones(8), 1e-6)\n"
        "for fn, args in ((sm.silu_and_mul, (x,)), (rn.rms_norm, (x, torch.ones(8), 1e-6)),\n"
        "                 (pa.paged_attention, (None,) * 9), (rc.reshape_and_cache, (None,) * 5)):\n"
        "    try:\n"
        "        fn(*args)\n"
        "    except RuntimeError as e:\n"
        "        assert 'Triton is not installed' in str(e)\n"
        "    else:\n"
        "        raise AssertionError(fn)\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=root)


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", ["mixed", "decode-auto", "decode-split"])
def test_gpu_bf16_large(kind):
    torch.manual_seed(6)
    gen = torch.Generator().manual_seed(6)

    def randint(lo, hi):
        return int(torch.randint(lo, hi, (1,), generator=gen))

    if kind == "mixed":
        # ~2000 query tokens: prefill chunks with and without cached prefixes, plus many decodes.
        lens = [(q, q + randint(0, 4096 - q)) for q in (512, 400, 300, 256, 129, 64, 17)]
        lens += [(q, q) for q in (200, 33)] + [(1, randint(1, 4097)) for _ in range(64)]
    else:
        lens = [(1, 4096), (1, 3001), (1, 777), (1, 1)]
    batch, mql, msl = make_batch(lens, 32, 4, 128, block_size=16, dtype=torch.bfloat16, device="cuda")
    out = paged_attention(**batch, max_query_len=mql, max_seq_len=msl,
                          num_kv_splits=8 if kind == "decode-split" else None)
    ref = paged_attention_ref(**on_cpu(batch, torch.float32))
    out = out.float().cpu()
    rel = (out - ref).norm() / ref.norm()
    assert rel < 2e-2, rel
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)


def test_small_shared_memory_gpus_keep_the_small_decode_tiles(monkeypatch):
    """The 128-key, 4-stage decode tiles need ~200 KiB of shared memory: a GPU with less (an A100's
    163 KiB) must get the old 64-key, 2-stage launch, not a compile error."""
    import deepbatch.kernels.paged_attention as pa

    seen = []
    real = pa._paged_attention_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen.append((kwargs["TILE_N"], kwargs["num_stages"]))
                return real[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(pa, "_paged_attention_kernel", Spy())
    torch.manual_seed(0)
    q = torch.randn(2, 4, 128, dtype=torch.float16, device=DEVICE)  # d=128: 200 KiB of buffers
    k_cache = torch.randn(4, 16, 2, 128, dtype=torch.float16, device=DEVICE)
    v_cache = torch.randn_like(k_cache)
    tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=DEVICE)
    qsl = torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([20, 32], dtype=torch.int32, device=DEVICE)
    args = (q, k_cache, v_cache, tables, qsl, lens, 128**-0.5, 1, 32)
    pa.paged_attention(*args, num_kv_splits=1)
    monkeypatch.setattr(pa, "max_shared_memory", lambda device: 166912)
    small = pa.paged_attention(*args, num_kv_splits=1)
    assert seen == [(128, 4), (64, 2)]
    ref = pa.paged_attention_ref(q, k_cache, v_cache, tables, qsl, lens, 128**-0.5)
    torch.testing.assert_close(small.float(), ref.float(), atol=2e-3, rtol=2e-3)
