"""Par4D in the simulator: the communication model against hand-derived vectors,
the grid's layouts and shardings, the planner's search and its bad inputs; and the
baselines it is compared with (ZeRO-3 with recompute and a memory check, DeepSpeed-3D)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from src.errors import ConfigError, PlanError
from src.mesh import Sharding
from src.models.registry import build_model
from src.program import RECOMPUTE_MODES, Collective, Compute, Wait
from src.setup import plan_run, validate
from src.sim.engine import simulate
from src.strategies.base import PlanRequest
from src.strategies.ddp import DDPOptions
from src.strategies.ddp import _build as ddp_build
from src.strategies.par4d.layout import Grid, UnitGrid, grids
from src.strategies.par4d.model import fc_comm, placement_bandwidths, rank_grids, valid_grids
from tests.test_cli import assert_one_line_error
from tests.test_configs import compose_config

GPT20_16 = [
    "model=gpt",
    "model.preset=gpt_20b",
    "cluster=perlmutter",
    "cluster.nodes=4",
    "train.global_batch=16",
    "strategy=par4d",
    "strategy.recompute=full",
]
TINY_GPT = [
    "model=gpt",
    "model.preset=null",
    "model.layers=2",
    "model.hidden=64",
    "model.heads=4",
    "model.vocab=128",
    "train.seq_len=16",
    "train.global_batch=16",
    "cluster=perlmutter",
    "cluster.nodes=2",
]


def _setup(*overrides: str):
    return validate(compose_config(*overrides))


def _plan(*overrides: str):
    setup = _setup(*overrides)
    return plan_run(setup), setup


# ---- the communication model (eqs. 1-10) ----------------------------------------------------
def test_eqs_4_to_9_reproduce_hand_derived_vectors():
    # Derived by hand from eqs. 4-9 (docs/strategies.md, Par4D): m = k = n = 1024, G = (2, 2, 2, 2), every β = 1.
    terms = fc_comm(1024, 1024, 1024, Grid(2, 2, 2, 2), (1, 1, 1, 1))
    assert (terms.ag_z, terms.rs_z, terms.ar_y, terms.ar_x, terms.ar_data) == (131072, 131072, 262144, 262144, 131072)
    assert terms.total == 917504


def test_a_transposed_layer_swaps_x_and_y_and_their_bandwidths():
    grid, betas = Grid(4, 2, 1, 1), (1.0, 3.0, 1.0, 1.0)
    plain = fc_comm(100, 200, 300, grid, betas)
    swapped = fc_comm(100, 200, 300, Grid(2, 4, 1, 1), (3.0, 1.0, 1.0, 1.0))
    assert fc_comm(100, 200, 300, grid, betas, transposed=True) == swapped != plain
    assert plain.ar_y == 2 * (1 / 2) * 100 * 300 / 4 / 3.0 and plain.ar_x == 2 * (3 / 4) * 100 * 200 / 2


@pytest.mark.parametrize(
    "grid, betas",
    [
        # Placement-aware β (eq. 10), G_node = 4, β_inter = 1.
        ((2, 2, 2, 2), ("intra", "intra", 1 / 4, 1 / 4)),
        ((1, 1, 8, 2), ("intra", "intra", 1, 1 / 4)),
        ((8, 1, 1, 2), (1, 1 / 4, 1 / 4, 1 / 4)),
    ],
)
def test_eq10_placement_aware_bandwidths(grid, betas):
    want = tuple(100.0 if b == "intra" else b for b in betas)
    assert placement_bandwidths(Grid(*grid), 4, intra=100.0, inter=1.0) == pytest.approx(want)


def test_every_grid_of_the_device_count_is_ranked_by_the_model():
    assert len(grids(1024)) == 286  # ordered 4-factorisations of 2^10: C(13, 3)
    assert all(g.devices == 32 for g in grids(32)) and len(grids(32)) == 56
    setup = _setup(*GPT20_16[:-2], "cluster.nodes=8", "train.global_batch=32")
    unit = UnitGrid(setup.model.units[0])
    valid, rejected = valid_grids(unit, 32, 32)
    assert len(valid) + len(rejected) == 56
    # 56 heads: no grid with G_x = 16 or 32 runs GPT-20B's attention.
    assert any("56 attention heads" in r for r in rejected)
    aware = rank_grids(unit, valid, setup.cluster, 32, 2, "aware")
    agnostic = rank_grids(unit, valid, setup.cluster, 32, 2, "agnostic")
    totals = [r.comm.total for r in aware]
    assert totals == sorted(totals) and {r.grid for r in aware} == set(valid)
    # Bandwidths matter: the two models order the grids differently.
    assert [r.grid for r in aware] != [r.grid for r in agnostic]


# ---- the grid's rank mapping ------------------------------------------------------------------
def test_rank_mapping_puts_x_innermost_then_y_z_data():
    # The paper's rank mapping: rank = i + G_x(j + G_y(k + G_z d)); (2,2,2,2) as in the paper.
    mesh = Grid(2, 2, 2, 2).mesh()
    assert mesh.family("x")[:3] == [(0, 1), (2, 3), (4, 5)]
    assert mesh.family("y")[:4] == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert mesh.group("z", 5) == (1, 5) and mesh.group("dp", 3) == (3, 11)
    assert mesh.rank(x=1, y=0, z=1, dp=1) == 1 + 2 * (0 + 2 * (1 + 2 * 1))
    assert sorted(r for fam in mesh.family("z") for r in fam) == list(range(16))


# ---- layouts and shardings ----------------------------------------------------------------
def test_a_gpt_block_alternates_fc_orientation_and_splits_at_each_fc():
    model = build_model({"name": "gpt", "preset": "gpt_5b"}, None)
    unit = model.units[0]
    layouts = UnitGrid(unit).layout(Grid(2, 4, 2, 1))
    block, head = layouts[1], layouts[-1]
    names = [unit.layers[1].kernels[fc.kernel].name for fc in block.fcs]
    assert names == ["attn_qkv", "attn_proj", "fc1", "fc2"]
    assert [fc.transposed for fc in block.fcs] == [False, True, False, True]
    assert block.ranges[-1][1] == len(unit.layers[1].kernels) and block.ranges[0][0] == 0
    assert [fc.transposed for fc in head.fcs] == [False] and layouts[0].fcs == (None,)  # embedding: no FC
    assert all(lay.sharding.transposed is False for lay in layouts)


def _assert_realisable_flow(unit, layouts) -> None:
    """Walk a U-Net's data flow on its layouts (tracking the axis its channels lie over),
    asserting every FC reads its input where it lies: a chain FC where
    the previous one left it (a replicated layer leaves it whole), a skip projection where
    the layer's first FC reads it and written (after any re-split) where the layer's output
    lies, the time-embedding projection added where its conv's output lies, and each skip
    connection concatenated with the decoder's activations on the same axis."""
    current: str | None = None  # None: whole on every rank
    saved: list[str | None] = []
    names = [layer.name for layer in unit.layers]
    for layout, layer in zip(layouts, unit.layers):
        fcs = [fc for fc in layout.fcs if fc is not None]
        if layer.name.startswith("up") and layer.name.endswith("_res"):
            assert saved.pop() in (current, None), layer.name
        if fcs:
            chain = [fc for fc in fcs if not layer.kernels[fc.kernel].skip_projection and layer.kernels[fc.kernel].name != "emb_proj"]
            assert current in (None, chain[0].axes()[1]), layer.name
            for before, after in zip(chain, chain[1:]):
                assert after.axes()[1] == before.axes()[0], layer.name
            for fc in fcs:
                kernel = layer.kernels[fc.kernel]
                if kernel.skip_projection:
                    assert fc.axes()[1] == chain[0].axes()[1], layer.name
                    assert fc.resplit == (fc.axes()[0] != chain[-1].axes()[0]), layer.name
                if kernel.name == "emb_proj":
                    assert fc.axes()[0] == chain[0].axes()[0], layer.name
            current = chain[-1].axes()[0]
        elif layout.sharding.degree("x") == 1 and layout.sharding.degree("y") == 1 and layer.params:
            current = None  # replicated on the tensor grid
        following = names[names.index(layer.name) + 1] if layer is not unit.layers[-1] else ""
        if (layer.name == "conv_in" or layer.name.startswith("down")) and not following.endswith("_attn"):
            saved.append(current)
    assert not saved


