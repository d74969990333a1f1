"""Every option of every strategy is run for real by the real backend or refused before any
worker starts, with one line naming it: never run under a label it did not earn.

Each option of conf/strategy/<name>.yaml (and the run's precision) has a sample setting
and a verdict here; an option nobody classified fails the test. "run" verdicts name the
test that trains with the option and compares the losses with one process.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from src.config import ContrastiveSpec, DeepSpeedSpec
from src.errors import ConfigError
from src.plan_io import PlannedRun, read_plan, write_plan
from src.program import Collective
from src.runtime.checks import check_runnable
from src.runtime.engines import EngineSettings, deepspeed_config
from src.setup import options_named, plan_run, validate
from src.strategies import STRATEGIES
from tests.runtime.support import CLIP, GPT, UNET, composed, mllm_shard

CONF = Path(__file__).resolve().parents[2] / "conf" / "strategy"
WORKERS = ["backend=torch", "cluster=local", "cluster.devices_per_node=4", "logger=none"]
# A GPU preset priced as the real backend trains: PyTorch AMP.
HOPPER = ["cluster=hopper", "cluster.nodes=1", "cluster.amp=true"]
MEGATRON = (
    WORKERS
    + GPT
    + [
        "strategy=megatron",
        "strategy.tp=1",
        "strategy.pp=2",
        "strategy.micro_batch_size=2",
        "strategy.recompute=none",
        "strategy.zero_stage=0",
        "strategy.vpp=1",
    ]
)
DISTMM = WORKERS + [
    "model=clip",
    "model.scale=tiny",
    "train.global_batch=16",
    "train.contrastive_batch=8",
    "strategy=distmm",
    "strategy.vision.dp=2",
    "strategy.text.dp=2",
]
DDP = WORKERS + CLIP + ["strategy=ddp"]
PAR4D = WORKERS + GPT + ["strategy=par4d", "strategy.recompute=none", "strategy.micro_batch_size=2"]
DS3D = (
    WORKERS
    + GPT
    + ["strategy=deepspeed3d", "strategy.tp=1", "strategy.pp=2", "strategy.micro_batch_size=2", "strategy.recompute=none"]
)
MLLM_REPLICATED = [
    "backend=torch",
    "cluster=local",
    "cluster.devices_per_node=6",
    "logger=none",
    "model=mllm_9b",
    "model.scale=tiny",
    "train.data=uniform",
    "train.global_batch=8",
    "strategy=megatron",
    "strategy.tp=2",
    "strategy.pp=3",
    "strategy.sequence_parallel=false",
    "strategy.recompute=none",
    "strategy.zero_stage=0",
]
DISTTRAIN = WORKERS + ["model=mllm_9b", "model.scale=tiny", "train.global_batch=8", "strategy=disttrain", "train.data=uniform"]
MLLM_SKEWED = WORKERS + [
    "model=mllm_9b",
    "model.scale=tiny",
    "model.images_per_sequence=2",
    "model.image_size_spread=0",
    "train.global_batch=8",
    "train.data=interleaved",
    "train.balance=cost",
    "strategy=megatron",
    "strategy.modality_stages=merged",
]
EQUALITY, DISTMM_RUNS, DISTTRAIN_RUNS = "test_runtime_equality", "test_runtime_distmm", "test_runtime_disttrain"
TP_PP_RUNS = "test_runtime_tp_pp"
PAR4D_RUNS = "test_runtime_par4d"
OPTIMUS_RUNS = "test_runtime_optimus"
INTERLEAVED_RUNS = "test_runtime_interleaved"
# The tiny LLM's four layers on four pipeline stages (test_runtime_optimus's base).
OPTIMUS = WORKERS + [
    "model=optimus",
    "model.scale=tiny",
    "train.global_batch=8",
    "strategy=optimus",
    "strategy.llm.pp=4",
    "strategy.llm.dp=1",
    "strategy.llm.tp=1",
    "strategy.llm.micro_batch_size=1",
]
OPTIMUS_TP2 = ["strategy.llm.pp=2", "strategy.llm.tp=2", "strategy.fine_grained=false"]
OPTIMUS_INTERLEAVED = [*OPTIMUS_TP2, "strategy.llm.vpp=2", "strategy.llm.schedule=interleaved"]

# (strategy, option): (the plan's base overrides, the sample setting, verdict, where it runs for real)
FIELDS: dict[tuple[str, str], tuple[list[str], list[str], str, str]] = {
    # auto runs the winner's plan, whose own fields are classified under its strategy.
    ("auto", "contenders"): (WORKERS + CLIP + ["strategy=auto"], ["strategy.contenders=[megatron]"], "run", "test_compare"),
    ("megatron", "tp"): (
        MEGATRON,
        ["strategy.tp=2", "strategy.sequence_parallel=false", "strategy.scatter_gather=false"],
        "run",
        EQUALITY,
    ),
    ("megatron", "pp"): (MEGATRON, ["strategy.pp=1"], "run", EQUALITY),
    ("megatron", "dp"): (MEGATRON, ["strategy.dp=2"], "run", EQUALITY),
    ("megatron", "vpp"): (MEGATRON, ["strategy.vpp=2", "strategy.schedule=interleaved"], "run", EQUALITY),
    ("megatron", "micro_batch_size"): (MEGATRON, ["strategy.micro_batch_size=4"], "run", EQUALITY),
    ("megatron", "schedule"): (MEGATRON, ["strategy.schedule=gpipe"], "run", EQUALITY),
    ("megatron", "extra_warmup"): (MEGATRON, ["strategy.extra_warmup=2"], "run", EQUALITY),
    ("megatron", "recompute"): (MEGATRON, ["strategy.recompute=full"], "run", EQUALITY),
    ("megatron", "sequence_parallel"): (MEGATRON, ["strategy.tp=2", "strategy.sequence_parallel=true"], "run", EQUALITY),
    ("megatron", "zero_stage"): (MEGATRON, ["strategy.zero_stage=1"], "run", EQUALITY),
    ("megatron", "overlap_grad_reduce"): (MEGATRON, ["strategy.overlap_grad_reduce=true", "strategy.dp=2"], "run", EQUALITY),
    # The executor's distributed optimizer, a bucket per layer.
    ("megatron", "overlap_param_gather"): (
        MEGATRON,
        ["strategy.overlap_param_gather=true", "strategy.zero_stage=1", "strategy.dp=2"],
        "run",
        EQUALITY,
    ),
    # The executor's distributed optimizer all-reduces the whole gradient and steps its slice.
    ("megatron", "grad_all_reduce"): (
        MEGATRON,
        ["strategy.grad_all_reduce=true", "strategy.zero_stage=1", "strategy.dp=2"],
        "run",
        EQUALITY,
    ),
    # Each send in DeepSpeed's step order, the stream waiting until it has landed.
    ("megatron", "p2p"): (MEGATRON, ["strategy.p2p=deepspeed", "strategy.schedule=1f1b"], "run", EQUALITY),
    ("megatron", "modality_stages"): (MEGATRON, ["strategy.modality_stages=merged"], "run", EQUALITY),
    ("megatron", "uneven_pp"): (MEGATRON, ["strategy.uneven_pp=true"], "run", EQUALITY),
    ("megatron", "balance"): (MEGATRON, ["strategy.balance=true"], "run", EQUALITY),
    ("megatron", "balance_by"): (MEGATRON, ["strategy.balance=true", "strategy.balance_by=time"], "run", EQUALITY),
    ("megatron", "scatter_gather"): (
        MEGATRON,
        ["strategy.tp=2", "strategy.sequence_parallel=false", "strategy.scatter_gather=true"],
        "run",
        TP_PP_RUNS,
    ),
    # The encoder's and generator's stages replicated over their TP group (tp=2 x pp=3).
    ("megatron", "replicate"): (
        MLLM_REPLICATED,
        ["strategy.replicate=[encoder,generator]", "strategy.micro_batch_size=2"],
        "run",
        "test_runtime_replicate",
    ),
    # Which of the search's plans runs, chosen on the first batch of skewed data.
    ("megatron", "choose_on"): (MLLM_SKEWED, ["strategy.choose_on=data"], "run", INTERLEAVED_RUNS),
    ("distmm", "balance"): (DISTMM, ["strategy.balance=even"], "run", DISTMM_RUNS),
    ("distmm", "placement"): (
        DISTMM,
        ["strategy.placement=naive", "strategy.vision.dp=null", "strategy.text.dp=null"],
        "run",
        DISTMM_RUNS,
    ),
    ("distmm", "pipeline"): (DISTMM, ["strategy.pipeline=gpipe_sync"], "run", DISTMM_RUNS),
    ("distmm", "use_all_devices"): (DISTMM, ["strategy.use_all_devices=false"], "run", DISTMM_RUNS),
    ("distmm", "microbatches"): (
        DISTMM,
        ["strategy.vision.pp=2", "strategy.text.pp=2", "strategy.vision.dp=1", "strategy.text.dp=1", "strategy.microbatches=2"],
        "run",
        DISTMM_RUNS,
    ),
    ("distmm", "recompute"): (DISTMM, ["strategy.recompute=selective"], "run", "test_runtime_recompute"),
    ("distmm", "zero_stage"): (DISTMM, ["strategy.zero_stage=1"], "run", DISTMM_RUNS),
    ("distmm", "vision.tp"): (DISTMM, ["strategy.vision.tp=2", "strategy.vision.dp=1"], "run", DISTMM_RUNS),
    ("distmm", "vision.pp"): (DISTMM, ["strategy.vision.pp=2", "strategy.vision.dp=1"], "run", DISTMM_RUNS),
    ("distmm", "vision.dp"): (DISTMM, ["strategy.vision.dp=1"], "run", DISTMM_RUNS),
    ("distmm", "text.tp"): (DISTMM, ["strategy.text.tp=2", "strategy.text.dp=1"], "run", DISTMM_RUNS),
    ("distmm", "text.pp"): (DISTMM, ["strategy.text.pp=2", "strategy.text.dp=1"], "run", DISTMM_RUNS),
    ("distmm", "text.dp"): (DISTMM, ["strategy.text.dp=1"], "run", DISTMM_RUNS),
    ("disttrain", "orchestration"): (
        DISTTRAIN,
        ["strategy.orchestration=ratio", "strategy.generator.pp=1"],
        "run",
        DISTTRAIN_RUNS,
    ),
    ("disttrain", "reorder"): (DISTTRAIN, ["strategy.reorder=both"], "run", DISTTRAIN_RUNS),
    ("disttrain", "plan_reorder"): (DISTTRAIN, ["strategy.plan_reorder=both", "strategy.reorder=none"], "run", DISTTRAIN_RUNS),
    ("disttrain", "tp_overlap_chunks"): (
        DISTTRAIN,
        ["strategy.llm.tp=2", "strategy.llm.sequence_parallel=false", "strategy.tp_overlap_chunks=4"],
        "run",
        DISTTRAIN_RUNS,
    ),
    ("disttrain", "ranked"): (DISTTRAIN, ["strategy.ranked=2"], "run", DISTTRAIN_RUNS),
    ("disttrain", "ranked_shapes"): (DISTTRAIN, ["strategy.ranked_shapes=2"], "run", DISTTRAIN_RUNS),
    ("disttrain", "recompute"): (DISTTRAIN, ["strategy.recompute=full"], "run", DISTTRAIN_RUNS),
    ("disttrain", "zero_stage"): (DISTTRAIN, ["strategy.zero_stage=0"], "run", DISTTRAIN_RUNS),
    ("disttrain", "encoder.tp"): (
        DISTTRAIN,
        ["strategy.encoder.tp=2", "strategy.encoder.sequence_parallel=false", "strategy.tp_overlap_chunks=1"],
        "run",
        DISTTRAIN_RUNS,
    ),
    ("disttrain", "encoder.pp"): (DISTTRAIN, ["strategy.encoder.pp=2"], "run", DISTTRAIN_RUNS),
    ("disttrain", "encoder.dp"): (DISTTRAIN, ["strategy.encoder.dp=1"], "run", DISTTRAIN_RUNS),
    ("disttrain", "llm.tp"): (
        DISTTRAIN,
        ["strategy.llm.tp=2", "strategy.llm.sequence_parallel=false", "strategy.tp_overlap_chunks=1"],
        "run",
        DISTTRAIN_RUNS,
    ),
    ("disttrain", "llm.pp"): (DISTTRAIN, ["strategy.llm.pp=2"], "run", DISTTRAIN_RUNS),
    ("disttrain", "llm.dp"): (DISTTRAIN, ["strategy.llm.dp=2"], "run", DISTTRAIN_RUNS),
    # A unit's own Megatron-LM options: what the strategy-wide recompute and zero_stage
    # set for every unit, run by the same runs. The LLM interleaves (MLLM-72B's four tiny
    # layers on two stages of two chunks); the tiny ViT's and the U-Net's single stage
    # (the runtime runs a U-Net whole) have nothing to interleave, as in every run.
    ("disttrain", "llm.vpp"): (
        WORKERS + ["model=mllm_72b", "model.scale=tiny", "train.global_batch=8", "strategy=disttrain", "train.data=uniform"],
        ["strategy.llm.pp=2", "strategy.llm.vpp=2"],
        "run",
        DISTTRAIN_RUNS,
    ),
    **{("disttrain", f"{u}.vpp"): (DISTTRAIN, [f"strategy.{u}.vpp=1"], "run", DISTTRAIN_RUNS) for u in ("encoder", "generator")},
    **{
        ("disttrain", f"{u}.recompute"): (DISTTRAIN, [f"strategy.{u}.recompute=selective"], "run", DISTTRAIN_RUNS)
        for u in ("encoder", "llm", "generator")
    },
    **{
        ("disttrain", f"{u}.zero_stage"): (DISTTRAIN, [f"strategy.{u}.zero_stage=0"], "run", DISTTRAIN_RUNS)
        for u in ("encoder", "llm", "generator")
    },
    # Sequence parallelism in the LLM's Llama blocks; the encoder's 17 tokens split over no TP degree.
    ("disttrain", "llm.sequence_parallel"): (
        DISTTRAIN,
        ["cluster.nodes=2", "strategy.llm.tp=2", "strategy.llm.sequence_parallel=true", "strategy.tp_overlap_chunks=1"],
        "run",
        DISTTRAIN_RUNS,
    ),
    ("disttrain", "encoder.sequence_parallel"): (
        DISTTRAIN,
        ["cluster.nodes=2", "strategy.encoder.tp=2", "strategy.encoder.sequence_parallel=true", "strategy.tp_overlap_chunks=1"],
        "refused",
        "",
    ),
    # The U-Net runs on tp=1 (below), where sequence parallelism has nothing to split.
    ("disttrain", "generator.sequence_parallel"): (
        DISTTRAIN,
        ["strategy.generator.sequence_parallel=true", "strategy.tp_overlap_chunks=1"],
        "run",
        DISTTRAIN_RUNS,
    ),
    # Scattered pipeline sends of one sequence over tp=2: each rank an equal chunk of the flattened activation.
    **{
        ("disttrain", f"{u}.scatter_gather"): (
            DISTTRAIN,
            [
                "cluster.nodes=2",
                "strategy.llm.dp=1",
                "strategy.generator.tp=1",
                "strategy.generator.pp=1",
                f"strategy.{u}.tp=2",
                f"strategy.{u}.pp=2",
                f"strategy.{u}.sequence_parallel=false",
                f"strategy.{u}.scatter_gather=true",
                "strategy.tp_overlap_chunks=1",
            ],
            "run",
            DISTTRAIN_RUNS,
        )
        for u in ("encoder", "llm")
    },
    # The U-Net runs on tp=1 (below), where scatter/gather has nothing to split: every run has it.
    ("disttrain", "generator.scatter_gather"): (DISTTRAIN, ["strategy.generator.scatter_gather=true"], "run", DISTTRAIN_RUNS),
    # The U-Net runs whole on each of its ranks.
    ("disttrain", "generator.tp"): (
        DISTTRAIN,
        ["strategy.generator.tp=2", "strategy.generator.sequence_parallel=false"],
        "refused",
        "",
    ),
    ("disttrain", "generator.pp"): (DISTTRAIN, ["strategy.generator.pp=2"], "refused", ""),
    # The encoder and generator replicated over their TP group, handing over through brokers.
    ("disttrain", "replicate"): (
        DISTTRAIN,
        ["cluster.devices_per_node=6", "strategy.replicate=[encoder,generator]", "strategy.encoder.tp=2", "strategy.generator.tp=2"]
        + ["strategy.llm.dp=2", "strategy.llm.tp=1", "strategy.llm.pp=1"],
        "run",
        "test_runtime_replicate",
    ),
    ("disttrain", "generator.dp"): (DISTTRAIN, ["strategy.generator.dp=1"], "run", DISTTRAIN_RUNS),
    ("ddp", "zero_stage"): (DDP, ["strategy.zero_stage=3"], "run", EQUALITY),
    ("ddp", "micro_batch_size"): (DDP, ["strategy.micro_batch_size=2"], "run", EQUALITY),
    ("ddp", "recompute"): (DDP, ["strategy.recompute=selective"], "run", EQUALITY),
    ("ddp", "overlap_comm"): (DDP, ["strategy.zero_stage=3", "strategy.overlap_comm=true"], "run", EQUALITY),
    ("ddp", "prefetch_bucket_size"): (
        DDP,
        ["strategy.zero_stage=3", "strategy.overlap_comm=true", "strategy.prefetch_bucket_size=1000"],
        "run",
        EQUALITY,
    ),
    ("ddp", "max_reuse_distance"): (
        DDP,
        ["strategy.zero_stage=3", "strategy.recompute=full", "strategy.max_reuse_distance=1000"],
        "run",
        EQUALITY,
    ),
    ("ddp", "param_persistence_threshold"): (
        DDP,
        ["strategy.zero_stage=3", "strategy.param_persistence_threshold=0"],
        "run",
        EQUALITY,
    ),
    # The installed DeepSpeed fetches a module's tensors together: a release's fetch before 0.5.5 is refused.
    ("ddp", "deepspeed_version"): (DDP, ["strategy.zero_stage=3", "strategy.deepspeed_version=0.3.15"], "refused", ""),
    ("ddp", "zero3_fetch"): (DDP, ["strategy.zero_stage=3", "strategy.zero3_fetch=per_tensor"], "refused", ""),
    # The workers reduce the fp32 gradients of fp32 weights (fp32 or AMP): a 16-bit reduction is refused.
    ("ddp", "grad_reduce_dtype"): (DDP, ["strategy.grad_reduce_dtype=bf16"], "refused", ""),
    ("megatron", "grad_reduce_dtype"): (MEGATRON, ["strategy.grad_reduce_dtype=bf16"], "refused", ""),
    ("deepspeed3d", "grad_reduce_dtype"): (DS3D, ["strategy.dp=2", "strategy.grad_reduce_dtype=bf16"], "refused", ""),
    ("megatron", "grad_accum_dtype"): (MEGATRON, ["strategy.grad_accum_dtype=fp32"], "refused", ""),
    ("deepspeed3d", "grad_accum_dtype"): (DS3D, ["strategy.grad_accum_dtype=fp32"], "refused", ""),
    # Par4D runs in the simulator only: the real backend refuses its grid, naming every option.
    ("par4d", "grid"): (PAR4D, ["strategy.grid=[2,1,2,1]"], "run", PAR4D_RUNS),
    ("par4d", "model"): (PAR4D, ["strategy.model=agnostic"], "run", PAR4D_RUNS),
    ("par4d", "top_k"): (PAR4D, ["strategy.top_k=1"], "run", PAR4D_RUNS),
    ("par4d", "overlap"): (PAR4D, ["strategy.overlap=[]"], "run", PAR4D_RUNS),
    ("par4d", "micro_batch_size"): (PAR4D, ["strategy.micro_batch_size=2"], "run", PAR4D_RUNS),
    ("par4d", "recompute"): (PAR4D, ["strategy.recompute=none"], "run", PAR4D_RUNS),
    ("par4d", "gathers"): (PAR4D, ["strategy.gathers=lightning", "strategy.overlap=[all_reduce,all_gather]"], "run", PAR4D_RUNS),
    ("deepspeed3d", "tp"): (DS3D, ["strategy.tp=2", "strategy.pp=1"], "run", EQUALITY),
    ("deepspeed3d", "pp"): (DS3D, ["strategy.pp=2"], "run", EQUALITY),
    ("deepspeed3d", "dp"): (DS3D, ["strategy.dp=2"], "run", EQUALITY),
    ("deepspeed3d", "micro_batch_size"): (DS3D, ["strategy.micro_batch_size=4"], "run", EQUALITY),
    ("deepspeed3d", "recompute"): (DS3D, ["strategy.recompute=full"], "run", EQUALITY),
    ("deepspeed3d", "uneven_pp"): (DS3D, ["strategy.uneven_pp=false"], "run", EQUALITY),
    ("deepspeed3d", "zero_stage"): (DS3D, ["strategy.dp=2", "strategy.zero_stage=1"], "run", EQUALITY),
    ("deepspeed3d", "scatter_gather"): (DS3D, ["strategy.tp=2", "strategy.scatter_gather=true"], "run", TP_PP_RUNS),
    # The attention kernel the model is priced with; the workers' attention (PyTorch's SDPA) computes the same.
    ("deepspeed3d", "attention"): (DS3D, ["strategy.attention=flash"], "run", EQUALITY),
    # How the parameter gradients' reductions are priced; the workers' autograd computes the same gradients.
    ("deepspeed3d", "param_grad_kernels"): (DS3D, ["strategy.param_grad_kernels=fused"], "run", EQUALITY),
    ("deepspeed3d", "cross_entropy"): (DS3D, ["strategy.cross_entropy=fused"], "run", EQUALITY),
    # How each micro-batch's weight gradients are added into the step's is priced; autograd accumulates them the same.
    ("deepspeed3d", "grad_accumulation"): (DS3D, ["strategy.grad_accumulation=fused"], "run", EQUALITY),
    # Which operations are priced as separate kernels; the workers compute the same softmax either way.
    ("deepspeed3d", "unfused"): (DS3D, ["strategy.unfused=[]"], "run", EQUALITY),
    ("optimus", "llm.tp"): (OPTIMUS, ["strategy.llm.pp=2", "strategy.llm.tp=2", "strategy.fine_grained=false"], "run", OPTIMUS_RUNS),
    ("optimus", "llm.pp"): (OPTIMUS, ["strategy.llm.pp=4"], "run", OPTIMUS_RUNS),
    ("optimus", "llm.dp"): (OPTIMUS, ["strategy.llm.pp=2", "strategy.llm.dp=2", "strategy.llm.zero_stage=0"], "run", OPTIMUS_RUNS),
    ("optimus", "llm.vpp"): (OPTIMUS, OPTIMUS_INTERLEAVED, "run", OPTIMUS_RUNS),
    ("optimus", "llm.micro_batch_size"): (OPTIMUS, ["strategy.llm.micro_batch_size=2"], "run", OPTIMUS_RUNS),
    ("optimus", "llm.schedule"): (OPTIMUS, OPTIMUS_INTERLEAVED, "run", OPTIMUS_RUNS),
    ("optimus", "llm.recompute"): (OPTIMUS, ["strategy.llm.recompute=full"], "run", OPTIMUS_RUNS),
    ("optimus", "llm.zero_stage"): (OPTIMUS, ["strategy.llm.zero_stage=1"], "run", OPTIMUS_RUNS),
    ("optimus", "llm.sequence_parallel"): (OPTIMUS, [*OPTIMUS_TP2, "strategy.llm.sequence_parallel=true"], "run", OPTIMUS_RUNS),
    ("optimus", "encoder.tp"): (OPTIMUS, [*OPTIMUS_TP2, "strategy.encoder.tp=2"], "run", OPTIMUS_RUNS),
    ("optimus", "encoder.pp"): (OPTIMUS, ["strategy.encoder.pp=1"], "run", OPTIMUS_RUNS),
    ("optimus", "encoder_zero_stage"): (OPTIMUS, ["strategy.encoder_zero_stage=0"], "run", OPTIMUS_RUNS),
    # Fine-grained scheduling puts encoder kernels under the LLM's asynchronous TP
    # all-reduces: they run while each pass's last TP collective travels (runtime.tp_bins).
    ("optimus", "fine_grained"): (OPTIMUS, [*OPTIMUS_TP2[:2], "strategy.fine_grained=true"], "run", OPTIMUS_RUNS),
    ("optimus", "defer_warmup"): (OPTIMUS, ["strategy.defer_warmup=false"], "run", OPTIMUS_RUNS),
    ("optimus", "max_partitions"): (OPTIMUS, ["strategy.max_partitions=2"], "run", OPTIMUS_RUNS),
    ("optimus", "refine"): (OPTIMUS, ["strategy.refine=1"], "run", OPTIMUS_RUNS),
}
PRECISIONS = {"fp32": "run", "bf16": "run", "fp16": "run"}


def _options(strategy: str) -> list[str]:
    """The option keys of a strategy's config, nested ones dotted (vision.tp)."""

    def flat(prefix: str, node: dict) -> list[str]:
        out = []
        for key, value in node.items():
            if isinstance(value, dict):
                out += flat(f"{prefix}{key}.", value)
            elif key != "name":
                out.append(f"{prefix}{key}")
        return out

    return flat("", yaml.safe_load((CONF / f"{strategy}.yaml").read_text()))


