"""Mixed precision: a ``LossScaleOptimizer``'s step as straight-line code.

Keras applies the inner optimizer inside ``tf.cond(finite, apply, skip)``. A
``tf.cond`` hides the update's ops from the cut into per-variable stages
(``update.py``), so while AutoDist traces a step, the optimizer applies through
``apply_without_cond`` instead, with the same effect on every variable:

* the inner optimizer's update always runs, but each of its writes keeps the
  old value when a gradient is not finite (``gate_writes``): an assign writes
  back what it read, an add adds zero. The iteration count is one of those
  writes, so a skipped step does not count, as in Keras;
* the loss scale and its counter are set by selects on the same check.

The check reads every averaged gradient, so it lands in the update's common
stage: each node applying the update takes the same decision from the same
gradients, and the replicas skip or apply a step together. The loss scale is
also read by the forward pass (``scale_loss``), so it is lifted as a
non-trainable variable of the model, which lives where the updates run
(``KernelContext.update_state_device``).
"""
from __future__ import annotations

from typing import Optional

import keras
import tensorflow as tf

from autodist import _keras_compat, _tf_compat
from autodist.graph_item import RESOURCE_WRITES

# Write op -> (index of the input it writes, what leaves the variable as it was:
# "old" the value it holds there, or the identity element of the write).
_KEEPS = {
    "AssignVariableOp": (1, "old"),
    "AssignAddVariableOp": (1, "zero"),
    "AssignSubVariableOp": (1, "zero"),
    "ResourceScatterAdd": (2, "zero"),
    "ResourceScatterSub": (2, "zero"),
    "ResourceScatterNdAdd": (2, "zero"),
    "ResourceScatterNdSub": (2, "zero"),
    "ResourceScatterMul": (2, "one"),
    "ResourceScatterDiv": (2, "one"),
    "ResourceScatterUpdate": (2, "old"),
    "ResourceScatterMin": (2, "old"),
    "ResourceScatterMax": (2, "old"),
    "ResourceScatterNdUpdate": (2, "old"),
}
assert set(_KEEPS) == set(RESOURCE_WRITES), "every write AutoDist knows can be gated"


def apply_without_cond(optimizer: keras.optimizers.LossScaleOptimizer, grads: list,
                       trainable_variables: Optional[list] = None
                       ) -> _keras_compat.ConditionalUpdate:
    """Traces ``optimizer.apply(grads, trainable_variables)`` without a ``tf.cond``.

    Returns:
        the finite check, and the names of the inner update's ops, whose writes
        ``gate_writes`` makes conditional on it once the step is lifted.
    """
    if not optimizer.built:
        with keras.name_scope(optimizer.name, caller=optimizer):
            optimizer.build(trainable_variables)
        optimizer.built = True
    variables = (list(trainable_variables) if trainable_variables is not None
                 else _keras_compat.trainable_variables(optimizer))
    finite = optimizer.check_finite(grads)
    scale = tf.convert_to_tensor(optimizer.dynamic_scale)  # read once, before its write
    unscaled = [g if g is None or _keras_compat.overwrites_with_gradient(optimizer, v)
                else keras.ops.divide(g, scale) for g, v in zip(grads, variables)]
    graph = tf.compat.v1.get_default_graph()
    before = {op.name for op in graph.get_operations()}
    optimizer.inner_optimizer.apply(unscaled, trainable_variables=trainable_variables)
    inner = frozenset(op.name for op in graph.get_operations()) - before
    counter = tf.convert_to_tensor(optimizer.step_counter)
    grow = tf.logical_and(finite, tf.equal(counter, optimizer.dynamic_growth_steps - 1))
    optimizer.step_counter.assign(
        tf.where(finite, tf.where(grow, tf.zeros_like(counter), counter + 1),
                 tf.zeros_like(counter)))
    optimizer.dynamic_scale.assign(
        tf.where(finite, tf.where(grow, scale * 2.0, scale), scale * 0.5))
    return _keras_compat.ConditionalUpdate(finite, inner, optimizer.dynamic_scale)


def gate_writes(graph: tf.Graph, write_names: list, applied_if: tf.Tensor) -> list:
    """Makes each write op of ``write_names`` leave its variable unchanged unless
    ``applied_if`` holds.

    It works on a lifted ``tf.compat.v1`` graph, which, unlike a traced one,
    adds no control edges of its own between the new reads and the writes.

    Returns:
        the ops it created.
    """
    before = {op.name for op in graph.get_operations()}
    with graph.as_default():
        for name in write_names:
            write = graph.get_operation_by_name(name)
            index, keep = _KEEPS[write.type]
            value = write.inputs[index]
            with tf.name_scope(f"{name}_applied_if"):
                # A scalar identity broadcasts: no variable-sized tensor of zeros per step.
                if keep == "zero":
                    unchanged = tf.zeros([], value.dtype)
                elif keep == "one":
                    unchanged = tf.ones([], value.dtype)
                else:
                    unchanged = _held_value(write)
                _tf_compat.replace_input(write, index, tf.where(applied_if, value, unchanged))
    return [op for op in graph.get_operations() if op.name not in before]


def _held_value(write: tf.Operation) -> tf.Tensor:
    """What the variable ``write`` writes holds where it writes."""
    resource, dtype = write.inputs[0], write.get_attr("dtype")
    if write.type == "AssignVariableOp":
        return tf.raw_ops.ReadVariableOp(resource=resource, dtype=dtype)
    if write.type == "ResourceScatterNdUpdate":
        return tf.raw_ops.ResourceGatherNd(resource=resource, indices=write.inputs[1],
                                           dtype=dtype)
    return tf.raw_ops.ResourceGather(resource=resource, indices=write.inputs[1], dtype=dtype)
