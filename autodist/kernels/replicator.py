"""Replicator: copies the user's model onto every local replica device.

The shared part of the graph (inputs, non-trainable variables, initial values)
is imported once under its original names; the replicated part (everything fed
by a batch or a trainable variable) is imported once per replica under
``AutoDist-Replica-<i>/`` with each replica reading its slice of every batched
input and its own view of every trainable variable.
"""
from __future__ import annotations

import tensorflow as tf

from autodist import _tf_compat
from autodist.graph_item import GraphItem
from autodist.kernels.context import KernelContext, replica_scope

_PLACEMENT_ATTRS = ("_class",)
_VARIABLE_OPS = ("VarHandleOp",)


def _op_name(input_name: str) -> str:
    return input_name.lstrip("^").split(":")[0]


def _subgraph(item: GraphItem, names: set, external: dict, deferred: list,
              device_for=lambda node: "", with_library: bool = True):
    """GraphDef of the ``names`` nodes, ready to import.

    Colocations are cleared and devices set by ``device_for(node)`` (the strategy
    decides placement, not the single-device graph). Control
    inputs leaving the subgraph are dropped and appended to ``deferred`` as
    (node name, source name) to be reconnected after import; data inputs leaving
    it are counted in ``external`` (tensor name -> None) for the caller to map.
    """
    graph_def = tf.compat.v1.GraphDef()
    graph_def.versions.CopyFrom(item.graph_def.versions)
    if with_library:
        graph_def.library.CopyFrom(item.graph_def.library)
    for node in item.graph_def.node:
        if node.name not in names:
            continue
        new = graph_def.node.add()
        new.CopyFrom(node)
        new.device = device_for(node)
        for attr in _PLACEMENT_ATTRS:
            if attr in new.attr:
                del new.attr[attr]
        del new.input[:]
        for inp in node.input:
            source = _op_name(inp)
            if source in names:
                new.input.append(inp)
            elif inp.startswith("^"):
                deferred.append((node.name, source))
            else:
                new.input.append(inp)
                external[inp if ":" in inp else inp + ":0"] = None
    return graph_def


def import_shared(item: GraphItem, ctx: KernelContext, deferred: list) -> None:
    """Imports the shared ops into the default graph under their original names.

    Non-trainable variables go to ``ctx.variable_device`` (the chief, so a cluster
    has one global step), ops using them directly follow them, the rest of the
    shared ops (inputs, pipelines) stay on this node's ``ctx.shared_device``.
    """
    variables = {node.name for node in item.graph_def.node
                 if node.name in item.shared and node.op in _VARIABLE_OPS}

    def device_for(node) -> str:
        if node.name in variables:
            return ctx.variable_device
        if any(_op_name(inp) in variables for inp in node.input if not inp.startswith("^")):
            return ""  # resource ops are colocated with their variable
        return ctx.shared_device

    external = {}
    graph_def = _subgraph(item, item.shared, external, deferred, device_for)
    if external:
        raise NotImplementedError(
            f"Ops outside the model read {sorted(external)}, which AutoDist recreates per "
            "strategy (trainable variables or the optimizer's update); it cannot rewrite "
            "that graph.")
    tf.graph_util.import_graph_def(graph_def, name="")


def replicate(item: GraphItem, ctx: KernelContext, variable_handles: dict,
              deferred: list) -> None:
    """Imports one copy of the replicated ops per replica into the default graph.

    Args:
        variable_handles: trainable variable name -> [resource handle per replica].
        deferred: receives (node name in the new graph, source name) control
            edges to reconnect.
    """
    graph = tf.compat.v1.get_default_graph()
    external = {}
    local_deferred = []
    # The library came with the shared import; each copy only adds its ops.
    graph_def = _subgraph(item, item.replicated, external, local_deferred, with_library=False)
    for replica in range(ctx.num_replicas):
        scope = replica_scope(replica)
        device = ctx.replica_tf_device(replica)
        input_map = {}
        with tf.device(device):
            for name in external:
                source = _op_name(name)
                if source in item.variables:
                    input_map[name] = variable_handles[source][replica]
                elif source in item.batched_inputs:
                    input_map[name] = _batch_slice(graph.get_tensor_by_name(name),
                                                   replica, ctx.num_replicas)
                elif source in item.shared:
                    input_map[name] = graph.get_tensor_by_name(name)
                else:
                    raise NotImplementedError(
                        f"The model reads '{name}', produced by the optimizer's update; "
                        "AutoDist cannot replicate that graph.")
        for node in graph_def.node:
            node.device = device
        _tf_compat.import_graph_def(graph_def, input_map, scope)
        deferred.extend((f"{scope}/{node}", source) for node, source in local_deferred)


def _batch_slice(batch: tf.Tensor, replica: int, num_replicas: int) -> tf.Tensor:
    """Rows [i*B/n, (i+1)*B/n) of a batch: replica i's share."""
    size = tf.shape(batch, out_type=tf.int64)[0]
    start = size * replica // num_replicas
    end = size * (replica + 1) // num_replicas
    return batch[start:end]
