"""What a strategy puts on the wire each step: its synchronized parts and their bytes.

The cost model (``cost_model.py``) turns these bytes into named components; the
learned simulator reads the same per-part quantities as features. Parts are
held as columns (numpy arrays), so that both work per strategy, not per part.
Each part's kind fills its own columns (``SynchronizerKind.traffic_record``) and
states its own traffic rules (e.g. ``synchronizers/ps.py``).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Dict, List, Mapping, Sequence, Tuple

import numpy as np

from autodist import partition
from autodist.graph_item import UPDATES_BY_ROWS
from autodist.network import node_of
from autodist.strategy.compiler import check_configs_match, synchronizer_kind
from autodist.synchronizers import KINDS

KIND_NUMBERS = {kind: number for number, kind in enumerate(KINDS.values())}
"""Each kind's class -> its number in ``SyncParts.kind`` (the registry's order)."""


@functools.lru_cache(maxsize=None)
def _itemsize(dtype: str) -> int:
    return np.dtype(dtype).itemsize


def _num_elements(shape) -> int:
    return math.prod(map(int, shape))


def sparse_grad_bytes(var_shape: Sequence[int], part_shape: Sequence[int], axis: int, dtype: str,
                      rows_touched: float) -> float:
    """Bytes of one replica's sparse gradient of one part.

    Row ids are assumed uniform: a part holding a share of the rows (split
    along axis 0) receives that share of the touched rows; a part split along
    another axis receives every touched row, each narrower.

    Args:
        var_shape: shape of the whole variable.
        part_shape: shape of the part.
        axis: the partitioned axis (0 when not partitioned).
        dtype: numpy dtype name.
        rows_touched: rows of the whole variable one replica's step touches.

    Returns:
        float: ``rows touched in the part * bytes per row of the part``.
    """
    rows, part_rows = int(var_shape[0]), int(part_shape[0])
    touched = min(float(rows_touched), rows)
    if axis == 0:
        touched = touched * part_rows / rows
    return touched * _num_elements(part_shape[1:]) * _itemsize(dtype)


@dataclasses.dataclass(frozen=True)
class SyncParts:
    """A strategy's synchronized parts (a part is a whole variable when not partitioned).

    One entry per part in every array, in the strategy's order. The synchronizer's
    fields are read once, here: scoring reads every part of thousands of
    strategies several times, and arrays let it do so per strategy, not per part.
    The columns after ``wire_bytes`` are the kinds': a kind that has no use for
    one leaves it at its default.

    Attributes:
        variables: the variables' names, in the strategy's order.
        names: each part's name.
        row: each part's variable, an index into ``variables``.
        kind: its synchronizer kind, numbered as in :data:`KIND_NUMBERS`.
        has_grad: the optimizer receives a gradient for it.
        sparse: its gradient is sparse.
        value_bytes: bytes of the whole part.
        grad_bytes: bytes of one replica's gradient: the part, or the rows it touches.
        wire_bytes: that gradient as the kind sends it (after compression).
        servers: node addresses of the servers parts live on.
        server: its server, an index into ``servers``; -1 when it has none.
        proxy: nodes keep a local copy (local_replication or a staleness bound).
        staleness: the staleness bound; 0 without one.
        aggregate: nodes sum their replicas' gradients (a transfer_destination).
        compressor: the Compressor enum value; 0 (none) without one.
        group: its collective group; 0 without one.
        dtype: its variable's dtype, numbered (parts of one dtype share the number).
        collective: on a cluster it reduces through collectives
            (``SynchronizerKind.uses_collectives``).
        remote_ops: on a cluster its step runs ops on other nodes' devices
            (``SynchronizerKind.uses_remote_ops``).
        ready_rank: when the backward pass computes its variable's gradient
            (``VariableInfo.ready_rank``; 0: first).
        read_whole: some op of the model reads its variable's whole value, not
            only rows of it (``VariableInfo.read_whole``).
        updates_rows: its variable's update writes only the rows of its sparse
            gradient (``VariableInfo.updates_rows``).
        updated_by_rows: its variable's optimizer update runs on the rows of its
            sparse gradient, not on every row (``VariableInfo.update_mode``).
    """

    variables: List[str]
    names: List[str]
    row: np.ndarray
    kind: np.ndarray
    has_grad: np.ndarray
    sparse: np.ndarray
    value_bytes: np.ndarray
    grad_bytes: np.ndarray
    wire_bytes: np.ndarray
    servers: List[str]
    server: np.ndarray
    proxy: np.ndarray
    staleness: np.ndarray
    aggregate: np.ndarray
    compressor: np.ndarray
    group: np.ndarray
    dtype: np.ndarray
    collective: np.ndarray
    remote_ops: np.ndarray
    ready_rank: np.ndarray
    read_whole: np.ndarray
    updates_rows: np.ndarray
    updated_by_rows: np.ndarray

    def of_kind(self, kind) -> np.ndarray:
        """The indices of the parts of ``kind`` (a class of the registry)."""
        return np.flatnonzero(self.kind == KIND_NUMBERS[kind])


def _part_bytes(shape: tuple, dtype: str, sparse: bool, axis: int, part_shape: tuple,
                touched: float) -> Tuple[float, float]:
    """Bytes of a part's value and of one replica's gradient of it."""
    value_bytes = float(_num_elements(part_shape) * _itemsize(dtype))
    grad_bytes = (sparse_grad_bytes(shape, part_shape, axis, dtype, touched)
                  if sparse else value_bytes)
    return value_bytes, grad_bytes


@functools.lru_cache(maxsize=65536)
def _split_bytes(shape: tuple, dtype: str, sparse: bool, partitioner: str,
                 touched: float) -> Tuple[Tuple[float, float], ...]:
    """:func:`_part_bytes` of each part of a variable cut by ``partitioner`` ("" for none).

    Cached: sampled strategies cut the same variables the same few ways.
    """
    if not partitioner:
        return (_part_bytes(shape, dtype, sparse, 0, shape, touched),)
    plan = partition.parse_partitioner(partitioner, shape, "")
    return tuple(_part_bytes(shape, dtype, sparse, plan.axis, plan.part_shape(i), touched)
                 for i in range(plan.num_parts))


_RECORD = 13  # row, value_bytes, grad_bytes, kind, the kind's seven columns, two flags


def _columns(infos: List[Any], names: List[str], records: List[tuple],
             devices: Dict[str, int]) -> SyncParts:
    """Turns the parts' records, built in ``sync_parts``, into :class:`SyncParts`.

    A record is ``(row, value_bytes, grad_bytes, kind, wire_bytes, device,
    proxy, staleness, aggregate, compressor, group, collective, remote_ops)``,
    ``device`` numbered in
    ``devices`` (-1 for none); ``infos`` are the rows' ``VariableInfo``.
    """
    table = np.array(records, dtype=np.float64).reshape(len(records), _RECORD)
    row = table[:, 0].astype(np.intp)
    flags = np.array([(info.has_grad, info.sparse_grad, info.read_whole, info.updates_rows,
                       info.update_mode in UPDATES_BY_ROWS)
                      for info in infos], dtype=bool).reshape(len(infos), 5)[row]
    ready_rank = np.array([info.ready_rank for info in infos], dtype=np.int64)[row]
    _, dtype = np.unique([info.dtype for info in infos], return_inverse=True)
    servers = list(dict.fromkeys(map(node_of, devices)))  # a node's devices share its NIC
    # Device -1 (parts without a server) picks the appended -1.
    server = np.array([servers.index(node_of(device)) for device in devices] + [-1],
                      dtype=np.intp)[table[:, 5].astype(np.intp)]
    return SyncParts([info.name for info in infos], names, row, table[:, 3].astype(np.intp),
                     flags[:, 0], flags[:, 1], table[:, 1], table[:, 2], table[:, 4], servers,
                     server, table[:, 6] != 0, table[:, 7].astype(np.int64), table[:, 8] != 0,
                     table[:, 9].astype(np.int64), table[:, 10].astype(np.int64), dtype[row],
                     table[:, 11] != 0, table[:, 12] != 0, ready_rank, flags[:, 2],
                     flags[:, 3], flags[:, 4])


def sync_parts(strategy: Any, variables: Sequence[Any], batch_size: int,
               rows_touched: Mapping[str, float]) -> Tuple[SyncParts, Any]:
    """Lists the synchronized parts of a strategy with their bytes.

    A ``CompiledStrategy`` (duck-typed: ``strategy`` and ``variables``) is read
    through its ``Strategy``, which the compiler has checked. A ``Strategy`` is
    read without the compiler's checks: scoring thousands of samples must be
    cheap, and the sampler's output compiles by construction. Compile a
    strategy of unknown origin first.

    Args:
        strategy: a ``CompiledStrategy`` or a ``Strategy``.
        variables: ``VariableInfo`` objects (unused for a ``CompiledStrategy``).
        batch_size: examples per replica and step; a sparse-gradient variable
            touches ``VariableInfo.rows_touched(batch_size)`` rows (its gathers'
            ids per example times the batch) unless ``rows_touched`` says otherwise.
        rows_touched: variable name -> rows one replica's step touches.

    Returns:
        tuple: (the parts, the ``Strategy``).

    Raises:
        StrategyError: if a ``Strategy`` lacks a config for a variable, has one
            for an unknown variable, or a part without a synchronizer (the
            compiler's checks of these, the only ones made here).
    """
    if hasattr(strategy, "variables") and hasattr(strategy, "strategy"):
        variables = [compiled.info for compiled in strategy.variables.values()]
        strategy = strategy.strategy
    by_name = {v.name: v for v in variables}
    nodes = list(strategy.node_config)  # one wrapper per node, not one per access
    node_names = [node.var_name for node in nodes]
    check_configs_match(strategy.id, node_names, list(by_name))
    names: List[str] = []
    records: List[tuple] = []  # per part; see _columns
    devices: Dict[str, int] = {}  # server device -> its number, in order of appearance
    for row, (node, name) in enumerate(zip(nodes, node_names)):
        info = by_name[name]
        partitioner = node.partitioner
        split = _split_bytes(tuple(info.shape), info.dtype, info.sparse_grad, partitioner,
                             rows_touched.get(name, info.rows_touched(batch_size)))
        for unit, (value_bytes, grad_bytes) in zip(
                node.part_config if partitioner else (node,), split):
            kind = synchronizer_kind(unit, strategy.id)
            config = getattr(unit, kind.field)
            names.append(unit.var_name)
            records.append((row, value_bytes, grad_bytes, KIND_NUMBERS[kind],
                            *kind.traffic_record(config, info, grad_bytes, devices),
                            kind.uses_collectives(config), kind.uses_remote_ops(config)))
    return _columns([by_name[name] for name in node_names], names, records, devices), strategy
