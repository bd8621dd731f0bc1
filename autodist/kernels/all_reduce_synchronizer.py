"""AllReduce synchronizer: every node keeps a copy; gradients meet in collectives.

Dense gradients of the parts sharing a group are flattened into one buffer per
replica and reduced by a single TensorFlow collective (mean), then split back;
a group mixing dtypes (a mixed-precision model) has one buffer per dtype.
Sparse gradients are all-gathered (values and indices), which keeps them sparse.
Collective keys are derived from the strategy alone, so every node of a cluster
computes the same ones.

A node's replicas share its one copy of each part (on the node's CPU; CPU
replicas share the host's memory): the collective leaves the same mean on every
replica, so one update per node is enough, and a model of hundreds of
variables on many replicas does not pay for a copy, optimizer slots and an
update per replica.
"""
from __future__ import annotations

import math

import tensorflow as tf

from autodist.kernels.compressor import compressor_class
from autodist.kernels.context import KernelContext, replica_scope

COLLECTIVE_GROUP_KEY = 1
# Sub-rings per device: a merged group is one large buffer, and with a single
# ring every step copies a whole chunk before adding it; several overlap the
# transfer of one piece with the arithmetic of another (docs/notes/step_time.md).
_RING_SUBDIVISIONS = 4


def create_all_reduce_storage(name: str, initial_value: tf.Tensor, ctx: KernelContext):
    """This node's copy of the part, on its CPU, read by all its replicas.

    On a cluster every node's copy starts from an origin variable on the chief,
    so they agree even when the initializer is random and unseeded.

    Returns:
        (the copy, origin variable or None)
    """
    origin = None
    if ctx.multi_node:
        with tf.device(ctx.chief_device):
            origin = tf.Variable(initial_value, trainable=False, name=f"{name}/origin")
        initial_value = origin.read_value()
    with tf.device(ctx.shared_device):
        return tf.Variable(initial_value, name=name), origin


class CollectiveKeys:
    """Hands out instance keys in the (deterministic) order collectives are built."""

    def __init__(self):
        self._next = 1

    def take(self) -> int:
        key = self._next
        self._next += 1
        return key


def all_reduce_group(members: list, keys: CollectiveKeys, ctx: KernelContext) -> tuple:
    """Reduces the gradients of one group across all replicas.

    Args:
        members: list of (part name, its AllReduceSynchronizer, [grad per local
            replica]) in a fixed order; the compiler has checked that the dense
            ones agree on the compressor.

    Returns:
        (list parallel to ``members`` of the mean gradient, taken from this
        node's first replica; the other replicas' collectives, which must run too)
    """
    group_size = ctx.total_replicas
    means = [None] * len(members)
    others = []
    by_dtype = {}  # one buffer, so one collective, per dtype; in the members' order
    for i, (_, _, grads) in enumerate(members):
        if not isinstance(grads[0], tf.IndexedSlices):
            by_dtype.setdefault(grads[0].dtype, []).append(i)
    for dense in by_dtype.values():
        key = keys.take()
        name, sync, _ = members[dense[0]]
        for replica in range(ctx.num_replicas):
            with tf.device(ctx.replica_tf_device(replica)):
                grads = [members[i][2][replica] for i in dense]
                scope = f"{replica_scope(replica)}/{name}"
                summed, unpack = _reduce_dense(grads, sync, group_size, key, scope)
                if replica == 0:
                    for i, grad in zip(dense, unpack(summed)):
                        means[i] = grad
                else:
                    others.append(summed.op)
    for i, (_, _, grads) in enumerate(members):
        if not isinstance(grads[0], tf.IndexedSlices):
            continue
        sparse_keys = (keys.take(), keys.take(), keys.take())
        for replica in range(ctx.num_replicas):
            with tf.device(ctx.replica_tf_device(replica)):
                gathered = _gather_sparse(grads[replica], group_size, sparse_keys)
                if replica == 0:
                    means[i] = _mean_of_gathered(*gathered, group_size, grads[replica])
                else:
                    others.extend(t.op for t in gathered)
    return means, others


