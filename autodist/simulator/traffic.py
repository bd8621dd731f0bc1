"""What a strategy puts on the wire each step: synchronized parts, their bytes, PS loads.

The cost model (``cost_model.py``) turns these bytes into named components; the
learned simulator reads the same per-part quantities as features. Parts are
held as columns (numpy arrays), so that both work per strategy, not per part.

Traffic rules for a PS part on node ``D``, each replica's gradient ``g`` bytes
(the part's bytes, or for a sparse gradient the rows it touches, see
:func:`sparse_grad_bytes`) and the part's value ``v`` bytes:

* push: each replica on another node sends ``g`` to ``D``. With a
  ``transfer_destination``, or when a multi-node step is split because the
  strategy mixes PS and AllReduce (README), a node sums its replicas' gradients
  first and sends one dense ``g``; sparse sums concatenate rows, so they do not
  shrink.
* pull: each remote replica reads ``v``; a whole sparse-gradient variable is
  read by a gather on its server, so only the touched rows travel, but a
  partitioned one is read whole, since the partitioner re-stitches its parts
  before the lookup. With a local proxy (``local_replication``, a staleness
  bound or a split step) each remote node copies the whole part once: one
  read feeds all the node's proxies, and TensorFlow's master cuts a graph by
  worker, not by device, so the value crosses the network once per node.
* staleness ``s`` refreshes proxies every ``s + 1`` steps, so pulls are divided
  by ``s + 1``; pushes are not, since every gradient is still applied.
* replicas on ``D`` itself load ``D``'s local bus instead of its NIC.

NICs are full duplex (``autodist emulate`` shapes both directions separately),
so a node's inbound and outbound bytes are separate resources. When those bytes
move in a step is given by :data:`PHASES`.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Dict, List, Mapping, NamedTuple, Sequence, Tuple

import numpy as np

from autodist import partition
from autodist.kernels.compressor import compressor_class
from autodist.resource_spec import DEFAULT_BANDWIDTH_GBPS, DeviceSpec
from autodist.strategy.base import StrategyError

Resource = Tuple[str, str]
"""``(node address, "in" | "out" | "local")``."""

DIRECTIONS = ("in", "out", "local")
"""A node's resources: its NIC inbound, its NIC outbound, its local bus."""
_IN, _OUT, _LOCAL = range(len(DIRECTIONS))

PHASES = ("push", "refresh", "read")
"""How PS bytes move in a synchronous step: gradients are pushed to the
servers; a proxy is refreshed as soon as its own part is updated, so refreshes
overlap the pushes of the parts still arriving; replicas without a proxy read
the servers in the next step's forward pass, after every update."""
_PUSH, _REFRESH, _READ = range(len(PHASES))

@functools.lru_cache(maxsize=None)
def _itemsize(dtype: str) -> int:
    return np.dtype(dtype).itemsize


@functools.lru_cache(maxsize=4096)
def node_of(device: str) -> str:
    """Returns the node address of a device string such as ``"10.0.0.1:CPU:0"``."""
    return DeviceSpec.from_string(device).host_address


def seconds(num_bytes: float, gbps: float) -> float:
    """Returns the time ``num_bytes`` take at ``gbps`` Gbit/s."""
    return num_bytes * 8.0 / (gbps * 1e9)


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


@dataclasses.dataclass(frozen=True)
class SyncParts:
    """A strategy's synchronized parts (a part is a whole variable when not partitioned).

    One entry per part in every array, in the strategy's order. The synchronizer's
    fields are read once, here: scoring reads every part of thousands of
    strategies several times, and arrays let it do so per strategy, not per part.

    Attributes:
        variables: the variables' names, in the strategy's order.
        names: each part's name.
        row: each part's variable, an index into ``variables``.
        is_ps: synchronized by a parameter server (else by all-reduce).
        has_grad: the optimizer receives a gradient for it.
        sparse: its gradient is sparse.
        value_bytes: bytes of the whole part.
        grad_bytes: bytes of one replica's gradient: the part, or the rows it touches.
        wire_bytes: that gradient as an all-reduce sends it (after compression).
        servers: node addresses of the PS servers.
        server: PS: its server, an index into ``servers``; -1 for all-reduce.
        proxy: PS: nodes keep a local copy (local_replication or a staleness bound).
        staleness: PS: the staleness bound; 0 for all-reduce.
        aggregate: PS: nodes sum their replicas' gradients (a transfer_destination).
        compressor: all-reduce: the Compressor enum value; 0 for PS.
        group: all-reduce: the group; 0 for PS.
        dtype: its variable's dtype, numbered (parts of one dtype share the number).
    """

    variables: List[str]
    names: List[str]
    row: np.ndarray
    is_ps: np.ndarray
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

    def collective(self) -> np.ndarray:
        """All-reduce: the dense collective of each part, as a number per (group, dtype) pair.

        The kernel gives each dtype of a group a buffer, and so a collective, of its own.
        """
        return self.group * (self.dtype.max(initial=0) + 1) + self.dtype


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


