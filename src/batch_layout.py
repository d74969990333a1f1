"""How a unit cuts each step's global batch over its data-parallel replicas and their
micro-batches: planners size their Programs by it, the bridges between units of different
sizes route samples by it, and the real backend slices each rank's inputs by it."""

from __future__ import annotations

from dataclasses import dataclass

from src.errors import ConfigError


@dataclass(frozen=True)
class BatchLayout:
    """The step's `global_batch` samples cut into `groups` contiguous sample groups, each
    split evenly over the `dp` replicas, each replica's share of a group cut into
    micro-batches of `micro_batch` samples in order. Groups are DistMM's batch-syncs (the
    samples one contrastive loss scores together); None: one group per micro-batch index.
    Every unit thus holds a group's samples at the same step positions whatever its
    replicas and micro-batches: units of different dp pair up row by row, and any plan
    trains on the very samples of a 1-process run. A planner that has not chosen the
    micro-batch yet reads the replicas' batch off a layout of micro-batches of 1."""

    global_batch: int
    dp: int = 1
    micro_batch: int = 1
    groups: int | None = None

    def __post_init__(self) -> None:
        if self.global_batch % self.dp:
            raise ConfigError(f"global batch {self.global_batch} is not divisible by dp={self.dp}")
        if self.per_replica % self.micro_batch:
            raise ConfigError(
                f"global batch {self.global_batch} is not divisible by dp x micro-batch = "
                f"{self.dp} x {self.micro_batch} = {self.dp * self.micro_batch}"
            )
        if self.microbatches % self.sample_groups:
            raise ConfigError(
                f"{self.microbatches} micro-batches per replica (global batch {self.global_batch} / dp {self.dp} / "
                f"micro-batch {self.micro_batch}) do not split into {self.sample_groups} sample groups"
            )

    @classmethod
    def of_replica_batch(cls, global_batch: int, per_replica: int, micro_batch: int, groups: int) -> BatchLayout:
        """The layout whose replicas take `per_replica` samples each: a UnitPlan states its
        batch per replica, not how many replicas share the step's batch."""
        return cls(global_batch, global_batch // per_replica, micro_batch, groups)

    @staticmethod
    def busiest_share(global_batch: int, replicas: int) -> int:
        """The samples the busiest of `replicas` replicas sharing the batch takes (the others
        one fewer where they do not divide it): fewer replicas take no fewer."""
        return -(-global_batch // replicas)

    @property
    def per_replica(self) -> int:
        """Samples each replica takes per step."""
        return self.global_batch // self.dp

    @property
    def microbatches(self) -> int:
        """Micro-batches each replica runs per step, over all groups."""
        return self.per_replica // self.micro_batch

    @property
    def sample_groups(self) -> int:
        return self.microbatches if self.groups is None else self.groups

    def first_sample(self, replica: int, microbatch: int) -> int:
        """Position in the step's batch of the first sample of `replica`'s micro-batch."""
        groups = self.sample_groups
        group, local = divmod(microbatch, self.microbatches // groups)
        return group * (self.global_batch // groups) + replica * (self.per_replica // groups) + local * self.micro_batch