def _check(overrides: list[str]) -> None:
    """What the front door checks before it starts workers (refusals naming the options)."""
    setup = validate(composed(overrides))
    plan = plan_run(setup)
    assert setup.backend is not None
    with options_named(plan.strategy):
        check_runnable(PlannedRun(setup.model, setup.cluster, setup.train, plan), setup.backend.data)


def test_every_option_of_every_strategy_is_classified():
    missing = [(s, o) for s in STRATEGIES for o in _options(s) if (s, o) not in FIELDS]
    assert not missing, f"classify these options as run (with the test that runs them) or refused: {missing}"


@pytest.mark.parametrize("strategy, option", list(FIELDS))
def test_an_option_runs_for_real_or_is_refused_naming_it(strategy, option):
    base, setting, verdict, _ = FIELDS[(strategy, option)]
    if verdict == "run":
        _check(base + setting)
        return
    with pytest.raises(ConfigError, match=option.split(".")[-1]):
        _check(base + setting)


@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_a_precision_runs_for_real_or_is_refused_naming_it(precision):
    # A cluster whose device has a peak in every precision: the runtime, not the preset, decides.
    overrides = MEGATRON + [
        "cluster=hopper",
        "cluster.nodes=1",
        "cluster.devices_per_node=4",
        "cluster.amp=true",
        f"train.precision={precision}",
    ]
    if PRECISIONS[precision] == "run":
        _check(overrides)
        return
    with pytest.raises(ConfigError, match=f"precision={precision}"):
        _check(overrides)