@pytest.mark.parametrize("grid", [Grid(2, 4, 1, 1), Grid(4, 2, 2, 1), Grid(4, 4, 1, 1)])
def test_a_unet_on_the_grid_is_a_realisable_data_flow(grid):
    model = build_model({"name": "unet", "preset": "unet_50m"}, None)
    unit = model.units[0]
    layouts = UnitGrid(unit).layout(grid)
    _assert_realisable_flow(unit, layouts)
    resblocks = [lay for lay, layer in zip(layouts, unit.layers) if layer.name.endswith("_res")]
    # A residual block's two convs alternate, so the block leaves its input's layout.
    assert all(lay.fcs[0].transposed != lay.fcs[2].transposed for lay in resblocks)
    assert any(fc is not None and fc.resplit for lay in resblocks for fc in lay.fcs)  # channel-changing blocks


def test_the_unet_stem_and_output_run_replicated_where_the_grid_does_not_divide_them():
    model = build_model({"name": "unet", "preset": "unet_50m"}, None)
    grid = Grid(4, 4, 1, 1)
    layouts = UnitGrid(model.units[0]).layout(grid)
    stem, out = layouts[0], layouts[-1]
    assert stem.sharding == grid.replicated() and stem.fcs == (None,)  # 3 x 3 x 3 input columns
    assert out.sharding == grid.replicated()  # 6 output channels
    assert UnitGrid(model.units[0]).layout(Grid(2, 1, 1, 1))[-1].fcs[0] is not None  # 2 divides 6


