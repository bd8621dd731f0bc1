"""compile_strategy: validate a Strategy against a graph and cluster, before any rewrite.

The result says, for every trainable variable, how it is cut and how each part is
synchronized, in the form the kernels consume. Where the resource spec gives a
node's ``memory``, a strategy whose variables and optimizer slots on that node
exceed it is refused here, before any node starts training.
"""
from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Dict, Optional, Type

from google.protobuf.message import Message

from autodist.graph_item import UPDATE_BY_ROWS, UPDATE_BY_ROWS_LAZY, GraphItem, VariableInfo
from autodist.kernel_context import splits_step
from autodist.partition import PartitionPlan, parse_partitioner
from autodist.resource_spec import DeviceSpec, ResourceSpec
from autodist.strategy.base import Strategy, StrategyError
from autodist.synchronizers import KINDS, kind_of
from autodist.synchronizers.base import NodeLayout, SynchronizerKind


class NodeMemoryError(StrategyError):
    """A strategy stores more on a node than the node's ``memory`` in the resource spec."""


@dataclasses.dataclass(frozen=True)
class VariablePart:
    """One stored piece of a variable (the whole variable when not partitioned).

    Attributes:
        name: storage name: the variable name, or ``<var>/part_<i>``.
        index: position among the variable's parts.
        shape: shape of this piece.
        kind: the class of its synchronizer kind.
        synchronizer: its synchronizer config, the message of its kind's oneof field.
    """

    name: str
    index: int
    shape: tuple
    kind: Type[SynchronizerKind]
    synchronizer: Message


@dataclasses.dataclass(frozen=True)
class CompiledVariable:
    info: VariableInfo
    plan: Optional[PartitionPlan]
    parts: tuple


@dataclasses.dataclass(frozen=True)
class CompiledStrategy:
    strategy: Strategy
    variables: dict  # var name -> CompiledVariable, in graph order
    # The step itself sums tensors over every replica (``GraphItem.sums_over_replicas``).
    sums_over_replicas: bool = False

    @property
    def synchronized_parts(self) -> list:
        """The parts whose gradients are synchronized (their variable has one)."""
        return [part for variable in self.variables.values() for part in variable.parts
                if variable.info.has_grad]

    @property
    def has_collectives(self) -> bool:
        """The step runs collectives (``KernelContext``'s): some synchronized part
        reduces through them, or the step sums tensors over the replicas."""
        return self.sums_over_replicas or any(
            p.kind.uses_collectives(p.synchronizer) for p in self.synchronized_parts)

    @property
    def has_remote_ops(self) -> bool:
        """Some synchronized part runs ops on other nodes' devices (``KernelContext``'s)."""
        return any(p.kind.uses_remote_ops(p.synchronizer) for p in self.synchronized_parts)

    def node_layout(self, resource_spec: ResourceSpec) -> NodeLayout:
        """The cluster as this strategy uses it, for the kinds' ``stored_copies``."""
        replicas = dict.fromkeys(resource_spec.node_addresses, 0)
        cpu_replicas = dict(replicas)
        for replica in map(DeviceSpec.from_string, self.strategy.replicas):
            replicas[replica.host_address] += 1
            cpu_replicas[replica.host_address] += replica.device_type == "CPU"
        return NodeLayout(resource_spec.chief, replicas, cpu_replicas,
                          splits_step(len(replicas), self.has_collectives,
                                      self.has_remote_ops))


