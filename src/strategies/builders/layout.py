"""Where a unit's ranks sit, and the groups and routes that connect them.

Megatron-LM's rank order is a (tp, dp, pp) mesh: TP fastest (inside a node), then DP,
then PP. Groups are made per mesh axis with their whole family (so every rank of a class
finds its own member, and the family's NIC sharing is known); routes are made from the
messages they carry.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Iterable

from src.cluster import ClusterSpec, family_sharing
from src.mesh import ROWS, Mesh
from src.program import CommKind, Group, Message, Program, Table


def megatron_mesh(tp: int, dp: int, pp: int, offset: int = 0) -> Mesh:
    return Mesh.contiguous((("tp", tp), ("dp", dp), ("pp", pp)), offset)


def make_group(cluster: ClusterSpec, name: str, ranks: tuple[int, ...], family: list[tuple[int, ...]]) -> Group:
    """A group whose bandwidth share is computed over its whole family."""
    return Group(name, ranks, sharing=family_sharing(cluster, family), family=tuple(family))


def axis_group(program: Program, cluster: ClusterSpec, name: str, mesh: Mesh, axis: str, through: int) -> str | None:
    """Add the group along `axis` of `mesh` through rank `through` (its family: every
    such group of the mesh); None when the axis has degree 1."""
    if mesh.degree(axis) == 1:
        return None
    if name not in program.groups:
        program.add_group(make_group(cluster, name, mesh.group(axis, through), mesh.family(axis)))
    return name


def stage_group(program: Program, cluster: ClusterSpec, name: str, mesh: Mesh, stage: int) -> str | None:
    """Add the group of every rank of pipeline stage `stage` of a (tp, dp, pp) `mesh` (a
    unit replicated over its TP group reduces its gradients over its TP and DP ranks at
    once; its family: that one group); None for a stage of one rank."""
    ranks = mesh.slice(pp=stage)
    if len(ranks) == 1:
        return None
    if name not in program.groups:
        program.add_group(make_group(cluster, name, ranks, [ranks]))
    return name


def replicated_mesh(mesh: Mesh, stage: int) -> Mesh:
    """The mesh of a unit replicated over the TP group of stage `stage` of a (tp, dp, pp)
    `mesh`: the stage's ranks in the same order, its tp axis become the rows axis."""
    return Mesh(((ROWS, mesh.degree("tp")), ("dp", mesh.degree("dp")), ("pp", 1)), mesh.slice(pp=stage))


def pipeline_pairs(mesh: Mesh) -> list[tuple[int, int]]:
    """Every (sender, receiver) pair of neighbouring stages, both directions counted
    once: they run at the same time in a pipeline's steady state."""
    pp = mesh.degree("pp")
    return [pair for p in range(pp - 1) for pair in zip(mesh.slice(pp=p), mesh.slice(pp=p + 1))]


def route_sharing(cluster: ClusterSpec, messages: Iterable[Message]) -> int:
    """How many transfers cross the busiest node's links at once when every rank sends
    (and receives) its messages one after another: the ranks of a node that send, or
    that receive, across nodes."""
    senders: dict[int, set[int]] = defaultdict(set)
    receivers: dict[int, set[int]] = defaultdict(set)
    for message in messages:
        src, dst = cluster.node_of(message.src), cluster.node_of(message.dst)
        if src != dst:
            senders[src].add(message.src)
            receivers[dst].add(message.dst)
    return max([len(s) for s in senders.values()] + [len(r) for r in receivers.values()] + [1])


def table(cluster: ClusterSpec, name: str, kind: CommKind, messages: list[Message], reduce: bool = False) -> Table:
    return Table(name, kind, tuple(messages), route_sharing(cluster, messages), reduce)