@pytest.mark.parametrize("grid, output_gathers", [((2, 2, 1, 1), 0), ((4, 4, 1, 1), 1)])
def test_unet_resplits_and_its_replicated_ends_gathers_are_priced(grid, output_gathers):
    """Each re-split skip projection all-gathers forward and backward; a replicated output
    conv (6 channels on G_x=4) gathers its split input; the replicated stem's and timestep
    embedding's readers' slices gather their gradients back; z=1, so no weight gathers."""
    plan, _ = _plan(
        "model=unet",
        "model.preset=unet_50m",
        "strategy=par4d",
        f"strategy.grid=[{','.join(map(str, grid))}]",
        "cluster=perlmutter",
        f"cluster.nodes={grid[0] * grid[1] // 4}",
        "train.global_batch=4",
        "strategy.recompute=none",
    )
    gathers = [i for i in plan.program.classes[0].instructions if isinstance(i, Collective) and i.op == "all_gather"]
    layouts = UnitGrid(build_model({"name": "unet", "preset": "unet_50m"}, None).units[0]).layout(Grid(*grid))
    resplits = sum(fc is not None and fc.resplit for lay in layouts for fc in lay.fcs)
    embedding_reads = sum(fc is not None and fc.embedding_input for lay in layouts for fc in lay.fcs)
    assert resplits and embedding_reads and (layouts[-1].gather_input is not None) == bool(output_gathers)
    assert layouts[0].scatter_output == "y" and layouts[1].sharding == Grid(*grid).replicated()  # stem, timestep embedding
    per_microbatch = 2 * resplits + output_gathers + embedding_reads + 1
    assert len(gathers) == per_microbatch * plan.units[0].num_microbatches


def test_a_grid_that_splits_group_norm_groups_is_refused():
    with pytest.raises(ConfigError, match=r"G_y=64 splits its 32 GroupNorm groups"):
        _plan(
            "model=unet",
            "model.preset=unet_50m",
            "strategy=par4d",
            "strategy.grid=[1,64,1,1]",
            "cluster=perlmutter",
            "cluster.nodes=16",
            "train.global_batch=64",
        )


def test_grid_sharding_divides_each_kernel_as_par4d_lays_it_out():
    grid = Sharding((("x", 2), ("y", 4), ("z", 8)))
    assert [grid.gemm_divisors(s) for s in ("n", "k", "batch", "none")] == [(8, 2, 4, 1), (8, 4, 2, 1), (8, 1, 1, 2), (8, 1, 1, 1)]
    # Residual stream (layer norms) on z x y; an FC's output (activation, softmax) on z x x.
    assert grid.memory_divisor("none") == 32 and grid.memory_divisor("n") == 16 and grid.memory_divisor("batch") == 16
    assert grid.activation_divisors() == (32, 16)
    flipped = Sharding((("x", 2), ("y", 4), ("z", 8)), transposed=True)
    assert flipped.gemm_divisors("n") == (8, 4, 2, 1) and flipped.activation_divisors() == (16, 32)
    # A layer replicated on the tensor grid: rows over z only.
    assert Sharding((("z", 8),)).gemm_divisors("n") == (8, 1, 1, 1)


