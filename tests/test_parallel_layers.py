"""Sharding arithmetic and weight loading of the tensor-parallel layers (one process, no collectives)."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pagellm.distributed import TensorParallelGroup, shard_range
from pagellm.layers.parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from pagellm.weights.loader import LazyTensor


@pytest.mark.parametrize("total,world", [(t, w) for t in (1, 2, 3, 9, 99, 49152) for w in (1, 2, 3, 4) if t >= w])
def test_shard_range_tiles_the_whole_range(total, world):
    ranges = [shard_range(total, world, r) for r in range(world)]
    assert ranges[0][0] == 0
    for (s0, n0), (s1, _) in zip(ranges, ranges[1:], strict=False):
        assert s0 + n0 == s1
    assert sum(n for _, n in ranges) == total
    assert max(n for _, n in ranges) - min(n for _, n in ranges) <= 1


def _lazy(tmp_path, tensors: dict[str, torch.Tensor]) -> dict[str, LazyTensor]:
    path = str(tmp_path / "w.safetensors")
    save_file(tensors, path)
    f = safe_open(path, framework="pt")
    return {name: LazyTensor(f.get_slice(name)) for name in tensors}


@pytest.mark.parametrize("lazy", [False, True])
@torch.no_grad()
def test_each_rank_gets_its_rows_and_columns(tmp_path, lazy):
    """3 KV heads of size 2 and 6 query heads over 2 ranks: rank 1 gets query heads 4-5 and KV head 2."""
    torch.manual_seed(0)
    q, k, v = torch.randn(12, 5), torch.randn(6, 5), torch.randn(6, 5)
    o = torch.randn(5, 12)
    emb = torch.randn(7, 5)
    src = _lazy(tmp_path, {"q": q, "k": k, "v": v, "o": o, "emb": emb}) if lazy else \
        {"q": q, "k": k, "v": v, "o": o, "emb": emb}
    tp = TensorParallelGroup(rank=1, world_size=2)
    qkv = ColumnParallelLinear(5, [(8, 4), (4, 2), (4, 2)], bias=False)
    for i, name in enumerate("qkv"):
        qkv.weight_loader(qkv.weight, src[name], i)
    assert torch.equal(qkv.weight, torch.cat([q[8:12], k[4:6], v[4:6]]))
    row = RowParallelLinear((8, 4), 5, bias=False, tp=tp)
    row.weight_loader(row.weight, src["o"], None)
    assert torch.equal(row.weight, o[:, 8:12])
    embed = VocabParallelEmbedding(7, 5, tp)
    assert embed.vocab_range == (4, 3) and embed.vocab_sizes == [4, 3]
    embed.weight_loader(embed.weight, src["emb"], None)
    assert torch.equal(embed.weight, emb[4:7])


@torch.no_grad()
def test_wrong_checkpoint_shape_names_both_shapes():
    layer = ColumnParallelLinear(5, [(0, 4)], bias=False)
    with pytest.raises(ValueError, match=r"shape \(3, 5\).*\(4, 5\)"):
        layer.weight_loader(layer.weight, torch.zeros(3, 5), None)


def test_size_one_group_is_a_plain_layer():
    torch.manual_seed(0)
    tp = TensorParallelGroup()
    row = RowParallelLinear((0, 6), 4, bias=True, tp=tp)
    ref = torch.nn.Linear(6, 4)
    ref.load_state_dict(row.state_dict())
    x = torch.randn(3, 6)
    assert torch.equal(row(x), ref(x))
    embed = VocabParallelEmbedding(10, 4, tp)
    ids = torch.tensor([0, 9, 3])
    assert torch.equal(embed(ids), embed.weight[ids])
