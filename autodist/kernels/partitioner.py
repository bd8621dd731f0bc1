"""Partitioner: splits a variable, its gradient and its update along one axis.

A variable of shape ``[10, 4]`` with partitioner ``"3,1"`` becomes three parts of
4, 3 and 3 rows. Consumers of the variable read the re-stitched value; each part
gets its own slice of the gradient and its own optimizer update.
"""
from __future__ import annotations

import dataclasses

import tensorflow as tf


@dataclasses.dataclass(frozen=True)
class PartitionPlan:
    """How one variable is cut.

    Attributes:
        axis: the partitioned axis.
        sizes: size of every part along ``axis``.
        shape: the full shape of the variable.
    """

    axis: int
    sizes: tuple
    shape: tuple

    @property
    def num_parts(self) -> int:
        return len(self.sizes)

    @property
    def offsets(self) -> tuple:
        starts, total = [], 0
        for size in self.sizes:
            starts.append(total)
            total += size
        return tuple(starts)

    def part_shape(self, part: int) -> tuple:
        shape = list(self.shape)
        shape[self.axis] = self.sizes[part]
        return tuple(shape)


def parse_partitioner(partitioner: str, shape: tuple, var_name: str) -> PartitionPlan:
    """Parses ``"1,3,1"`` for a variable of ``shape``.

    Raises:
        ValueError: when the string does not fit the shape, or splits more than one
            axis, or asks for more parts than the axis has elements.
    """
    try:
        counts = [int(c) for c in partitioner.split(",")]
    except ValueError:
        raise ValueError(f"Variable '{var_name}': partitioner '{partitioner}' is not a "
                         "comma-separated list of integers.") from None
    if len(counts) != len(shape):
        raise ValueError(f"Variable '{var_name}': partitioner '{partitioner}' has "
                         f"{len(counts)} entries but the variable has rank {len(shape)}.")
    if any(c < 1 for c in counts):
        raise ValueError(f"Variable '{var_name}': partitioner '{partitioner}' has a count "
                         "below 1.")
    axes = [axis for axis, c in enumerate(counts) if c > 1]
    if len(axes) > 1:
        raise ValueError(f"Variable '{var_name}': partitioner '{partitioner}' splits "
                         f"{len(axes)} axes; only one axis can be partitioned.")
    axis = axes[0] if axes else 0
    parts = counts[axis] if axes else 1
    if parts > shape[axis]:
        raise ValueError(f"Variable '{var_name}': partitioner '{partitioner}' asks for "
                         f"{parts} parts of axis {axis}, which has {shape[axis]} elements.")
    base, extra = divmod(shape[axis], parts)
    sizes = tuple(base + (1 if i < extra else 0) for i in range(parts))
    return PartitionPlan(axis=axis, sizes=sizes, shape=tuple(shape))


def split_value(value: tf.Tensor, plan: PartitionPlan) -> list:
    """Cuts a full-shape tensor into the parts of ``plan``."""
    return tf.split(value, list(plan.sizes), axis=plan.axis)


def stitch(parts: list, plan: PartitionPlan) -> tf.Tensor:
    """The full value from its parts."""
    return tf.concat(parts, axis=plan.axis)


def split_gradient(grad, plan: PartitionPlan) -> list:
    """Cuts a dense or IndexedSlices gradient into the parts of ``plan``.

    A sparse gradient split along axis 0 is routed by row index, each part getting
    the rows it owns with indices made local; along another axis its values are
    sliced.
    """
    if not isinstance(grad, tf.IndexedSlices):
        return split_value(grad, plan)
    if plan.axis != 0:
        values = tf.split(grad.values, list(plan.sizes), axis=plan.axis)
        return [tf.IndexedSlices(v, grad.indices, tf.constant(plan.part_shape(i), tf.int64))
                for i, v in enumerate(values)]
    parts = []
    indices = tf.cast(grad.indices, tf.int64)
    for part, (start, size) in enumerate(zip(plan.offsets, plan.sizes)):
        owned = tf.logical_and(indices >= start, indices < start + size)
        parts.append(tf.IndexedSlices(
            tf.boolean_mask(grad.values, owned),
            tf.boolean_mask(indices, owned) - start,
            tf.constant(plan.part_shape(part), tf.int64)))
    return parts