def _columns(infos: List[Any], names: List[str], records: List[tuple],
             devices: Dict[str, int]) -> SyncParts:
    """Turns the parts' records, built in ``sync_parts``, into :class:`SyncParts`.

    A record is ``(row, value_bytes, grad_bytes, wire_bytes, is_ps, device,
    proxy, staleness, aggregate, compressor, group)``, ``device`` numbered in
    ``devices`` (-1 for all-reduce); ``infos`` are the rows' ``VariableInfo``.
    """
    table = np.array(records, dtype=np.float64).reshape(len(records), 11)
    row = table[:, 0].astype(np.intp)
    flags = np.array([(info.has_grad, info.sparse_grad) for info in infos],
                     dtype=bool).reshape(len(infos), 2)[row]
    _, dtype = np.unique([info.dtype for info in infos], return_inverse=True)
    servers = list(dict.fromkeys(map(node_of, devices)))  # a node's devices share its NIC
    # Device -1 (all-reduce parts) picks the appended -1.
    server = np.array([servers.index(node_of(device)) for device in devices] + [-1],
                      dtype=np.intp)[table[:, 5].astype(np.intp)]
    return SyncParts([info.name for info in infos], names, row, table[:, 4] != 0,
                     flags[:, 0], flags[:, 1], table[:, 1], table[:, 2], table[:, 3], servers,
                     server, table[:, 6] != 0, table[:, 7].astype(np.int64), table[:, 8] != 0,
                     table[:, 9].astype(np.int64), table[:, 10].astype(np.int64), dtype[row])


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
            touches ``min(rows, batch_size)`` rows unless ``rows_touched`` says otherwise.
        rows_touched: variable name -> rows one replica's step touches.

    Returns:
        tuple: (the parts, the ``Strategy``).

    Raises:
        StrategyError: if a ``Strategy`` lacks a config for a variable, has one
            for an unknown variable, or a part without a synchronizer.
    """
    if hasattr(strategy, "variables") and hasattr(strategy, "strategy"):
        variables = [compiled.info for compiled in strategy.variables.values()]
        strategy = strategy.strategy
    by_name = {v.name: v for v in variables}
    nodes = list(strategy.node_config)  # one wrapper per node, not one per access
    node_names = [node.var_name for node in nodes]
    configured = set(node_names)
    missing = [name for name in by_name if name not in configured]
    extra = sorted(configured - set(by_name))
    if missing or extra:
        raise StrategyError(f"Cost model: strategy {strategy.id} does not match the variables: "
                            f"without a config {missing}; configs for unknown variables {extra}.")
    names: List[str] = []
    records: List[tuple] = []  # per part; see _columns
    devices: Dict[str, int] = {}  # PS device -> its number, in order of appearance
    for row, (node, name) in enumerate(zip(nodes, node_names)):
        info = by_name[name]
        partitioner = node.partitioner
        split = _split_bytes(tuple(info.shape), info.dtype, info.sparse_grad, partitioner,
                             rows_touched.get(name, batch_size))
        # Inlined rather than a function per part: this loop runs for every part of
        # thousands of candidates, and a call costs as much as the work.
        for unit, (value_bytes, grad_bytes) in zip(
                node.part_config if partitioner else (node,), split):
            kind = unit.WhichOneof("synchronizer")
            names.append(unit.var_name)
            if kind == "PSSynchronizer":
                sync = unit.PSSynchronizer
                staleness = sync.staleness
                records.append((row, value_bytes, grad_bytes, grad_bytes, True,
                                devices.setdefault(sync.reduction_destination, len(devices)),
                                sync.local_replication or staleness > 0, staleness,
                                sync.transfer_destination != "", 0, 0))
            elif kind == "AllReduceSynchronizer":
                sync = unit.AllReduceSynchronizer
                compressor = sync.compressor
                wire_bytes = compressor_class(compressor).wire_bytes(
                    grad_bytes, info.dtype, info.sparse_grad)
                records.append((row, value_bytes, grad_bytes, wire_bytes, False, -1, False, 0,
                                False, compressor, sync.group))
            else:
                raise StrategyError(f"Cost model: '{unit.var_name}' has no synchronizer; set "
                                    "PSSynchronizer or AllReduceSynchronizer.")
    return _columns([by_name[name] for name in node_names], names, records, devices), strategy


class PSFlows(NamedTuple):
    """How PS parts' bytes move each step, one entry per part; loads are linear in push and read."""

    server: np.ndarray     # index into the parts' servers
    push_once: np.ndarray  # a node sends one summed gradient, not one per replica
    proxy: np.ndarray      # a node pulls one copy for all its replicas
    push: np.ndarray       # one replica's gradient bytes
    read: np.ndarray       # bytes one read moves, already divided by the refresh period


