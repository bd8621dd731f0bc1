"""Partitioner: splits a variable, its gradient and its update along one axis.

The arithmetic (which rows each part holds) is :mod:`autodist.partition`'s;
this module cuts and stitches tensors by it. A gather of some rows of the
variable asks the parts for them (``gather_rows``), a product with the
variable multiplies by each part (``PartProducts``); other consumers read the
re-stitched value. Each part gets its own slice of the gradient and its own
optimizer update.
"""
from __future__ import annotations

from typing import Optional, Sequence

import tensorflow as tf

from autodist.kernels import initial_rows
from autodist.partition import PartitionPlan


def split_value(value: tf.Tensor, plan: PartitionPlan) -> list:
    """Cuts a full-shape tensor into the parts of ``plan``."""
    return tf.split(value, list(plan.sizes), axis=plan.axis)


def initial_parts(value: tf.Tensor, plan: PartitionPlan, devices: Sequence[str]) -> list:
    """The parts of an initial value, part ``i`` computed on ``devices[i]``.

    Split along axis 0, a value whose ops can produce any range of its rows
    (seeded random initializers, fills: ``initial_rows``) is computed part by
    part, so no device builds the whole value; any other value is built whole
    and cut.
    """
    builders = [part_rows(value, plan, index) for index in range(len(plan.sizes))]
    if not all(builders):
        return split_value(value, plan)
    parts = []
    for build, device in zip(builders, devices):
        with tf.device(device):
            parts.append(build())
    return parts


def part_rows(value: tf.Tensor, plan: PartitionPlan, index: int) -> Optional[initial_rows.Rows]:
    """A function building part ``index`` of ``value`` from ``value``'s ops alone
    (``initial_rows``), or None where the plan or the ops do not allow it."""
    if plan.axis != 0:
        return None
    begin = sum(plan.sizes[:index])
    return initial_rows.rows_of(value, begin, begin + plan.sizes[index])


def pieces(plan: Optional[PartitionPlan], shape: Sequence[int], max_rows: int) -> list:
    """The variable cut into pieces of at most ``max_rows`` rows (axis 0) within its
    parts; a variable cut along another axis, into its parts.

    Returns:
        per piece, ``(part, rows, index)``: the part holding it, its rows
        ``(begin, end)`` within that part or None for the whole part, and where it
        sits in the full value (a tuple of slices).
    """
    if not shape:
        return [(0, None, ())]
    if plan is not None and plan.axis != 0:
        return [(part, None, tuple(slice(offset, offset + size) if axis == plan.axis
                                   else slice(None) for axis in range(len(shape))))
                for part, (offset, size) in enumerate(zip(plan.offsets, plan.sizes))]
    starts, sizes = (plan.offsets, plan.sizes) if plan is not None else ((0,), (shape[0],))
    rest = (slice(None),) * (len(shape) - 1)
    return [(part, (begin, min(size, begin + max_rows)),
             (slice(offset + begin, offset + min(size, begin + max_rows)),) + rest)
            for part, (offset, size) in enumerate(zip(starts, sizes))
            for begin in range(0, size, max_rows)]


class PartProducts:
    """Products with a partitioned rank-2 variable as one replica computes them.

    No op holds the whole variable: each part is read once, where it is stored,
    and every product of the replica multiplies by those reads (one value of
    the variable per step, as the single-device graph's one read gives). Parts
    cut along the summed axis multiply their slice of the first factor and the
    products add up; parts cut along the output's columns each give their
    columns.
    """

    def __init__(self, parts: list, plan: PartitionPlan):
        """
        Args:
            parts: each part's variable as this replica reads it.
        """
        self._parts, self._plan = parts, plan
        self._values: list = []

    @property
    def reads(self) -> list:
        """The ops reading the parts (none before the first product)."""
        return [value.op for value in self._values]

    def matmul(self, other: tf.Tensor, factor: int, transpose_a: bool,
               transpose_b: bool) -> tf.Tensor:
        """``tf.linalg.matmul`` of the variable and ``other``, on the current device.

        Args:
            other: the other factor, of rank 2 or more (a batch of matrices).
            factor: the variable's place among the factors: 0 (first) or 1.
            transpose_a, transpose_b: as ``tf.linalg.matmul`` takes them.
        """
        if not self._values:
            self._values = [part.read_value() for part in self._parts]
        plan, rank = self._plan, other.shape.rank
        transposed = (transpose_a, transpose_b)
        # The variable's axis the product sums over (a matrix's columns when it is
        # the first factor, its rows when the second), and the other factor's.
        summed = (1 - factor) if not transposed[factor] else factor
        other_summed = (rank - 2 + factor) if not transposed[1 - factor] else (rank - 1 - factor)
        products = []
        for value, offset, size in zip(self._values, plan.offsets, plan.sizes):
            piece = other
            if plan.axis == summed:
                begin, length = [0] * rank, [-1] * rank
                begin[other_summed], length[other_summed] = offset, size
                piece = tf.slice(other, begin, length)
            pair = (value, piece) if factor == 0 else (piece, value)
            products.append(tf.linalg.matmul(*pair, transpose_a=transpose_a,
                                             transpose_b=transpose_b))
        if plan.axis == summed:
            return tf.add_n(products)
        # Parts cut along the output's rows (first factor) or columns (second).
        return tf.concat(products, axis=-2 if factor == 0 else -1)