def compile_strategy(strategy: Strategy, graph_item: GraphItem,
                     resource_spec: ResourceSpec) -> CompiledStrategy:
    """Checks ``strategy`` fits ``graph_item`` and ``resource_spec``.

    Raises:
        StrategyError: naming the variables, devices or fields that do not fit;
            ``NodeMemoryError`` for a node's memory.
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
    # Every node runs the script, so each must hold its replicas: a strategy built for a
    # smaller cluster leaves the others' with nothing to run.
    missing = [d.name_string() for d in resource_spec.replica_devices
               if d.name_string() not in replicas]
    if missing:
        raise StrategyError(
            f"Strategy {strategy.id} has no replica on {missing}, which the resource spec "
            f"{resource_spec.source!r} lists: it was built for another cluster (its replicas "
            f"are {replicas}). Build a strategy for this spec, or list only the nodes and "
            "devices it uses.")
    configs = {}
    for node in strategy.node_config:
        if node.var_name in configs:
            raise StrategyError(f"Strategy {strategy.id} configures variable "
                                f"'{node.var_name}' twice.")
        configs[node.var_name] = node
    check_configs_match(strategy.id, list(configs),
                        [v.name for v in graph_item.trainable_variables])
    compiled = {}
    for info in graph_item.trainable_variables:
        compiled[info.name] = _compile_variable(configs[info.name], info, devices, strategy.id)
    for kind in KINDS.values():
        kind.check_variables(list(compiled.values()), strategy.id, len(replicas))
    result = CompiledStrategy(strategy=strategy, variables=compiled,
                              sums_over_replicas=graph_item.sums_over_replicas)
    check_node_memory(result, resource_spec)
    return result


def check_graph(graph_item: GraphItem, resource_spec: ResourceSpec) -> None:
    """Warns of what no strategy distributes exactly on ``resource_spec``: a product of
    the batch's rows with its rows (in-batch negatives) that no gathered batch covers.

    Sums over the whole batch or every replica (a masked loss's count, synchronized
    batch normalization, ``gather_batch``) are exact on any cluster: the replicator
    sums them over every replica of every node.
    """
    if graph_item.rows_multiplied and len(resource_spec.replica_devices) > 1:
        warnings.warn(
            f"AutoDist: the step multiplies two tensors of the batch's rows "
            f"('{graph_item.rows_multiplied[0]}': the [batch, batch] scores of in-batch "
            "negatives or a contrastive loss, or a sum over the batch used as a weight): "
            "each replica computes it from its own rows only, so its loss is not the "
            "single-device one. For in-batch negatives, gather the candidates over the "
            "replicas with autodist.gather_batch(...) to train exactly (README, Keras "
            "section).", stacklevel=3)


def stored_bytes(compiled: CompiledStrategy, resource_spec: ResourceSpec) -> Dict[str, dict]:
    """Node address -> {variable name: bytes of its values and optimizer slots stored in
    that node's memory} under ``compiled``, as its kinds lay them out."""
    layout = compiled.node_layout(resource_spec)
    out = {address: {} for address in resource_spec.node_addresses}
    for variable in compiled.variables.values():
        info = variable.info
        for part in variable.parts:
            share = math.prod(part.shape) / max(info.num_elements, 1)
            value_bytes, slot_bytes = info.size_bytes * share, info.slot_bytes * share
            for address, copies in part.kind.stored_copies(part.synchronizer, layout).items():
                held = out[address]
                held[info.name] = (held.get(info.name, 0) + copies.values * value_bytes
                                   + copies.slots * slot_bytes)
        if variable.plan is not None and info.needs_stitching:
            # Stitched from its parts where CPU replicas read it whole: once per node.
            for address, cpu_replicas in layout.cpu_replicas.items():
                if cpu_replicas:
                    out[address][info.name] = out[address].get(info.name, 0) + info.size_bytes
    return out


def check_node_memory(compiled: CompiledStrategy, resource_spec: ResourceSpec) -> None:
    """Refuses a strategy whose variables and slots on a node exceed the node's ``memory``.

    The estimate counts the training state in the node's memory alone (not on its
    GPUs), so it is a floor of what the node needs: the refusal is never wrong, and
    a strategy that passes may still need more.

    Raises:
        NodeMemoryError: naming the node, its memory, the estimate and the largest variables.
    """
    capped = {node.address: node.memory for node in resource_spec.nodes
              if node.memory is not None}
    if not capped:
        return
    held = stored_bytes(compiled, resource_spec)
    for address, memory in capped.items():
        total = sum(held[address].values())
        if total <= memory:
            continue
        # The three largest, leaving out after the first those too small to matter.
        ranked = sorted(held[address].items(), key=lambda item: -item[1])[:3]
        largest = ranked[:1] + [item for item in ranked[1:] if item[1] >= total / 100]
        kinds = {name: sorted({p.kind.field for p in compiled.variables[name].parts})
                 for name, _ in largest}
        listed = "; ".join(f"'{name}' {_gib(nbytes)} ({', '.join(kinds[name])})"
                           for name, nbytes in largest)
        raise NodeMemoryError(
            f"Strategy {compiled.strategy.id} does not fit node '{address}': its variables "
            f"and optimizer slots there take at least {_gib(total)}, and the resource spec "
            f"{resource_spec.source!r} gives the node memory {_gib(memory)}. Largest: "
            f"{listed}. Partition the largest variables over the nodes' parameter servers "
            "(PartitionedPS stores each node's share only), or give the node more memory.")


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2 ** 30:.2f} GiB"


