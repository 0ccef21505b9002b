"""The network of a described cluster: intra- vs inter-node point-to-point messages and the gradient all-reduce.

Chimera §3.4 charges a message of ``L`` bytes ``α + β·L`` and a gradient all-reduce over ``r`` replicas
Rabenseifner's ``2·log2(r)·α + 2·(r−1)/r·β·L``. On a cluster of multi-device nodes the constants depend on whether
the two ends share a node (NVLink) or not (InfiniBand), and collective libraries (NCCL) run an all-reduce whose group
spans nodes hierarchically: a reduce-scatter among the ``g`` members of each node, an all-reduce of the ``L/g``-byte
shards across the ``n`` nodes, an all-gather in the node ("Bandwidth optimal all-reduce algorithms for clusters of
workstations", Patarasuk and Yuan, for the ring; the two-level scheme is Horovod's and NCCL's hierarchical
all-reduce):

    T = 2·(log2(g)·α_intra + (g−1)/g·β_intra·L) + Rabenseifner(n, L/g, α_inter, β_inter)

Ranks are laid out replica by replica: the ``D`` workers of one pipeline replica are consecutive, so a stage's
``W`` copies are ``D`` ranks apart (:meth:`Network.members_per_node`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .costs import AlphaBeta, rabenseifner

ALGORITHMS = ("rabenseifner", "ring", "hierarchical")


def ring_allreduce(replicas: int, nbytes: float, link: AlphaBeta) -> float:
    """Ring all-reduce (Patarasuk and Yuan): ``2·(r−1)·α + 2·(r−1)/r·β·L``; zero for one replica."""
    if replicas <= 1 or nbytes <= 0:
        return 0.0
    return 2.0 * (replicas - 1) * link.alpha + 2.0 * (replicas - 1) / replicas * link.beta * nbytes


def hierarchical_allreduce(per_node: int, nodes: int, nbytes: float, intra: AlphaBeta, inter: AlphaBeta) -> float:
    """Reduce-scatter in the node, Rabenseifner across nodes on ``L/g`` bytes, all-gather in the node (module docstring)."""
    if nbytes <= 0 or per_node * nodes <= 1:
        return 0.0
    local = 0.0
    if per_node > 1:
        local = 2.0 * (math.log2(per_node) * intra.alpha + (per_node - 1) / per_node * intra.beta * nbytes)
    return local + rabenseifner(nodes, nbytes / per_node, inter.alpha, inter.beta)


@dataclass(frozen=True)
class Network:
    """Links of a cluster (:class:`pipeline_recipes.planner.cluster.ClusterSpec`) and its all-reduce algorithm."""

    devices_per_node: int
    intra: AlphaBeta
    inter: AlphaBeta
    algorithm: str = "hierarchical"

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"Network.algorithm={self.algorithm!r}: must be one of {', '.join(ALGORITHMS)}")
        if self.devices_per_node < 1:
            raise ValueError(f"Network.devices_per_node={self.devices_per_node}: must be >= 1")

    def p2p(self, nbytes: float, crosses_node: bool) -> float:
        """One message between neighbouring stages."""
        return (self.inter if crosses_node else self.intra)(nbytes)

    def pipeline_crosses_nodes(self, D: int) -> bool:
        """Whether a replica's ``D`` consecutive workers span more than one node (some stage boundary is then an
        inter-node hop, and the uniform ``t_comm`` of the simulation is charged at the inter-node link: an upper
        bound)."""
        return D > self.devices_per_node

    def members_per_node(self, D: int, W: int, copies: int = 1) -> int:
        """Members of a stage's all-reduce group on one node: the ``copies`` workers of one replica holding the stage
        (Chimera's two pipelines: two) share a node when the replica fits in one; the ``W`` replicas are ``D`` ranks
        apart, so ``devices_per_node // D`` of them share a node."""
        inside = copies if D <= self.devices_per_node else 1
        replicas = max(1, min(W, self.devices_per_node // D)) if D <= self.devices_per_node else 1
        return max(1, min(inside * replicas, copies * W))

    def allreduce(self, replicas: int, nbytes: float, per_node: int = 1) -> float:
        """Seconds of an all-reduce of ``nbytes`` over ``replicas`` processes, ``per_node`` of them on each node."""
        if replicas <= 1 or nbytes <= 0:
            return 0.0
        per_node = max(1, min(per_node, replicas))
        nodes = -(-replicas // per_node)
        link = self.intra if nodes == 1 else self.inter
        if self.algorithm == "ring":
            return ring_allreduce(replicas, nbytes, link)
        if self.algorithm == "rabenseifner" or nodes == 1 or per_node == 1:
            return rabenseifner(replicas, nbytes, link.alpha, link.beta)
        return hierarchical_allreduce(per_node, nodes, nbytes, self.intra, self.inter)