# ---- the planner ------------------------------------------------------------------------------
def test_a_fixed_grid_plans_algorithm_1_with_its_overlaps():
    plan, setup = _plan(*GPT20_16, "strategy.grid=[2,2,4,1]")
    unit = plan.units[0]
    assert plan.strategy == "par4d" and plan.details["grid"] == "(2,2,4,1)"
    assert unit.mesh.axes == (("x", 2), ("y", 2), ("z", 4), ("dp", 1)) and unit.recompute == "full"
    assert plan.details["search"]["grids_simulated"] == 1 and plan.details["search"]["fixed"]
    groups = plan.program.groups
    assert groups["x"].ranks == (0, 1) and groups["y"].ranks == (0, 2) and groups["z"].ranks == (0, 4, 8, 12)
    assert "dp" not in groups  # G_data = 1
    instructions = plan.program.classes[0].instructions
    ops = {(i.op, i.group, i.blocking) for i in instructions if isinstance(i, Collective)}
    # Every overlap on: gathers and reduce-scatters over z and dX's all-reduce are asynchronous,
    # the forward's output all-reduce blocks.
    assert ("all_gather", "z", False) in ops and ("reduce_scatter", "z", False) in ops
    assert ("all_reduce", "x", False) in ops and ("all_reduce", "y", True) in ops
    assert not any(i.op == "all_gather" and i.blocking for i in instructions if isinstance(i, Collective))
    # D: the layers that fit keep their gathered weights (the paper: 28 of GPT-20B's 32).
    assert 0 < plan.details["cached_layers"] <= 34 and unit.gathered_params > 0
    assert plan.details["memory_gib"] * 2**30 <= setup.cluster.usable_memory_bytes


def test_full_recomputation_gathers_again_only_the_blocks_it_re_runs():
    """The embedding and the head run once under full recomputation: their backward reuses
    the forward's gathered weights (Algorithm 1, line 5), so only the blocks gather again,
    and only blocks are cached (D)."""
    base = (*TINY_GPT, "strategy=par4d", "strategy.grid=[1,1,8,1]", "strategy.recompute=full")
    plan, setup = _plan(*base, "strategy.overlap=[all_gather]")  # asynchronous gathers carry their layer in their handle
    layers = setup.model.units[0].layers
    again = {
        int(i.handle.split(".L")[1].split(".")[0])
        for i in plan.program.classes[0].instructions
        if isinstance(i, Collective) and i.handle and i.handle.startswith("ag.re.")
    }
    assert again == {index for index, layer in enumerate(layers) if layer.block} == {1, 2}
    cached, _ = _plan(*base, "strategy.overlap=[cache]")
    assert cached.details["cached_layers"] == 2  # both blocks; the embedding and head need none


def test_lightning_gathers_follow_axonns_cache_and_iterator():
    """gathers=lightning: the forward's iterator starts at the head (LitGPT registers it
    before its blocks), so every block's gather blocks until the head uses its prefetch; the
    backward's runs in reverse and each FC's backward gathers its W again. Derived by hand for
    the tiny GPT (embedding, two blocks of 4 FCs, head) on G_z = 8, full recomputation:
    forward 9 blocking (the embedding's table and 8 block FCs) and 2 issued ahead (the head's,
    then block 1's first, left unused); backward 8 blocking (per block: the recomputation's
    first two FCs, the backward's last two) and 10 issued ahead. The paper's chain: 18 gathers
    (10 forward, 8 recomputed), every one issued ahead."""
    base = (*TINY_GPT, "strategy=par4d", "strategy.grid=[1,1,8,1]", "strategy.recompute=full")
    overlaps = "strategy.overlap=[all_reduce,reduce_scatter,all_gather]"
    counts = {}
    for gathers in ("paper", "lightning"):
        plan, _ = _plan(*base, overlaps, f"strategy.gathers={gathers}")
        issued = [
            i for i in plan.program.classes[0].instructions if isinstance(i, Collective) and i.op == "all_gather" and i.group == "z"
        ]
        counts[gathers] = (sum(i.blocking for i in issued), sum(not i.blocking for i in issued))
    assert counts == {"paper": (0, 18), "lightning": (17, 12)}


