"""All-reduce builders: AllReduce, PartitionedAR, RandomAxisPartitionAR."""
from __future__ import annotations

import random
from typing import List, Optional, Sequence

from autodist import partition
from autodist.strategy import common
from autodist.strategy.base import Strategy, StrategyBuilder


class ARConfig:
    """All-reduce settings shared by the all-reduce builders.

    Args:
        chunk_size: number of consecutive all-reduced units (variables or
            parts) merged into one collective group.
        all_reduce_spec: an ``AllReduceSynchronizer.Spec`` name.
        compressor: an ``AllReduceSynchronizer.Compressor`` name.

    Raises:
        ValueError: if ``chunk_size < 1`` or a name is not a valid enum name
            (the message lists the valid ones).
    """

    def __init__(self, chunk_size: int = 128, all_reduce_spec: str = "AUTO",
                 compressor: str = "NoneCompressor"):
        common.check_int("chunk_size", chunk_size)
        common.ar_spec_value(all_reduce_spec)
        common.ar_compressor_value(compressor)
        self.chunk_size = int(chunk_size)
        self.all_reduce_spec = all_reduce_spec
        self.compressor = compressor

    def node(self, name: str, index: int):
        """Returns the AR node config of the ``index``-th all-reduced unit."""
        return common.ar_node_config(name, common.chunk_group(index, self.chunk_size),
                                     self.all_reduce_spec, self.compressor)

    def __repr__(self) -> str:
        return (f"ARConfig(chunk_size={self.chunk_size!r}, "
                f"all_reduce_spec={self.all_reduce_spec!r}, compressor={self.compressor!r})")


def no_grad_node_config(var, ps_devices: Sequence[str]):
    """Config of a variable that gets no gradient: whole, on the chief's CPU.

    Nothing is all-reduced for it, so it takes no slot in any group.
    """
    return common.ps_node_config(var.name, ps_devices[0])


class AllReduce(StrategyBuilder):
    """Every variable all-reduced; ``group = index // chunk_size`` in variable order.

    Args: as :class:`ARConfig`.
    """

    def __init__(self, chunk_size: int = 128, all_reduce_spec: str = "AUTO",
                 compressor: str = "NoneCompressor"):
        self._ar = ARConfig(chunk_size, all_reduce_spec, compressor)

    def build(self, graph_item, resource_spec) -> Strategy:
        strategy = common.new_strategy(resource_spec)
        index = 0
        for var in graph_item.trainable_variables:
            if not var.has_grad:
                strategy.node_config.append(
                    no_grad_node_config(var, common.ps_device_names(resource_spec)))
                continue
            strategy.node_config.append(self._ar.node(var.name, index))
            index += 1
        return strategy


class PartitionedAR(StrategyBuilder):
    """Variables split along axis 0, each part all-reduced.

    A variable whose split axis has size >= 2 gets
    ``min(num_partitions or max(2, num_replicas), size)`` parts (uneven sizes
    allowed, see :func:`autodist.partition.partition_sizes`). Groups are assigned by chunk
    over the sequence of all-reduced units (parts, or whole variables).

    Args:
        chunk_size: all-reduced units per group.
        num_partitions: parts per variable; ``max(2, num_replicas)`` when None.
        all_reduce_spec: an ``AllReduceSynchronizer.Spec`` name.
        compressor: an ``AllReduceSynchronizer.Compressor`` name.

    Raises:
        ValueError: for a bad ``chunk_size``, ``num_partitions`` or enum name.
    """

    def __init__(self, chunk_size: int = 128, num_partitions: Optional[int] = None,
                 all_reduce_spec: str = "AUTO", compressor: str = "NoneCompressor"):
        common.check_int("num_partitions", num_partitions, allow_none=True)
        self._ar = ARConfig(chunk_size, all_reduce_spec, compressor)
        self._num_partitions = num_partitions

    def _choose_axis(self, shape: Sequence[int], rng: random.Random) -> Optional[int]:
        """Returns the axis to split, or None to keep the variable whole."""
        del rng  # axis 0 is fixed
        return 0 if len(shape) >= 1 and int(shape[0]) >= 2 else None

    def _rng(self) -> random.Random:
        return random.Random(0)

    def build(self, graph_item, resource_spec) -> Strategy:
        strategy = common.new_strategy(resource_spec)
        num_replicas = len(strategy.replicas)
        # A fresh generator per build keeps build() pure and repeatable.
        rng = self._rng()
        index = 0
        for var in graph_item.trainable_variables:
            if not var.has_grad:
                strategy.node_config.append(
                    no_grad_node_config(var, common.ps_device_names(resource_spec)))
                continue
            shape = tuple(int(d) for d in var.shape)
            axis = self._choose_axis(shape, rng)
            k = 1 if axis is None else common.num_ar_partitions(
                shape[axis], self._num_partitions, num_replicas)
            if k == 1:
                strategy.node_config.append(self._ar.node(var.name, index))
                index += 1
                continue
            parts: List = []
            for i in range(k):
                parts.append(self._ar.node(partition.part_name(var.name, i), index))
                index += 1
            strategy.node_config.append(
                common.partitioned_node_config(var.name, axis, len(shape), parts))
        return strategy


class RandomAxisPartitionAR(PartitionedAR):
    """Like :class:`PartitionedAR`, but each variable is split along a random axis.

    The axis is drawn uniformly among the axes of size >= 2 with a generator
    seeded by ``seed`` and consumed in variable order, so the same seed and
    graph always give the same strategy. Variables with no such axis stay whole.

    Args:
        chunk_size: all-reduced units per group.
        num_partitions: parts per variable; ``max(2, num_replicas)`` when None.
        seed: seed of the axis choice.
        all_reduce_spec: an ``AllReduceSynchronizer.Spec`` name.
        compressor: an ``AllReduceSynchronizer.Compressor`` name.

    Raises:
        ValueError: for a bad ``chunk_size``, ``num_partitions``, ``seed`` or enum name.
    """

    def __init__(self, chunk_size: int = 128, num_partitions: Optional[int] = None,
                 seed: int = 0, all_reduce_spec: str = "AUTO",
                 compressor: str = "NoneCompressor"):
        super().__init__(chunk_size, num_partitions, all_reduce_spec, compressor)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an int, got seed={seed!r}.")
        self._seed = seed

    def _rng(self) -> random.Random:
        return random.Random(self._seed)

    def _choose_axis(self, shape, rng):
        axes = [axis for axis, size in enumerate(shape) if size >= 2]
        return rng.choice(axes) if axes else None
