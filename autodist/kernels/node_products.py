"""A node's replica gradients added up as one product over the node's rows.

A dense layer's weight gradient is a matrix product that contracts the batch
(``x^T @ dy``). The replicas' products add up to the product of their factors
joined along the contracted axis (block multiplication), which is the product a
single device computes for the node's rows. CPU replicas share their host's
memory, so the node computes that one product on its CPU instead of a
gradient-sized product per replica and a pass adding them up: a step of a
dense model then writes its weights' bytes once, as a single device's does.

Cut into parts (``PartitionPlan``), each part's sum is the product with the
factor that indexes the cut axis sliced to the part's range, so no replica
computes the whole gradient of a partitioned variable either.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import numpy as np
import tensorflow as tf

from autodist.kernel_context import KernelContext
from autodist.partition import PartitionPlan


class NodeProduct:
    """The sum of one node's replica gradients, each a ``MatMul`` of its replica's factors.

    Args:
        products: the replicas' ``MatMul`` ops, all with the same transposes.
        control_inputs: ops the replicas' gradients waited for (reads of the
            variable the update must not overtake); the sums wait for them too.
        device: where the sums are computed (the node's CPU).
        scope: the name scope of their ops.
    """

    def __init__(self, products: List[tf.Operation], control_inputs: List[tf.Operation],
                 device: str, scope: str):
        self._products = products
        self._controls = control_inputs
        self._device = device
        self._scope = scope
        self._transpose = (products[0].get_attr("transpose_a"),
                           products[0].get_attr("transpose_b"))
        self._joined: Optional[Tuple[tf.Tensor, tf.Tensor]] = None
        self._sums: Dict[Optional[tuple], tf.Tensor] = {}  # (axis, begin, size) -> sum

    def whole(self) -> tf.Tensor:
        """The node's sum of the whole gradient."""
        return self._sum(None, None)

    def part(self, plan: PartitionPlan, index: int) -> tf.Tensor:
        """The node's sum of part ``index`` of the gradient cut by ``plan``."""
        return self._sum(plan, index)

    def _factors(self) -> Tuple[tf.Tensor, tf.Tensor]:
        """Both factors, the replicas' joined along the contracted axis."""
        if self._joined is None:
            transpose_a, transpose_b = self._transpose
            with tf.device(self._device), tf.name_scope(self._scope):
                self._joined = (
                    tf.concat([p.inputs[0] for p in self._products], 0 if transpose_a else 1),
                    tf.concat([p.inputs[1] for p in self._products], 1 if transpose_b else 0))
        return self._joined

    def _sum(self, plan: Optional[PartitionPlan], index: Optional[int]) -> tf.Tensor:
        cut = None if plan is None else (plan.axis, plan.offsets[index], plan.sizes[index])
        if cut not in self._sums:
            left, right = self._factors()
            transpose_a, transpose_b = self._transpose
            with tf.device(self._device), tf.name_scope(self._scope), \
                    tf.control_dependencies(self._controls):
                if cut is not None:
                    # The product's rows index the left factor's free axis, its columns
                    # the right factor's: slice the one the plan cuts.
                    axis, begin, size = cut
                    if axis == 0:
                        left = _slice(left, 1 if transpose_a else 0, begin, size)
                    else:
                        right = _slice(right, 0 if transpose_b else 1, begin, size)
                self._sums[cut] = tf.linalg.matmul(left, right, transpose_a=transpose_a,
                                                   transpose_b=transpose_b)
        return self._sums[cut]


def node_product(grads: list, ctx: KernelContext, name: str) -> Optional[NodeProduct]:
    """The node's sum of ``grads`` (one dense gradient per local replica of the variable
    ``name``) as one product, or None where it is not one: a single replica, a
    replica that is not a CPU, or a gradient that is not a matrix product (an op in
    between, such as a multiplication by the replica's share, leaves it as it is)."""
    if len(grads) < 2 or not all(_on_cpu(ctx.replica_tf_device(r)) for r in range(len(grads))):
        return None
    products, controls = [], []
    for grad in grads:
        found = _product_of(grad)
        if found is None:
            return None
        products.append(found[0])
        controls.extend(found[1])
    transposes = {(p.get_attr("transpose_a"), p.get_attr("transpose_b")) for p in products}
    if (len(transposes) > 1 or len({p.outputs[0].dtype for p in products}) > 1
            or not _pays(products)):
        return None
    return NodeProduct(products, controls, ctx.shared_device, f"{name}/node_product")


# Examples a node is assumed to train on per step, at most, when judging a product
# (``_pays``); a node's batch is rarely larger for a layer large enough to matter.
_EXAMPLES_PER_NODE = 512


def _pays(products: List[tf.Operation]) -> bool:
    """Whether joining the factors costs less than the sum it replaces.

    The join copies every row of both factors (``rows * (m + n)`` elements for an
    ``m x n`` gradient); the sum it replaces writes a gradient per replica and
    adds them up (about ``replicas * m * n``). Rows are ``_EXAMPLES_PER_NODE``
    times the rows of one example: one for a batch of vectors, a sequence's length
    where a factor is a batch of sequences flattened (``tensordot``), unknown
    when that length is.
    """
    rows_per_example = 1
    for product in products:
        for factor in product.inputs:
            rows = _rows_per_example(factor)
            if rows is None:
                return False
            rows_per_example = max(rows_per_example, rows)
    m, n = products[0].outputs[0].shape.as_list()
    if m is None or n is None:
        return False
    return _EXAMPLES_PER_NODE * rows_per_example * (m + n) <= len(products) * m * n


def _rows_per_example(factor: tf.Tensor) -> Optional[int]:
    """Rows of ``factor`` per example: the static inner dimensions of a batch of
    sequences (or images) it flattens, else one; None where they are unknown."""
    if factor.op.type != "Reshape":
        return 1
    shape = factor.op.inputs[0].shape
    if shape.rank is None:
        return None
    if shape.rank <= 2:
        return 1
    inner = shape.as_list()[1:-1]
    return None if None in inner else int(np.prod(inner))


def _product_of(grad) -> Optional[Tuple[tf.Operation, List[tf.Operation]]]:
    """The ``MatMul`` computing ``grad`` through identities, and what they waited for.

    ``tf.gradients`` hands out an op's gradients through identities waiting for a
    group of them all, the product itself among them: the group's other members
    stand in for it, or the node's sum would run the product it replaces.
    """
    if not isinstance(grad, tf.Tensor):
        return None
    waits = []
    op = grad.op
    while op.type == "Identity":
        waits.extend(op.control_inputs)
        op = op.inputs[0].op
    if op.type != "MatMul" or not op.outputs[0].shape.is_compatible_with(grad.shape):
        return None
    controls = list(op.control_inputs)
    for wait in waits:
        if wait.type == "NoOp" and op in wait.control_inputs:
            controls.extend(c for c in wait.control_inputs if c is not op)
        else:
            controls.append(wait)
    return op, controls


def _on_cpu(device: str) -> bool:
    return tf.DeviceSpec.from_string(device).device_type in (None, "CPU")


def _slice(value: tf.Tensor, axis: int, begin: int, size: int) -> tf.Tensor:
    starts = [0] * value.shape.rank
    sizes = [-1] * value.shape.rank
    starts[axis], sizes[axis] = begin, size
    return tf.slice(value, starts, sizes)
