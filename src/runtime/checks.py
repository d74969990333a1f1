"""What the real backend runs, checked before any worker starts: a plan field it cannot
honour is refused in one line naming that field (PlanRefused; the door adds the strategy
options that set it), never run under a label it did not earn.

Every rank class's first rank stands for its class for instruction kinds; routes are
checked message by message for every rank: over one route, two ranks must send and
receive the messages between them in the same order (NCCL matches point-to-point messages
by order only; each route has its own group).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from src.errors import ConfigError, PlanRefused
from src.models.spec import ModelSpec
from src.program import Collective, Compute, Plan, Recv, Send, Wait
from src.runtime.batch_rows import placed_by_rows
from src.runtime.dist_optimizer import SHARDED, named_ranges, sharded_units
from src.runtime.executor import input_key
from src.data.interleaved_mllm import InterleavedMLLM
from src.runtime.inputs import dataset_for, tell_repeats
from src.runtime.layouts import layout_runtime
from src.runtime.row_shares import data_group, sharing_units
from src.runtime.tp_bins import find_bins

if TYPE_CHECKING:
    from src.plan_io import PlannedRun

PHASES = ("fwd", "bwd", "bwd_input", "bwd_weight", "optimizer", "interaction")
PAYLOAD_COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "broadcast")


def check_runnable(run: PlannedRun, data: str, data_errors: str = "fail") -> None:
    """Refuse what the real backend cannot run of `run`'s plan, training on `data`
    (backend.data: synthetic or a glob of tar shards; bad members per `data_errors`)."""
    plan, model = run.plan, run.model
    if run.cluster.host_launch != "eager":
        raise ConfigError(
            f"cluster.host_launch={run.cluster.host_launch}: the real backend issues every kernel from the host, "
            f"so a plan priced with CUDA-graph launches is not what it runs; set cluster.host_launch=eager"
        )
    if plan.precision != "fp32" and not run.cluster.amp:
        raise ConfigError(
            f"cluster.amp=false with precision={plan.precision}: the real backend trains under PyTorch's automatic "
            f"mixed precision (fp32 weights cast at each use, fp32 gradients), so a plan priced with {plan.precision} "
            f"weights is not what it runs; set cluster.amp=true"
        )
    if plan.precision == "fp16":
        # The executor's own distributed optimizer unscales what it reduced; DeepSpeed's ZeRO would not.
        own = {unit for rp in plan.program.classes if rp.ranks for unit in sharded_units(plan, rp.ranks[0])}
        zero = [u for u in plan.units if u.zero_stage > 0 and u.dp > 1 and u.unit not in own]
        if zero:
            raise PlanRefused(
                f"precision=fp16 with ZeRO-{zero[0].zero_stage} (unit {zero[0].unit}: zero_stage={zero[0].zero_stage}): "
                f"the real backend scales fp16 losses itself and unscales plain data parallelism's gradients, not "
                f"DeepSpeed's ZeRO partitions; it needs zero_stage=0, precision=bf16, or the executor's distributed "
                f"optimizer (Megatron-LM's overlap_grad_reduce or overlap_param_gather at zero_stage=1)",
                ("zero_stage", "precision"),
                (zero[0].unit,),
            )
    for unit in plan.units:
        spec = model.unit(unit.unit)
        if any(kernel.attention_dropout for layer in spec.layers for kernel in layer.kernels):
            raise ConfigError(
                f"model.dropout=true (unit {unit.unit}): the real backend's blocks train without dropout, so that every "
                f"layout's losses agree with one process; set model.dropout=false or leave it null"
            )
        layout = layout_runtime(unit)
        if layout is not None:
            layout.check(unit, spec)
        if unit.sequence_parallel and any(layer.name.endswith("_projector") for layer in spec.layers):
            raise PlanRefused(
                f"unit {unit.unit}: the real backend runs sequence parallelism in GPT, ViT, CLIP and Llama units, "
                f"not yet in an MLLM's projectors (it needs sequence_parallel=false)",
                ("sequence_parallel",),
                (unit.unit,),
            )
        tp, seq = unit.mesh.degree("tp"), spec.seq_len
        if unit.sequence_parallel and seq % tp:
            raise PlanRefused(
                f"unit {unit.unit}: sequence parallelism splits its {seq} tokens over tp={tp}, which does "
                f"not divide them (it needs sequence_parallel=false, or another tp)",
                ("sequence_parallel", "tp"),
                (unit.unit,),
            )
        if unit.zero3_fetch == "per_tensor" and unit.zero_stage == 3 and unit.dp > 1:
            raise PlanRefused(
                f"unit {unit.unit}: zero3_fetch=per_tensor is DeepSpeed's fetch before 0.5.5 (an all-gather per "
                f"tensor); the real backend runs the installed DeepSpeed, which fetches a module's tensors together "
                f"(it needs zero3_fetch=coalesced or prefetched, or a deepspeed_version from 0.5.5)",
                ("zero3_fetch",),
                (unit.unit,),
            )
        if unit.grad_reduce_dtype not in (None, "fp32") and unit.dp > 1:
            raise PlanRefused(
                f"unit {unit.unit}: grad_reduce_dtype={unit.grad_reduce_dtype}; the real backend reduces the fp32 "
                f"gradients of its fp32 weights (fp32 or PyTorch AMP) in fp32 (it needs grad_reduce_dtype=fp32 or null)",
                ("grad_reduce_dtype",),
                (unit.unit,),
            )
        if unit.grad_accum_dtype is not None:
            raise PlanRefused(
                f"unit {unit.unit}: grad_accum_dtype={unit.grad_accum_dtype}; the real backend accumulates the fp32 "
                f"gradients of its fp32 weights in their own .grad, with no second copy (it needs grad_accum_dtype=null)",
                ("grad_accum_dtype",),
                (unit.unit,),
            )
        if spec.kind == "unet" and (unit.tp > 1 or unit.pp > 1):
            raise PlanRefused(
                f"unit {unit.unit} is a U-Net on tp={unit.tp} x pp={unit.pp}: the real backend runs a U-Net whole "
                f"on each rank (its skip connections do not cross pipeline stages, its convolutions have no TP); "
                f"it needs tp=1 and pp=1",
                ("tp", "pp"),
                (unit.unit,),
            )
    dataset = dataset_for(model, run.train.seed, data, data_errors, plan.sample_content)
    tell_repeats(dataset, run.train.global_batch, run.train.steps)
    # Sequences of their samples' images: every one the run reads must fit the model's
    # sequence, and each micro-batch runs the load its images make.
    interleaved = isinstance(dataset, InterleavedMLLM)
    if interleaved:
        _check_priced_images(plan, dataset, data, run.train.global_batch)
        dataset.check(range(run.train.global_batch * run.train.steps))
        _check_image_rows(plan, model)
    shared = frozenset(sharing_units(plan))
    # DeepSpeed overlaps ZeRO-3's communication where the plan says so (engines.deepspeed_config).
    overlapped = any(u.zero_stage == 3 and u.overlap_comm for u in plan.units)
    for rank_program in plan.program.classes:
        handles: set[str] = set()
        partitioned = tuple(u for u in rank_program.units if plan.unit(u).zero_stage in (1, 2))
        for instruction in rank_program.instructions:
            _check_instruction(
                instruction, handles, rank_program.label, model.interaction, overlapped, partitioned, interleaved, shared
            )
        _check_backward_ranges(rank_program.label, rank_program.instructions)
        _check_kernel_ranges(rank_program.label, rank_program.instructions, model)
        _check_work_under_tp(rank_program.label, rank_program.instructions)
        if rank_program.ranks:
            _check_distributed_optimizer(plan, model, rank_program.label, rank_program.ranks[0], rank_program.instructions)
            _check_gathered_batches(plan, rank_program.ranks[0], rank_program.instructions)
    check_message_order(plan)


def _check_priced_images(plan: Plan, dataset: InterleavedMLLM, data: str, batch: int) -> None:
    """A plan whose loads follow its first batch's images runs on data whose first batch
    holds those images (a written plan re-run on other data would run other loads)."""
    held = tuple(dataset.image_count(i) for i in range(batch))
    if plan.sample_images is not None and plan.sample_images != held:
        raise ConfigError(
            f"backend.data={data}: the first step's samples hold {list(held)} images, the plan's loads price "
            f"{list(plan.sample_images)} (it was planned on other data: plan the run on this data)"
        )


def _check_image_rows(plan: Plan, model: ModelSpec) -> None:
    """An interleaved micro-batch's images are rows of their own inside a unit that reads
    them: its stages pass their real images' token states, as many as the micro-batch holds.
    With tp > 1 each TP peer holds them whole and passes them whole to its peer on the next
    stage; sequence parallelism or a scattered transfer (scatter_gather) would pass them split
    among the TP peers, which the real backend does not. (A unit replicated over its TP group
    runs on one stage: runtime.row_shares deals it its images.)"""
    scattered = {
        payload.unit
        for rank_program in plan.program.classes
        for instruction in rank_program.instructions
        if isinstance(instruction, Collective) and instruction.kind == "pp" and instruction.op == "all_gather"
        for payload in instruction.inputs
    }
    for unit in plan.units:
        tp = unit.mesh.degree("tp")
        if not (model.unit(unit.unit).arch.reads_images and unit.pp > 1 and tp > 1):
            continue
        split = "sequence parallelism" if unit.sequence_parallel else "a scattered transfer" if unit.unit in scattered else None
        if split is not None:
            raise PlanRefused(
                f"unit {unit.unit} on pp={unit.pp} with tp={tp} and interleaved data, by {split}: the real backend passes a "
                f"micro-batch's images between pipeline stages of the unit that encodes them whole from each TP peer "
                f"(it needs sequence_parallel=false and scatter_gather=false, or tp=1)",
                ("sequence_parallel", "scatter", "tp"),
                (unit.unit,),
            )


def _check_backward_ranges(label: str, instructions: list) -> None:
    """A backward runs the layers of one forward of its micro-batch, all or a part of them
    (the executor cuts that forward where the backward starts), or of consecutive forwards
    (which it runs backward one by one, last first)."""
    forwards: dict[tuple, list[tuple[int, int]]] = {}
    for instruction in instructions:
        if isinstance(instruction, Compute) and instruction.work.phase in ("fwd", "bwd", "bwd_input"):
            work = instruction.work
            key = (work.unit, instruction.microbatch, instruction.chunk)
            if work.phase == "fwd":
                forwards.setdefault(key, []).append(work.layers)
            elif not _tiled(work.layers, forwards.get(key, [])):
                raise ConfigError(
                    f"{label}: backward of {work.unit} layers {work.layers} (micro-batch {instruction.microbatch}) "
                    f"spans no forward or run of consecutive forwards of its layers ({forwards.get(key, [])}): the "
                    f"real backend cannot run it"
                )


def _tiled(layers: tuple[int, int], forwards: list[tuple[int, int]]) -> bool:
    start, end = layers
    if any(a <= start and end <= b for a, b in forwards):
        return True
    reached = start
    while reached < end:
        nexts = [b for a, b in forwards if a == reached and b <= end]
        if not nexts:
            return False
        reached = max(nexts)
    return True


def _check_kernel_ranges(label: str, instructions: list, model: ModelSpec) -> None:
    """A layer pass the plan splits into kernel ranges runs whole at its last range
    (Executor._kernel_pass): its ranges must cover the layer's kernels once each, or the
    layer would never run, or run twice."""
    open_passes: dict[tuple, list[tuple[int, int]]] = {}
    for instruction in instructions:
        if not isinstance(instruction, Compute) or instruction.work.phase == "bwd_weight":
            continue
        work = instruction.work
        if work.kernels is None:
            continue
        count = len(model.unit(work.unit).layers[work.layers[0]].kernels)
        phase = "bwd" if work.phase == "bwd_input" else work.phase
        key = (work.unit, phase, work.layers, instruction.microbatch, instruction.chunk)
        ranges = open_passes.setdefault(key, [])
        ranges.append(work.kernels)
        covered = sorted(k for a, b in ranges for k in range(a, b))
        if covered == list(range(count)):
            del open_passes[key]
        elif len(covered) != len(set(covered)) or work.layers[1] != work.layers[0] + 1:
            raise ConfigError(
                f"{label}: {work.unit} layers {work.layers} {phase} (micro-batch {instruction.microbatch}) in kernel "
                f"ranges {ranges}: the real backend runs one layer's {count} kernels once each, whole at its last range"
            )
    for (unit, phase, layers, microbatch, _), ranges in open_passes.items():
        raise ConfigError(
            f"{label}: {unit} layers {layers} {phase} (micro-batch {microbatch}) in kernel ranges {ranges} that do not "
            f"cover its {len(model.unit(unit).layers[layers[0]].kernels)} kernels: the real backend would never run it"
        )


def _check_work_under_tp(label: str, instructions: list) -> None:
    """An asynchronous TP collective without payloads is a layer's own, which its modules
    run inside the layer: the real backend overlaps one with what follows inside a pass
    that overlaps its own (StepCCL's row chunks, a tensor grid's kernel ranges), and runs
    the work a plan places in a whole pass's TP bins while that pass's last TP collective
    travels (runtime.tp_bins). A whole pass placed under any other (the LLM under an
    encoder's all-reduces) would run after it, not beside it."""
    binned = {i for bins in find_bins(instructions).values() for i in bins.work}
    issued: dict[str, str] = {}
    owner: dict[str, str] = {}  # the unit of the pass that issued each
    last_unit = ""
    for index, instruction in enumerate(instructions):
        if isinstance(instruction, Compute):
            last_unit = instruction.work.unit
        if isinstance(instruction, Collective) and instruction.kind == "tp" and not instruction.blocking and instruction.handle:
            if not (instruction.inputs or instruction.outputs):
                issued[instruction.handle] = f"{instruction.op} on {instruction.group}"
                owner[instruction.handle] = last_unit
        elif isinstance(instruction, Wait):
            issued.pop(instruction.handle, None)
        elif (
            isinstance(instruction, Compute)
            and issued
            and index not in binned
            and instruction.work.fraction == 1.0
            and not instruction.work.sharding.grid
        ):
            handle, what = next(iter(issued.items()))
            raise PlanRefused(
                f"{label}: {instruction.work.unit} layers {instruction.work.layers} {instruction.work.phase} run under "
                f"the asynchronous TP {what} ({handle}), which the real backend runs inside its layer, before them, not "
                f"overlapped (it needs tp=1 on both sides, or no whole pass placed among a layer's kernel ranges)",
                ("tp", "kernels"),
                tuple(dict.fromkeys([owner[handle], instruction.work.unit])),
            )


def _check_distributed_optimizer(plan: Plan, model: ModelSpec, label: str, rank: int, instructions: list) -> None:
    """A DP reduce-scatter or all-gather that names its unit's layers is the executor's
    distributed optimizer's (runtime.dist_optimizer): Megatron-LM's, ZeRO-1 over a unit's
    data-parallel replicas of a unit without a layout of its own (runtime.layouts). Once a
    step it reduce-scatters the gradients of every layer of the unit a rank holds and
    all-gathers their parameters, each op either whole (one collective naming all of them)
    or layer by layer (one per layer with trained parameters), over the unit's
    data-parallel group."""
    for name, ops in named_ranges(instructions).items():
        unit = plan.unit(name)
        layout = layout_runtime(unit)  # which steps the unit with its own optimizer
        if unit.zero_stage != 1 or layout is not None:
            raise PlanRefused(
                f"{label}: a DP reduce-scatter or all-gather names unit {name}'s layers, which the real backend runs as "
                f"Megatron-LM's distributed optimizer: ZeRO-1 of a unit on its mesh's tp, dp and pp axes (the unit has zero_stage="
                f"{unit.zero_stage}{f' on a {layout.name}' if layout is not None else ''})",
                ("zero_stage",),
                (name,),
            )
        held = unit.layers_on(rank)
        spec = model.unit(name)
        trained = sorted(layer for layer in held if spec.trainable_params(layer, layer + 1) > 0)
        for op, ranges in ops.items():
            whole = len(ranges) == 1 and all(ranges[0][0] <= layer < ranges[0][1] for layer in held)
            if not whole and sorted(start for start, end in ranges if end == start + 1) != trained:
                raise PlanRefused(
                    f"{label}: the {op}(s) of unit {name}'s layers {ranges}: the real backend's distributed optimizer "
                    f"reduce-scatters a unit's gradients and all-gathers its parameters once a step, either whole or "
                    f"layer by layer over the layers with trained parameters this rank holds ({trained})",
                    ("zero_stage",),
                    (name,),
                )
    for instruction in instructions:
        if isinstance(instruction, Collective) and instruction.grads_of is not None and instruction.op in SHARDED:
            name = instruction.grads_of[0]
            ranks, replicas = tuple(plan.program.group_for(instruction.group, rank)), data_group(plan.unit(name).mesh, rank)
            if ranks != tuple(replicas):
                raise PlanRefused(
                    f"{label}: unit {name}'s distributed optimizer {instruction.op}s over group {instruction.group} (ranks "
                    f"{list(ranks)}), not over its data-parallel replicas {list(replicas)}, as the real backend's does",
                    ("zero_stage",),
                    (name,),
                )


def _check_gathered_batches(plan: Plan, rank: int, instructions: list) -> None:
    """A batch all-gathered for an interaction must hold its contrastive batch: ranks that
    hold the same rows (TP peers of a tower) would bring them twice."""
    rows: dict = {}
    for instruction in instructions:
        if isinstance(instruction, Collective) and instruction.op == "all_gather" and instruction.outputs:
            size = len(plan.program.group_for(instruction.group, rank))
            for source, target in zip(instruction.inputs, instruction.outputs):
                rows[target] = (size, size * plan.unit(source.unit).micro_batch, instruction.group)
        if isinstance(instruction, Compute) and instruction.work.phase == "interaction":
            for payload in instruction.inputs:
                if payload in rows and rows[payload][1] != instruction.work.contrastive_batch:
                    size, held, group = rows[payload]
                    raise ConfigError(
                        f"{payload} gathered over the {size} ranks of group {group} holds {held} rows, "
                        f"not the contrastive batch of {instruction.work.contrastive_batch}: its ranks "
                        f"hold the same rows more than once (a tower with TP on every device)"
                    )


def _check_instruction(
    instruction,
    handles: set[str],
    label: str,
    interaction: str | None,
    overlapped: bool,
    partitioned: tuple[str, ...],
    interleaved: bool,
    shared: frozenset[str],
) -> None:
    """`partitioned`: the class's units whose ZeRO-1/2 partitions a DP reduce-scatter serves;
    `interleaved`: sequences hold their samples' images (a micro-batch's load is theirs);
    `shared`: the units replicated over their TP group, whose ranks each run a share of a micro-batch."""
    if isinstance(instruction, Compute):
        work = instruction.work
        if work.phase not in PHASES:
            raise ConfigError(f"{label}: the real backend does not run {work.phase} Work ({work.unit})")
        if work.load != 1.0 and not interleaved:
            raise PlanRefused(
                f"{label}: a micro-batch of load {work.load:.3g} ({work.unit}): the real backend runs this model's samples "
                f"with the same content (one image per sequence, at the nominal sizes); it needs load=1 (uniform data)",
                ("load",),
                (work.unit,),
            )
        # A fraction is a chunk of a pass (StepCCL's, under TP) or, in a unit replicated over
        # its TP group, the busiest rank's share of a micro-batch, which the rank runs once.
        share = work.fraction * work.chunks  # of the micro-batch, by the pass's chunks together
        if (abs(share - 1) > 1e-9 and work.unit not in shared) or (work.chunks > 1 and work.sharding.degree("tp") == 1):
            raise PlanRefused(
                f"{label}: {work.unit} layers {work.layers} run in chunks of fraction={work.fraction:.3g}: the real "
                f"backend chunks a pass only to overlap its TP collectives, in a whole number of chunks (it needs "
                f"fraction=1 here)",
                ("fraction",),
                (work.unit,),
            )
        if work.phase == "fwd":
            for payload in instruction.inputs:
                input_key(work.unit, payload)
    elif isinstance(instruction, Collective):
        if instruction.inputs or instruction.outputs:
            if instruction.op not in PAYLOAD_COLLECTIVES and not placed_by_rows(instruction, interaction):
                raise ConfigError(f"{label}: the real backend carries no payloads in a {instruction.op}")
        elif instruction.kind not in ("tp", "dp"):
            raise ConfigError(
                f"{label}: the real backend cannot run a standalone {instruction.op} of kind "
                f"{instruction.kind} on group {instruction.group}: no tensor of the model travels in it"
            )
        elif not instruction.blocking:
            own = instruction.grads_of is not None  # the executor's: a gradient bucket, or the distributed optimizer's
            chunked = instruction.kind == "tp"  # a chunked pass's TP all-reduces, its layers' own (Executor._chunk_done)
            if not chunked and (instruction.kind != "dp" or not (overlapped or own)):
                raise PlanRefused(
                    f"{label}: asynchronous {instruction.kind} {instruction.op} on {instruction.group} (blocking=false): "
                    f"the real backend overlaps plain DP's gradient all-reduce, ZeRO-3's reduction and prefetch, and the "
                    f"distributed optimizer's collectives that name their layers, not DeepSpeed's ZeRO-1/2 overlapped "
                    f"reduce-scatter (it needs blocking=true, or zero_stage=0, or 3)",
                    ("blocking", "zero_stage"),
                    partitioned,
                )
            if instruction.handle is not None:
                handles.add(instruction.handle)
    elif isinstance(instruction, Recv) and not instruction.blocking and instruction.handle is not None:
        handles.add(instruction.handle)
    elif isinstance(instruction, Wait) and instruction.handle not in handles:
        raise ConfigError(f"{label}: wait on {instruction.handle!r}, which no asynchronous receive or collective returned")


def check_message_order(plan: Plan) -> None:
    """For every route and pair of ranks, the messages one sends the other over it come in
    the order the other receives them."""
    program = plan.program
    sent: dict[tuple[str, int, int], list] = {}
    received: dict[tuple[str, int, int], list] = {}
    for rank in range(program.world_size):
        for instruction in program.instructions_for(rank) if _covered(program, rank) else []:
            if isinstance(instruction, Send):
                for m in program.route(instruction.route).sends(rank, instruction.payload):
                    if m.dst != rank:
                        sent.setdefault((instruction.route, rank, m.dst), []).append((m.sent, m.received))
            elif isinstance(instruction, Recv):
                for m in program.route(instruction.route).receives(rank, instruction.payload):
                    if m.src != rank:
                        received.setdefault((instruction.route, m.src, rank), []).append((m.sent, m.received))
    for pair in set(sent) | set(received):
        a, b = sent.get(pair, []), received.get(pair, [])
        if a != b:
            first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            what = a[first] if first < len(a) else b[first]
            raise ConfigError(
                f"rank {pair[1]} sends rank {pair[2]} {len(a)} messages over route {pair[0]} and it "
                f"receives {len(b)}, in another order from message {first} ({what[0]})"
            )


def _covered(program, rank: int) -> bool:
    return any(rank in c.ranks for c in program.classes)
