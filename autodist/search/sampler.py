"""A guided random sampler of per-variable strategies, for AutoStrategy's search.

A sample is drawn in two levels. First a few strategy-wide knobs: per
synchronizer kind the share of dense and of sparse-gradient variables it gets,
the share of optional partitions, and each kind's own knobs (for PS: which
devices serve, the shares with a local proxy or whose nodes sum their
replicas' gradients first, a staleness bound; for AllReduce and the sharded
update: how many groups; for AllReduce the share of fp16-compressed groups).
Then every variable draws its own choices from those shares. Drawing the
shares first spreads the samples from pure strategies of one kind to the
others instead of piling them up around an even mix, which independent
per-variable coin flips would do; half the samples give every variable one
kind, and other shares are 0 or 1 a quarter of the time each
(:func:`draw_share`), since with hundreds of variables a share drawn uniformly
almost never makes all of them choose alike, and such pure choices (every
dense variable on PS, each behind a proxy) are often the fastest.

The structure is never random where a rule does better: PS places its units
with :func:`common.balanced_placement`, so servers carry balanced bytes, and
the collective kinds cut their units, in the order the backward pass computes
their gradients, into buckets of about equal bytes (:func:`common.even_buckets`),
so the first bucket can be reduced while the backward pass goes on.
"""
from __future__ import annotations

import dataclasses
import hashlib
import random
from typing import Any, Dict, List, NamedTuple, Optional, Tuple, Union

from autodist import partition
from autodist.strategy import common
from autodist.strategy.all_reduce_builders import no_grad_node_config
from autodist.strategy.base import Strategy
from autodist.synchronizers import KINDS
from autodist.synchronizers.base import draw_share

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
    kind: str            # the synchronizer oneof field
    choices: Any         # the kind's own per-variable choices


@dataclasses.dataclass(frozen=True)
class _Knobs:
    """The strategy-wide shares one sample draws first."""

    dense_shares: Tuple[float, ...]   # per kind, in the registry's order
    sparse_shares: Tuple[float, ...]
    partition_share: float
    of_kind: Dict[str, Any]           # oneof field -> the kind's own knobs


class StrategySampler:
    """Draws random strategies for one graph and cluster under constraints.

    Every sample compiles (``compile_strategy``) against the same graph and
    cluster. Samples depend only on the generator's state, and the strategy id
    is a digest of the content, so equal strategies have equal ids. Each
    synchronizer kind makes its own choices (``SynchronizerKind.sampling``);
    this class draws the cuts and which kind each variable gets.

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
        self._sizes = {v.name: v.size_bytes for v in self._variables}
        # Axes that can take the fewest parts, per variable; empty when none can.
        fewest = constraints.min_partitions
        self._axes = {v.name: [a for a, d in enumerate(v.shape) if int(d) >= fewest]
                      for v in self._variables}
        self._cuts: Dict[Tuple[str, int, int], Tuple[str, List[str], List[int]]] = {}
        self._kinds = {field: kind.sampling(self._variables, resource_spec, constraints)
                       for field, kind in KINDS.items()}
        self._fields = list(self._kinds)
        # Per variable, the kinds it may get, as indices into the registry's order.
        self._allowed = {v.name: [i for i, sampling in enumerate(self._kinds.values())
                                  if sampling.allowed(v)] for v in self._variables}
        ps_devices = common.ps_device_names(resource_spec)
        self._no_grad_configs = {v.name: no_grad_node_config(v, ps_devices)
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
        configs: Dict[str, Node] = {}  # unit name -> the config it copies
        for field, sampling in self._kinds.items():
            units = [(var, plan) for var, plan in zip(self._variables, plans)
                     if plan is not None and plan.kind == field]
            if units:
                configs.update(sampling.configs(units, knobs.of_kind[field], rng))
        strategy = common.new_strategy(self._spec)
        nodes = strategy.node_config
        for var, plan in zip(self._variables, plans):
            if plan is None:
                nodes.append(self._no_grad_configs[var.name])
                continue
            # Configs are built in place in the strategy, since appending a
            # finished message would copy it again; the partitioned_node_config
            # layout: the top node holds the partitioner only.
            add = (nodes.add(var_name=var.name, partitioner=plan.partitioner).part_config.add
                   if plan.partitioner else nodes.add)
            for name in plan.names:
                node = add()
                node.CopyFrom(configs[name])
                node.var_name = name
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
        return _Knobs(
            dense_shares=self._draw_kind_shares(rng),
            sparse_shares=self._draw_kind_shares(rng),
            partition_share=draw_share(rng),
            of_kind={field: sampling.draw_knobs(rng) for field, sampling in self._kinds.items()})

    def _draw_kind_shares(self, rng: random.Random) -> Tuple[float, ...]:
        """Per kind, in the registry's order: half the time one kind alone, else each
        kind's share drawn uniformly (a variable's odds are in proportion to them)."""
        count = len(self._kinds)
        if rng.random() < 0.5:
            alone = rng.randrange(count)
            return tuple(float(i == alone) for i in range(count))
        return tuple(rng.random() for _ in range(count))

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
        field = self._draw_kind(var, knobs, rng)
        choices = self._kinds[field].plan(var, knobs.of_kind[field], rng)
        if num_parts == 1:
            return _Plan("", [var.name], [size], field, choices)
        key = (var.name, axis, num_parts)
        if key not in self._cuts:
            self._cuts[key] = (partition.partitioner_string(num_parts, axis, len(var.shape)),
                               [partition.part_name(var.name, i) for i in range(num_parts)],
                               common.part_sizes_bytes(var, axis, num_parts))
        return _Plan(*self._cuts[key], field, choices)

    def _draw_kind(self, var, knobs: _Knobs, rng: random.Random) -> str:
        """A kind the variable may get, with odds in proportion to the kinds' shares."""
        allowed = self._allowed[var.name]
        shares = knobs.sparse_shares if var.sparse_grad else knobs.dense_shares
        weights = [shares[i] for i in allowed]
        total = sum(weights)
        if total <= 0:  # every allowed kind's share is 0: any of them
            return self._fields[allowed[rng.randrange(len(allowed))]]
        draw = rng.random() * total
        for i, weight in zip(allowed, weights):
            if draw < weight:
                return self._fields[i]
            draw -= weight
        return self._fields[allowed[-1]]  # the draw rounded up to the total


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