def test_lightning_gathers_refuse_a_cache_axonns_lightning_strategy_lacks():
    with pytest.raises(ConfigError, match="strategy.gathers=lightning with cache in strategy.overlap"):
        _plan(*TINY_GPT, "strategy=par4d", "strategy.grid=[1,1,8,1]", "strategy.gathers=lightning")
    with pytest.raises(ConfigError, match="strategy.gathers='axonn'; choose one of"):
        _plan(*TINY_GPT, "strategy=par4d", "strategy.gathers=axonn")


def test_each_overlap_lowers_the_iteration_time_on_gpt20b():
    times = []
    for overlap in (
        "[]",
        "[all_reduce]",
        "[all_reduce,reduce_scatter]",
        "[all_reduce,reduce_scatter,all_gather]",
        "[all_reduce,reduce_scatter,all_gather,cache]",
    ):
        plan, setup = _plan(*GPT20_16, "strategy.grid=[2,2,4,1]", f"strategy.overlap={overlap}")
        times.append(simulate(plan.program, setup.model, setup.cluster, setup.train.precision).iteration_time)
    assert all(later < earlier for earlier, later in zip(times, times[1:])), times


def test_the_search_simulates_the_top_k_and_keeps_the_fastest():
    plan, setup = _plan(
        *GPT20_16[:-2], "cluster.nodes=8", "train.global_batch=32", "strategy=par4d", "strategy.recompute=full", "strategy.top_k=3"
    )
    search = plan.details["search"]
    simulated = [r for r in search["ranking"] if r["iteration_time_s"] is not None]
    assert len(simulated) == search["grids_simulated"] == 3
    assert [r["rank"] for r in search["ranking"]] == sorted(r["rank"] for r in search["ranking"])
    best = min(simulated, key=lambda r: r["iteration_time_s"])
    assert plan.details["grid"] == best["grid"]
    assert search["rank_of_best"] == [r["rank"] for r in simulated].index(best["rank"]) + 1
    # Every ranked grid ahead of the last simulated one was either simulated or does not fit.
    last = simulated[-1]["rank"]
    assert all(r["fits"] is False for r in search["ranking"] if r["rank"] < last and r["iteration_time_s"] is None)


# ---- bad input: one line with the numbers ------------------------------------------------------
@pytest.mark.parametrize(
    "overrides, needles",
    [
        (["strategy.grid=[2,2,4,2]"], [r"strategy\.grid=\[2, 2, 4, 2\]", r"= 32 devices", r"has 16"]),
        (
            ["strategy.grid=[3,1,1,1]", "cluster.nodes=1", "cluster.devices_per_node=3"],
            [r"G_x=3 does not divide", r"\b(7168|21504)\b"],
        ),
        (
            [
                "model.preset=null",
                "model.layers=2",
                "model.hidden=1536",
                "model.heads=24",
                "model.vocab=51200",
                "strategy.grid=[16,1,1,1]",
            ],
            [r"G_x=16 does not divide the 24 attention heads"],
        ),
        (["strategy.grid=[1,1,1,16]"], [r"\(1,1,1,16\)", r"[\d.]+ GiB", r"A100", r"short by [\d.]+ GiB"]),
    ],
)
def test_bad_par4d_input_is_one_line_with_its_numbers(overrides, needles):
    import re

    with pytest.raises(ConfigError) as err:
        _plan(*GPT20_16, *overrides)
    for needle in needles:
        assert re.search(needle, str(err.value)), (needle, str(err.value))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "overrides, needles",
    [
        (["strategy.grid=[2,2,4,2]"], [r"= 32 devices", r"has 16"]),
        (["strategy.grid=[1,1,1,16]"], [r"short by [\d.]+ GiB"]),
    ],
)
@pytest.mark.slow
def test_bad_par4d_input_exits_2_from_the_front_door(cli, tmp_path: Path, overrides, needles):
    proc = cli(*GPT20_16, *overrides, "logger=none", f"hydra.run.dir={tmp_path}")
    assert_one_line_error(proc, tmp_path, *needles)


def test_bad_par4d_options_are_refused():
    for overrides, needle in (
        (["strategy.grid=[2,2,4]"], "four positive integers"),
        (["strategy.model=exact"], "aware"),
        (["strategy.overlap=[prefetch]"], "prefetch"),
        (["strategy.top_k=0"], "top_k"),
    ):
        with pytest.raises(ConfigError, match=needle):
            _plan(*GPT20_16, *overrides)


