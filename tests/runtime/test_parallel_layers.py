"""Each tensor-parallel layer of the runtime equals its sequential self (as AxoNN tests its
layers): on two processes, the column-parallel and row-parallel linears and the
head-parallel attention give the outputs, input gradients and weight-gradient slices of
the same layer run whole in one process, from the same seed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from src.runtime.driver import free_port
from src.runtime.modules.blocks import Attention
from src.runtime.modules.parallel import TP, ColumnParallelLinear, RowParallelLinear, tp_overlap
from tests.runtime.support import run_forked

HIDDEN, HEADS, TOKENS, BATCH = 8, 4, 5, 3


def _layers(tp: TP) -> dict[str, torch.nn.Module]:
    torch.manual_seed(0)
    return {
        "column": ColumnParallelLinear(HIDDEN, 2 * HIDDEN, tp),
        "row": RowParallelLinear(2 * HIDDEN, HIDDEN, tp),
        "attention": Attention(HIDDEN, HEADS, tp, causal=True),
    }


def _inputs() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, TOKENS, HIDDEN, generator=generator)
    return {"column": x, "row": torch.randn(BATCH, TOKENS, 2 * HIDDEN, generator=generator), "attention": x}


def _run(layers: dict[str, torch.nn.Module], inputs: dict[str, torch.Tensor], row_slice=None) -> dict:
    """Output, input gradient and weight gradients of each layer under loss = sum(out · w)."""
    out = {}
    generator = torch.Generator().manual_seed(2)
    for name, layer in layers.items():
        x = inputs[name].clone()
        if name == "row" and row_slice is not None:  # a row-parallel layer reads its slice of the features
            x = x[..., row_slice]
        x.requires_grad_()
        y = layer(x)
        weight = torch.randn(BATCH, TOKENS, HIDDEN if name != "column" else 2 * HIDDEN, generator=generator)
        if name == "column" and row_slice is not None:
            weight = weight[..., _column_slice()]
        (y * weight).sum().backward()
        out[name] = {"y": y.detach(), "dx": x.grad, "params": {k: p.grad for k, p in layer.named_parameters()}}
    return out


def _column_slice(rank: int | None = None) -> slice:
    rank = dist.get_rank() if rank is None else rank
    return slice(rank * HIDDEN, (rank + 1) * HIDDEN)


def _worker(rank: int, port: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        tp = TP(2, rank, dist.new_group([0, 1]))
        torch.save(_run(_layers(tp), _inputs(), row_slice=_column_slice()), f"{out}/rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_tensor_parallel_layers_equal_their_sequential_selves(tmp_path: Path) -> None:
    run_forked(_worker, (free_port(), str(tmp_path)), 2)
    parts = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    whole = _run(_layers(TP()), _inputs())

    # Column-parallel: each rank holds half the output features and their weight rows;
    # the input gradient is the sum over ranks (all-reduced in backward).
    for r, part in enumerate(parts):
        cols = _column_slice(r)
        torch.testing.assert_close(part["column"]["y"], whole["column"]["y"][..., cols])
        torch.testing.assert_close(part["column"]["dx"], whole["column"]["dx"])
        torch.testing.assert_close(part["column"]["params"]["weight"], whole["column"]["params"]["weight"][cols])
    # Row-parallel: each rank holds half the input features; the output is summed.
    for r, part in enumerate(parts):
        cols = _column_slice(r)
        torch.testing.assert_close(part["row"]["y"], whole["row"]["y"])
        torch.testing.assert_close(part["row"]["dx"], whole["row"]["dx"][..., cols])
        torch.testing.assert_close(part["row"]["params"]["weight"], whole["row"]["params"]["weight"][:, cols])
        torch.testing.assert_close(part["row"]["params"]["bias"], whole["row"]["params"]["bias"])
    # Attention: heads split over ranks; output and input gradient are the whole layer's.
    for part in parts:
        torch.testing.assert_close(part["attention"]["y"], whole["attention"]["y"])
        torch.testing.assert_close(part["attention"]["dx"], whole["attention"]["dx"])
    # The output projection's weight-gradient columns of each rank's heads add up to the whole.
    proj = [part["attention"]["params"]["proj.weight"] for part in parts]
    torch.testing.assert_close(torch.cat(proj, dim=1), whole["attention"]["params"]["proj.weight"])


def test_a_shard_is_drawn_alone_with_the_values_of_the_whole_weight() -> None:
    # No process group: building a shard needs none, and never draws the whole weight.
    whole = _layers(TP())
    for rank in range(2):
        part = _layers(TP(2, rank, None))
        cols = _column_slice(rank)
        assert torch.equal(part["column"].weight, whole["column"].weight[cols])
        assert torch.equal(part["column"].bias, whole["column"].bias[cols])
        assert torch.equal(part["row"].weight, whole["row"].weight[:, cols])
        assert torch.equal(part["row"].bias, whole["row"].bias)
    # nn.Linear's distribution: uniform within +-1/sqrt(fan_in), spread over the range.
    weight = ColumnParallelLinear(256, 512, TP()).weight.detach()
    bound = 1 / 256**0.5
    assert weight.abs().max() <= bound and weight.abs().max() > 0.99 * bound
    assert abs(float(weight.mean())) < 0.01 * bound and float(weight.std()) == pytest.approx(bound / 3**0.5, rel=0.02)


SP_TOKENS = 6  # three a rank: StepCCL's 2 chunks cut each rank's part unevenly (2 + 1), its 3 evenly


def _sp_run(tp: TP, chunks: int) -> dict:
    """Under sequence parallelism, a column-parallel layer on this rank's part of the
    sequence and a row-parallel one on its slice of the features, in `chunks` StepCCL pairs."""
    torch.manual_seed(0)
    column, row = ColumnParallelLinear(HIDDEN, 2 * HIDDEN, tp), RowParallelLinear(2 * HIDDEN, HIDDEN, tp)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, SP_TOKENS, HIDDEN, generator=generator)
    features = torch.randn(BATCH, SP_TOKENS, 2 * HIDDEN, generator=generator)
    part = SP_TOKENS // tp.size
    inputs = {"column": x[:, tp.rank * part : (tp.rank + 1) * part], "row": features[..., _column_slice(tp.rank)]}
    out = {}
    with tp_overlap(chunks):
        for name, layer in (("column", column), ("row", row)):
            x = inputs[name].clone().requires_grad_()
            y = layer(x)
            (y * torch.randn(y.shape, generator=generator)).sum().backward()
            out[name] = {"y": y.detach(), "dx": x.grad, "params": {k: p.grad for k, p in layer.named_parameters()}}
    return out


def _sp_worker(rank: int, port: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        tp = TP(2, rank, dist.new_group([0, 1]), sequence_parallel=True)
        torch.save({chunks: _sp_run(tp, chunks) for chunks in (1, 2, 3)}, f"{out}/rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_stepccl_s_chunks_under_sequence_parallelism_equal_the_whole_gather_and_scatter(tmp_path: Path) -> None:
    """The gather before a column-parallel GEMM and the reduce-scatter after a row-parallel
    one, cut into chunks paired with the GEMM and put back in the sequence's order, give
    what the whole gather and scatter give: outputs, input and weight gradients."""
    run_forked(_sp_worker, (free_port(), str(tmp_path)), 2)
    for rank in range(2):
        runs = torch.load(tmp_path / f"rank{rank}.pt")
        for chunks in (2, 3):
            for name in ("column", "row"):
                whole, cut = runs[1][name], runs[chunks][name]
                torch.testing.assert_close(cut["y"], whole["y"])
                torch.testing.assert_close(cut["dx"], whole["dx"])
                for key, grad in whole["params"].items():
                    torch.testing.assert_close(cut["params"][key], grad)