def test_a_distributed_optimizer_gathering_some_layers_only_is_refused_naming_them():
    """Megatron-Core's overlaps under ZeRO-1 run as the executor's distributed optimizer,
    whole or layer by layer; a plan whose gathers leave a layer out would train on stale
    parameters, and is refused."""
    overlaps = ["strategy.overlap_grad_reduce=true", "strategy.overlap_param_gather=true"]
    overrides = MEGATRON + ["strategy.zero_stage=1", "strategy.dp=2", *overlaps]
    _check(overrides)
    setup = validate(composed(overrides))
    plan = plan_run(setup)
    first = plan.program.classes[0].instructions
    gathers = [i for i in first if isinstance(i, Collective) and i.op == "all_gather" and i.grads_of is not None]
    assert [g.grads_of for g in gathers][:2] == [("llm", (0, 1)), ("llm", (1, 2))]
    left_out = gathers[1].handle
    first[:] = [i for i in first if getattr(i, "handle", None) != left_out]
    with pytest.raises(ConfigError, match=r"all_gather\(s\) of unit llm's layers .*layer by layer.*\[0, 1, 2\]"):
        with options_named(plan.strategy):
            check_runnable(PlannedRun(setup.model, setup.cluster, setup.train, plan), "synthetic")


def test_fp16_with_zero_partitions_is_refused_naming_the_fix():
    # A device with an fp16 peak: the local preset has one only where this host's profile
    # measured it (a CPU without fp16 GEMMs has none).
    overrides = WORKERS + GPT + HOPPER + ["strategy=ddp", "strategy.zero_stage=1", "train.precision=fp16"]
    with pytest.raises(ConfigError, match=r"fp16 with ZeRO-1.*zero_stage=0.*\[ddp: strategy.zero_stage, train.precision\]"):
        _check(overrides)


