"""The space the Megatron-LM planner searches: what Megatron-LM users set.

tp: powers of two dividing every unit's heads (a replicated unit's aside), inside a node
(spanning nodes only when nothing fits inside one); pp: divisors of the main unit's blocks
(any count with uneven_pp or balance); vpp: 1 (plain 1F1B) and every interleaving Megatron-LM runs;
micro-batch sizes dividing the replica's batch; sequence parallelism on and off when
tp > 1. A value the user fixes is the only choice of its axis. Recomputation and the
distributed optimizer are no axes: the search turns them on only as far as memory
requires (memory_ladder).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from src.batch_layout import BatchLayout
from src.errors import ConfigError
from src.models.spec import ModelSpec
from src.strategies.base import PlanRequest, check_microbatch_count, microbatch_sizes
from src.strategies.megatron.options import MegatronOptions
from src.strategies.base import Degrees
from src.strategies.builders.stages import main_unit

# Pipelines want many micro-batches; larger ones only help GEMM efficiency, which saturates.
MAX_PIPELINE_MICRO_BATCH = 8


@dataclass(frozen=True)
class Shape:
    """One point of the space before its memory settings are chosen."""

    degrees: Degrees
    sequence_parallel: bool
    schedule: str

    def label(self) -> str:
        d = self.degrees
        return f"tp={d.tp} pp={d.pp} dp={d.dp} vpp={d.vpp} micro-batch={d.micro_batch} sp={'on' if self.sequence_parallel else 'off'}"


@dataclass
class Space:
    """The shapes of one search, and the rule broken by each choice of degrees it left out."""

    shapes: list[Shape] = field(default_factory=list)
    invalid: list[str] = field(default_factory=list)


def powers_of_two(limit: int) -> list[int]:
    out, value = [], 1
    while value <= limit:
        out.append(value)
        value *= 2
    return out


def pipeline_blocks(model: ModelSpec) -> int:
    """What Megatron's --num-layers counts: the main unit's transformer blocks."""
    main = main_unit(model)
    return sum(1 for layer in main.layers if layer.tp_allreduces > 0) or main.num_layers


def extra_stages(model: ModelSpec, opts: MegatronOptions) -> int:
    """Pipeline stages of units other than the main one (modality_stages=extra)."""
    return len(model.units) - 1 if opts.modality_stages == "extra" and not opts.balance else 0


def enumerate_space(request: PlanRequest, opts: MegatronOptions, contrastive: bool, across_nodes: bool, searched: bool) -> Space:
    """Every shape of the space, in a fixed order; a choice of degrees that breaks a rule
    is an error when nothing is searched, else noted and left out."""
    space = Space()
    for tp in _tp_choices(request, opts, across_nodes):
        for pp in _pp_choices(request.model, opts, contrastive):
            try:
                dp = check_degrees(request, opts, tp, pp)
                micro_batches = _micro_batch_choices(request, opts, dp, contrastive)
            except ConfigError as err:
                if not searched:
                    raise
                space.invalid.append(str(err))
                continue
            for mb in micro_batches:
                microbatches = BatchLayout(request.train.global_batch, dp, mb).microbatches
                for vpp in _vpp_choices(request.model, opts, pp, microbatches, contrastive):
                    for sp in _sp_choices(opts, tp, contrastive):
                        schedule = "interleaved" if vpp > 1 else opts.schedule or "1f1b"
                        space.shapes.append(Shape(Degrees(tp, pp, dp, vpp, mb), sp, schedule))
    return space


def _tp_choices(request: PlanRequest, opts: MegatronOptions, across_nodes: bool) -> list[int]:
    """Powers of two dividing every unit's heads, inside a node; only when nothing fits
    there, degrees that span nodes (DistMM §7.1: CoCa(13B,13B) at 16)."""
    if opts.tp is not None:
        return [opts.tp]
    heads = [u.heads for u in request.model.units if u.kind == "transformer" and u.heads > 1 and u.name not in opts.replicate]
    node = request.cluster.devices_per_node
    return [t for t in powers_of_two(request.cluster.devices) if all(h % t == 0 for h in heads) and (t > node) == across_nodes]


def _pp_choices(model: ModelSpec, opts: MegatronOptions, contrastive: bool) -> list[int]:
    if opts.pp is not None:
        return [opts.pp]
    if contrastive:
        return [1]
    blocks = pipeline_blocks(model)
    chunks = opts.vpp or 1
    extra = extra_stages(model, opts)
    return [
        p + extra
        for p in range(1, blocks + 1)
        if (opts.uneven_pp or opts.balance or blocks % (p * chunks) == 0) and p * chunks <= blocks
    ]


def _vpp_choices(model: ModelSpec, opts: MegatronOptions, pp: int, microbatches: int, contrastive: bool) -> list[int]:
    """1 (no interleaving), and the interleavings Megatron-LM runs: pp > 1, micro-batches
    a multiple of pp, pp x vpp dividing the main unit's blocks (also under the balanced
    cut, which could take any count: other counts can be set by hand). MLLMs with extra
    modality stages do not interleave: their extra stages have one chunk; nor does a 1F1B
    with extra warm-up forwards (schedules.pipeline)."""
    if opts.vpp is not None:
        return [opts.vpp]
    if contrastive or opts.schedule in ("gpipe", "1f1b") or opts.extra_warmup or pp == 1 or microbatches % pp:
        return [1]
    if extra_stages(model, opts):
        return [1]
    blocks = pipeline_blocks(model)
    return [1] + [v for v in range(2, blocks // pp + 1) if blocks % (pp * v) == 0]


def _sp_choices(opts: MegatronOptions, tp: int, contrastive: bool) -> list[bool]:
    """Sequence parallelism changes nothing without TP. The contrastive baseline keeps
    its published setting (no sequence parallelism) unless the user turns it on."""
    if opts.sequence_parallel is not None:
        return [opts.sequence_parallel]
    if tp == 1 or contrastive:
        return [False]
    return [False, True]


def check_degrees(request: PlanRequest, opts: MegatronOptions, tp: int, pp: int) -> int:
    """Validate one (tp, pp) choice against the model and cluster; return dp."""
    devices = request.cluster.devices
    # Transformer units split attention heads across TP ranks. A U-Net's TP splits its
    # convolutions' output channels; its few attention heads (5 in SD-2.1's first level)
    # are priced as an even split of the attention work, as a spatially split attention
    # would run.
    for unit in request.model.units:
        if unit.name in opts.replicate:
            continue  # whole on every rank of its TP group
        if unit.kind == "transformer" and unit.heads > 1 and unit.heads % tp:
            raise ConfigError(f"tp={tp} does not divide the {unit.heads} attention heads of unit {unit.name}")
        request.limits.whole_unet(unit, tp, 1)
    if devices % (tp * pp):
        why = ""
        if extra := extra_stages(request.model, opts):
            why = f" (pp includes {extra} stage{'s' if extra > 1 else ''} of the modality units under "
            why += "strategy.modality_stages=extra; merged puts them on the LLM's stages)"
        raise ConfigError(f"tp x pp = {tp} x {pp} = {tp * pp} does not divide the cluster's {devices} devices{why}")
    dp = devices // (tp * pp)
    if opts.dp is not None and opts.dp != dp:
        raise ConfigError(
            f"tp x pp x dp = {tp} x {pp} x {opts.dp} = {tp * pp * opts.dp} but cluster {request.cluster.name} has {devices} devices"
        )
    return dp


def _micro_batch_choices(request: PlanRequest, opts: MegatronOptions, dp: int, contrastive: bool) -> list[int]:
    batch = BatchLayout(request.train.global_batch, dp)
    if opts.micro_batch_size is not None:
        fixed = replace(batch, micro_batch=opts.micro_batch_size)
        check_microbatch_count(fixed.per_replica, fixed.micro_batch, f"global batch {fixed.global_batch} over dp={dp}")
        choices = [fixed.micro_batch]
    else:
        # Largest first: for contrastive models the whole replica batch is one micro-batch
        # unless memory forces accumulation. A batch too large for micro-batches of at most
        # MAX_PIPELINE_MICRO_BATCH gets the smallest size that keeps the count in bounds.
        sizes = microbatch_sizes(batch.per_replica)
        choices = [m for m in sizes if contrastive or m <= MAX_PIPELINE_MICRO_BATCH] or sizes[-1:]
    if contrastive:
        rbs = request.train.contrastive_batch
        fitting = [m for m in choices if m * dp >= rbs]
        if not fitting:
            raise ConfigError(
                f"micro-batch {choices[0]} x dp {dp} = {choices[0] * dp} samples per step is below the "
                f"contrastive batch {rbs}: Megatron-LM cannot accumulate gradients without "
                f"shrinking the contrastive loss's batch"
            )
        choices = fitting
    return choices
