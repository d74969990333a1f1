"""What every strategy planner receives, and the registry from names to planners."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping

from src.batch_layout import BatchLayout
from src.cluster import ClusterSpec
from src.config import TrainSpec
from src.errors import ConfigError
from src.models.spec import ModelSpec, UnitSpec
from src.program import Plan


@dataclass(frozen=True)
class Degrees:
    """A unit's parallel degrees, the one type every planner states them in: tensor,
    pipeline (with `vpp` virtual stages per device) and data parallelism, and the
    micro-batch each replica runs. Par4D's tensor grid is a Grid (par4d.layout) whose
    `tensor` product plays tp."""

    tp: int
    pp: int
    dp: int = 1
    vpp: int = 1
    micro_batch: int = 1

    @property
    def replica_devices(self) -> int:
        """The devices one model replica spans."""
        return self.tp * self.pp

    @property
    def devices(self) -> int:
        return self.tp * self.pp * self.dp

    def batch_layout(self, global_batch: int) -> BatchLayout:
        """The step's batch over the replicas and their micro-batches, one sample group per
        micro-batch index."""
        return BatchLayout(global_batch, self.dp, self.micro_batch)


@dataclass(frozen=True)
class BackendLimits:
    """What the backend a plan is made for runs, where a planner could emit more. The
    simulator prices every Program (the defaults: no limit); the real backend refuses the
    rest before any worker starts (src/runtime/checks.py), so a planner searches only plans
    its backend runs, and one fixed by hand beyond them is refused in one line.

    split_unets: a U-Net unit's layers may be split over TP ranks or pipeline stages
    (the real backend runs a U-Net whole on each rank: its skips do not cross stages, its
    convolutions have no TP)."""

    backend: str = "sim"  # the backend's name, for the lines that refuse a plan beyond it
    split_unets: bool = True

    def whole_unet(self, unit: UnitSpec, tp: int, stages: int) -> None:
        """Refuse a U-Net unit on `tp` ranks or cut over `stages` pipeline stages where the
        backend runs U-Nets whole."""
        if self.split_unets or unit.kind != "unet":
            return
        if tp > 1:
            split = f"on tp={tp} (its convolutions have no TP there)"
        elif stages > 1:
            split = f"cut over {stages} pipeline stages (its skip connections do not cross stages there)"
        else:
            return
        raise ConfigError(
            f"unit {unit.name} is a U-Net {split}: backend={self.backend} runs a U-Net whole on each rank "
            f"(it needs tp=1 and one pipeline stage, pp=1)"
        )


@dataclass(frozen=True)
class PlanRequest:
    """A planner's whole input. Planners are pure functions of it: no I/O.

    sample_images: images per sample of the first step's batch, in data order, every one at
    the encoder's nominal side, where the run reads an MLLM's tar shards (the door reads
    them: a plan prices the data its run reads); None where the data is drawn from the seed.
    limits: what the backend the plan is for runs (the door's; the simulator's by default).
    batch_index: which of the workload's global batches the plan is priced on (the first by
    default; a study of many batches prices the others)."""

    model: ModelSpec
    cluster: ClusterSpec
    train: TrainSpec
    options: Mapping[str, Any]
    sample_images: tuple[int, ...] | None = None
    limits: BackendLimits = BackendLimits()
    batch_index: int = 0


def on_batch(request: PlanRequest, batch: int | None) -> PlanRequest:
    """The request priced on global batch `batch` of the workload's data, or, for None, on
    uniform data (every sequence at the mean): a plan's choices priced there show what its
    shape costs without the skew it was chosen for."""
    if batch is None:
        return replace(request, train=replace(request.train, data="uniform"), sample_images=None)
    return replace(request, batch_index=batch)


Planner = Callable[[PlanRequest], Plan]

# A Program holds every micro-batch of the iteration. Megatron-LM's runs take tens to a
# thousand (Narayanan et al.'s 530B on 560 GPUs: 1120); at this many on 35 stages the front
# door plans, simulates and writes a run in about 25 s and 0.9 GB, and beyond it in minutes.
MAX_MICROBATCHES = 2048


def check_microbatch_count(per_replica: int, micro_batch: int, batch: str) -> None:
    """Refuse a fixed micro-batch that splits `batch` (a replica's `per_replica` samples,
    described for the message) into more micro-batches than a Program is built with."""
    count = per_replica // micro_batch
    if count > MAX_MICROBATCHES:
        raise ConfigError(
            f"{batch} in micro-batches of {micro_batch} is {count} micro-batches per iteration; "
            f"the planner builds at most {MAX_MICROBATCHES}"
        )


def microbatch_sizes(per_replica: int, multiple_of: int = 1) -> list[int]:
    """Micro-batch sizes dividing a replica's batch, largest first, that keep the count
    within MAX_MICROBATCHES (O(sqrt n): an absurd batch costs nothing here)."""
    return [m for m in reversed(divisors(per_replica)) if m % multiple_of == 0 and per_replica // m <= MAX_MICROBATCHES]


def divisors(n: int) -> list[int]:
    """Ascending; O(sqrt n), so an absurd batch costs nothing here."""
    small, large, d = [], [], 1
    while d * d <= n:
        if n % d == 0:
            small.append(d)
            if d * d != n:
                large.append(n // d)
        d += 1
    return small + large[::-1]