def test_a_plan_priced_with_cuda_graph_launches_is_refused():
    overrides = WORKERS + GPT + HOPPER + ["strategy=ddp"]
    _check(overrides)
    with pytest.raises(ConfigError, match=r"^cluster.host_launch=graphed: the real backend issues every kernel from the host"):
        _check([*overrides, "cluster.host_launch=graphed"])


def test_a_plan_priced_with_16_bit_weights_is_refused():
    """The preset's software (Megatron-LM) keeps bf16 weights; the real backend trains under
    PyTorch AMP, which the simulator prices only with cluster.amp=true; fp32 casts nothing."""
    overrides = WORKERS + GPT + ["cluster=hopper", "cluster.nodes=1", "strategy=ddp"]
    with pytest.raises(ConfigError, match=r"^cluster.amp=false with precision=bf16: the real backend trains under PyTorch's"):
        _check(overrides)
    _check([*overrides, "cluster.amp=true"])
    _check([*overrides, "train.precision=fp32"])


def test_sequence_parallelism_in_an_mllm_s_encoder_is_refused_naming_the_fix():
    # An MLLM's units on tp=2 of their own (Megatron-LM's tp would split the U-Net generator too,
    # which the planner keeps whole for the real backend: tests/strategies/test_backend_limits.py).
    llm = ["cluster.nodes=2", "strategy.llm.tp=2", "strategy.llm.sequence_parallel=true", "strategy.tp_overlap_chunks=1"]
    _check(DISTTRAIN + llm)  # runs: test_runtime_disttrain, llm_tp2_sequence_parallel
    encoder = ["cluster.nodes=2", "strategy.encoder.tp=2", "strategy.encoder.sequence_parallel=true", "strategy.tp_overlap_chunks=1"]
    # A ViT's tokens (16 patches and a CLS) split over no TP degree, as Megatron-LM splits them.
    with pytest.raises(ConfigError, match=r"encoder's 17 tokens evenly over TP.*set strategy.encoder.sequence_parallel=false"):
        _check(DISTTRAIN + encoder)