def _compile_variable(node, info: VariableInfo, devices: set, strategy_id: str):
    info = _as_updated(node, info, strategy_id)
    if not node.partitioner:
        return CompiledVariable(info, None, (VariablePart(
            info.name, 0, info.shape, *_synchronizer(node, devices, strategy_id)),))
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
                               *_synchronizer(part, devices, strategy_id))
                  for i, part in enumerate(node.part_config))
    return CompiledVariable(info, plan, parts)


def _as_updated(node, info: VariableInfo, strategy_id: str) -> VariableInfo:
    """``info`` with the update mode ``node`` asks for: lazily by rows where it sets
    ``lazy_row_update`` and the update is not by rows exactly already."""
    on_parts = [part.var_name for part in node.part_config if part.lazy_row_update]
    if on_parts:
        raise StrategyError(
            f"Strategy {strategy_id}: lazy_row_update is set on the part configs {on_parts}; "
            f"set it on the config of variable '{info.name}', which all its parts follow.")
    if not node.lazy_row_update or info.update_mode == UPDATE_BY_ROWS:
        return info
    if not info.update_mode:
        raise StrategyError(
            f"Strategy {strategy_id}: variable '{info.name}' sets lazy_row_update, but its "
            "gradient is not sparse (it is not read by rows), so there are no untouched rows "
            "to leave out; clear lazy_row_update for it.")
    if info.lazy_refusal:
        raise StrategyError(f"Strategy {strategy_id}: variable '{info.name}' sets "
                            f"lazy_row_update, but {info.lazy_refusal}.")
    dense_because = f"; exact: dense, as {info.update_note}" if info.update_note else ""
    return dataclasses.replace(
        info, update_mode=UPDATE_BY_ROWS_LAZY, updates_rows=True,
        update_note=("lazy_row_update: rows without gradient keep their value and slots, "
                     f"unlike on one device{dense_because}"))


def check_configs_match(strategy_id: str, configured: list, variables: list) -> None:
    """Raises StrategyError unless ``configured`` names exactly the ``variables``."""
    configured_names, variable_names = set(configured), set(variables)
    missing = [name for name in variables if name not in configured_names]
    extra = [name for name in configured if name not in variable_names]
    if missing or extra:
        raise StrategyError(
            f"Strategy {strategy_id} does not match the graph: variables in the graph "
            f"without a config: {missing}; configs for variables the graph lacks: {extra}. "
            "Build the strategy for this model, or rebuild it with a builder.")


def synchronizer_kind(node, strategy_id: str) -> Type[SynchronizerKind]:
    """The kind of a node or part config; StrategyError when it has no synchronizer."""
    kind = kind_of(node)
    if kind is None:
        raise StrategyError(f"Strategy {strategy_id}: '{node.var_name}' has no synchronizer; "
                            f"set one of {list(KINDS)}.")
    return kind


def _synchronizer(node, devices: set, strategy_id: str) -> tuple:
    """(the kind's class, the config) of a node or part config, checked."""
    kind = synchronizer_kind(node, strategy_id)
    config = getattr(node, kind.field)
    kind.check(config, node.var_name, devices, strategy_id)
    return kind, config
