"""What a strategy puts on the wire each step: synchronized parts, their bytes, PS loads.

The cost model (``cost_model.py``) turns these bytes into named components; the
learned simulator will read the same per-part quantities as features.

Traffic rules for a PS part on node ``D``, each replica's gradient ``g`` bytes
(the part's bytes, or for a sparse gradient the rows it touches, see
:func:`sparse_grad_bytes`) and the part's value ``v`` bytes:

* push: each replica on another node sends ``g`` to ``D``. With a
  ``transfer_destination``, or when a multi-node step is split because the
  strategy mixes PS and AllReduce (README), a node sums its replicas' gradients
  first and sends one dense ``g``; sparse sums concatenate rows, so they do not
  shrink.
* pull: each remote replica reads ``v``; a sparse-gradient variable is read by a
  gather on its server, so only the touched rows travel. With a local proxy
  (``local_replication``, a staleness bound or a split step) each remote node
  copies the whole part once.
* staleness ``s`` refreshes proxies every ``s + 1`` steps, so pulls are divided
  by ``s + 1``; pushes are not, since every gradient is still applied.
* replicas on ``D`` itself load ``D``'s local bus instead of its NIC.

NICs are full duplex (``autodist emulate`` shapes both directions separately),
so a node's inbound and outbound bytes are separate resources.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Dict, List, Mapping, NamedTuple, Tuple

import numpy as np

from autodist.resource_spec import DEFAULT_BANDWIDTH_GBPS, DeviceSpec
from autodist.strategy import common
from autodist.strategy.base import StrategyError

Resource = Tuple[str, str]
"""``(node address, "in" | "out" | "local")``."""

_FP16_BYTES = 2


@functools.lru_cache(maxsize=None)
def _itemsize(dtype: str) -> int:
    return np.dtype(dtype).itemsize


@functools.lru_cache(maxsize=None)
def _is_floating(dtype: str) -> bool:
    return np.issubdtype(np.dtype(dtype), np.floating)


@functools.lru_cache(maxsize=4096)
def node_of(device: str) -> str:
    """Returns the node address of a device string such as ``"10.0.0.1:CPU:0"``."""
    return DeviceSpec.from_string(device).host_address


def seconds(num_bytes: float, gbps: float) -> float:
    """Returns the time ``num_bytes`` take at ``gbps`` Gbit/s."""
    return num_bytes * 8.0 / (gbps * 1e9)


def _num_elements(shape) -> int:
    return math.prod(map(int, shape))


def sparse_grad_bytes(var_shape, part_shape, axis: int, dtype: str, rows_touched: float) -> float:
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
class ClusterView:
    """The replicas a strategy uses, per node, with link rates in Gbit/s."""

    replicas_per_node: Dict[str, int]
    nic_gbps: Dict[str, float]
    local_gbps: float

    @property
    def num_replicas(self) -> int:
        """int: replicas in all."""
        return sum(self.replicas_per_node.values())

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


def cluster_view(replicas, resource_spec: Any, local_gbps: float) -> ClusterView:
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


class SyncPart(NamedTuple):
    """One synchronized part (a whole variable when not partitioned) and its bytes per step.

    The synchronizer's fields are read once, here: scoring reads every part
    several times, and a proto field costs far more than a tuple's.
    """

    variable: str
    part: str
    is_ps: bool
    has_grad: bool
    sparse: bool
    value_bytes: float   # the whole part
    grad_bytes: float    # one replica's gradient: the part, or the rows it touches
    wire_bytes: float    # that gradient as an all-reduce sends it (after compression)
    server: str          # PS: the node address of its server; "" for all-reduce
    proxy: bool          # PS: nodes keep a local copy (local_replication or a staleness bound)
    staleness: int       # PS: the staleness bound
    aggregate: bool      # PS: nodes sum their replicas' gradients (a transfer_destination)
    compressor: int      # all-reduce: the Compressor enum value; 0 for PS
    group: int           # all-reduce: the group; 0 for PS


def _part_bytes(info, axis: int, shape, touched: float) -> Tuple[float, float]:
    """(bytes of a part's value, bytes of one replica's gradient of it)."""
    value_bytes = float(_num_elements(shape) * _itemsize(info.dtype))
    grad_bytes = (sparse_grad_bytes(info.shape, shape, axis, info.dtype, touched)
                  if info.sparse_grad else value_bytes)
    return value_bytes, grad_bytes


def _sync_part(info, name: str, sync, is_ps: bool, value_bytes: float,
               grad_bytes: float) -> SyncPart:
    if is_ps:
        staleness = sync.staleness
        return SyncPart(info.name, name, True, info.has_grad, info.sparse_grad, value_bytes,
                        grad_bytes, grad_bytes, node_of(sync.reduction_destination),
                        bool(sync.local_replication or staleness > 0), staleness,
                        bool(sync.transfer_destination), 0, 0)
    compressor = sync.compressor
    wire_bytes = grad_bytes
    # fp16 compressors change floating dense gradients only; sparse ones are gathered as they are.
    if compressor and _is_floating(info.dtype) and not info.sparse_grad:
        wire_bytes = grad_bytes * _FP16_BYTES / _itemsize(info.dtype)
    return SyncPart(info.name, name, False, info.has_grad, info.sparse_grad, value_bytes,
                    grad_bytes, wire_bytes, "", False, 0, False, compressor, sync.group)


def sync_parts(strategy: Any, variables, batch_size: int,
               rows_touched: Mapping[str, float]) -> Tuple[List[SyncPart], Any]:
    """Lists the synchronized parts of a strategy with their bytes.

    A ``CompiledStrategy`` (duck-typed: ``strategy`` and ``variables``) gives its
    parts as compiled. A ``Strategy`` is read directly, without the compiler's
    checks: scoring thousands of samples must be cheap, and the sampler's output
    compiles by construction. Compile a strategy of unknown origin first.

    Args:
        strategy: a ``CompiledStrategy`` or a ``Strategy``.
        variables: ``VariableInfo`` objects (unused for a ``CompiledStrategy``).
        batch_size: examples per replica and step; a sparse-gradient variable
            touches ``min(rows, batch_size)`` rows unless ``rows_touched`` says otherwise.
        rows_touched: variable name -> rows one replica's step touches.

    Returns:
        tuple: (the parts in graph order, the ``Strategy``).

    Raises:
        StrategyError: if a ``Strategy`` lacks a config for a variable, has one
            for an unknown variable, or a part without a synchronizer.
    """
    parts: List[SyncPart] = []
    if hasattr(strategy, "variables") and hasattr(strategy, "strategy"):
        for compiled in strategy.variables.values():
            info = compiled.info
            axis = compiled.plan.axis if compiled.plan is not None else 0
            touched = rows_touched.get(info.name, batch_size)
            parts.extend(_sync_part(info, part.name, part.synchronizer, part.is_ps,
                                    *_part_bytes(info, axis, part.shape, touched))
                         for part in compiled.parts)
        return parts, strategy.strategy
    by_name = {v.name: v for v in variables}
    nodes = list(strategy.node_config)  # one wrapper per node, not one per access
    configured = {node.var_name for node in nodes}
    missing = [name for name in by_name if name not in configured]
    extra = sorted(configured - set(by_name))
    if missing or extra:
        raise StrategyError(f"Cost model: strategy {strategy.id} does not match the variables: "
                            f"without a config {missing}; configs for unknown variables {extra}.")
    for node in nodes:
        info = by_name[node.var_name]
        touched = rows_touched.get(info.name, batch_size)
        partitioner = node.partitioner
        if partitioner:
            counts = [int(c) for c in partitioner.split(",")]
            axis = next((i for i, c in enumerate(counts) if c > 1), 0)
            units = zip(node.part_config, common.part_shapes(info.shape, axis, counts[axis]))
        else:
            axis, units = 0, ((node, tuple(info.shape)),)
        part_bytes = {}  # by shape: a variable's parts differ by one row at most
        for unit, shape in units:
            kind = unit.WhichOneof("synchronizer")
            if kind is None:
                raise StrategyError(f"Cost model: '{unit.var_name}' has no synchronizer; set "
                                    "PSSynchronizer or AllReduceSynchronizer.")
            if shape not in part_bytes:
                part_bytes[shape] = _part_bytes(info, axis, shape, touched)
            parts.append(_sync_part(info, unit.var_name, getattr(unit, kind),
                                    kind == "PSSynchronizer", *part_bytes[shape]))
    return parts, strategy


class PSFlow(NamedTuple):
    """How one PS part's bytes move each step; loads are linear in ``push`` and ``read``."""

    server: str
    push_once: bool   # a node sends one summed gradient, not one per replica
    proxy: bool       # a node pulls one copy for all its replicas
    push: float       # one replica's gradient bytes
    read: float       # bytes one read moves, already divided by the refresh period


def ps_flow(part: SyncPart, split_step: bool) -> PSFlow:
    """Applies the module's traffic rules to one PS part."""
    proxy = part.proxy or split_step
    aggregate = part.aggregate or split_step
    read = part.grad_bytes if part.sparse and not proxy else part.value_bytes
    return PSFlow(part.server, aggregate and not part.sparse, proxy,
                  part.grad_bytes if part.has_grad else 0.0, read / (part.staleness + 1))


def add_ps_loads(loads: Dict[Resource, float], flow: PSFlow, cluster: ClusterView) -> None:
    """Adds the bytes ``flow`` puts on every resource to ``loads`` (mutated)."""
    server = flow.server
    for node, count in cluster.replicas_per_node.items():
        pull = flow.read if flow.proxy else count * flow.read
        if node == server:
            loads[(node, "local")] = loads.get((node, "local"), 0.0) + count * flow.push + pull
            continue
        sent = flow.push if flow.push_once else count * flow.push
        for resource, num_bytes in (((node, "out"), sent), ((server, "in"), sent),
                                    ((server, "out"), pull), ((node, "in"), pull)):
            loads[resource] = loads.get(resource, 0.0) + num_bytes