def test_a_replicated_unit_runs_micro_batches_its_tp_group_does_not_divide():
    """Each rank runs its block of the rows, as the plan prices them (a rank past the rows
    none); runs: test_runtime_replicate, replicated_one_sequence_zero1 and
    disttrain_one_sequence_uniform (and interleaved: disttrain_one_sequence)."""
    _check(MLLM_REPLICATED + ["strategy.replicate=[encoder,generator]", "strategy.micro_batch_size=1"])
    replicated = ["strategy.replicate=[encoder,generator]", "strategy.encoder.tp=2", "strategy.generator.tp=2"]
    one = ["cluster.devices_per_node=6", "strategy.llm.tp=1", "strategy.llm.pp=2", "strategy.llm.dp=1"]
    for data in ("uniform", "interleaved"):
        _check(DISTTRAIN + replicated + one + [f"train.data={data}"])


@pytest.mark.parametrize("micro_batch", [1, 2])
def test_a_replicated_unit_on_interleaved_data_runs(micro_batch):
    """Each rank of the TP group runs the images dealt to it, as the plan prices them, and
    its part of a scattered transfer carries those images' tokens, also where a micro-batch
    has fewer rows than ranks (runs: test_runtime_replicate, interleaved and
    interleaved_one_sequence)."""
    replicated = ["strategy.replicate=[encoder,generator]", f"strategy.micro_batch_size={micro_batch}"]
    _check(MLLM_REPLICATED + replicated + ["train.data=interleaved"])


