"""A guided random sampler of per-variable strategies, for AutoStrategy's search.

A sample is drawn in two levels. First a few strategy-wide knobs: the share of
dense and of sparse-gradient variables sent to parameter servers, the share of
optional partitions, the shares of dense and of sparse PS variables with a
local proxy (a sparse one copies its whole table), the share whose nodes sum
their replicas' gradients before the push (on a cluster with a node of
several replicas), which PS devices serve, how many AllReduce groups
there are and, when allowed, the staleness bound and the share of
fp16-compressed groups. Then every variable draws its own choices from those
shares. Drawing the shares first spreads the samples from all-AllReduce to
all-PS strategies instead of piling them up around an even mix, which
independent per-variable coin flips would do; and each share is 0 or 1 a
quarter of the time each, since with hundreds of variables a share drawn
uniformly almost never makes all of them choose alike, and such pure choices
(every dense variable on PS, each behind a proxy) are often the fastest.

The structure is never random where a rule does better: PS variables and shards
are placed with :func:`common.balanced_placement`, and AllReduce units are
spread over the chosen number of groups the same way, so servers and groups
carry balanced bytes.
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib
import math
import random
from typing import Any, Dict, List, NamedTuple, Optional, Tuple, Union

import numpy as np

from autodist import partition
from autodist.kernels.compressor import LOSSY as LOSSY_COMPRESSORS
from autodist.strategy import common
from autodist.strategy.all_reduce_builders import no_grad_node_config
from autodist.strategy.base import Strategy

Node = common.Node

__all__ = ["SamplerConstraints", "StrategySampler", "sample", "sample_many"]


@dataclasses.dataclass(frozen=True)
class SamplerConstraints:
    """What the sampler may choose.

    Attributes:
        partition_threshold_bytes: variables of at most this size are never
            partitioned (many tiny parts only add per-part overhead).
        always_partition_bytes: variables above this size are always
            partitioned, when one axis has at least ``min_partitions`` elements.
        min_partitions: fewest parts of a partitioned variable.
        max_partitions: most parts; also capped by the size of the split axis.
        max_groups: most AllReduce groups per gradient dtype; None for one per unit.
        sparse_all_reduce: sparse-gradient variables may be all-reduced
            (all-gathered); with False they always go to parameter servers.
        allow_fp16: lossy compressors (the fp16 ones) may be chosen.
        max_staleness: PS staleness bounds may go up to this (lossy; 0 keeps
            training synchronous).

    Raises:
        ValueError: naming the field and value that is out of range.
    """

    partition_threshold_bytes: int = 1 << 20
    always_partition_bytes: int = 64 << 20
    min_partitions: int = 2
    max_partitions: int = 16
    max_groups: Optional[int] = None
    sparse_all_reduce: bool = True
    allow_fp16: bool = False
    max_staleness: int = 0

    def __post_init__(self):
        if self.partition_threshold_bytes < 0:
            raise ValueError("SamplerConstraints: partition_threshold_bytes must be >= 0, got "
                             f"{self.partition_threshold_bytes!r}.")
        if self.always_partition_bytes < self.partition_threshold_bytes:
            raise ValueError(
                "SamplerConstraints: always_partition_bytes must be >= partition_threshold_bytes, "
                f"got {self.always_partition_bytes!r} < {self.partition_threshold_bytes!r}.")
        if not 2 <= self.min_partitions <= self.max_partitions:
            raise ValueError(
                "SamplerConstraints: need 2 <= min_partitions <= max_partitions, got "
                f"min_partitions={self.min_partitions!r}, max_partitions={self.max_partitions!r}.")
        common.check_int("max_groups", self.max_groups, allow_none=True)
        common.check_int("max_staleness", self.max_staleness, least=0)


class _Plan(NamedTuple):
    """One variable's cut and synchronizer choice (names and bytes of its units)."""

    partitioner: str     # "" when not partitioned
    names: List[str]
    sizes: List[int]
    is_ps: bool
    proxy: bool
    aggregate: bool      # PS: each node sums its replicas' gradients before the push