def _reduce_dense(grads: list, sync, group_size: int, key: int, scope: str) -> tuple:
    """One replica's collective of a group: (its output, a function unpacking the mean)."""
    flat_shape = tf.constant([-1])  # one shape constant for all: large groups are common
    flat = tf.concat([tf.reshape(g, flat_shape) for g in grads], 0) if len(grads) > 1 \
        else tf.reshape(grads[0], flat_shape)
    compressor = compressor_class(sync.compressor)(scope)
    wire, ctx = compressor.compress(flat)
    summed = tf.raw_ops.CollectiveReduceV2(
        input=wire, group_size=group_size, group_key=COLLECTIVE_GROUP_KEY,
        instance_key=key, ordering_token=[], merge_op="Add", final_op="Div",
        max_subdivs_per_device=_RING_SUBDIVISIONS)

    def unpack(summed):
        mean = compressor.decompress(summed, ctx)
        sizes = [g.shape.num_elements() for g in grads]
        return [tf.reshape(piece, g.shape) for piece, g in zip(tf.split(mean, sizes), grads)]
    return summed, unpack


# Instance keys of sparse gathers: one per gather and padded size, above the
# keys CollectiveKeys hands out.
_SIZED_KEY_BASE = 1 << 24
_SIZE_CLASSES = 48


def _gather_sparse(grad: tf.IndexedSlices, group_size: int, keys: tuple) -> tuple:
    """All-gathers an IndexedSlices gradient: (values, indices) of every replica.

    Replicas may hold different numbers of rows (a partition owns the rows whose
    ids fall in its range, a short batch has fewer), but a gather needs equal
    shapes: every replica pads to the power of two above the largest count
    with rows of index -1, dropped by :func:`_mean_of_gathered`. The extra row
    keeps the gather from ever being empty, which crashes the collective.

    TensorFlow resolves a collective's shape once per instance key and then
    holds every later run of that key to it, so each padded size gathers under
    a key of its own (at most one per power of two).
    """
    count_key, value_key, index_key = keys
    indices = tf.cast(grad.indices, tf.int64)
    count = tf.shape(indices, out_type=tf.int64)[:1]
    longest = tf.reduce_max(_gather(count, group_size, count_key))
    size_class = _ceil_log2(longest + 1)
    padding = tf.bitwise.left_shift(tf.constant(1, tf.int64), size_class) - count[0]
    values = tf.pad(grad.values, [[0, padding]] + [[0, 0]] * (grad.values.shape.rank - 1))
    indices = tf.pad(indices, [[0, padding]], constant_values=-1)

    def sized_key(key):
        return tf.cast(_SIZED_KEY_BASE + key * _SIZE_CLASSES + size_class, tf.int32)

    return (_gather(values, group_size, sized_key(value_key)),
            _gather(indices, group_size, sized_key(index_key)))


def _ceil_log2(value: tf.Tensor) -> tf.Tensor:
    """The smallest int64 ``b`` with ``2 ** b >= value``, for ``value >= 1``."""
    guess = tf.cast(tf.math.ceil(tf.math.log(tf.cast(value, tf.float64)) / math.log(2.0)),
                    tf.int64)
    one = tf.constant(1, tf.int64)
    # Correct a floating-point rounding either way.
    guess = tf.where(tf.bitwise.left_shift(one, guess) < value, guess + 1, guess)
    return tf.where((guess > 0) & (tf.bitwise.left_shift(one, tf.maximum(guess - 1, 0))
                                   >= value), guess - 1, guess)


def _mean_of_gathered(values: tf.Tensor, indices: tf.Tensor, group_size: int,
                      grad: tf.IndexedSlices) -> tf.IndexedSlices:
    real = indices >= 0
    return tf.IndexedSlices(tf.boolean_mask(values, real) / float(group_size),
                            tf.boolean_mask(indices, real), grad.dense_shape)


def _gather(tensor: tf.Tensor, group_size: int, instance_key: int) -> tf.Tensor:
    return tf.raw_ops.CollectiveGatherV2(
        input=tensor, group_size=group_size, group_key=COLLECTIVE_GROUP_KEY,
        instance_key=instance_key, ordering_token=[])
