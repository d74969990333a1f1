"""The executor's distributed optimizer in one process (one replica owns every slice): its
buckets per layer, an update equal to a whole AdamW's, parameters that take the update only
when a gather brings it, a checkpoint that holds the updated parameters even where the
next forward would have gathered them, and the gradient norm it takes and clips by. Two replicas train for real in
test_runtime_equality.py (megatron_dp2_distributed_optimizer_overlapped)."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from torch import nn

from src.config import ContrastiveSpec, DeepSpeedSpec, OptimizerSpec
from src.runtime.dist_optimizer import DistributedOptimizer
from src.runtime.engines import ParallelGroups
from src.runtime.optimizer import build_optimizer

# Weight decay on, so that a parameter in the wrong group would update otherwise.
SETTINGS = DeepSpeedSpec(optimizer=OptimizerSpec(lr=0.5, eps=1.0, weight_decay=0.1))


@pytest.fixture
def world(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield ParallelGroups(dist.group.WORLD, (0,), None, ())
    finally:
        dist.destroy_process_group()


def _layers() -> nn.ModuleList:
    """Layers 0 and 2 held, 1 another rank's; biases and a LayerNorm's parameters are exempt
    from decay."""
    torch.manual_seed(0)
    return nn.ModuleList([nn.Linear(3, 4), None, nn.Sequential(nn.LayerNorm(4), nn.Linear(4, 2))])


def _grads(layers: nn.ModuleList) -> None:
    torch.manual_seed(1)
    for param in layers.parameters():
        param.grad = torch.randn_like(param)


def _whole_adamw(layers: nn.ModuleList) -> nn.ModuleList:
    """The same update by the optimizer a DeepSpeed engine builds over the whole model."""
    whole = copy.deepcopy(layers)
    _grads(whole)
    build_optimizer(whole, SETTINGS, ContrastiveSpec()).step()
    return whole


def test_the_gradient_norm_is_the_whole_model_s_and_clipping_scales_the_update_as_one_optimizer_does(world):
    clipped = replace(SETTINGS, gradient_clipping=0.1)
    layers = _layers()
    engine = DistributedOptimizer(layers, world, clipped, ContrastiveSpec(), steps=1, layerwise=True)
    whole = copy.deepcopy(layers)
    _grads(whole)
    norm = torch.nn.utils.clip_grad_norm_(list(whole.parameters()), 0.1)
    assert norm > 0.1  # it clips
    build_optimizer(whole, clipped, ContrastiveSpec()).step()
    _grads(layers)
    engine.step()
    engine.all_gather().finish()
    assert engine.get_global_grad_norm() == pytest.approx(float(norm), rel=1e-6)
    assert all(torch.allclose(p, e) for p, e in zip(layers.parameters(), whole.parameters()))


def test_layer_by_layer_buckets_update_as_one_adamw_and_reach_the_parameters_when_gathered(world):
    layers = _layers()
    engine = DistributedOptimizer(layers, world, SETTINGS, ContrastiveSpec(), steps=1, layerwise=True)
    assert [bucket.layers for bucket in engine.buckets] == [range(0, 1), range(2, 3)]
    expected = _whole_adamw(layers)
    before = [p.detach().clone() for p in layers.parameters()]
    _grads(layers)
    engine.reduce_scatter((2, 3)).finish()  # the plan reduces layer 2; the step reduces layer 0
    engine.step()
    # The update is in the master shard; the parameters keep the old values until gathered.
    assert all(torch.equal(p, b) for p, b in zip(layers.parameters(), before))
    engine.all_gather((2, 3)).finish()
    assert all(torch.allclose(p, e) for p, e in zip(layers[2].parameters(), expected[2].parameters()))
    assert all(torch.equal(p, b) for p, b in zip(layers[0].parameters(), before[:2]))
    engine.all_gather((0, 1)).finish()
    assert all(torch.allclose(p, e) for p, e in zip(layers.parameters(), expected.parameters()))


def test_a_checkpoint_holds_the_update_the_next_forward_would_have_gathered(world, tmp_path):
    layers = _layers()
    engine = DistributedOptimizer(layers, world, SETTINGS, ContrastiveSpec(), steps=1, layerwise=True)
    expected = _whole_adamw(layers)
    _grads(layers)
    engine.step()
    engine.save_checkpoint(str(tmp_path / "ckpt"), tag="t")
    saved = torch.load(tmp_path / "ckpt" / "t" / "rank0.pt", weights_only=False)
    assert all(torch.allclose(saved["module"][name], value) for name, value in expected.state_dict().items())


def test_one_bucket_for_all_where_the_plan_reduces_and_gathers_whole(world):
    layers = _layers()
    engine = DistributedOptimizer(layers, world, SETTINGS, ContrastiveSpec(), steps=1)
    assert [bucket.layers for bucket in engine.buckets] == [range(0, 3)]
    expected = _whole_adamw(layers)
    _grads(layers)
    engine.step()
    engine.all_gather().finish()
    assert all(torch.allclose(p, e) for p, e in zip(layers.parameters(), expected.parameters()))