# ---- baselines: ZeRO-3 and DeepSpeed-3D ---------------------------------------------------------
GPT80_64 = ["model=gpt", "model.preset=gpt_80b", "cluster=perlmutter", "cluster.nodes=16", "strategy=ddp"]


def test_ddp_refuses_a_plan_that_does_not_fit_memory():
    with pytest.raises(PlanError, match=r"zero_stage=0 .* needs 1[\d.]+ GiB .* short by 1[\d.]+ GiB"):
        _plan(*GPT80_64)


@pytest.mark.parametrize("model", [["model=unet"], TINY_GPT[:7]])
def test_ddp_prices_memory_on_two_micro_batches_as_on_all(model):
    """plan_ddp checks memory on an inner and the last micro-batch before building them all;
    with one only, U-Net's ZeRO-0 overlapped reduction under full recompute read 11 % high."""
    setup = _setup(*model, "strategy=ddp", "cluster=local", "cluster.nodes=1", "train.global_batch=16")
    for zero, overlap, recompute in itertools.product((0, 1, 3), (False, True), RECOMPUTE_MODES):
        opts = DDPOptions(zero_stage=zero, overlap_comm=overlap)
        request = PlanRequest(setup.model, setup.cluster, setup.train, {})
        _, probed = ddp_build(request, opts, setup.cluster.devices, 2, recompute, probe=True)
        _, whole = ddp_build(request, opts, setup.cluster.devices, 2, recompute)
        assert probed == pytest.approx(whole), (zero, overlap, recompute)


def test_an_absurd_batch_is_refused_in_seconds():
    # 2.5e8 samples per replica: the micro-batch sizes are divisors (not a scan of 2.5e8),
    # each priced on at most two micro-batches.
    for strategy in (["strategy=ddp"], ["strategy=par4d", "strategy.grid=[1,1,4,4]"]):
        with pytest.raises(PlanError, match=r"short by [\d.]+ GiB"):
            _plan("model=unet", *strategy, "cluster=local", "cluster.nodes=4", "train.global_batch=1000000000")


def test_zero3_recomputes_and_shrinks_micro_batches_only_as_far_as_memory_requires():
    plan, setup = _plan(*GPT80_64, "strategy.zero_stage=3")
    unit = plan.units[0]
    assert unit.recompute == "full" and unit.micro_batch < unit.batch_per_replica
    assert plan.details["memory_gib"] * 2**30 <= setup.cluster.usable_memory_bytes
    small, _ = _plan(*TINY_GPT, "strategy=ddp", "strategy.zero_stage=3")
    assert small.units[0].recompute == "none" and small.units[0].num_microbatches == 1


def test_zero3_overlap_comm_prefetches_and_reduces_asynchronously():
    plain, setup = _plan(*TINY_GPT, "strategy=ddp", "strategy.zero_stage=3")
    overlapped, _ = _plan(*TINY_GPT, "strategy=ddp", "strategy.zero_stage=3", "strategy.overlap_comm=true")
    layers = setup.model.units[0].num_layers
    for plan, blocking in ((plain, True), (overlapped, False)):
        instructions = plan.program.classes[0].instructions
        scatters = [i for i in instructions if isinstance(i, Collective) and i.op == "reduce_scatter"]
        assert len(scatters) == layers and all(i.blocking == blocking for i in scatters)
    waits = [i for i in overlapped.program.classes[0].instructions if isinstance(i, Wait)]
    assert len(waits) >= layers  # the reductions, and the prefetched gathers
    times = [simulate(p.program, setup.model, setup.cluster, setup.train.precision).iteration_time for p in (plain, overlapped)]
    assert times[1] < times[0]


def test_deepspeed3d_is_megatrons_pipeline_with_zero1_and_1f1b():
    plan, _ = _plan(*TINY_GPT, "strategy=deepspeed3d", "strategy.recompute=full")
    assert plan.strategy == "deepspeed3d"
    assert plan.details["zero_stage"] == 1 and plan.details["schedule"] == "1f1b"
    assert plan.details["sequence_parallel"] is False and plan.details["vpp"] == 1
    assert any(isinstance(i, Compute) and i.work.phase == "optimizer" for i in plan.program.classes[0].instructions)
    with pytest.raises(ConfigError, match="deepspeed3d"):
        _plan(*TINY_GPT, "strategy=deepspeed3d", "strategy.tp=3")