def test_a_scattered_transfer_of_fewer_rows_than_tp_sends_equal_chunks():
    """Runs: test_runtime_tp_pp, megatron_scatter_gather_micro_batch_1; an encoder's packed
    image tokens: test_runtime_replicate, interleaved_encoder_tp2_one_sequence."""
    odd = ["strategy.tp=2", "strategy.sequence_parallel=false", "strategy.scatter_gather=true", "strategy.micro_batch_size=1"]
    _check(MEGATRON + odd)
    # The encoder on a TP stage of its own (the generator replicated: a U-Net runs whole).
    stages = ["cluster.devices_per_node=8", "strategy.modality_stages=extra", "strategy.pp=4", "strategy.replicate=[generator]"]
    _check([o for o in MLLM_SKEWED if not o.startswith("strategy.modality_stages")] + stages + odd)


@pytest.mark.slow  # long, not a process: six U-Net plans (4.5 s of CPU)
def test_a_unet_runs_on_each_rank_and_on_a_grid_unless_z_cannot_shard_a_weight():
    unet = ["model=unet", "model.preset=unet_50m", "model.image_size=16", "train.global_batch=8"]
    for zero_stage in range(4):  # runs: tests/runtime/test_runtime_equality.py
        _check(WORKERS + unet + ["strategy=ddp", f"strategy.zero_stage={zero_stage}"])
    # On a grid it runs: tests/runtime/test_runtime_par4d_unet.py; AxoNN's Lightning order is LitGPT's, a GPT's.
    on_grid = WORKERS + unet + ["strategy=par4d", "strategy.grid=[2,2,1,1]", "strategy.micro_batch_size=2"]
    _check(on_grid)
    with pytest.raises(ConfigError, match="gathers=lightning is AxoNN's Lightning strategy for LitGPT's GPTs.*strategy.gathers"):
        _check(on_grid + ["strategy.gathers=lightning", "strategy.overlap=[all_gather]"])
    five = ["backend=torch", "cluster=local", "cluster.devices_per_node=5", "logger=none"]
    z5 = ["train.global_batch=10", "strategy=par4d", "strategy.grid=[1,1,5,1]", "strategy.micro_batch_size=5"]
    with pytest.raises(ConfigError, match=r"layer 0 \(conv_in\).*G_z=5: G_z divides neither the block's 27 rows nor its 32 columns"):
        _check(five + UNET + z5)


