"""A predefined cost model: per-iteration synchronization time of a strategy.

The prediction is a linear combination of a few named components, each a
*feature* in its natural unit times a *weight* (:class:`CostWeights`):

* ``ring_all_reduce`` (seconds at nominal bandwidth): every dense AllReduce
  group costs ``2 (n - 1) / n * bytes / bandwidth`` for ``n`` replicas; the
  slowest link of the ring binds (the lowest NIC bandwidth when the ring spans
  several nodes, the host's local bandwidth between replicas of one node).
  fp16 compressors put floating gradients on the wire as 2-byte values.
* ``all_gather`` (seconds at nominal bandwidth): a sparse AllReduce part is
  all-gathered, ``(n - 1) * sparse bytes per replica / bandwidth``.
* ``collective_latency`` (collectives launched per step): one per dense group,
  three per sparse AllReduce part (the kernel gathers counts, values, indices).
* ``ps_transfer`` (seconds at nominal bandwidth): PS gradients pushed and
  values pulled, accumulated per resource: each node's NIC inbound, its NIC
  outbound (full duplex: ``autodist emulate`` shapes both directions
  separately) and its local bus for replicas next to the server. The busiest
  resource binds.
* ``ps_part_overhead`` (PS parts with a gradient): fixed per-part work every
  step (send, accumulate, apply, read), so that many tiny parts cost something.

The bytes behind the components, and the rules by which PS traffic loads each
resource, are in ``traffic.py``. Compute time is left out: it hardly depends on
the strategy, and the model exists to rank strategies, not to predict wall time.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Tuple

from autodist.simulator.traffic import (ClusterView, PSFlow, SyncPart, add_ps_loads,
                                        cluster_view, ps_flow, seconds, sync_parts)

COMPONENTS = ("ring_all_reduce", "all_gather", "collective_latency", "ps_transfer",
              "ps_part_overhead")
"""Names of the cost components, in report order."""

_GATHERS_PER_SPARSE_PART = 3  # the kernel gathers row counts, values and indices

@dataclasses.dataclass(frozen=True)
class CostWeights:
    """Weights of the components; the prediction is ``sum(weight * feature)``.

    Transfer weights multiply seconds at nominal bandwidth, so 1.0 means the
    link runs at its nominal rate and 1.25 means 80% of it. Count weights are
    seconds per occurrence.

    Attributes:
        ring_all_reduce: multiplier of the ring transfer time.
        all_gather: multiplier of the sparse all-gather transfer time.
        collective_latency: seconds per collective: a ring over gRPC makes
            ``2 (n - 1)`` dependent hops of some tens of microseconds each.
        ps_transfer: multiplier of the busiest PS resource's transfer time.
        ps_part_overhead: seconds per PS part and step: a handful of send,
            accumulate and apply ops, each some tens of microseconds.
    """

    ring_all_reduce: float = 1.0
    all_gather: float = 1.0
    collective_latency: float = 2e-4
    ps_transfer: float = 1.0
    ps_part_overhead: float = 1e-4


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
        binding_resource: the PS resource that binds, e.g. ``"10.0.0.1 in"``,
            or None without PS traffic.
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
                rows_touched: Optional[Mapping[str, float]] = None) -> float:
        """Predicted seconds per iteration.

        Args and Raises: as :meth:`breakdown`.

        Returns:
            float: the weighted sum of the components.
        """
        features = self._evaluate(strategy, graph_item, resource_spec, batch_size,
                                  rows_touched, keep_rows=False).features
        return sum(getattr(self.weights, name) * value for name, value in features.items())

    def breakdown(self, strategy: Any, graph_item: Any, resource_spec: Any, *, batch_size: int,
                  rows_touched: Optional[Mapping[str, float]] = None) -> CostBreakdown:
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
                variable touches ``min(rows, batch_size)`` rows unless
                ``rows_touched`` says otherwise.
            rows_touched: variable name -> rows one replica's step touches.

        Returns:
            CostBreakdown: rows, features, weighted totals and the binding resource.

        Raises:
            StrategyError: if a ``Strategy`` lacks a config for a variable, has
                one for an unknown variable, or a part without a synchronizer.
            ValueError: if ``batch_size`` is not a positive int.
        """
        charges = self._evaluate(strategy, graph_item, resource_spec, batch_size, rows_touched,
                                 keep_rows=True)
        weights = dataclasses.asdict(self.weights)
        weighted = tuple(CostRow(var, part, name, weights[name] * value)
                         for var, part, name, value in charges.rows)
        totals = {name: weights[name] * charges.features[name] for name in COMPONENTS}
        return CostBreakdown(weighted, charges.features, totals, weights, charges.binding)

    def charges(self, strategy: Any, graph_item: Any, resource_spec: Any, *, batch_size: int,
                rows_touched: Optional[Mapping[str, float]] = None) -> "Charges":
        """The unweighted features per part, with the parts and the cluster behind them.

        For callers that derive their own figures per part (the learned
        simulator's features) without paying for :class:`CostRow` objects.

        Args and Raises: as :meth:`breakdown`.
        """
        return self._evaluate(strategy, graph_item, resource_spec, batch_size, rows_touched,
                              keep_rows=True)

    def _evaluate(self, strategy, graph_item, resource_spec, batch_size, rows_touched,
                  keep_rows) -> "Charges":
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1 (per replica), got {batch_size!r}.")
        variables = getattr(graph_item, "trainable_variables", graph_item)
        parts, proto_strategy = sync_parts(strategy, variables, batch_size, rows_touched or {})
        cluster = cluster_view(proto_strategy.replicas, resource_spec, self.local_bandwidth_gbps)
        rows: Optional[List[Tuple[str, str, str, float]]] = [] if keep_rows else None
        features = dict.fromkeys(COMPONENTS, 0.0)
        ar_parts = [p for p in parts if not p.is_ps and p.has_grad]
        ps_parts = [p for p in parts if p.is_ps]
        _all_reduce_features(ar_parts, cluster, features, rows)
        # A multi-node step mixing PS and AllReduce gradients is split in two runs (README).
        split_step = (len(cluster.replicas_per_node) > 1 and bool(ar_parts)
                      and any(p.has_grad for p in ps_parts))
        binding = _ps_features(ps_parts, cluster, split_step, features, rows)
        return Charges(parts, cluster, features, rows, binding)


