"""A strategy's view of the cluster's network: replicas per node, link rates, transfer times.

Pure arithmetic, shared by the synchronizer kinds' costs and the simulator.
NICs are full duplex (``autodist emulate`` shapes both directions separately),
so a node's inbound and outbound bytes are separate resources.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Dict, List, Sequence, Tuple

import numpy as np

from autodist.resource_spec import DEFAULT_BANDWIDTH_GBPS, DeviceSpec

Resource = Tuple[str, str]
"""``(node address, "in" | "out" | "local")``."""

DIRECTIONS = ("in", "out", "local")
"""A node's resources: its NIC inbound, its NIC outbound, its local bus."""


@functools.lru_cache(maxsize=4096)
def node_of(device: str) -> str:
    """Returns the node address of a device string such as ``"10.0.0.1:CPU:0"``."""
    return DeviceSpec.from_string(device).host_address


def seconds(num_bytes: float, gbps: float) -> float:
    """Returns the time ``num_bytes`` take at ``gbps`` Gbit/s."""
    return num_bytes * 8.0 / (gbps * 1e9)


def in_order_sum(values: np.ndarray) -> float:
    """Sums left to right, as a loop would (``np.sum`` pairs terms, rounding differently)."""
    return float(np.bincount(np.zeros(len(values), dtype=np.intp), values, minlength=1)[0])


@dataclasses.dataclass(frozen=True)
class ClusterView:
    """The replicas a strategy uses, per node, with link rates in Gbit/s."""

    replicas_per_node: Dict[str, int]
    nic_gbps: Dict[str, float]
    local_gbps: float

    @property
    def num_replicas(self) -> int:
        """int: replicas in all."""
        return sum(self.replicas_per_node.values())

    @property
    def multi_node(self) -> bool:
        return len(self.replicas_per_node) > 1

    def ring_gbps(self) -> float:
        """The slowest link of a ring through every replica, each node's replicas adjacent."""
        links = ([self.nic_gbps[node] for node in self.replicas_per_node]
                 if len(self.replicas_per_node) > 1 else [])
        if any(count > 1 for count in self.replicas_per_node.values()):
            links.append(self.local_gbps)
        return min(links) if links else self.local_gbps

    def gbps(self, resource: Resource) -> float:
        """The rate of a resource: its node's NIC, or the local bus."""
        node, direction = resource
        return self.local_gbps if direction == "local" else self.nic_gbps[node]

    def step_nodes(self, hosts: List[str]) -> Tuple[List[str], np.ndarray]:
        """The nodes a step runs on, and each of ``hosts``' index among them.

        Args:
            hosts: nodes holding parts (a PS kind's servers), with or without replicas.

        Returns:
            tuple: (the nodes: the replicas' first, then hosts without replicas;
            for each of ``hosts`` its index in the nodes, then -1, so that a
            part without a host (-1) picks -1).
        """
        nodes = list(self.replicas_per_node)
        nodes += [node for node in hosts if node not in self.replicas_per_node]
        return nodes, np.array([nodes.index(node) for node in hosts] + [-1], dtype=np.intp)


def cluster_view(replicas: Sequence[str], resource_spec: Any, local_gbps: float) -> ClusterView:
    """Builds the view of the replica devices ``replicas`` on ``resource_spec``.

    A node without a ``network_bandwidth`` gets ``DEFAULT_BANDWIDTH_GBPS``.
    """
    per_node: Dict[str, int] = {}
    for replica in replicas:
        node = node_of(replica)
        per_node[node] = per_node.get(node, 0) + 1
    spec_gbps = dict(getattr(resource_spec, "network_bandwidth", None) or {})
    nic = {node: float(spec_gbps.get(node) or DEFAULT_BANDWIDTH_GBPS)
           for node in list(per_node) + list(spec_gbps)}
    return ClusterView(per_node, nic, float(local_gbps))
