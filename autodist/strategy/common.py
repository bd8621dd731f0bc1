"""Helpers shared by the strategy builders: node configs, partitioning, placement.

The partition convention (names, strings, which rows each part holds) is
:mod:`autodist.partition`'s.
"""
from __future__ import annotations

import heapq
import numbers
import operator
from typing import Dict, Hashable, List, Optional, Sequence, Tuple

from autodist.partition import partition_sizes, partitioner_string
from autodist.proto import strategy_pb2
from autodist.proto import synchronizers_pb2
from autodist.strategy.base import Strategy, StrategyError

Node = strategy_pb2.Strategy.Node
_AR = synchronizers_pb2.AllReduceSynchronizer


# --------------------------------------------------------------------------- argument checks

def check_sync_args(sync: bool, staleness: int) -> None:
    """Validates the PS synchronization arguments.

    ``sync=True`` (staleness 0) is synchronous training; ``sync=False`` with
    ``staleness=s >= 1`` lets replicas read values up to ``s`` updates old.
    Asynchronous training without a bound is not supported, so each value
    needs the other.

    Raises:
        ValueError: if ``sync`` is not a bool, ``staleness`` is not an int >= 0,
            or the two disagree.
    """
    if not isinstance(sync, bool):
        raise ValueError(f"sync must be a bool, got sync={sync!r}.")
    check_int("staleness", staleness, least=0)
    if sync and staleness:
        raise ValueError(f"staleness={staleness} needs sync=False: synchronous training reads "
                         "every update; pass sync=False for bounded staleness.")
    if not sync and not staleness:
        raise ValueError("sync=False needs staleness >= 1: asynchronous training without a "
                         "bound is not supported; staleness=s lets replicas read values up to "
                         "s updates old.")


def check_int(name: str, value: Optional[int], least: int = 1, allow_none: bool = False) -> None:
    """Validates an integer argument such as ``chunk_size``, ``staleness`` or ``trials``.

    Raises:
        ValueError: naming ``name`` and ``value`` when ``value`` is not an
            integer >= ``least`` (nor None, with ``allow_none``); a bool is not
            a count here.
    """
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
        suffix = " or None" if allow_none else ""
        raise ValueError(f"{name} must be an integer >= {least}{suffix}, got {value!r}.")


def _enum_value(enum, field: str, name: str) -> int:
    """The value of ``name`` in a proto enum; ValueError listing the valid names."""
    valid = list(enum.keys())
    if name not in valid:
        raise ValueError(f"Unknown {field}={name!r}; valid names are {valid}.")
    return enum.Value(name)


def ar_spec_value(name: str) -> int:
    """Maps an all-reduce spec name to its ``AllReduceSynchronizer.Spec`` value.

    Raises:
        ValueError: listing the valid names when ``name`` is unknown.
    """
    return _enum_value(_AR.Spec, "all_reduce_spec", name)


def ar_compressor_value(name: str) -> int:
    """Maps a compressor name to its ``AllReduceSynchronizer.Compressor`` value.

    Raises:
        ValueError: listing the valid names when ``name`` is unknown.
    """
    return _enum_value(_AR.Compressor, "compressor", name)


# --------------------------------------------------------------------------- strategy skeleton

def new_strategy(resource_spec) -> Strategy:
    """Makes an empty strategy whose replicas are the spec's replica devices.

    Returns:
        Strategy: with ``graph_config.replicas`` set and no node configs.

    Raises:
        StrategyError: if the spec has no replica device.
    """
    replicas = [d.name_string() for d in resource_spec.replica_devices]
    if not replicas:
        raise StrategyError("The resource spec has no replica devices; cannot build a strategy.")
    strategy = Strategy()
    strategy.proto.graph_config.replicas.extend(replicas)
    return strategy


def ps_device_names(resource_spec) -> List[str]:
    """Returns the parameter-server device strings, chief's CPU first.

    Raises:
        StrategyError: if the spec has no PS device.
    """
    names = [d.name_string() for d in resource_spec.ps_devices]
    if not names:
        raise StrategyError("The resource spec has no ps_devices; PS strategies need at least one.")
    return names


# --------------------------------------------------------------------------- node configs

