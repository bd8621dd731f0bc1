"""A predefined cost model: per-iteration synchronization time of a strategy.

The prediction is a linear combination of a few named components, each a
*feature* in its natural unit times a *weight* (:class:`CostWeights`):

* ``ring_all_reduce`` (seconds at nominal bandwidth): every dense AllReduce
  group costs ``2 (n - 1) / n * bytes / bandwidth`` for ``n`` replicas; the
  slowest link of the ring binds (the lowest NIC bandwidth when the ring spans
  several nodes, the host's local bandwidth between replicas of one node).
  A group sends what its compressor class puts on the wire (fp16: 2-byte values).
* ``scatter_gather`` (seconds at nominal bandwidth): a dense group whose spec is
  ``SCATTER_GATHER`` costs ``2 (m - 1) / m * bytes / bandwidth`` across ``m``
  nodes, each node's replicas summed locally first
  (``scatter_gather.transfer_seconds``).
* ``all_gather`` (seconds at nominal bandwidth): a sparse AllReduce part is
  all-gathered, ``(n - 1) * sparse bytes per replica / bandwidth``.
* ``collective_latency`` (reductions launched per step): one per dtype of a
  dense group, ring or scatter-gather (the kernel reduces each dtype in a
  buffer of its own; the sampler's groups hold one), three per sparse
  AllReduce part (the kernel gathers counts, values, indices).
* ``all_reduce_part_overhead`` (all-reduced parts with a gradient): fixed work
  per part and step on every replica: its gradient is copied into and out of
  its collective's buffer and the part is updated on its own, so cutting
  variables into many parts costs time even when the bytes do not change.
* ``ps_transfer`` (seconds at nominal bandwidth): PS gradients pushed and
  values pulled, accumulated per resource: each node's NIC inbound, its NIC
  outbound (full duplex: ``autodist emulate`` shapes both directions
  separately) and its local bus for replicas next to the server. Proxies are
  refreshed part by part as the parts are updated, overlapping the other
  parts' pushes, so pushes and refreshes load the resources together; but a
  server's pushes arrive together, at the end, so its largest part's refresh
  overlaps nothing and may add to the pushes' time. Direct reads of the
  servers come after every update, so the busiest resource of the pushes and
  refreshes and that of the reads add up.
* ``ps_part_overhead`` (PS parts with a gradient): fixed per-part work every
  step (send, accumulate, apply, read), so that many tiny parts cost something.
* ``ps_serving_nodes`` (nodes serving PS parts with a gradient, on a cluster):
  as measured, each such node adds a fixed time to every step beyond its bytes
  (``docs/notes/auto_strategy.md``; its cause is not pinned down).
* ``split_step`` (1 when a cluster's step mixes PS and AllReduce gradients): the
  step runs twice, its PS traffic waits for the collectives, and every node
  waits for the slowest at the barrier in between.
* ``optimizer_update`` (GB of variables the busiest node updates, on a
  cluster): the optimizer's update runs where a variable lives, on its server
  for PS and on every node for AllReduce (each node keeps a copy), so it costs
  CPU time that PS placement can spread over the nodes and AllReduce cannot.
  A table whose update runs by rows (``VariableInfo.update_mode``) counts the
  rows its gradients touch, not its every row. On one node every strategy
  updates every variable there, so it is left out.
* ``overlap`` (seconds at nominal bandwidth, a negative weight): the transfer
  of a dense all-reduce group that can run while the backward pass computes
  the gradients after its own: its transfer time times the share of gradients
  ready after its last one. More, smaller buckets raise it and pay
  ``collective_latency`` per bucket; that is the trade AutoStrategy makes.

Each synchronizer kind charges its own parts (``SynchronizerKind.cost``; the
rules by which PS traffic loads each resource are in ``synchronizers/ps.py``);
this module adds the split step and the optimizer update, which depend on every
kind at once. The bytes behind the components are in ``traffic.py``. Compute time is left out: it hardly depends on
the strategy, and the model exists to rank strategies, not to predict wall time.

With gradient accumulation over ``k`` runs every component is paid once per
``k`` runs, for the gradients of ``k`` batches (a sparse gradient carries the
rows of all ``k``): the model charges a run ``1 / k`` of such a sync.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, Mapping, NamedTuple, Optional, Tuple, Union

import numpy as np

from autodist.network import ClusterView, cluster_view, in_order_sum
from autodist.simulator.traffic import KIND_NUMBERS, SyncParts, sync_parts

COMPONENTS = ("ring_all_reduce", "scatter_gather", "all_gather", "collective_latency",
              "all_reduce_part_overhead", "ps_transfer", "ps_part_overhead", "ps_serving_nodes",
              "split_step", "optimizer_update", "overlap")
"""Names of the cost components, in report order."""

@dataclasses.dataclass(frozen=True)
class CostWeights:
    """Weights of the components; the prediction is ``sum(weight * feature)``.

    Transfer weights multiply seconds at nominal bandwidth, so 1.0 means the
    link runs at its nominal rate and 1.25 means 80% of it. Count weights are
    seconds per occurrence.

    Attributes:
        ring_all_reduce: multiplier of the ring transfer time.
        scatter_gather: multiplier of the scatter-gather transfer time: below the
            ring's, as that path spends less CPU per byte (0.10 against 0.15 CPU s
            per process for 42 MB on 4 nodes, ``docs/notes/peers.md``), which
            binds once links are fast.
        all_gather: multiplier of the sparse all-gather transfer time.
        collective_latency: seconds per collective: a ring over gRPC makes
            ``2 (n - 1)`` dependent hops of some tens of microseconds each.
        all_reduce_part_overhead: seconds per all-reduced part and step;
            fitted on the mlp trials of ``benchmarks/auto_vs_builders.py``
            (0.8-1.3 ms, ``docs/notes/auto_strategy.md``), where four replicas share
            two cores.
        ps_transfer: multiplier of the busiest PS resource's transfer time.
        ps_part_overhead: seconds per PS part and step: a handful of send,
            accumulate and apply ops, each some tens of microseconds.
        ps_serving_nodes: seconds per serving node and step, and
        split_step: seconds per split step; both as measured on the emulated
            clusters of ``benchmarks/auto_vs_builders.py`` (four nodes sharing
            two cores, where a barrier also makes every node compute at once).
            The learned simulator corrects them for the cluster at hand.
        optimizer_update: seconds per GB of variables updated on the busiest
            node: tf.compat.v1 Adam reads and writes the variable, its two
            slots and the gradient; fitted on the mlp trials of
            ``benchmarks/auto_vs_builders.py`` (``docs/notes/auto_strategy.md``).
        overlap: multiplier of the overlappable transfer time, negative: -1
            hides all of it, as the CNN of ``benchmarks/overlap.py`` does (2
            nodes at 1 Gbit/s, ``AllReduce``: 45 ms overlappable, 51 ms hidden,
            ``docs/benchmarks.md``). A transfer hides only behind compute that
            is there, and the model does not know the compute: the 42 MB MLP of
            ``benchmarks/peers.py`` at 8 rows per replica computes its backward
            pass in some 20 ms against 0.5 s of transfer, and hides next to
            nothing. The default takes half; the trials' calibration refits it.
    """

    ring_all_reduce: float = 1.0
    scatter_gather: float = 0.8
    all_gather: float = 1.0
    collective_latency: float = 2e-4
    all_reduce_part_overhead: float = 1e-3
    ps_transfer: float = 1.0
    ps_part_overhead: float = 1e-4
    ps_serving_nodes: float = 0.04
    split_step: float = 0.05
    optimizer_update: float = 2.0
    overlap: float = -0.5


@dataclasses.dataclass(frozen=True)
class CostRow:
    """What one variable part contributes to one component, in seconds (weighted)."""

    variable: str
    part: str
    component: str
    seconds: float


@dataclasses.dataclass(frozen=True)
class CostBreakdown:
    """A prediction, explained.

    Attributes:
        rows: per-part contributions; together they add up to ``total``.
        features: component -> unweighted value (for fitting weights later).
        totals: component -> seconds (weighted), every component present.
        weights: component -> weight used.
        binding_resource: the PS resource that binds in each phase, e.g.
            ``"10.0.0.1 in (push, refresh), 10.0.0.1 out (read)"``, or None without PS traffic.
    """

    rows: Tuple[CostRow, ...]
    features: Dict[str, float]
    totals: Dict[str, float]
    weights: Dict[str, float]
    binding_resource: Optional[str]

    @property
    def total(self) -> float:
        """float: predicted seconds per iteration."""
        return sum(self.totals.values())

    def per_variable(self) -> Dict[str, float]:
        """Returns variable -> seconds, in the order variables first appear in ``rows``."""
        out: Dict[str, float] = {}
        for row in self.rows:
            out[row.variable] = out.get(row.variable, 0.0) + row.seconds
        return out


class CostModel:
    """Predicts per-iteration synchronization time; see the module docstring.

    Args:
        weights: the component weights.
        local_bandwidth_gbps: rate of copies between devices of one node
            (memory or PCIe), far above a NIC's; 50 Gbit/s is a conservative
            memcpy rate for tensors crossing TensorFlow devices.
    """

    def __init__(self, weights: CostWeights = CostWeights(), local_bandwidth_gbps: float = 50.0):
        if local_bandwidth_gbps <= 0:
            raise ValueError(f"local_bandwidth_gbps must be > 0, got {local_bandwidth_gbps!r}.")
        self.weights = weights
        self.local_bandwidth_gbps = float(local_bandwidth_gbps)

    def __repr__(self) -> str:
        return (f"CostModel(weights={self.weights!r}, "
                f"local_bandwidth_gbps={self.local_bandwidth_gbps!r})")

    def predict(self, strategy: Any, graph_item: Any, resource_spec: Any, *, batch_size: int,
                rows_touched: Optional[Mapping[str, float]] = None,
                accumulation_steps: int = 1) -> float:
        """Predicted seconds per iteration.

        Args and Raises: as :meth:`breakdown`.

        Returns:
            float: the weighted sum of the components.
        """
        features = self.charges(strategy, graph_item, resource_spec, batch_size=batch_size,
                                rows_touched=rows_touched,
                                accumulation_steps=accumulation_steps).features
        return sum(getattr(self.weights, name) * value for name, value in features.items())

    def breakdown(self, strategy: Any, graph_item: Any, resource_spec: Any, *, batch_size: int,
                  rows_touched: Optional[Mapping[str, float]] = None,
                  accumulation_steps: int = 1) -> CostBreakdown:
        """Explains the prediction per variable part and per component.

        Args:
            strategy: a ``CompiledStrategy`` (from ``compile_strategy``), or a
                ``Strategy``, read without the compiler's checks so that
                scoring thousands of samples stays cheap; compile a strategy
                of unknown origin first.
            graph_item: a ``GraphItem``, or a list of ``VariableInfo``; unused
                for a ``CompiledStrategy``.
            resource_spec: the cluster; its ``network_bandwidth`` (Gbit/s) per
                node, ``DEFAULT_BANDWIDTH_GBPS`` for a node it lacks.
            batch_size: examples per replica and step; a sparse-gradient
                variable touches ``VariableInfo.rows_touched(batch_size)`` rows
                (its gathers' ids per example times the batch) unless
                ``rows_touched`` says otherwise.
            rows_touched: variable name -> rows one replica's step touches.
            accumulation_steps: runs per sync (``AutoDist(accumulation_steps=...)``);
                every figure is per run.

        Returns:
            CostBreakdown: rows, features, weighted totals and the binding resource.

        Raises:
            StrategyError: if a ``Strategy`` lacks a config for a variable, has
                one for an unknown variable, or a part without a synchronizer.
            ValueError: if ``batch_size`` or ``accumulation_steps`` is not a positive int.
        """
        charges = self.charges(strategy, graph_item, resource_spec, batch_size=batch_size,
                               rows_touched=rows_touched, accumulation_steps=accumulation_steps)
        weights = dataclasses.asdict(self.weights)
        parts = charges.parts
        rows = parts.row.tolist()
        weighted = tuple(
            CostRow(parts.variables[rows[part]], parts.names[part], COMPONENTS[component],
                    weights[COMPONENTS[component]] * value)
            for part, component, value in zip(charges.part.tolist(), charges.component.tolist(),
                                              charges.value.tolist()))
        totals = {name: weights[name] * charges.features[name] for name in COMPONENTS}
        return CostBreakdown(weighted, charges.features, totals, weights, charges.binding)

    def charges(self, strategy: Any, graph_item: Any, resource_spec: Any, *, batch_size: int,
                rows_touched: Optional[Mapping[str, float]] = None,
                accumulation_steps: int = 1) -> "Charges":
        """The unweighted features, per part and in all, with the parts and the cluster behind them.

        For callers that derive their own figures per part (the learned
        simulator's features) without paying for :class:`CostRow` objects.

        Args and Raises: as :meth:`breakdown`.
        """
        for name, value in (("batch_size", batch_size), ("accumulation_steps", accumulation_steps)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}.")
        variables = getattr(graph_item, "trainable_variables", graph_item)
        # A sync carries the rows of every run of its cycle.
        touched = {name: rows * accumulation_steps for name, rows in (rows_touched or {}).items()}
        parts, proto_strategy = sync_parts(strategy, variables, batch_size * accumulation_steps,
                                           touched)
        cluster = cluster_view(proto_strategy.replicas, resource_spec, self.local_bandwidth_gbps)
        of_kind = [(kind, parts.of_kind(kind)) for kind in KIND_NUMBERS]
        # A multi-node step mixing collectives with ops on other nodes' devices is
        # split in two runs (README).
        split_step = (cluster.multi_node and (parts.collective & parts.has_grad).any()
                      and (parts.remote_ops & parts.has_grad).any())
        features = dict.fromkeys(COMPONENTS, 0.0)
        charged, bindings = [], []
        for kind, index in of_kind:
            if not index.size:
                continue
            cost = kind.cost(parts, index, cluster, split_step)
            for name, value in cost.features.items():  # kinds may share a component
                features[name] += value
            charged.extend(_interleave(part, *specs) for part, specs in cost.charges)
            if cost.binding:
                bindings.append(cost.binding)
        if split_step:
            with_grad = np.flatnonzero(parts.has_grad)
            features["split_step"] = 1.0
            charged.append(_interleave(with_grad, ("split_step", 1.0 / len(with_grad), True)))
        if cluster.multi_node:
            update, update_charges = _update_charges(parts, of_kind, cluster)
            features["optimizer_update"] = update
            charged.append(update_charges)
        part, component, value = (np.concatenate(column) for column in zip(*charged)) \
            if charged else (np.zeros(0, np.intp), np.zeros(0, np.intp), np.zeros(0))
        if accumulation_steps > 1:  # one sync per cycle
            features = {name: total / accumulation_steps for name, total in features.items()}
            value = value / accumulation_steps
        return Charges(parts, cluster, features, part, component, value,
                       ", ".join(bindings) or None)


class Charges(NamedTuple):
    """What :meth:`CostModel.charges` returns; features and charges are unweighted.

    The charges are columns, one entry per charge, in a fixed order, so that
    sums over them round alike every time: each kind's, in the registry's order
    and as the kind lists them, then the split step's shares, then the busiest
    node's updates.

    Attributes:
        parts: the synchronized parts.
        cluster: the replicas per node and the link rates.
        features: component -> unweighted value.
        part: the part charged, an index into ``parts``.
        component: the component charged, an index into ``COMPONENTS``.
        value: the unweighted value charged.
        binding: the binding PS resources, as ``CostBreakdown.binding_resource``.
    """

    parts: SyncParts
    cluster: ClusterView
    features: Dict[str, float]
    part: np.ndarray
    component: np.ndarray
    value: np.ndarray
    binding: Optional[str]


_Column = Union[float, np.ndarray]
_Charged = Tuple[np.ndarray, np.ndarray, np.ndarray]  # part, component, value


def _interleave(index: np.ndarray, *charges: Tuple[str, _Column, _Column]) -> _Charged:
    """The charges of the parts ``index``, part by part, each part's in the order of ``charges``.

    Args:
        index: the parts charged.
        charges: ``(component, value, where)``: the value charged and whether it
            is charged at all, each per part or one for all.
    """
    part = np.repeat(index, len(charges))
    component = np.tile([COMPONENTS.index(name) for name, _, _ in charges], len(index))
    value = np.stack([np.broadcast_to(v, index.shape) for _, v, _ in charges], axis=1).ravel()
    where = np.stack([np.broadcast_to(w, index.shape) for _, _, w in charges], axis=1).ravel()
    return part[where], component[where], value[where]


def _update_charges(parts: SyncParts, of_kind: list, cluster: ClusterView
                    ) -> Tuple[float, _Charged]:
    """The optimizer-update feature: GB of variable parts the busiest node updates (of
    a part updated by rows, the rows its gradients touch).

    Each kind says which share of its parts each node updates
    (``SynchronizerKind.update_shares``); the parts updated on the busiest node
    are charged their GB times that node's share.

    Returns:
        tuple: (the feature, the charges).
    """
    nodes, server_node = cluster.step_nodes(parts.servers)
    shares = np.zeros((len(nodes), len(parts.names)))
    for kind, index in of_kind:
        if index.size:
            shares[:, index] = kind.update_shares(parts, index, nodes,
                                                  server_node[parts.server[index]], cluster)
    updated = np.flatnonzero(parts.has_grad)
    # An update by rows runs on the rows the replicas' gradients touch, at most the part.
    by_rows = np.minimum(parts.value_bytes, parts.grad_bytes * cluster.num_replicas)
    gigabytes = np.where(parts.updated_by_rows & parts.sparse, by_rows,
                         parts.value_bytes)[updated] / 1e9
    shares = shares[:, updated]
    busiest = int(np.argmax(shares @ gigabytes))
    charged = shares[busiest] > 0
    on_busiest = gigabytes[charged] * shares[busiest][charged]
    return (in_order_sum(on_busiest),
            _interleave(updated[charged], ("optimizer_update", on_busiest, True)))