def test_optimus_llm_distributed_optimizer_over_replicas_runs_and_only_as_zero_1():
    """Its parameter all-gather and gradient reduce-scatter run under the encoders' work, as
    the executor's distributed optimizer (runs: test_runtime_optimus, distributed_optimizer); the same
    collectives on a unit of another ZeRO stage are refused naming it."""
    replicas = ["strategy.llm.pp=2", "strategy.llm.dp=2", "strategy.llm.zero_stage=1"]
    _check(OPTIMUS + replicas)
    setup = validate(composed(OPTIMUS + replicas))
    plan = plan_run(setup)
    unsharded = replace(plan, units=tuple(replace(u, zero_stage=0) if u.unit == "llm" else u for u in plan.units))
    fix = r"names unit llm's layers.*zero_stage=0\) \[optimus: strategy.llm.zero_stage\]"
    with pytest.raises(ConfigError, match=fix):
        with options_named(plan.strategy):
            check_runnable(PlannedRun(setup.model, setup.cluster, setup.train, unsharded), "synthetic")


def test_interleaved_data_refuses_an_encoder_passing_its_images_split_among_tp_peers():
    """Each TP peer of an encoder on pipeline stages passes a micro-batch's images whole
    (runs: test_runtime_interleaved, encoder_tp2_pp2); split among them by a scattered
    transfer, they are refused naming the option."""
    interleaved = DISTTRAIN + [
        "train.data=interleaved",
        "model.image_size_spread=0",
        "strategy.generator.pp=1",
        "strategy.encoder.pp=2",
    ]
    _check(interleaved)  # tp=1
    wider = [o for o in interleaved if not o.startswith("cluster.devices_per_node")] + ["cluster.devices_per_node=8"]
    _check(wider + ["strategy.encoder.tp=2", "strategy.encoder.sequence_parallel=false"])
    split = r"unit encoder on pp=2 with tp=2 and interleaved data, by a scattered transfer.*strategy.encoder.scatter_gather"
    with pytest.raises(ConfigError, match=split):
        _check(wider + ["strategy.encoder.tp=2", "strategy.encoder.sequence_parallel=false", "strategy.encoder.scatter_gather=true"])