def ps_node_config(var_name: str, reduction_destination: str, local_replication: bool = False,
                   sync: bool = True, staleness: int = 0, transfer_destination: str = "") -> Node:
    """Makes a node config synchronized by a parameter server.

    Returns:
        strategy_pb2.Strategy.Node: with its ``PSSynchronizer`` set.
    """
    node = Node(var_name=var_name)
    ps = node.PSSynchronizer
    ps.reduction_destination = reduction_destination
    ps.local_replication = local_replication
    ps.sync = sync
    ps.staleness = staleness
    ps.transfer_destination = transfer_destination
    return node


def ar_node_config(var_name: str, group: int, spec: str = "AUTO",
                   compressor: str = "NoneCompressor") -> Node:
    """Makes a node config synchronized by all-reduce.

    Returns:
        strategy_pb2.Strategy.Node: with its ``AllReduceSynchronizer`` set.

    Raises:
        ValueError: if ``spec`` or ``compressor`` is not a valid enum name.
    """
    node = Node(var_name=var_name)
    ar = node.AllReduceSynchronizer
    ar.spec = ar_spec_value(spec)
    ar.compressor = ar_compressor_value(compressor)
    ar.group = group
    return node


def partitioned_node_config(var_name: str, axis: int, rank: int,
                            part_configs: Sequence[Node]) -> Node:
    """Makes the top-level config of a partitioned variable.

    The top node carries only the partitioner; each part carries its own
    synchronizer.

    Returns:
        strategy_pb2.Strategy.Node: with ``partitioner`` and ``part_config`` set.
    """
    node = Node(var_name=var_name,
                partitioner=partitioner_string(len(part_configs), axis, rank))
    node.part_config.extend(part_configs)
    return node


# --------------------------------------------------------------------------- partitioning

def part_sizes_bytes(var, axis: int, num_parts: int) -> List[int]:
    """Returns the byte size of each part of ``var`` (a ``VariableInfo``) split along ``axis``."""
    row_bytes = var.size_bytes // int(var.shape[axis])
    return [rows * row_bytes for rows in partition_sizes(int(var.shape[axis]), num_parts)]


def largest_divisor_at_most(n: int, limit: int) -> int:
    """Returns the largest divisor of ``n`` that is ``<= limit`` (at least 1)."""
    for k in range(min(n, limit), 1, -1):
        if n % k == 0:
            return k
    return 1


def _splittable_rows(shape: Sequence[int]) -> int:
    """Returns ``shape[0]`` when axis 0 can be split (rank >= 1, size >= 2), else 0."""
    return int(shape[0]) if len(shape) >= 1 and int(shape[0]) >= 2 else 0


def num_shards_even(shape: Sequence[int], num_ps: int) -> int:
    """Number of axis-0 shards for :class:`PartitionedPS`.

    The largest divisor of ``shape[0]`` that is ``<= max(2, num_ps)``: on a
    single node (one PS device) variables are still split in two, so that the
    partitioning path is exercised and shards can be updated independently.

    Returns:
        int: 1 for scalars or ``shape[0] < 2`` (not partitioned).
    """
    rows = _splittable_rows(shape)
    return largest_divisor_at_most(rows, max(2, num_ps)) if rows else 1


def num_shards_uneven(shape: Sequence[int], num_ps: int) -> int:
    """Number of axis-0 shards for :class:`UnevenPartitionedPS`: ``min(max(2, num_ps), shape[0])``.

    Returns:
        int: 1 for scalars or ``shape[0] < 2`` (not partitioned).
    """
    rows = _splittable_rows(shape)
    return min(max(2, num_ps), rows) if rows else 1


def num_ar_partitions(dim: int, num_partitions: Optional[int], num_replicas: int) -> int:
    """Number of all-reduce partitions along an axis of size ``dim``.

    ``min(num_partitions or max(2, num_replicas), dim)``; 1 when ``dim < 2``.
    """
    if dim < 2:
        return 1
    return min(num_partitions or max(2, num_replicas), dim)


# --------------------------------------------------------------------------- placement

