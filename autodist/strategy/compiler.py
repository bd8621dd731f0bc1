"""compile_strategy: validate a Strategy against a graph and cluster, before any rewrite.

The result says, for every trainable variable, how it is cut and how each part is
synchronized, in the form the kernels consume.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Union

from autodist.graph_item import GraphItem, VariableInfo
from autodist.partition import PartitionPlan, parse_partitioner
from autodist.proto import synchronizers_pb2
from autodist.resource_spec import ResourceSpec
from autodist.strategy.base import Strategy, StrategyError

_COMPRESSOR = synchronizers_pb2.AllReduceSynchronizer.Compressor
Synchronizer = Union[synchronizers_pb2.PSSynchronizer, synchronizers_pb2.AllReduceSynchronizer]


@dataclasses.dataclass(frozen=True)
class VariablePart:
    """One stored piece of a variable (the whole variable when not partitioned).

    Attributes:
        name: storage name: the variable name, or ``<var>/part_<i>``.
        index: position among the variable's parts.
        shape: shape of this piece.
        synchronizer: its PSSynchronizer or AllReduceSynchronizer config.
    """

    name: str
    index: int
    shape: tuple
    synchronizer: Synchronizer

    @property
    def is_ps(self) -> bool:
        return isinstance(self.synchronizer, synchronizers_pb2.PSSynchronizer)


@dataclasses.dataclass(frozen=True)
class CompiledVariable:
    info: VariableInfo
    plan: Optional[PartitionPlan]
    parts: tuple


@dataclasses.dataclass(frozen=True)
class CompiledStrategy:
    strategy: Strategy
    variables: dict  # var name -> CompiledVariable, in graph order


def compile_strategy(strategy: Strategy, graph_item: GraphItem,
                     resource_spec: ResourceSpec) -> CompiledStrategy:
    """Checks ``strategy`` fits ``graph_item`` and ``resource_spec``.

    Raises:
        StrategyError: naming the variables, devices or fields that do not fit.
    """
    devices = {d.name_string() for d in resource_spec.cpu_devices}
    devices |= {d.name_string() for d in resource_spec.replica_devices}
    replicas = list(strategy.replicas)
    if not replicas:
        raise StrategyError(f"Strategy {strategy.id} lists no replica devices.")
    unknown = [r for r in replicas if r not in devices]
    if unknown:
        raise StrategyError(f"Strategy {strategy.id} places replicas on {unknown}, which the "
                            f"resource spec does not have (it has {sorted(devices)}).")
    configs = {}
    for node in strategy.node_config:
        if node.var_name in configs:
            raise StrategyError(f"Strategy {strategy.id} configures variable "
                                f"'{node.var_name}' twice.")
        configs[node.var_name] = node
    graph_vars = [v.name for v in graph_item.trainable_variables]
    missing = [name for name in graph_vars if name not in configs]
    extra = [name for name in configs if name not in set(graph_vars)]
    if missing or extra:
        raise StrategyError(
            f"Strategy {strategy.id} does not match the graph: variables in the graph "
            f"without a config: {missing}; configs for variables the graph lacks: {extra}. "
            "Build the strategy for this model, or rebuild it with a builder.")
    compiled = {}
    for info in graph_item.trainable_variables:
        compiled[info.name] = _compile_variable(configs[info.name], info, devices, strategy.id)
    _check_group_compressors(compiled, strategy.id)
    return CompiledStrategy(strategy=strategy, variables=compiled)


def _check_group_compressors(compiled: dict, strategy_id: str) -> None:
    """A group's dense gradients share one buffer, so its parts must agree on the compressor.

    Sparse gradients are gathered one by one, uncompressed, whatever their group.
    """
    compressors = {}  # group -> {compressor -> a part name}
    for variable in compiled.values():
        if not variable.info.has_grad or variable.info.sparse_grad:
            continue
        for part in variable.parts:
            if not part.is_ps:
                sync = part.synchronizer
                compressors.setdefault(sync.group, {}).setdefault(sync.compressor, part.name)
    for group, names in sorted(compressors.items()):
        if len(names) > 1:
            found = ", ".join(f"'{name}' {_COMPRESSOR.Name(value)}"
                              for value, name in sorted(names.items()))
            raise StrategyError(
                f"Strategy {strategy_id}: all-reduce group {group} mixes compressors ({found}); "
                "a group's gradients share one buffer, so give them one compressor or "
                "separate groups.")


def _compile_variable(node, info: VariableInfo, devices: set, strategy_id: str):
    if not node.partitioner:
        return CompiledVariable(info, None, (VariablePart(
            info.name, 0, info.shape, _synchronizer(node, devices, strategy_id)),))
    try:
        plan = parse_partitioner(node.partitioner, info.shape, info.name)
    except ValueError as err:
        raise StrategyError(f"Strategy {strategy_id}: {err}") from None
    if len(node.part_config) != plan.num_parts:
        raise StrategyError(
            f"Strategy {strategy_id}: variable '{info.name}' is cut into {plan.num_parts} "
            f"parts by partitioner '{node.partitioner}' but has {len(node.part_config)} "
            "part configs.")
    parts = tuple(VariablePart(f"{info.name}/part_{i}", i, plan.part_shape(i),
                               _synchronizer(part, devices, strategy_id))
                  for i, part in enumerate(node.part_config))
    return CompiledVariable(info, plan, parts)


def _synchronizer(node, devices: set, strategy_id: str) -> Synchronizer:
    kind = node.WhichOneof("synchronizer")
    if kind is None:
        raise StrategyError(f"Strategy {strategy_id}: '{node.var_name}' has no synchronizer; "
                            "set PSSynchronizer or AllReduceSynchronizer.")
    sync = getattr(node, kind)
    if kind == "PSSynchronizer":
        for field in ("reduction_destination", "transfer_destination"):
            device = getattr(sync, field)
            if (device or field == "reduction_destination") and device not in devices:
                raise StrategyError(
                    f"Strategy {strategy_id}: '{node.var_name}' has {field} '{device}', "
                    f"which is not a device of the resource spec ({sorted(devices)}).")
        if sync.staleness < 0:
            raise StrategyError(f"Strategy {strategy_id}: '{node.var_name}' has staleness "
                                f"{sync.staleness}; it must be 0 or more.")
        if sync.sync and sync.staleness:
            raise StrategyError(f"Strategy {strategy_id}: '{node.var_name}' has sync true and "
                                f"staleness {sync.staleness}; bounded staleness needs sync "
                                "false.")
        if not sync.sync and not sync.staleness:
            raise StrategyError(f"Strategy {strategy_id}: '{node.var_name}' has sync false (or "
                                "unset) and staleness 0, which asks for unbounded asynchrony; "
                                "it is not built. Set sync true for synchronous training, or a "
                                "staleness of 1 or more.")
    else:
        if sync.group < 0:
            raise StrategyError(f"Strategy {strategy_id}: '{node.var_name}' has group "
                                f"{sync.group}; it must be 0 or more.")
        for field, enum in (("spec", synchronizers_pb2.AllReduceSynchronizer.Spec),
                            ("compressor", synchronizers_pb2.AllReduceSynchronizer.Compressor)):
            value = getattr(sync, field)
            if value not in enum.values():
                raise StrategyError(
                    f"Strategy {strategy_id}: '{node.var_name}' has {field} {value}, which is "
                    f"not one of {dict(zip(enum.keys(), enum.values()))}.")
    return sync
