"""Weight loaders cut each checkpoint tensor into the slice its rank holds, and the slices
recombine into the unsharded computation (sums for row-parallel and MoE partials, concatenation
for column-parallel and vocab-parallel outputs). Ranks are simulated in one process; the
collectives themselves run in test_tensor_parallel.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from deepbatch.distributed.parallel_state import TensorParallelGroup, building_for
from deepbatch.kernels.fused_moe import fused_moe_ref
from deepbatch.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from deepbatch.layers.moe import FusedMoE
from deepbatch.layers.vocab_parallel_embedding import VocabParallelEmbedding

N = 2


def on_rank(rank: int, build):
    with building_for(TensorParallelGroup(rank, N)):
        return build()


def test_column_then_row_parallel_sums_to_the_full_product():
    torch.manual_seed(0)
    w1, w2, b2, x = torch.randn(12, 8), torch.randn(5, 12), torch.randn(5), torch.randn(3, 8)
    partial = []
    for rank in range(N):
        col = on_rank(rank, lambda: ColumnParallelLinear(8, 12))
        # Unreduced, so one process can play both ranks: the test adds the partial sums.
        row = on_rank(rank, lambda: RowParallelLinear(12, 5, bias=True, reduce_results=False))
        col.weight_loader(col.weight, w1)
        row.weight_loader(row.weight, w2)
        row.weight_loader(row.bias, b2)
        torch.testing.assert_close(row.bias.data, b2)  # the bias is whole on every rank
        partial.append(row(col(x)))  # ... and added by rank 0 alone
    torch.testing.assert_close(sum(partial), F.linear(F.linear(x, w1), w2, b2))


def test_merged_column_parts_are_split_one_by_one():
    gate, up = torch.randn(6, 4), torch.randn(6, 4)
    for rank in range(N):
        layer = on_rank(rank, lambda: MergedColumnParallelLinear(4, [6, 6]))
        layer.weight_loader(layer.weight, gate, 0)
        layer.weight_loader(layer.weight, up, 1)
        rows = slice(3 * rank, 3 * rank + 3)
        torch.testing.assert_close(layer.weight.data, torch.cat((gate[rows], up[rows])))
        whole = on_rank(rank, lambda: MergedColumnParallelLinear(4, [6, 6]))
        whole.weight_loader(whole.weight, torch.cat((gate, up)))  # an already merged tensor
        torch.testing.assert_close(whole.weight.data, layer.weight.data)


@pytest.mark.parametrize("num_kv_heads, expected_kv_head", [(2, [0, 1]), (1, [0, 0])])
def test_qkv_heads_split_or_replicated(num_kv_heads, expected_kv_head):
    head_dim, num_heads = 3, 4
    q = torch.arange(num_heads * head_dim * 2, dtype=torch.float32).view(-1, 2)
    k = 100 + torch.arange(num_kv_heads * head_dim * 2, dtype=torch.float32).view(-1, 2)
    for rank in range(N):
        layer = on_rank(rank, lambda: QKVParallelLinear(2, head_dim, num_heads, num_kv_heads))
        assert (layer.num_heads, layer.num_kv_heads) == (2, 1)
        for shard, t in enumerate((q, k, k)):
            layer.weight_loader(layer.weight, t, shard)
        q_rows, k_rows, v_rows = layer.weight.data.split(layer.out_sizes)
        torch.testing.assert_close(q_rows, q[rank * 2 * head_dim : (rank + 1) * 2 * head_dim])
        kv = expected_kv_head[rank]
        torch.testing.assert_close(k_rows, k[kv * head_dim : (kv + 1) * head_dim])
        torch.testing.assert_close(v_rows, k_rows)


def test_kv_heads_that_cannot_be_shared_evenly_are_refused():
    with pytest.raises(ValueError, match="KV heads"):
        with building_for(TensorParallelGroup(0, 4)):
            QKVParallelLinear(8, 2, 8, 3)


def test_vocab_parallel_embedding_and_head_with_a_padded_vocabulary():
    torch.manual_seed(0)
    vocab, hidden = 7, 3  # 4 rows per rank; rank 1 holds 3 real rows and one zero pad row
    table, ids, h = torch.randn(vocab, hidden), torch.tensor([0, 3, 4, 6]), torch.randn(2, hidden)
    looked_up, logits = [], []
    for rank in range(N):
        emb = on_rank(rank, lambda: VocabParallelEmbedding(vocab, hidden))
        emb.weight_loader(emb.weight, table)
        mine = (ids >= emb.vocab_start) & (ids < emb.vocab_end)
        looked_up.append(F.embedding(torch.where(mine, ids - emb.vocab_start, 0), emb.weight) * mine[:, None])
        logits.append(F.linear(h, emb.weight))
    torch.testing.assert_close(sum(looked_up), table[ids])
    torch.testing.assert_close(torch.cat(logits, -1)[:, :vocab], F.linear(h, table))


def test_moe_experts_split_by_intermediate_sum_to_the_full_moe():
    torch.manual_seed(0)
    E, H, inter, T = 4, 8, 6, 5
    gate, up, down = torch.randn(E, inter, H), torch.randn(E, inter, H), torch.randn(E, H, inter)
    x = torch.randn(T, H)
    weights, ids = torch.rand(T, 2), torch.stack([torch.randperm(E)[:2] for _ in range(T)])
    full = fused_moe_ref(x, torch.cat((gate, up), 1), down, weights, ids)
    partial = []
    for rank in range(N):
        per_expert = on_rank(rank, lambda: FusedMoE(E, H, inter))
        for e in range(E):
            per_expert.weight_loader(per_expert.gate_up_proj, gate[e], (e, "gate_proj"))
            per_expert.weight_loader(per_expert.gate_up_proj, up[e], (e, "up_proj"))
            per_expert.weight_loader(per_expert.down_proj, down[e], (e, "down_proj"))
        stacked = on_rank(rank, lambda: FusedMoE(E, H, inter))
        stacked.weight_loader(stacked.gate_up_proj, torch.cat((gate, up), 1))
        stacked.weight_loader(stacked.down_proj, down)
        torch.testing.assert_close(stacked.gate_up_proj.data, per_expert.gate_up_proj.data)
        torch.testing.assert_close(stacked.down_proj.data, per_expert.down_proj.data)
        partial.append(fused_moe_ref(x, per_expert.gate_up_proj, per_expert.down_proj, weights, ids))
    torch.testing.assert_close(sum(partial), full)
