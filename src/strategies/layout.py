"""Where a unit's ranks sit: the (tp, dp, pp) rank grid and its process-group families."""
from __future__ import annotations

from dataclasses import dataclass

from src.cluster import ClusterSpec, family_sharing
from src.program import Group


@dataclass(frozen=True)
class Grid:
    """Megatron's rank order: TP fastest (inside a node), then DP, then PP, starting at
    `offset`: rank = offset + t + tp·(d + dp·p)."""

    tp: int
    dp: int
    pp: int
    offset: int = 0

    @property
    def size(self) -> int:
        return self.tp * self.dp * self.pp

    def rank(self, t: int, d: int, p: int) -> int:
        return self.offset + t + self.tp * (d + self.dp * p)

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(range(self.offset, self.offset + self.size))

    def stage_ranks(self, p: int) -> tuple[int, ...]:
        return tuple(self.rank(t, d, p) for d in range(self.dp) for t in range(self.tp))

    def tp_group(self, d: int, p: int) -> tuple[int, ...]:
        return tuple(self.rank(t, d, p) for t in range(self.tp))

    def dp_group(self, t: int, p: int) -> tuple[int, ...]:
        return tuple(self.rank(t, d, p) for d in range(self.dp))

    def tp_family(self) -> list[tuple[int, ...]]:
        return [self.tp_group(d, p) for p in range(self.pp) for d in range(self.dp)]

    def dp_family(self) -> list[tuple[int, ...]]:
        return [self.dp_group(t, p) for p in range(self.pp) for t in range(self.tp)]

    def pp_pairs(self) -> list[tuple[int, int]]:
        """Every (sender, receiver) pair of neighbouring stages, both directions counted
        once: they run at the same time in a pipeline's steady state."""
        return [(self.rank(t, d, p), self.rank(t, d, p + 1))
                for p in range(self.pp - 1) for d in range(self.dp) for t in range(self.tp)]


def make_group(cluster: ClusterSpec, name: str, ranks: tuple[int, ...],
               family: list[tuple[int, ...]]) -> Group:
    """A group whose bandwidth share is computed over its whole family."""
    return Group(name, ranks, sharing=family_sharing(cluster, family), family=tuple(family))
