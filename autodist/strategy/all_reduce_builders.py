"""All-reduce builders: AllReduce, PartitionedAR, RandomAxisPartitionAR."""
from __future__ import annotations

import random
from typing import Dict, Optional, Sequence, Tuple

from autodist import partition
from autodist.strategy import common
from autodist.strategy.base import Strategy, StrategyBuilder


COLLECTIVE_UP_TO_GBPS = 2.0
"""On a cluster whose slowest link carries at most this many Gbit/s, the builders'
default spec is TensorFlow's collective ring, else ``SCATTER_GATHER``
(:func:`default_all_reduce_spec`)."""


def default_all_reduce_spec(resource_spec) -> str:
    """The ``AllReduceSynchronizer.Spec`` name the all-reduce builders use unless told.

    ``SCATTER_GATHER`` costs less CPU per byte than TensorFlow's collective ring,
    which wins where the CPU is the limit (one node, fast links); on slow links
    the ring's pipelined chunks use the wire a little better, so a cluster whose
    slowest link (``network_bandwidth``, 1 Gbit/s when omitted; ``autodist probe``
    measures it) carries at most ``COLLECTIVE_UP_TO_GBPS`` gets ``AUTO``
    (``docs/benchmarks.md``, peers).
    """
    rates = resource_spec.network_bandwidth.values()
    if len(rates) > 1 and min(rates) <= COLLECTIVE_UP_TO_GBPS:
        return "AUTO"
    return "SCATTER_GATHER"


class ARConfig:
    """All-reduce settings shared by the all-reduce builders.

    The all-reduced units (variables or parts) are grouped into buckets, one
    reduce each, filled in the order the backward pass computes their gradients
    (:func:`autodist.strategy.common.byte_buckets`).

    Args:
        chunk_size: the most units in one bucket; None for no such cap.
        all_reduce_spec: an ``AllReduceSynchronizer.Spec`` name, or None for the
            cluster's default (:func:`default_all_reduce_spec`); the strategy
            records the spec chosen.
        compressor: an ``AllReduceSynchronizer.Compressor`` name.
        bucket_bytes: the most gradient bytes in one bucket (8 MiB by default);
            None for no such cap.

    Raises:
        ValueError: if a cap is not None or an integer >= 1, or a name is not a
            valid enum name (the message lists the valid ones).
    """

    def __init__(self, chunk_size: Optional[int] = None, all_reduce_spec: Optional[str] = None,
                 compressor: str = "NoneCompressor",
                 bucket_bytes: Optional[int] = common.DEFAULT_BUCKET_BYTES):
        common.check_bucket_args(bucket_bytes, chunk_size)
        if all_reduce_spec is not None:
            common.ar_spec_value(all_reduce_spec)
        common.ar_compressor_value(compressor)
        self.chunk_size = chunk_size
        self.bucket_bytes = bucket_bytes
        self.all_reduce_spec = all_reduce_spec
        self.compressor = compressor

    def groups(self, units: Sequence[Tuple[str, object, int]]) -> Dict[str, int]:
        """Unit name -> its bucket, for ``(name, VariableInfo, bytes)`` of every all-reduced unit.

        A sparse gradient is gathered, not reduced in its bucket's buffer, so its
        bytes fill no bucket.
        """
        return common.byte_buckets(
            [(name, 0 if var.sparse_grad else size, var.ready_rank) for name, var, size in units],
            self.bucket_bytes, self.chunk_size)

    def spec(self, resource_spec) -> str:
        """The spec name the strategy records for this cluster."""
        return self.all_reduce_spec or default_all_reduce_spec(resource_spec)

    def node(self, name: str, group: int, spec: str):
        """Returns the AR node config of the unit ``name`` in bucket ``group``, by ``spec``."""
        return common.ar_node_config(name, group, spec, self.compressor)

    def __repr__(self) -> str:
        return (f"ARConfig(chunk_size={self.chunk_size!r}, "
                f"all_reduce_spec={self.all_reduce_spec!r}, compressor={self.compressor!r}, "
                f"bucket_bytes={self.bucket_bytes!r})")


def no_grad_node_config(var, ps_devices: Sequence[str]):
    """Config of a variable that gets no gradient: whole, on the chief's CPU.

    Nothing is all-reduced for it, so it takes no slot in any group.
    """
    return common.ps_node_config(var.name, ps_devices[0])