def test_interleaved_data_of_spread_image_sides_runs():
    """The plan prices the sides the sampler draws, and the real backend runs each image at
    its side (runs: test_runtime_interleaved, drawn_sides)."""
    _check(DISTTRAIN + ["train.data=interleaved", "model.images_per_sequence=2"])


def test_a_written_plan_runs_on_the_images_its_loads_price_only(tmp_path):
    """The plan prices its first batch's images (the sampler's, at spread 0); re-run with
    plan=DIR on shards whose samples hold other images, it is refused."""
    spread_zero = ["model.images_per_sequence=2", "model.image_size_spread=0"]
    setup = validate(composed(DISTTRAIN + spread_zero + ["train.data=interleaved", "strategy.generator.pp=1"]))
    write_plan(tmp_path, PlannedRun(setup.model, setup.cluster, setup.train, plan_run(setup)))
    written = read_plan(tmp_path)
    priced = written.plan.sample_images
    assert priced is not None and len(priced) == 8 and len(set(priced)) > 1
    check_runnable(written, "synthetic")
    mllm_shard(tmp_path / "shard-0.tar", [2, 1, 3, 0, 1, 2, 0, 0])
    with pytest.raises(ConfigError) as refused:
        check_runnable(written, f"{tmp_path}/shard-*.tar")
    assert str(refused.value) == (
        f"backend.data={tmp_path}/shard-*.tar: the first step's samples hold [2, 1, 3, 0, 1, 2, 0, 0] images, the "
        f"plan's loads price {list(priced)} (it was planned on other data: plan the run on this data)"
    )


def test_deepspeed_is_given_the_reuse_distance_and_persistence_threshold_the_plan_priced():
    def zero_config(*options: str) -> dict:
        plan = plan_run(validate(composed(DDP + ["strategy.zero_stage=3", *options])))
        return deepspeed_config(EngineSettings.of(plan.units[0], DeepSpeedSpec(), ContrastiveSpec(), 1), 2)["zero_optimization"]

    priced = zero_config("strategy.max_reuse_distance=1000", "strategy.param_persistence_threshold=0")
    assert (priced["stage3_max_reuse_distance"], priced["stage3_param_persistence_threshold"]) == (1000, 0)
    default = zero_config()
    assert default["stage3_max_reuse_distance"] == 1_000_000_000 and default["stage3_param_persistence_threshold"] == 100_000


def test_the_real_backend_trains_without_dropout_and_refuses_it_in_one_line():
    """model.dropout: null reads as false under the real backend (its blocks run none, and the
    plan it writes says so); true is refused before any worker starts, a plan written by the
    simulator (which prices Megatron-LM's dropout) too."""
    setup = validate(composed(MEGATRON))
    assert setup.config["model"]["dropout"] is False
    assert not any(k.attention_dropout for layer in setup.model.unit("llm").layers for k in layer.kernels)
    _check(MEGATRON)
    with pytest.raises(ConfigError, match=r"^model.dropout=true \(unit llm\): the real backend's blocks train without dropout"):
        _check([*MEGATRON, "model.dropout=true"])
    simulated = validate(composed([*MEGATRON, "backend=sim"]))
    assert any(k.attention_dropout for layer in simulated.model.unit("llm").layers for k in layer.kernels)
    with pytest.raises(ConfigError, match="model.dropout=true"):
        check_runnable(PlannedRun(simulated.model, simulated.cluster, simulated.train, plan_run(simulated)), "synthetic")


def test_interleaved_data_for_two_encoders_is_refused_in_one_line():
    two = [*OPTIMUS, "model.encoders=[vit_3b,vit_5b]", "strategy.llm.dp=2", "strategy.llm.pp=2", "train.data=interleaved"]
    with pytest.raises(ConfigError, match=r"^train.data=interleaved: the real backend gives interleaved images to one encoder"):
        _check(two)
