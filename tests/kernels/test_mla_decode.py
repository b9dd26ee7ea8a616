"""The Triton MLA kernel (one pass and split-KV) held to ``mla_attention_ref``, and the reference held
to ordinary paged attention over the expanded keys. Runs on the CPU through the Triton interpreter."""

import math
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

from deepbatch.kernels.mla_decode import mla_attention, mla_attention_ref  # noqa: E402
from deepbatch.kernels.paged_attention import paged_attention_ref  # noqa: E402

TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=2e-3, rtol=2e-3)}

# (q_len, seq_len) per sequence: a whole prompt, decodes, chunks over a cached prefix that start
# and end mid-block, an empty sequence, and one that fits in a single partial block.
MIXED = [(7, 7), (1, 40), (19, 33), (0, 12), (1, 1), (4, 50), (1, 17), (3, 3)]
DECODES = [(1, 150), (1, 1), (1, 129), (0, 5), (1, 64), (1, 17)]


def make_batch(lens, num_heads, rank, rope, block_size, dtype, device=DEVICE, num_pad_rows=0):
    """Random inputs with shuffled, non-contiguous block ids. ``q_latent`` is a head-major bmm
    output seen token-major (as the layer makes it); ``q_pe`` a slice of a wider projection;
    ``num_pad_rows`` extra rows past the last sequence must stay unwritten."""
    q_lens = [q for q, _ in lens]
    seq_lens = [s for _, s in lens]
    max_blocks = max(-(-s // block_size) for s in seq_lens) + 2
    num_blocks = len(lens) * max_blocks + 5
    ids = torch.randperm(num_blocks)[: len(lens) * max_blocks].view(len(lens), max_blocks)
    cache = torch.randn(num_blocks, block_size, 1, rank + rope, dtype=dtype, device=device)
    num_tokens = sum(q_lens) + num_pad_rows
    q_latent = torch.randn(num_heads, num_tokens, rank, dtype=dtype, device=device).transpose(0, 1)
    q_pe = torch.randn(num_tokens, num_heads, rope + 16, dtype=dtype, device=device)[..., :rope]
    qsl = torch.tensor([0] + q_lens, dtype=torch.int64).cumsum(0)
    return dict(
        q_latent=q_latent,
        q_pe=q_pe,
        latent_cache=cache,
        block_tables=ids.to(torch.int32).to(device),
        query_start_loc=qsl.to(torch.int32).to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        scale=(rank // 2 + rope) ** -0.5,
    ), max(q_lens), max(seq_lens)


def on_cpu(batch, dtype=None):
    return {k: (v.cpu().to(dtype or v.dtype) if v.is_floating_point() else v.cpu()) if torch.is_tensor(v) else v
            for k, v in batch.items()}


def run_both(batch, max_query_len, max_seq_len, **kw):
    q = batch["q_latent"]
    poisoned = torch.full(q.shape, float("nan"), dtype=q.dtype, device=q.device)
    ref = mla_attention_ref(**on_cpu(batch), out=poisoned.cpu().clone())
    out = mla_attention(**batch, max_query_len=max_query_len, max_seq_len=max_seq_len, out=poisoned, **kw)
    return out.cpu(), ref


def assert_matches(out, ref, dtype, batch, padding_untouched=True):
    num_owned = int(batch["query_start_loc"][-1].cpu())
    torch.testing.assert_close(out[:num_owned], ref[:num_owned], **TOL[dtype])
    assert not out[:num_owned].isnan().any()
    if padding_untouched:
        assert out[num_owned:].isnan().all()


def test_reference_equals_paged_attention_over_expanded_keys():
    """Absorbed MLA is MQA with key [c_kv | k_pe] and value c_kv: the paged reference over those
    (values zero-padded to the key width) gives the same rows."""
    torch.manual_seed(0)
    rank, rope = 32, 8
    batch, _, _ = make_batch([(q, s) for q, s in MIXED if q], 4, rank, rope, block_size=16, dtype=torch.float32,
                             device="cpu")
    query = torch.cat((batch["q_latent"], batch["q_pe"]), dim=-1)  # [T, H, R+P]
    value = batch["latent_cache"].clone()
    value[..., rank:] = 0
    expected = paged_attention_ref(query, batch["latent_cache"], value, batch["block_tables"],
                                   batch["query_start_loc"], batch["seq_lens"], batch["scale"])
    torch.testing.assert_close(mla_attention_ref(**batch), expected[..., :rank], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("dims", [(4, 32, 8), (16, 64, 16), (20, 48, 8)],
                         ids=["h4-r32-p8", "h16-r64-p16", "h20-r48-p8"])
def test_mixed_batch_matches_reference(dtype, dims):
    torch.manual_seed(1)
    batch, mql, msl = make_batch(MIXED, *dims, block_size=16, dtype=dtype, num_pad_rows=3)
    out, ref = run_both(batch, mql, msl, num_kv_splits=1)
    assert_matches(out, ref, dtype, batch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_one_pass_and_split_kv_match_reference(dtype):
    torch.manual_seed(2)
    batch, mql, msl = make_batch(DECODES, 16, 32, 8, block_size=16, dtype=dtype, num_pad_rows=2)
    out, ref = run_both(batch, mql, msl)  # the heuristic: one pass at these lengths
    assert_matches(out, ref, dtype, batch)
    # 5 splits leave trailing splits of the short sequences empty; rows past the batch are
    # unspecified on this path.
    out, ref = run_both(batch, mql, msl, num_kv_splits=5)
    assert_matches(out, ref, dtype, batch, padding_untouched=False)


def test_long_prefill_chunk_and_block_size_32():
    torch.manual_seed(3)
    batch, mql, msl = make_batch([(40, 70), (1, 9)], 4, 32, 8, block_size=32, dtype=torch.float32)
    out, ref = run_both(batch, mql, msl)
    assert_matches(out, ref, torch.float32, batch)


@pytest.mark.parametrize("max_q_len", [1, 3])
def test_max_q_len_skips_longer_sequences(max_q_len):
    """Sequences with more query rows than ``max_q_len`` are left to another path: their rows stay
    unwritten, the others match the reference."""
    torch.manual_seed(4)
    batch, mql, msl = make_batch(MIXED, 4, 32, 8, block_size=16, dtype=torch.float32)
    q = batch["q_latent"]
    out = mla_attention(**batch, max_query_len=mql, max_seq_len=msl, max_q_len=max_q_len,
                        out=torch.full(q.shape, float("nan")))
    ref = mla_attention_ref(**batch, out=torch.full(q.shape, float("nan")), max_q_len=max_q_len)
    qsl = batch["query_start_loc"].tolist()
    for (q_len, _), start, end in zip(MIXED, qsl, qsl[1:]):
        if q_len > max_q_len:
            assert out[start:end].isnan().all() and ref[start:end].isnan().all()
        else:
            torch.testing.assert_close(out[start:end], ref[start:end], **TOL[torch.float32])
            assert not out[start:end].isnan().any()
    with pytest.raises(ValueError, match="max_q_len"):
        mla_attention(**batch, max_query_len=mql, max_seq_len=msl, max_q_len=0)


def test_context_reference_is_the_absorbed_attention_over_cached_keys():
    """With ``context_lse`` the reference attends each chunk's cached context alone: its rows equal
    the plain reference on a batch cut back to that context (the chunk's queries as the last
    rows of a sequence of ``context_len + q_len`` tokens whose new keys are masked away below),
    and its lse is the log2-sum-exp of the scaled scores."""
    torch.manual_seed(7)
    batch, _, _ = make_batch(MIXED, 4, 32, 8, block_size=16, dtype=torch.float32, device="cpu")
    num_tokens, heads, rank = batch["q_latent"].shape
    lse = torch.full((num_tokens, heads), float("nan"))
    out = mla_attention_ref(**batch, out=torch.full((num_tokens, heads, rank), float("nan")), context_lse=lse)
    qsl, lens = batch["query_start_loc"].tolist(), batch["seq_lens"].tolist()
    cache = batch["latent_cache"]
    for i, (start, end, seq_len) in enumerate(zip(qsl, qsl[1:], lens)):
        q_len = end - start
        if q_len < 2:
            assert out[start:end].isnan().all() and lse[start:end].isnan().all()
            continue
        ctx = seq_len - q_len
        keys = cache[batch["block_tables"][i].long()].flatten(0, 1)[:ctx, 0]  # [ctx, R+P]
        query = torch.cat((batch["q_latent"][start:end], batch["q_pe"][start:end]), dim=-1)  # [q, H, R+P]
        scores = torch.einsum("qhd,kd->qhk", query, keys) * batch["scale"]
        if ctx == 0:  # a fresh prompt: lse -inf, its rows not written
            assert out[start:end].isnan().all() and (lse[start:end] == float("-inf")).all()
            continue
        want = torch.einsum("qhk,kd->qhd", scores.softmax(-1), keys[:, :rank])
        torch.testing.assert_close(out[start:end], want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse[start:end], torch.logsumexp(scores, -1) / math.log(2), atol=1e-5, rtol=1e-5)
    assert any(e - s >= 2 and n > e - s for s, e, n in zip(qsl, qsl[1:], lens))  # a chunk with context


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_context_mode_matches_reference(dtype):
    """The kernel's context-only launch: chunk rows and their lse as the reference gives them;
    decode and padding rows, and the rows of chunks without context, untouched."""
    torch.manual_seed(8)
    batch, mql, msl = make_batch(MIXED, 16, 64, 16, block_size=16, dtype=dtype, num_pad_rows=3)
    q = batch["q_latent"]
    poisoned = torch.full(q.shape, float("nan"), dtype=dtype, device=q.device)
    lse = torch.full(q.shape[:2], float("nan"), device=q.device)
    ref_lse = torch.full(q.shape[:2], float("nan"))
    ref = mla_attention_ref(**on_cpu(batch), out=poisoned.cpu().clone(), context_lse=ref_lse)
    out = mla_attention(**batch, max_query_len=mql, max_seq_len=msl, out=poisoned, context_lse=lse).cpu()
    written = ~ref_lse.isnan()
    assert written.any() and not written.all()
    assert lse.cpu().isnan().equal(~written) and out.isnan().equal(ref.isnan())
    assert (ref_lse[written] == float("-inf")).any() and ref[written].isnan().any()  # a fresh prompt
    assert not ref[written & (ref_lse > float("-inf"))].isnan().any()
    torch.testing.assert_close(out, ref, equal_nan=True, **TOL[dtype])
    torch.testing.assert_close(lse.cpu()[written], ref_lse[written], **TOL[dtype])
    with pytest.raises(ValueError, match="context_lse"):
        mla_attention(**batch, max_query_len=mql, max_seq_len=msl, context_lse=lse[:, :3])
    with pytest.raises(ValueError, match="context_lse"):
        mla_attention(**batch, max_query_len=mql, max_seq_len=msl, context_lse=lse, max_q_len=1)


def _bad_inputs():
    def mutate(**changes):
        def f(batch):
            batch = dict(batch)
            for key, fn in changes.items():
                batch[key] = fn(batch)
            return batch
        return f

    return {
        "q-latent-2d": mutate(q_latent=lambda b: b["q_latent"].flatten(1)),
        "q-latent-int": mutate(q_latent=lambda b: b["q_latent"].int(), q_pe=lambda b: b["q_pe"].int(),
                               latent_cache=lambda b: b["latent_cache"].int()),
        "q-pe-dtype": mutate(q_pe=lambda b: b["q_pe"].half()),
        "rank-too-small": mutate(q_latent=lambda b: b["q_latent"][..., :8],
                                 latent_cache=lambda b: b["latent_cache"][..., 24:]),
        "q-pe-heads": mutate(q_pe=lambda b: b["q_pe"][:, :2]),
        "cache-width": mutate(latent_cache=lambda b: b["latent_cache"][..., :-1]),
        "cache-two-heads": mutate(latent_cache=lambda b: b["latent_cache"].expand(-1, -1, 2, -1)),
        "block-tables-int64": mutate(block_tables=lambda b: b["block_tables"].long()),
        "seq-lens-length": mutate(seq_lens=lambda b: b["seq_lens"][:-1]),
        "strided-last-dim": mutate(q_pe=lambda b: b["q_pe"].transpose(0, 2).contiguous().transpose(0, 2)),
        "out-shape": mutate(out=lambda b: torch.empty(1, *b["q_latent"].shape[1:])),
    }


@pytest.mark.parametrize("case", list(_bad_inputs()))
def test_bad_inputs_raise_value_error(case):
    batch, mql, msl = make_batch(MIXED, 4, 32, 8, block_size=16, dtype=torch.float32)
    batch = _bad_inputs()[case](batch)
    with pytest.raises(ValueError):
        mla_attention(**batch, max_query_len=mql, max_seq_len=msl)


def test_bad_lengths_raise_value_error():
    batch, mql, msl = make_batch(MIXED, 4, 32, 8, block_size=16, dtype=torch.float32)
    with pytest.raises(ValueError, match="max_seq_len"):
        mla_attention(**batch, max_query_len=mql, max_seq_len=10**6)
    for splits in (2, 0):
        with pytest.raises(ValueError, match="num_kv_splits"):
            mla_attention(**batch, max_query_len=mql, max_seq_len=msl, num_kv_splits=splits)


def test_module_imports_without_triton():
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "from deepbatch.kernels import mla_decode as m\n"
        "try:\n"
        "    m.mla_attention(*(None,) * 9)\n"
        "except RuntimeError as e:\n"
        "    assert 'Triton is not installed' in str(e)\n"
        "else:\n"
        "    raise AssertionError('no error')\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=root)


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", ["mixed", "decode-auto", "decode-split"])
def test_gpu_bf16_deepseek_dims(kind):
    """DeepSeek-V2-Lite's MLA: 16 heads, R = 512, P = 64."""
    torch.manual_seed(6)
    gen = torch.Generator().manual_seed(6)

    def randint(lo, hi):
        return int(torch.randint(lo, hi, (1,), generator=gen))

    if kind == "mixed":
        lens = [(q, q + randint(0, 2048 - q)) for q in (512, 300, 129, 17)]
        lens += [(64, 64)] + [(1, randint(1, 2049)) for _ in range(32)]
    else:
        lens = [(1, 4096), (1, 3001), (1, 777), (1, 1)]
    batch, mql, msl = make_batch(lens, 16, 512, 64, block_size=16, dtype=torch.bfloat16, device="cuda")
    out = mla_attention(**batch, max_query_len=mql, max_seq_len=msl,
                        num_kv_splits=8 if kind == "decode-split" else None)
    ref = mla_attention_ref(**on_cpu(batch, torch.float32))
    out = out.float().cpu()
    rel = (out - ref).norm() / ref.norm()
    assert rel < 2e-2, rel
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
