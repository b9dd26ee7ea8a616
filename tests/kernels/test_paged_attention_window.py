"""Sliding-window attention in every paged path: ``paged_attention_ref`` held to attention written
out key by key (transformers' rule: query ``p`` sees keys ``p - W < k <= p``), then the one-pass
and split-KV Triton kernels and the CPU backend held to the reference. The block-table entries of
blocks wholly before a sequence's window point at a block of NaNs, as a cache manager that freed
them may leave them: a path that reads one poisons its output. Runs on the CPU through the Triton
interpreter."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"

import pytest

pytest.importorskip("triton")

from deepbatch.kernels.kv_quant import quantize_int8_ref  # noqa: E402
from deepbatch.kernels.paged_attention import (  # noqa: E402
    first_key,
    paged_attention,
    paged_attention_ref,
)
from deepbatch.kernels.paged_attention_torch import paged_attention_torch  # noqa: E402

BS = 16
# (q_len, seq_len): whole prompts shorter and longer than the windows, chunks that start before,
# at and after a window's edge, decodes far past it, an empty sequence.
MIXED = [(7, 7), (40, 40), (1, 90), (19, 53), (0, 12), (5, 70), (1, 17), (33, 100)]
DECODES = [(1, 300), (1, 1), (1, 129), (0, 5), (1, 64), (1, 47)]
WINDOWS = [1, 5, 16, 37, 64]


def make_window_batch(lens, window, num_heads=4, num_kv_heads=2, head_dim=32, dtype=torch.float32, device=DEVICE,
                      num_pad_rows=0, seed=0):
    """Random inputs with shuffled block ids; entries for blocks that no query row of their
    sequence can see point at the last block, which holds NaN."""
    g = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-s // BS) for _, s in lens) + 1
    num_blocks = len(lens) * max_blocks + 1
    poison = num_blocks - 1
    ids = torch.randperm(num_blocks - 1, generator=g)[: len(lens) * max_blocks].view(len(lens), max_blocks)
    for i, (q, s) in enumerate(lens):
        ids[i, : first_key(s, q, window) // BS] = poison
    k_cache = torch.randn(num_blocks, BS, num_kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, BS, num_kv_heads, head_dim, generator=g).to(dtype)
    k_cache[poison] = float("nan")
    v_cache[poison] = float("nan")
    num_tokens = sum(q for q, _ in lens) + num_pad_rows
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, generator=g).to(dtype)
    qsl = torch.tensor([0] + [q for q, _ in lens]).cumsum(0)
    batch = dict(
        query=qkv[:, :num_heads].to(device), k_cache=k_cache.to(device), v_cache=v_cache.to(device),
        block_tables=ids.to(torch.int32).to(device), query_start_loc=qsl.to(torch.int32).to(device),
        seq_lens=torch.tensor([s for _, s in lens], dtype=torch.int32, device=device), scale=head_dim**-0.5,
    )
    return batch, max(q for q, _ in lens), max(s for _, s in lens)


def on_cpu(batch):
    return {k: v.cpu() if torch.is_tensor(v) else v for k, v in batch.items()}


def attention_key_by_key(batch, window):
    """Each query row's softmax over exactly the keys it may see, looked up slot by slot."""
    q_all, k_cache, v_cache = batch["query"].float(), batch["k_cache"].float(), batch["v_cache"].float()
    out = torch.zeros_like(q_all)
    group = q_all.shape[1] // k_cache.shape[2]
    qsl, lens = batch["query_start_loc"].tolist(), batch["seq_lens"].tolist()
    for i, seq_len in enumerate(lens):
        q_len = qsl[i + 1] - qsl[i]
        for j in range(q_len):
            p = seq_len - q_len + j
            keys = range(max(0, p - window + 1) if window else 0, p + 1)
            blocks = [int(batch["block_tables"][i, k // BS]) for k in keys]
            # [n, Hq, D]
            k = torch.stack([k_cache[b, k % BS] for b, k in zip(blocks, keys)]).repeat_interleave(group, 1)
            v = torch.stack([v_cache[b, k % BS] for b, k in zip(blocks, keys)]).repeat_interleave(group, 1)
            s = torch.einsum("nhd,hd->hn", k, q_all[qsl[i] + j]) * batch["scale"]
            out[qsl[i] + j] = torch.einsum("hn,nhd->hd", s.softmax(-1), v)
    return out


def owned_rows(batch):
    return int(batch["query_start_loc"][-1])


@pytest.mark.parametrize("window", WINDOWS)
def test_reference_is_attention_over_the_window(window):
    batch, _, _ = make_window_batch(MIXED, window, device="cpu")
    ref = paged_attention_ref(**batch, sliding_window=window)
    n = owned_rows(batch)
    torch.testing.assert_close(ref[:n], attention_key_by_key(batch, window)[:n], atol=1e-5, rtol=1e-5)


def test_window_longer_than_every_sequence_is_no_window():
    batch, _, _ = make_window_batch(MIXED, 1000, device="cpu")
    n = owned_rows(batch)
    torch.testing.assert_close(paged_attention_ref(**batch, sliding_window=1000)[:n], paged_attention_ref(**batch)[:n])
    short, _, _ = make_window_batch(MIXED, 16, device="cpu")
    # Not vacuous: the window changes the rows whose keys reach past it.
    short["block_tables"] = batch["block_tables"]
    short["k_cache"], short["v_cache"] = batch["k_cache"], batch["v_cache"]
    assert not torch.allclose(paged_attention_ref(**short, sliding_window=16)[:n], paged_attention_ref(**short)[:n])


def run_kernel(batch, mql, msl, window, **kw):
    poisoned = torch.full(batch["query"].shape, float("nan"), dtype=batch["query"].dtype, device=batch["query"].device)
    ref = paged_attention_ref(**on_cpu(batch), sliding_window=window, out=poisoned.cpu().clone())
    out = paged_attention(**batch, max_query_len=mql, max_seq_len=msl, out=poisoned, sliding_window=window, **kw)
    return out.cpu(), ref


def assert_matches(out, ref, batch, tol=1e-4):
    torch.testing.assert_close(out, ref, equal_nan=True, atol=tol, rtol=tol)
    n = owned_rows(batch)
    assert not out[:n].isnan().any()
    assert out[n:].isnan().all()


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("heads", [(4, 2, 32), (8, 1, 64)], ids=["gqa2-d32", "gqa8-d64"])
def test_one_pass_kernel_matches_reference(window, heads):
    batch, mql, msl = make_window_batch(MIXED, window, *heads, num_pad_rows=3, seed=window)
    out, ref = run_kernel(batch, mql, msl, window, num_kv_splits=1)
    assert_matches(out, ref, batch)


def test_one_pass_kernel_fp16_long_chunk():
    # A chunk spanning several 64-row query tiles, each with its own window edge.
    batch, mql, msl = make_window_batch([(150, 170), (1, 9)], 24, 2, 2, 64, dtype=torch.float16, seed=3)
    out, ref = run_kernel(batch, mql, msl, 24)
    assert_matches(out, ref, batch, tol=2e-3)


@pytest.mark.parametrize("window", [5, 37, 100])
@pytest.mark.parametrize("splits", [2, 5])
def test_split_kv_decode_matches_reference(window, splits):
    batch, mql, msl = make_window_batch(DECODES, window, 8, 2, 32, num_pad_rows=2, seed=splits)
    out, ref = run_kernel(batch, mql, msl, window, num_kv_splits=splits)
    assert_matches(out, ref, batch)


def test_int8_cache_with_window_matches_reference():
    batch, mql, msl = make_window_batch(MIXED, 37, seed=11)
    scales = []
    for name in ("k_cache", "v_cache"):
        q, s = quantize_int8_ref(batch[name].float())
        nan_rows = batch[name].isnan().any(-1)
        s[nan_rows] = float("nan")  # the poisoned block keeps poisoning through its scales
        batch[name] = q
        scales.append(s)
    for splits in (1,):
        poisoned = torch.full(batch["query"].shape, float("nan"))
        ref = paged_attention_ref(**batch, k_scale=scales[0], v_scale=scales[1], sliding_window=37,
                                  out=poisoned.clone())
        out = paged_attention(**batch, max_query_len=mql, max_seq_len=msl, out=poisoned, k_scale=scales[0],
                              v_scale=scales[1], sliding_window=37, num_kv_splits=splits)
        assert_matches(out, ref, batch)
    decodes, mql, msl = make_window_batch(DECODES, 37, seed=12)
    kq, ks = quantize_int8_ref(decodes["k_cache"].float())
    vq, vs = quantize_int8_ref(decodes["v_cache"].float())
    decodes.update(k_cache=kq, v_cache=vq)
    ref = paged_attention_ref(**decodes, k_scale=ks, v_scale=vs, sliding_window=37)
    out = paged_attention(**decodes, max_query_len=mql, max_seq_len=msl, k_scale=ks, v_scale=vs,
                          sliding_window=37, num_kv_splits=3)
    n = owned_rows(decodes)
    torch.testing.assert_close(out[:n], ref[:n], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("lens", [MIXED, DECODES], ids=["mixed", "all-decode"])
@pytest.mark.parametrize("window", WINDOWS)
def test_torch_backend_matches_reference(lens, window):
    batch, mql, _ = make_window_batch([(q, s) for q, s in lens if q > 0], window, device="cpu", seed=window + 1)
    ref = paged_attention_ref(**batch, sliding_window=window)
    for max_query_len in (mql, None):
        out = paged_attention_torch(**batch, max_query_len=max_query_len, sliding_window=window)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bad", [0, -4, 2.5, True])
def test_bad_window_raises_value_error(bad):
    batch, mql, msl = make_window_batch(MIXED, 16)
    for fn, kw in ((paged_attention, dict(max_query_len=mql, max_seq_len=msl)), (paged_attention_torch, {}),
                   (paged_attention_ref, {})):
        with pytest.raises(ValueError, match="sliding_window"):
            fn(**on_cpu(batch) if fn is not paged_attention else batch, sliding_window=bad, **kw)


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", ["mixed", "decode-auto", "decode-split"])
def test_gpu_bf16_large(kind):
    """Long sequences in bf16 on the compiled kernels: 128-key decode tiles, 64-row prefill tiles
    and the split-KV path cutting only the window."""
    gen = torch.Generator().manual_seed(6)

    def randint(lo, hi):
        return int(torch.randint(lo, hi, (1,), generator=gen))

    if kind == "mixed":
        lens = [(q, q + randint(0, 6000)) for q in (512, 300, 129, 17)] + [(1, randint(1, 8000)) for _ in range(32)]
    else:
        lens = [(1, 8192), (1, 5001), (1, 777), (1, 1)]
    batch, mql, msl = make_window_batch(lens, 1000, 32, 4, 128, dtype=torch.bfloat16, seed=6)
    out = paged_attention(**batch, max_query_len=mql, max_seq_len=msl, sliding_window=1000,
                          num_kv_splits=8 if kind == "decode-split" else None)
    cpu = {k: (v.cpu().float() if v.is_floating_point() else v.cpu()) if torch.is_tensor(v) else v
           for k, v in batch.items()}
    ref = paged_attention_ref(**cpu, sliding_window=1000)
    n = owned_rows(batch)
    out = out.float().cpu()[:n]
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref[:n], atol=2e-2, rtol=2e-2)