def balanced_placement(items: Sequence[Tuple[Hashable, int]], devices: Sequence[Hashable],
                       initial_loads: Optional[Dict[Hashable, int]] = None
                       ) -> Tuple[Dict[Hashable, Hashable], Dict[Hashable, int]]:
    """Greedily places items on devices, balancing bytes.

    Items are taken largest first (ties in the given order) and each goes to
    the currently least-loaded device, ties broken by device order. Taking the
    largest first keeps the final imbalance at most the size of one item.

    Args:
        items: ``(key, size_bytes)`` pairs; keys must be unique.
        devices: candidate device strings (or any ids, e.g. all-reduce groups), in
            priority order.
        initial_loads: bytes already on some devices (e.g. pinned variables).

    Returns:
        tuple: ``(placement, loads)``: key -> device, and device -> total bytes.

    Raises:
        StrategyError: if ``devices`` is empty.
    """
    if not devices:
        raise StrategyError("balanced_placement needs at least one device, got devices=[].")
    loads = dict(initial_loads or {})
    # A heap, not a scan: the sampler spreads units over hundreds of groups.
    heap = [(loads.get(d, 0), order, d) for order, d in enumerate(devices)]
    heapq.heapify(heap)
    placement: Dict[Hashable, Hashable] = {}
    # A stable sort keeps the given order among equal sizes, even reversed.
    for key, size in sorted(items, key=operator.itemgetter(1), reverse=True):
        load, order, target = heapq.heappop(heap)
        placement[key] = target
        heapq.heappush(heap, (load + size, order, target))
    loads.update((d, load) for load, _, d in heap)
    return placement, loads


DEFAULT_BUCKET_BYTES = 8 * 2 ** 20
"""Bytes of gradients an all-reduce bucket (one reduce) holds by default: large enough
that a reduce's fixed cost is small next to its transfer, small enough that the first
buckets go on the wire while the backward pass still computes the rest, and that one
bucket's gather overlaps the next one's reduce. On 4 emulated nodes at 5 Gbit/s, the
42 MB MLP's scatter-gather steps took 293 ms with 8 MiB buckets against 299-352 ms
with 25 MiB (benchmarks/peers.py, 2 rounds)."""


def check_bucket_args(bucket_bytes: Optional[int], chunk_size: Optional[int]) -> None:
    """Validates the bucket caps of an all-reduce builder.

    Raises:
        ValueError: naming the argument, unless each is None or an integer >= 1.
    """
    check_int("bucket_bytes", bucket_bytes, allow_none=True)
    check_int("chunk_size", chunk_size, allow_none=True)


def byte_buckets(units: Sequence[Tuple[Hashable, int, int]], bucket_bytes: Optional[int],
                 max_units: Optional[int] = None) -> Dict[Hashable, int]:
    """Collective groups ("buckets") of all-reduced units, filled in backward order.

    Units are taken in the order their gradients are ready (``ready_rank``, ties in
    the given order); a bucket takes units until the next one would carry it past
    ``bucket_bytes`` or it holds ``max_units`` units. A unit larger than the cap gets
    a bucket of its own. So group 0 holds the gradients the backward pass computes
    first, and its collective can start while the others are still computed.

    Args:
        units: ``(key, bytes, ready_rank)`` triples; a unit gathered rather than
            reduced (a sparse gradient) has 0 bytes.
        bucket_bytes: the byte cap, or None for no cap.
        max_units: the cap on units per bucket, or None for no cap.

    Returns:
        key -> bucket number, from 0 in the order the buckets fill.
    """
    groups: Dict[Hashable, int] = {}
    group, held, count = 0, 0, 0
    for key, size, _ in sorted(units, key=operator.itemgetter(2)):
        full = ((bucket_bytes is not None and held + size > bucket_bytes)
                or (max_units is not None and count == max_units))
        if count and full:
            group, held, count = group + 1, 0, 0
        groups[key] = group
        held, count = held + size, count + 1
    return groups


def even_buckets(units: Sequence[Tuple[Hashable, int, int]], count: int) -> Dict[Hashable, int]:
    """At most ``count`` buckets of about equal bytes, filled in backward order.

    As :func:`byte_buckets`, units are taken in ``ready_rank`` order and each
    bucket is a run of consecutive units; a unit joins the bucket its middle
    byte falls in when the units' bytes are laid end to end and cut in
    ``count`` equal lengths (empty buckets are dropped).

    Args:
        units: ``(key, bytes, ready_rank)`` triples.
        count: the most buckets, at least 1.

    Returns:
        key -> bucket number, from 0 in the order the buckets fill.
    """
    ordered = sorted(units, key=operator.itemgetter(2))
    total = sum(size for _, size, _ in ordered)
    groups: Dict[Hashable, int] = {}
    group, last, before = -1, -1, 0
    for key, size, _ in ordered:
        cut = min(count - 1, int(count * (before + size / 2) / total)) if total else 0
        if cut != last:
            group, last = group + 1, cut
        groups[key] = group
        before += size
    return groups

