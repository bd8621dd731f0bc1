"""Parameter-server builders: PS, PSLoadBalancing, PartitionedPS, UnevenPartitionedPS."""
from __future__ import annotations

from typing import Callable, Dict, List, Sequence

from autodist import partition
from autodist.strategy import common
from autodist.strategy.base import Strategy, StrategyBuilder

ShardCountFn = Callable[[Sequence[int], int], int]


class PSConfig:
    """PS synchronization settings shared by the PS-based builders.

    Args:
        local_proxy_variable: give each replica a local proxy copy of each variable.
        sync: synchronous training; False (with ``staleness`` >= 1) for bounded staleness.
        staleness: how many updates old a replica's read may be; needs ``sync=False``.

    Raises:
        ValueError: if ``sync`` is not a bool, ``staleness`` is negative, or
            the two disagree (see :func:`common.check_sync_args`).
    """

    def __init__(self, local_proxy_variable: bool = False, sync: bool = True, staleness: int = 0):
        if not isinstance(local_proxy_variable, bool):
            raise ValueError(
                f"local_proxy_variable must be a bool, got local_proxy_variable={local_proxy_variable!r}.")
        common.check_sync_args(sync, staleness)
        self.local_proxy_variable = local_proxy_variable
        self.sync = sync
        self.staleness = int(staleness)

    def node(self, var_name: str, destination: str):
        """Returns a PS node config for ``var_name`` on ``destination`` with these settings."""
        return common.ps_node_config(var_name, destination, self.local_proxy_variable,
                                     self.sync, self.staleness)

    def __repr__(self) -> str:
        return (f"PSConfig(local_proxy_variable={self.local_proxy_variable!r}, "
                f"sync={self.sync!r}, staleness={self.staleness!r})")


def sharded_ps_node_configs(variables: Sequence, ps_devices: Sequence[str], ps: PSConfig,
                            num_shards: ShardCountFn) -> Dict[str, object]:
    """Places variables on PS devices, split along axis 0, balancing bytes.

    Variables without a gradient are pinned whole to ``ps_devices[0]`` (the
    chief's CPU); their bytes count towards that device's load. Every other
    variable is split into ``num_shards(shape, len(ps_devices))`` parts (not
    split when that is 1), and all whole variables and shards are placed
    together with :func:`common.balanced_placement`.

    Args:
        variables: ``VariableInfo`` objects.
        ps_devices: PS device strings, chief's CPU first.
        ps: synchronization settings for every config.
        num_shards: shard-count rule, e.g. :func:`common.num_shards_even`.

    Returns:
        dict[str, Node]: variable name -> node config, in variable order.
    """
    pinned_loads: Dict[str, int] = {}
    items = []
    splits = {}
    for var in variables:
        if not var.has_grad:
            pinned_loads[ps_devices[0]] = pinned_loads.get(ps_devices[0], 0) + var.size_bytes
            continue
        k = num_shards(tuple(var.shape), len(ps_devices))
        splits[var.name] = k
        if k == 1:
            items.append((var.name, var.size_bytes))
        else:
            sizes = common.part_sizes_bytes(var, 0, k)
            items.extend((partition.part_name(var.name, i), size) for i, size in enumerate(sizes))
    placement, _ = common.balanced_placement(items, ps_devices, pinned_loads)

    nodes = {}
    for var in variables:
        k = splits.get(var.name)
        if k is None:
            nodes[var.name] = ps.node(var.name, ps_devices[0])
        elif k == 1:
            nodes[var.name] = ps.node(var.name, placement[var.name])
        else:
            parts = [ps.node(name, placement[name])
                     for name in (partition.part_name(var.name, i) for i in range(k))]
            nodes[var.name] = common.partitioned_node_config(var.name, 0, len(var.shape), parts)
    return nodes


class _PSBuilder(StrategyBuilder):
    """Base of the PS builders: holds the :class:`PSConfig`."""

    def __init__(self, local_proxy_variable: bool = False, sync: bool = True, staleness: int = 0):
        self._ps = PSConfig(local_proxy_variable, sync, staleness)

    def build(self, graph_item, resource_spec) -> Strategy:
        strategy = common.new_strategy(resource_spec)
        devices = common.ps_device_names(resource_spec)
        nodes = self._node_configs(list(graph_item.trainable_variables), devices)
        strategy.node_config.extend(nodes)
        return strategy

    def _node_configs(self, variables: List, ps_devices: List[str]) -> List:
        raise NotImplementedError


class PS(_PSBuilder):
    """Every variable, whole, on the chief's CPU (``ps_devices[0]``).

    Args:
        local_proxy_variable: give each replica a local proxy copy of each variable.
        sync: synchronous training; False (with ``staleness`` >= 1) for bounded staleness.
        staleness: how many updates old a replica's read may be; needs ``sync=False``.
    """

    def _node_configs(self, variables, ps_devices):
        return [self._ps.node(var.name, ps_devices[0]) for var in variables]


class PSLoadBalancing(_PSBuilder):
    """Whole variables spread over all PS devices, balancing bytes.

    Args: as :class:`PS`.
    """

    def _node_configs(self, variables, ps_devices):
        never_split = lambda shape, num_ps: 1  # noqa: E731
        return list(sharded_ps_node_configs(variables, ps_devices, self._ps, never_split).values())


class PartitionedPS(_PSBuilder):
    """Variables split evenly along axis 0, shards spread over PS devices by bytes.

    A variable with rank >= 1 and ``shape[0] >= 2`` gets ``k`` shards, ``k``
    the largest divisor of ``shape[0]`` that is ``<= max(2, len(ps_devices))``
    (see :func:`common.num_shards_even`; the floor of 2 makes a single node,
    which has one PS device, partition too). Scalars and ``shape[0] < 2`` stay
    whole. Part configs carry the ``PSSynchronizer``; the top node only the
    partitioner.

    Args: as :class:`PS`.
    """

    def _node_configs(self, variables, ps_devices):
        return list(sharded_ps_node_configs(
            variables, ps_devices, self._ps, common.num_shards_even).values())


class UnevenPartitionedPS(_PSBuilder):
    """Like :class:`PartitionedPS` with ``k = min(max(2, len(ps_devices)), shape[0])``.

    ``k`` need not divide ``shape[0]``: shard sizes differ by at most one row
    (:func:`autodist.partition.partition_sizes`).

    Args: as :class:`PS`.
    """

    def _node_configs(self, variables, ps_devices):
        return list(sharded_ps_node_configs(
            variables, ps_devices, self._ps, common.num_shards_uneven).values())
