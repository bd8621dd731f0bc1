"""Where a graph's backward pass starts: the constants its gradients are linear in.

Backpropagation starts from a seed, the gradient of the loss with respect to
itself: a constant 1 (``tf.gradients``' ``grad_ys``, a tape's ``ones``). Each
replica's gradient must count as its share of the cluster's rows; multiplying
the seed by that share scales the whole backward pass at the cost of one
scalar product, where multiplying the gradient costs a pass over every byte of
it (the model's size, per replica and step).

That is only right where the gradients are linear in the seed, which is what
this module proves, op by op, from the ops' semantics: every value computed
from a seed must reach the gradients through ops that are linear in it
(products with one such factor, sums of such terms only, reshapes, slices, the
gradient kernels in their incoming gradient). Where an op the rules do not
know stands in the way (a loop or a function call in the backward pass, a
custom gradient that clips), or a constant 1 of the forward pass shapes the
gradients (``1 - x``), there is no seed, and the caller scales the gradients
instead.
"""
from __future__ import annotations

from typing import Dict, List, Sequence

import numpy as np
import tensorflow as tf

from autodist.graph_defs import ancestors, data_inputs, op_name, tensor_name

# How an op's outputs depend on inputs computed from the seeds, by op type:
#   (positions that may carry such a value, how they combine)
# "one": linear in that input when it alone carries the seeds (the other
#   inputs are factors, shapes or indices);
# "product": one of the positions carries the seeds, the others are factors
#   (two would make a square);
# "sum": every listed position carries the seeds or is a zero (a term without
#   them would be an offset, which scaling leaves alone).
# An input at another position must not carry them.
_ALL = None  # every data input
_LINEAR_OPS: Dict[str, tuple] = {
    **{op: ((0,), "one") for op in (
        "Identity", "IdentityN", "Snapshot", "StopGradient", "PreventGradient", "EnsureShape",
        "CheckNumerics", "Neg", "Reshape", "Transpose", "ExpandDims", "Squeeze", "Tile",
        "BroadcastTo", "Sum", "Mean", "Cumsum", "ReverseV2", "StridedSlice", "Slice", "Pad",
        "MirrorPad", "GatherV2", "GatherNd", "UnsortedSegmentSum", "SegmentSum", "SplitV",
        "Unpack", "Cast", "BiasAddGrad", "RealDiv", "Div", "DivNoNan", "ReluGrad",
        "Relu6Grad", "EluGrad", "SeluGrad", "LeakyReluGrad", "SoftplusGrad", "SoftsignGrad",
        "FusedBatchNormGrad", "FusedBatchNormGradV2", "FusedBatchNormGradV3")},
    **{op: ((1,), "one") for op in (
        "Fill", "Split", "ScatterNd", "TanhGrad", "SigmoidGrad", "RsqrtGrad", "SqrtGrad",
        "ReciprocalGrad", "AvgPoolGrad")},
    **{op: ((2,), "one") for op in ("MaxPoolGrad", "MaxPoolGradV2")},
    **{op: ((0, 1), "product") for op in (
        "Mul", "MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "Conv2D", "Conv3D",
        "DepthwiseConv2dNative")},
    # A convolution's gradients are products of their input (or filter) and the
    # incoming gradient: a transposed convolution's backward pass swaps the roles.
    **{op: ((0, 2), "product") for op in (
        "Conv2DBackpropFilter", "DepthwiseConv2dNativeBackpropFilter", "Conv3DBackpropFilterV2")},
    **{op: ((1, 2), "product") for op in (
        "Conv2DBackpropInput", "DepthwiseConv2dNativeBackpropInput", "Conv3DBackpropInputV2")},
    "Einsum": (_ALL, "product"),
    **{op: ((0, 1), "sum") for op in ("Add", "AddV2", "Sub")},
    "AddN": (_ALL, "sum"),
    "Pack": (_ALL, "sum"),
    "ConcatV2": ("all but last", "sum"),
    "Select": ((1, 2), "sum"),
    "SelectV2": ((1, 2), "sum"),
}
# Ops whose output depends on their input's shape or type only: scaling the
# seeds leaves it unchanged.
_SHAPE_ONLY_OPS = frozenset({"Shape", "ShapeN", "Size", "Rank", "ZerosLike", "OnesLike",
                             "BroadcastGradientArgs"})
# A seed is small: the ones of a scalar loss, or of a loss per output row at most.
_MOST_SEED_ELEMENTS = 1 << 16