def stitch(parts: list, plan: PartitionPlan) -> tf.Tensor:
    """The full value from its parts."""
    return tf.concat(parts, axis=plan.axis)


def gather_rows(parts: list, ids: tf.Tensor, plan: PartitionPlan) -> tf.Tensor:
    """``tf.gather(variable, ids)`` of a partitioned variable, each part gathering on its device.

    Split along axis 0, the ids are routed to the parts owning them and the
    rows stitched back in the ids' order: only the ids and the rows they name
    cross devices. Split along another axis, every part gathers every id and
    the slices are joined.

    Args:
        parts: each part's variable as this replica reads it.
        ids: row ids of any shape, as the original gather took them.
    """
    def part_gather(part, part_ids):
        with tf.device(part.device):
            return tf.raw_ops.ResourceGather(resource=part.handle, indices=part_ids,
                                             dtype=part.dtype.base_dtype)

    if plan.axis != 0:
        return tf.concat([part_gather(p, ids) for p in parts], axis=tf.rank(ids) + plan.axis - 1)
    flat = tf.cast(tf.reshape(ids, [-1]), tf.int64)
    starts = tf.constant(plan.offsets, tf.int64)
    owner = tf.searchsorted(starts, flat, side="right") - 1
    local = tf.dynamic_partition(flat - tf.gather(starts, owner), owner, plan.num_parts)
    positions = tf.dynamic_partition(tf.range(tf.size(flat)), owner, plan.num_parts)
    rows = tf.dynamic_stitch(positions, [part_gather(p, i) for p, i in zip(parts, local)])
    return tf.reshape(rows, tf.concat([tf.shape(ids), tf.shape(rows)[1:]], axis=0))


def stitch_gradient(parts: list, plan: PartitionPlan):
    """The full gradient from its parts' gradients, undoing ``split_gradient``.

    Sparse parts are joined row for row (indices back to global ones), not
    summed into a dense tensor: an update may read the rows themselves (Keras's
    global norm of an IndexedSlices gradient sums its rows' squares, duplicate
    indices apart).
    """
    if not isinstance(parts[0], tf.IndexedSlices):
        return stitch([tf.convert_to_tensor(p) for p in parts], plan)
    shape = tf.constant(plan.shape, tf.int64)
    if plan.axis != 0:
        return tf.IndexedSlices(tf.concat([p.values for p in parts], axis=plan.axis),
                                parts[0].indices, shape)
    return tf.IndexedSlices(
        tf.concat([p.values for p in parts], axis=0),
        tf.concat([tf.cast(p.indices, tf.int64) + start
                   for p, start in zip(parts, plan.offsets)], axis=0),
        shape)


def as_indexed_slices(grad) -> tf.IndexedSlices:
    """``grad`` as an IndexedSlices: itself, or a dense gradient as one slice per row.

    A gradient the graph computes sparse but the replicas synchronize dense
    (``GradientRef.same_rows``) reaches code reading its rows this way; a row the
    batch did not touch carries zeros.
    """
    if isinstance(grad, tf.IndexedSlices):
        return grad
    dense = tf.convert_to_tensor(grad)
    shape = tf.shape(dense, out_type=tf.int64)
    return tf.IndexedSlices(dense, tf.range(shape[0]), shape)


def densify(grad: tf.IndexedSlices, num_rows: int) -> tf.Tensor:
    """The dense tensor of an IndexedSlices with ``num_rows`` rows, duplicate indices summed."""
    return tf.math.unsorted_segment_sum(grad.values, grad.indices, num_rows)


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