class AllReduce(StrategyBuilder):
    """Every variable all-reduced, in buckets filled in backward order (see :class:`ARConfig`).

    Args: as :class:`ARConfig`.
    """

    def __init__(self, chunk_size: Optional[int] = None, all_reduce_spec: Optional[str] = None,
                 compressor: str = "NoneCompressor",
                 bucket_bytes: Optional[int] = common.DEFAULT_BUCKET_BYTES):
        self._ar = ARConfig(chunk_size, all_reduce_spec, compressor, bucket_bytes)

    def build(self, graph_item, resource_spec) -> Strategy:
        strategy = common.new_strategy(resource_spec)
        variables = graph_item.trainable_variables
        groups = self._ar.groups([(v.name, v, v.size_bytes) for v in variables if v.has_grad])
        spec = self._ar.spec(resource_spec)
        for var in variables:
            strategy.node_config.append(
                self._ar.node(var.name, groups[var.name], spec) if var.has_grad
                else no_grad_node_config(var, common.ps_device_names(resource_spec)))
        return strategy


class PartitionedAR(StrategyBuilder):
    """Variables split along axis 0, each part all-reduced.

    A variable whose split axis has size >= 2 gets
    ``min(num_partitions or max(2, num_replicas), size)`` parts (uneven sizes
    allowed, see :func:`autodist.partition.partition_sizes`). The all-reduced
    units (parts, or whole variables) are bucketed as in :class:`ARConfig`.

    Args:
        chunk_size: the most all-reduced units per bucket; None for no such cap.
        num_partitions: parts per variable; ``max(2, num_replicas)`` when None.
        all_reduce_spec: an ``AllReduceSynchronizer.Spec`` name; None for the
            cluster's default (:func:`default_all_reduce_spec`).
        compressor: an ``AllReduceSynchronizer.Compressor`` name.
        bucket_bytes: the most gradient bytes per bucket; None for no such cap.

    Raises:
        ValueError: for a bad cap, ``num_partitions`` or enum name.
    """

    def __init__(self, chunk_size: Optional[int] = None, num_partitions: Optional[int] = None,
                 all_reduce_spec: Optional[str] = None, compressor: str = "NoneCompressor",
                 bucket_bytes: Optional[int] = common.DEFAULT_BUCKET_BYTES):
        common.check_int("num_partitions", num_partitions, allow_none=True)
        self._ar = ARConfig(chunk_size, all_reduce_spec, compressor, bucket_bytes)
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
        cuts = {}  # variable name -> (split axis or None, its units' names)
        units = []
        for var in graph_item.trainable_variables:
            if not var.has_grad:
                continue
            shape = tuple(int(d) for d in var.shape)
            axis = self._choose_axis(shape, rng)
            k = 1 if axis is None else common.num_ar_partitions(
                shape[axis], self._num_partitions, num_replicas)
            if k == 1:
                cuts[var.name] = (None, [var.name])
                units.append((var.name, var, var.size_bytes))
                continue
            names = [partition.part_name(var.name, i) for i in range(k)]
            cuts[var.name] = (axis, names)
            units.extend(zip(names, [var] * k, common.part_sizes_bytes(var, axis, k)))
        groups = self._ar.groups(units)
        spec = self._ar.spec(resource_spec)
        for var in graph_item.trainable_variables:
            if var.name not in cuts:
                strategy.node_config.append(
                    no_grad_node_config(var, common.ps_device_names(resource_spec)))
                continue
            axis, names = cuts[var.name]
            parts = [self._ar.node(name, groups[name], spec) for name in names]
            strategy.node_config.append(
                parts[0] if axis is None
                else common.partitioned_node_config(var.name, axis, len(var.shape), parts))
        return strategy


class RandomAxisPartitionAR(PartitionedAR):
    """Like :class:`PartitionedAR`, but each variable is split along a random axis.

    The axis is drawn uniformly among the axes of size >= 2 with a generator
    seeded by ``seed`` and consumed in variable order, so the same seed and
    graph always give the same strategy. Variables with no such axis stay whole.

    Args:
        chunk_size: the most all-reduced units per bucket; None for no such cap.
        num_partitions: parts per variable; ``max(2, num_replicas)`` when None.
        seed: seed of the axis choice.
        all_reduce_spec: an ``AllReduceSynchronizer.Spec`` name; None for the
            cluster's default (:func:`default_all_reduce_spec`).
        compressor: an ``AllReduceSynchronizer.Compressor`` name.
        bucket_bytes: the most gradient bytes per bucket; None for no such cap.

    Raises:
        ValueError: for a bad cap, ``num_partitions``, ``seed`` or enum name.
    """

    def __init__(self, chunk_size: Optional[int] = None, num_partitions: Optional[int] = None,
                 seed: int = 0, all_reduce_spec: Optional[str] = None,
                 compressor: str = "NoneCompressor",
                 bucket_bytes: Optional[int] = common.DEFAULT_BUCKET_BYTES):
        super().__init__(chunk_size, num_partitions, all_reduce_spec, compressor, bucket_bytes)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an int, got seed={seed!r}.")
        self._seed = seed

    def _rng(self) -> random.Random:
        return random.Random(self._seed)

    def _choose_axis(self, shape, rng):
        axes = [axis for axis, size in enumerate(shape) if size >= 2]
        return rng.choice(axes) if axes else None