class Charges(NamedTuple):
    """What :meth:`CostModel.charges` returns; features and rows are unweighted.

    Attributes:
        parts: the synchronized parts, in graph order.
        cluster: the replicas per node and the link rates.
        features: component -> unweighted value.
        rows: (variable, part, component, unweighted value) per charge, or None.
        binding: the binding PS resource, e.g. ``"10.0.0.1 in"``, or None.
    """

    parts: List[SyncPart]
    cluster: ClusterView
    features: Dict[str, float]
    rows: Optional[List[Tuple[str, str, str, float]]]
    binding: Optional[str]


def _all_reduce_features(parts: List[SyncPart], cluster: ClusterView, features, rows) -> None:
    """Adds the ring, all-gather and latency features of the all-reduced parts."""
    n = cluster.num_replicas
    if n < 2 or not parts:
        return
    gbps = cluster.ring_gbps()
    groups: Dict[int, List[SyncPart]] = {}
    for part in parts:
        if part.sparse:
            gather = seconds((n - 1) * part.grad_bytes, gbps)
            features["all_gather"] += gather
            features["collective_latency"] += _GATHERS_PER_SPARSE_PART
            if rows is not None:
                rows.append((part.variable, part.part, "all_gather", gather))
                rows.append((part.variable, part.part, "collective_latency",
                             float(_GATHERS_PER_SPARSE_PART)))
        else:
            groups.setdefault(part.group, []).append(part)
    ring_factor = 2.0 * (n - 1) / n
    for members in groups.values():
        group_bytes = sum(p.wire_bytes for p in members)
        features["ring_all_reduce"] += seconds(ring_factor * group_bytes, gbps)
        features["collective_latency"] += 1.0
        if rows is not None:
            for part in members:  # a group's launch is shared evenly by its members
                rows.append((part.variable, part.part, "ring_all_reduce",
                             seconds(ring_factor * part.wire_bytes, gbps)))
                rows.append((part.variable, part.part, "collective_latency", 1.0 / len(members)))


def _ps_features(parts: List[SyncPart], cluster: ClusterView, split_step: bool, features,
                 rows) -> Optional[str]:
    """Adds the PS transfer and overhead features; returns the binding resource."""
    flows = [ps_flow(part, split_step) for part in parts]
    features["ps_part_overhead"] = float(sum(1 for part in parts if part.has_grad))
    # Loads are linear in push and read: flows alike but for their bytes are summed
    # first, so the per-node loop runs per (server, mode), not per part.
    merged: Dict[Tuple[str, bool, bool], List[float]] = {}
    for flow in flows:
        total = merged.setdefault((flow.server, flow.push_once, flow.proxy), [0.0, 0.0])
        total[0] += flow.push
        total[1] += flow.read
    loads: Dict[Tuple[str, str], float] = {}
    for (server, push_once, proxy), (push, read) in merged.items():
        add_ps_loads(loads, PSFlow(server, push_once, proxy, push, read), cluster)
    loads = {resource: num_bytes for resource, num_bytes in loads.items() if num_bytes > 0}
    binding = None
    if loads:
        binding = max(loads, key=lambda r: (seconds(loads[r], cluster.gbps(r)), r))
        features["ps_transfer"] = seconds(loads[binding], cluster.gbps(binding))
    if rows is not None:
        # A part's share of the binding resource depends on its flow alone, and
        # parts of equal size share flows: each distinct flow is charged once.
        shares: Dict[PSFlow, Optional[float]] = {}
        for part, flow in zip(parts, flows):
            if part.has_grad:
                rows.append((part.variable, part.part, "ps_part_overhead", 1.0))
            if binding is None:
                continue
            if flow not in shares:
                own: Dict[Tuple[str, str], float] = {}
                add_ps_loads(own, flow, cluster)
                shares[flow] = (seconds(own[binding], cluster.gbps(binding))
                                if own.get(binding) else None)
            if shares[flow] is not None:
                rows.append((part.variable, part.part, "ps_transfer", shares[flow]))
    return None if binding is None else f"{binding[0]} {binding[1]}"