@dataclasses.dataclass(frozen=True)
class _Knobs:
    """The strategy-wide shares one sample draws first."""

    dense_ps_share: float
    sparse_ps_share: float
    partition_share: float
    dense_proxy_share: float
    sparse_proxy_share: float
    aggregate_share: float
    fp16_share: float
    staleness: int
    servers: tuple
    groups: int


def _draw_share(rng: random.Random) -> float:
    """A share in [0, 1]: 0 or 1 a quarter of the time each, else uniform."""
    draw = rng.random()
    if draw < 0.5:
        return float(draw >= 0.25)
    return rng.random()


class StrategySampler:
    """Draws random strategies for one graph and cluster under constraints.

    Every sample compiles (``compile_strategy``) against the same graph and
    cluster. Samples depend only on the generator's state, and the strategy id
    is a digest of the content, so equal strategies have equal ids.

    Args:
        item_or_variables: a ``GraphItem`` (its ``trainable_variables``) or a
            sequence of ``VariableInfo``.
        resource_spec: the cluster.
        constraints: what may be chosen.
    """

    def __init__(self, item_or_variables: Any, resource_spec: Any,
                 constraints: SamplerConstraints = SamplerConstraints()):
        variables = getattr(item_or_variables, "trainable_variables", item_or_variables)
        self._variables = list(variables)
        self._spec = resource_spec
        self._constraints = constraints
        self._ps_devices = common.ps_device_names(resource_spec)
        self._sizes = {v.name: v.size_bytes for v in self._variables}
        # Axes that can take the fewest parts, per variable; empty when none can.
        fewest = constraints.min_partitions
        self._axes = {v.name: [a for a, d in enumerate(v.shape) if int(d) >= fewest]
                      for v in self._variables}
        self._pinned_bytes = sum(v.size_bytes for v in self._variables if not v.has_grad)
        # Summing a node's replicas first only changes something on a cluster with
        # a node of several replicas.
        per_node = collections.Counter(d.host_address for d in resource_spec.replica_devices)
        self._can_aggregate = len(per_node) > 1 and max(per_node.values()) > 1
        # An upper bound of the all-reduced units, the most groups that can be useful.
        self._most_units = sum(
            constraints.max_partitions if v.size_bytes > constraints.partition_threshold_bytes
            else 1 for v in self._variables if v.has_grad)
        self._cuts: Dict[Tuple[str, int, int], Tuple[str, List[str], List[int]]] = {}
        # Node configs are copied from templates: protobuf field setters cost more
        # than one CopyFrom, and configs are built in place in the strategy, since
        # appending a finished message would copy it again.
        self._ps_templates: Dict[Tuple[str, bool, bool, int], Node] = {}
        self._no_grad_configs = {v.name: no_grad_node_config(v, self._ps_devices)
                                 for v in self._variables if not v.has_grad}

    @property
    def constraints(self) -> SamplerConstraints:
        """SamplerConstraints: what the sampler may choose."""
        return self._constraints

    def sample(self, rng: Union[random.Random, int]) -> Strategy:
        """Draws one strategy.

        Args:
            rng: a ``random.Random`` (advanced by the draw) or an int seed.

        Returns:
            Strategy: one node config per trainable variable, in graph order.
        """
        rng = random.Random(rng) if isinstance(rng, int) else rng
        knobs = self._draw_knobs(rng)
        plans = [self._plan_variable(var, knobs, rng) for var in self._variables]
        placement = self._place_ps_units(plans, knobs)
        groups, templates = self._group_ar_units(plans, knobs, rng)
        strategy = common.new_strategy(self._spec)
        configs = strategy.node_config
        for var, plan in zip(self._variables, plans):
            if plan is None:
                configs.append(self._no_grad_configs[var.name])
            else:
                self._add_node_config(configs, var, plan, placement, groups, templates, knobs)
        strategy.proto.id = ""
        digest = hashlib.sha1(strategy.proto.SerializeToString(deterministic=True)).hexdigest()
        strategy.proto.id = f"sampled-{digest[:16]}"
        return strategy

    def sample_many(self, count: int, seed: int = 0) -> List[Strategy]:
        """Draws ``count`` strategies from one generator seeded with ``seed``.

        Returns:
            list[Strategy]: the samples, in draw order (duplicates possible).
        """
        common.check_int("count", count)
        rng = random.Random(seed)
        return [self.sample(rng) for _ in range(count)]

    # ------------------------------------------------------------------ the draws

    def _draw_knobs(self, rng: random.Random) -> _Knobs:
        c = self._constraints
        num_servers = rng.randint(1, len(self._ps_devices))
        chosen = set(rng.sample(self._ps_devices, num_servers))
        servers = tuple(d for d in self._ps_devices if d in chosen)  # keep the chief first
        # Log-uniform over 1..most: a uniform draw over hundreds of counts would
        # almost never merge into a few large groups, often the fastest choice.
        most = max(1, min(c.max_groups or self._most_units, self._most_units))
        groups = min(most, int(math.exp(rng.uniform(0.0, math.log(most + 1)))))
        return _Knobs(
            dense_ps_share=_draw_share(rng),
            sparse_ps_share=_draw_share(rng) if c.sparse_all_reduce else 1.0,
            partition_share=_draw_share(rng),
            dense_proxy_share=_draw_share(rng),
            sparse_proxy_share=_draw_share(rng),
            aggregate_share=_draw_share(rng) if self._can_aggregate else 0.0,
            fp16_share=_draw_share(rng) if c.allow_fp16 else 0.0,
            staleness=rng.randint(0, c.max_staleness) if c.max_staleness else 0,
            servers=servers,
            groups=max(1, groups))

    def _plan_variable(self, var, knobs: _Knobs, rng: random.Random) -> Optional[_Plan]:
        """Decides the cut and synchronizer of one variable; None without a gradient."""
        if not var.has_grad:
            return None
        c = self._constraints
        axes = self._axes[var.name]
        size = self._sizes[var.name]
        split = bool(axes) and (size > c.always_partition_bytes or (
            size > c.partition_threshold_bytes and rng.random() < knobs.partition_share))
        num_parts = 1
        if split:
            axis = axes[0] if len(axes) == 1 else rng.choice(axes)
            num_parts = rng.randint(c.min_partitions, min(c.max_partitions, int(var.shape[axis])))
        share = knobs.sparse_ps_share if var.sparse_grad else knobs.dense_ps_share
        is_ps = rng.random() < share
        proxy = is_ps and rng.random() < (knobs.sparse_proxy_share if var.sparse_grad
                                          else knobs.dense_proxy_share)
        aggregate = is_ps and rng.random() < knobs.aggregate_share
        if num_parts == 1:
            return _Plan("", [var.name], [size], is_ps, proxy, aggregate)
        key = (var.name, axis, num_parts)
        if key not in self._cuts:
            self._cuts[key] = (partition.partitioner_string(num_parts, axis, len(var.shape)),
                               [partition.part_name(var.name, i) for i in range(num_parts)],
                               common.part_sizes_bytes(var, axis, num_parts))
        return _Plan(*self._cuts[key], is_ps, proxy, aggregate)

    def _place_ps_units(self, plans, knobs: _Knobs) -> Dict[str, str]:
        items = [(name, size) for plan in plans if plan is not None and plan.is_ps
                 for name, size in zip(plan.names, plan.sizes)]
        if not items:
            return {}
        # Variables without a gradient sit on the chief's CPU: count them when it serves.
        pinned = ({self._ps_devices[0]: self._pinned_bytes}
                  if self._ps_devices[0] in knobs.servers else None)
        return common.balanced_placement(items, knobs.servers, pinned)[0]

    def _group_ar_units(self, plans, knobs: _Knobs, rng: random.Random):
        """Returns (unit name -> group, group -> AR node config with its compressor).

        A group's gradients are concatenated into one buffer, so groups never
        mix dtypes. Sparse units are gathered one by one whatever their group;
        they join group 0. A group's compressor is drawn once for all its units.
        """
        by_dtype: Dict[str, List] = {}
        sparse_units: List[str] = []
        for var, plan in zip(self._variables, plans):
            if plan is None or plan.is_ps:
                continue
            if var.sparse_grad:
                sparse_units.extend(plan.names)
            else:
                by_dtype.setdefault(var.dtype, []).extend(zip(plan.names, plan.sizes))
        groups: Dict[str, int] = {name: 0 for name in sparse_units}
        compressors: Dict[int, str] = {}
        next_group = 0
        for dtype, items in by_dtype.items():
            ids = list(range(next_group, next_group + min(knobs.groups, len(items))))
            groups.update(common.balanced_placement(items, ids)[0])
            floating = np.issubdtype(np.dtype(dtype), np.floating)
            for group in ids:
                lossy = floating and rng.random() < knobs.fp16_share
                compressors[group] = rng.choice(LOSSY_COMPRESSORS) if lossy else "NoneCompressor"
            next_group = ids[-1] + 1
        compressors.setdefault(0, "NoneCompressor")
        # Units copy a config per compressor, then set their group: the helper's
        # enum lookups run a few times per sample rather than once per unit.
        templates = {name: common.ar_node_config("", 0, compressor=name)
                     for name in set(compressors.values())}
        return groups, {group: templates[name] for group, name in compressors.items()}

    def _add_node_config(self, configs, var, plan: _Plan, placement, groups, templates,
                         knobs: _Knobs) -> None:
        """Appends the config of a variable with a gradient to ``configs``."""
        if plan.partitioner:
            # The partitioned_node_config layout: the top node holds the partitioner only.
            configs = configs.add(var_name=var.name, partitioner=plan.partitioner).part_config
        add = configs.add
        if plan.is_ps:
            for name in plan.names:
                node = add()
                node.CopyFrom(self._ps_template(placement[name], plan.proxy, plan.aggregate,
                                                knobs.staleness))
                node.var_name = name
            return
        for name in plan.names:
            group = groups[name]
            node = add()
            node.CopyFrom(templates[group])
            node.var_name = name
            node.AllReduceSynchronizer.group = group

    def _ps_template(self, device: str, proxy: bool, aggregate: bool, staleness: int) -> Node:
        key = (device, proxy, aggregate, staleness)
        if key not in self._ps_templates:
            # On a cluster any transfer_destination makes every node sum its own replicas.
            self._ps_templates[key] = common.ps_node_config(
                "", device, proxy, sync=staleness == 0, staleness=staleness,
                transfer_destination=device if aggregate else "")
        return self._ps_templates[key]


def sample(item_or_variables: Any, resource_spec: Any, rng: Union[random.Random, int],
           constraints: SamplerConstraints = SamplerConstraints()) -> Strategy:
    """Draws one strategy; see :class:`StrategySampler` (build one to draw many).

    Returns:
        Strategy: a strategy that compiles against the graph and the cluster.
    """
    return StrategySampler(item_or_variables, resource_spec, constraints).sample(rng)


def sample_many(item_or_variables: Any, resource_spec: Any, count: int, seed: int = 0,
                constraints: SamplerConstraints = SamplerConstraints()) -> List[Strategy]:
    """Draws ``count`` strategies from a generator seeded with ``seed``.

    Returns:
        list[Strategy]: the samples in draw order.
    """
    return StrategySampler(item_or_variables, resource_spec, constraints).sample_many(count, seed)