def ps_flows(parts: SyncParts, index: np.ndarray, split_step: bool) -> PSFlows:
    """Applies the module's traffic rules to the PS parts ``index`` of ``parts``."""
    proxy = parts.proxy[index] | split_step
    sparse = parts.sparse[index]
    grad_bytes = parts.grad_bytes[index]
    partitioned = np.bincount(parts.row, minlength=len(parts.variables))[parts.row[index]] > 1
    read = np.where(sparse & ~proxy & ~partitioned, grad_bytes, parts.value_bytes[index])
    return PSFlows(parts.server[index], (parts.aggregate[index] | split_step) & ~sparse, proxy,
                   np.where(parts.has_grad[index], grad_bytes, 0.0),
                   read / (parts.staleness[index] + 1))


def step_nodes(cluster: ClusterView, servers: List[str]) -> Tuple[List[str], np.ndarray]:
    """The nodes a step runs on, and each server's index among them.

    Returns:
        tuple: (the nodes: the replicas' first, then servers without replicas;
        for each of ``servers`` its index in the nodes, then -1, so that an
        all-reduced part's server -1 picks -1).
    """
    nodes = list(cluster.replicas_per_node)
    nodes += [node for node in servers if node not in cluster.replicas_per_node]
    return nodes, np.array([nodes.index(node) for node in servers] + [-1], dtype=np.intp)


def ps_loads(flows: PSFlows, servers: List[str],
             cluster: ClusterView) -> Tuple[List[str], np.ndarray]:
    """The bytes each flow puts on every resource per step.

    Args:
        flows: from :func:`ps_flows`.
        servers: the node addresses ``flows.server`` indexes.
        cluster: the replicas per node.

    Returns:
        tuple: (the nodes: the replicas' first, then other servers; the bytes,
        ``[phase (PHASES), node, direction (DIRECTIONS), flow]``).
    """
    nodes, server_node = step_nodes(cluster, servers)
    server = server_node[flows.server]
    flow = np.arange(len(server))
    loads = np.zeros((len(PHASES), len(nodes), len(DIRECTIONS), len(server)))
    push, pull = loads[_PUSH], np.zeros_like(loads[_PUSH])
    for node, count in enumerate(cluster.replicas_per_node.values()):
        here = server == node
        reads = np.where(flows.proxy, flows.read, count * flows.read)
        push[node, _LOCAL] += np.where(here, count * flows.push, 0.0)
        pull[node, _LOCAL] += np.where(here, reads, 0.0)
        sent = np.where(here, 0.0, np.where(flows.push_once, flows.push, count * flows.push))
        reads = np.where(here, 0.0, reads)
        push[node, _OUT] += sent
        push[server, _IN, flow] += sent
        pull[server, _OUT, flow] += reads
        pull[node, _IN] += reads
    loads[_REFRESH] = np.where(flows.proxy, pull, 0.0)
    loads[_READ] = np.where(flows.proxy, 0.0, pull)
    return nodes, loads