def gradient_seeds(graph_def, gradients: Sequence[str]) -> frozenset:
    """The constants that ``gradients`` (tensor names) are jointly linear in.

    Multiplying every returned constant by a factor multiplies every gradient
    by it, and every other value computed from the constants (a gradient the
    update does not use, such as the input's): all of them are the replica's
    gradients, which the factor turns into its contributions to the batch's.

    Returns:
        names of ``Const`` nodes holding ones, or an empty set when the graph
        offers no such proof (the caller scales the gradients themselves).
    """
    if not gradients:
        return frozenset()
    graph = _Graph(graph_def)
    upstream = ancestors(graph.nodes, (op_name(g) for g in gradients), control=False)
    # Every constant 1 the gradients are computed from, together (a tape asked
    # for several targets seeds each). Never a subset: a constant 1 of the forward
    # pass (``weight * loss`` with ``weight=1.0``) may be one the gradients are
    # linear in, but it also scales the loss; taken together with the seed, it
    # meets the seed in a product, and the proof fails.
    candidates = sorted(name for name in upstream if graph.is_ones(name))
    if candidates and graph.linear_in(candidates, set(gradients), upstream):
        return frozenset(candidates)
    return frozenset()


class _Graph:
    """A GraphDef's nodes, with their data consumers."""

    def __init__(self, graph_def):
        self.nodes = {node.name: node for node in graph_def.node}
        self.consumers: Dict[str, List[str]] = {name: [] for name in self.nodes}
        for node in graph_def.node:
            for tensor in data_inputs(node):
                self.consumers.setdefault(op_name(tensor), []).append(node.name)

    def is_ones(self, name: str) -> bool:
        return self._constant_equal(name, 1)

    def is_zero(self, tensor: str) -> bool:
        """Whether ``tensor`` is zeros by construction (``ZerosLike``, a zero fill or constant)."""
        node = self.nodes.get(op_name(tensor))
        if node is None:
            return False
        if node.op == "ZerosLike":
            return True
        if node.op == "Fill":
            return self._constant_equal(op_name(data_inputs(node)[1]), 0)
        return self._constant_equal(node.name, 0)

    def _constant_equal(self, name: str, value: float) -> bool:
        node = self.nodes.get(name)
        if node is None or node.op != "Const" or node.input:
            return False
        proto = node.attr["value"].tensor
        if not tf.as_dtype(proto.dtype).is_floating:
            return False
        shape = [d.size for d in proto.tensor_shape.dim]
        if any(size < 0 for size in shape) or np.prod(shape) > _MOST_SEED_ELEMENTS:
            return False
        return bool(np.all(tf.make_ndarray(proto) == value))

    def linear_in(self, seeds: Sequence[str], gradients: set, ancestors: set) -> bool:
        """Whether every tensor of ``gradients`` is linear in the ``seeds`` constants, and
        so is every other value computed from them.

        What reads a gradient without leading to another (``ancestors``: the ops
        the gradients are computed from) is its processing and update, which
        see the mean gradient the replicas' contributions add up to: not followed.
        """
        carrying, todo = set(seeds), list(seeds)
        while todo:
            name = todo.pop()
            for consumer in self.consumers.get(name, []):
                node = self.nodes[consumer]
                if consumer in carrying or node.op in _SHAPE_ONLY_OPS:
                    continue
                if consumer not in ancestors and all(
                        tensor_name(t) in gradients for t in data_inputs(node) if op_name(t) == name):
                    continue
                carrying.add(consumer)
                todo.append(consumer)
        return (all(op_name(g) in carrying for g in gradients)
                and all(self._linear_op(self.nodes[name], carrying)
                        for name in carrying.difference(seeds)))

    def _linear_op(self, node, carrying: set) -> bool:
        rule = _LINEAR_OPS.get(node.op)
        if rule is None:
            return False
        inputs = data_inputs(node)
        positions, combine = rule
        if positions is _ALL:
            positions = range(len(inputs))
        elif positions == "all but last":
            positions = range(len(inputs) - 1)
        positions = [p for p in positions if p < len(inputs)]
        carried = [p for p, t in enumerate(inputs) if op_name(t) in carrying]
        if any(p not in positions for p in carried):
            return False  # the seeds reach a position the op is not linear in
        if node.op == "Cast" and not tf.as_dtype(node.attr["DstT"].type).is_floating:
            return False
        if combine == "product":
            return len(carried) == 1
        if combine == "sum":
            return all(p in carried or self.is_zero(inputs[p]) for p in positions)
        return bool(carried)

