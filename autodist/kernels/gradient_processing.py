"""Gradient processing: what the user does between ``compute_gradients`` and
``apply_gradients`` (``tf.clip_by_global_norm``, scaling, any function of the
gradients), run once on the averaged gradients.

The replicas compute and the synchronizer kinds average the raw gradients;
this kernel then imports the processing ops once into this node's graph, fed
with each variable's whole averaged gradient (its parts stitched back), and
hands the optimizer the processed gradient, cut into the parts again. This is
what single-device training does with the batch's gradient.

It runs where the updates run: on every node under AllReduce (each computes
the same result), on the chief for a PS strategy on a cluster (where every PS
part's mean is taken), which reads each part's mean from its server to compute
the processing and sends the result back.
"""
from __future__ import annotations

import dataclasses

import tensorflow as tf

from autodist.graph_item import GradientProcessing, GraphItem
from autodist.kernel_context import KernelContext
from autodist.kernels import partitioner
from autodist.kernels.replicator import subgraph_def
from autodist.synchronizers.base import Reduced


def scope(call: int) -> str:
    """The name scope of call ``call``'s processing in the distributed graph."""
    return f"autodist_gradient_processing_{call}"


def process(item: GraphItem, call: int, reduced: Reduced, ctx: KernelContext) -> Reduced:
    """``reduced`` with the updates of optimizer call ``call`` applying processed gradients.

    Raises:
        ValueError: when the processing cannot run on averaged gradients here:
            it reads a tensor computed per replica, or this strategy updates the
            variables it combines on several nodes, in several runs of a step,
            or in shards.
    """
    processing = item.processing[call]
    updates = reduced.local_updates + reduced.remote_updates
    mine = [u for u in updates if u.name in processing.applied]
    if not mine:
        return reduced  # another node updates them (the chief, under a PS strategy)
    _check_whole(processing, mine, reduced, ctx.split_step)
    by_variable = {}  # variable name -> its parts' updates, in part order
    for update in sorted(mine, key=lambda u: u.part):
        by_variable.setdefault(update.name, []).append(update)
    whole = {name: _stitched(parts) for name, parts in by_variable.items()}
    processed = _import(item, processing, whole, call, ctx)
    replaced = {}
    for name, parts in by_variable.items():
        plan = parts[0].plan
        pieces = [processed[name]] if plan is None else partitioner.split_gradient(
            processed[name], plan)
        for update, piece in zip(parts, pieces):
            replaced[id(update)] = dataclasses.replace(update, gradient=piece)
    return dataclasses.replace(
        reduced,
        local_updates=[replaced.get(id(u), u) for u in reduced.local_updates],
        remote_updates=[replaced.get(id(u), u) for u in reduced.remote_updates])


def _check_whole(processing: GradientProcessing, mine: list, reduced: Reduced,
                 split_step: bool) -> None:
    """Refuses a strategy under which no run of this node sees every processed gradient."""
    names = sorted(processing.applied)
    local = {id(u) for u in reduced.local_updates}
    if {u.name for u in mine} != set(processing.applied):
        where = "them on several nodes"
    elif any(u.shard is not None for u in mine) or any(
            u.name in processing.applied for u in reduced.foreign_updates):
        where = "them in shards"
    elif split_step and len({id(u) in local for u in mine}) > 1:
        where = "them in two runs of a step (PS and all-reduce on several nodes)"
    else:
        counts = {}
        for update in mine:
            counts[update.name] = counts.get(update.name, 0) + 1
        if all(update.plan is None or counts[update.name] == update.plan.num_parts
               for update in mine):
            return
        where = "their parts on several nodes"
    raise ValueError(
        f"AutoDist cannot process the gradients of {names[:5]}{'...' if len(names) > 5 else ''} "
        f"between compute_gradients and apply_gradients on their average: the strategy "
        f"updates {where}, so no single run holds them all. Use a strategy that updates them "
        "together (e.g. AllReduce or PS on one node), or apply them unprocessed.")


def _stitched(parts: list):
    """A variable's whole averaged gradient from its parts' updates, in part order."""
    if parts[0].plan is None:
        return parts[0].gradient
    return partitioner.stitch_gradient([u.gradient for u in parts], parts[0].plan)


def _import(item: GraphItem, processing: GradientProcessing, whole: dict, call: int,
            ctx: KernelContext) -> dict:
    """Imports the processing ops fed with ``whole``; returns variable name -> processed gradient."""
    graph = tf.compat.v1.get_default_graph()

    def as_original(tensor, name):  # input_map wants the original dtype
        return tf.cast(tensor, item.graph.get_tensor_by_name(name).dtype)

    inputs = {}
    for name, ref in processing.raw.items():
        gradient = whole[name]
        if ref.sparse:
            gradient = partitioner.as_indexed_slices(gradient)
            inputs[ref.values] = gradient.values
            inputs[ref.indices] = as_original(gradient.indices, ref.indices)
            if ref.dense_shape:
                inputs[ref.dense_shape] = as_original(gradient.dense_shape, ref.dense_shape)
        else:
            inputs[ref.values] = tf.convert_to_tensor(gradient)
    external = {}
    graph_def = subgraph_def(item, set(processing.ops), external, [], with_library=False)
    for name in external:
        if name in inputs:
            continue
        if item.is_replicated(name):
            raise ValueError(
                f"AutoDist cannot process the gradients between compute_gradients and "
                f"apply_gradients on their average: the processing reads '{name}', which "
                "each replica computes from its own rows. Compute it from the gradients "
                "alone, or from values every replica shares (constants, placeholders fed "
                "whole, variables).")
        inputs[name] = graph.get_tensor_by_name(name)
    outputs = sorted({n for ref in processing.applied.values()
                      for n in (ref.values, ref.indices, ref.dense_shape)
                      if n and n.split(":")[0] in processing.ops})
    with tf.device(ctx.shared_device):
        imported = tf.graph_util.import_graph_def(graph_def, input_map={
            name: tensor for name, tensor in inputs.items() if name in external},
                                                  return_elements=outputs, name=scope(call))
    produced = dict(zip(outputs, imported))

    def tensor(name):
        return produced[name] if name in produced else inputs[name]

    result = {}
    for name, ref in processing.applied.items():
        if ref.sparse:
            shape = tensor(ref.dense_shape) if ref.dense_shape else None
            result[name] = tf.IndexedSlices(tensor(ref.values), tensor(ref.indices), shape)
        else:
            result[name] = tensor(ref.values)
    return result
