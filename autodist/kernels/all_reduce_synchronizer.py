"""AllReduce synchronizer: every replica keeps a copy; gradients meet in collectives.

Dense gradients of the parts sharing a group are flattened into one buffer per
replica and reduced by a single TensorFlow collective (mean), then split back.
Sparse gradients are all-gathered (values and indices), which keeps them sparse.
Collective keys are derived from the strategy alone, so every node of a cluster
computes the same ones.
"""
from __future__ import annotations

import tensorflow as tf

from autodist.kernels.compressor import make_compressor
from autodist.kernels.context import KernelContext, replica_scope
from autodist.proto import synchronizers_pb2

COLLECTIVE_GROUP_KEY = 1
# Sub-rings per device: a merged group is one large buffer, and with a single
# ring every step copies a whole chunk before adding it; several overlap the
# transfer of one piece with the arithmetic of another (docs/benchmarks.md).
_RING_SUBDIVISIONS = 4
_COMPRESSOR_NAMES = synchronizers_pb2.AllReduceSynchronizer.Compressor.Name


def create_all_reduce_storage(name: str, initial_value: tf.Tensor, ctx: KernelContext):
    """One copy of the part on every replica device, all with the same initial value.

    On a cluster every node's copies start from an origin variable on the chief,
    so they agree even when the initializer is random and unseeded.

    Returns:
        (copies, origin variable or None)
    """
    origin = None
    if ctx.multi_node:
        with tf.device(ctx.chief_device):
            origin = tf.Variable(initial_value, trainable=False, name=f"{name}/origin")
        initial_value = origin.read_value()
    copies = []
    for replica in range(ctx.num_replicas):
        with tf.device(ctx.replica_tf_device(replica)):
            copies.append(tf.Variable(initial_value, name=f"{replica_scope(replica)}/{name}"))
    return copies, origin


class CollectiveKeys:
    """Hands out instance keys in the (deterministic) order collectives are built."""

    def __init__(self):
        self._next = 1

    def take(self) -> int:
        key = self._next
        self._next += 1
        return key


def all_reduce_group(members: list, sync, keys: CollectiveKeys, ctx: KernelContext) -> list:
    """Reduces the gradients of one group across all replicas.

    Args:
        members: list of (part name, [grad per local replica]) in a fixed order.
        sync: the group's AllReduceSynchronizer (its compressor applies to all).

    Returns:
        list parallel to ``members`` of [mean grad per local replica].
    """
    group_size = ctx.total_replicas
    reduced = [[None] * ctx.num_replicas for _ in members]
    dense = [i for i, (_, grads) in enumerate(members)
             if not isinstance(grads[0], tf.IndexedSlices)]
    if dense:
        key = keys.take()
        for replica in range(ctx.num_replicas):
            with tf.device(ctx.replica_tf_device(replica)):
                grads = [members[i][1][replica] for i in dense]
                mean = _reduce_dense(grads, sync, group_size, key,
                                     f"{replica_scope(replica)}/{members[dense[0]][0]}")
                for i, grad in zip(dense, mean):
                    reduced[i][replica] = grad
    for i, (_, grads) in enumerate(members):
        if i in dense:
            continue
        sparse_keys = (keys.take(), keys.take(), keys.take())
        for replica in range(ctx.num_replicas):
            with tf.device(ctx.replica_tf_device(replica)):
                reduced[i][replica] = _gather_sparse(grads[replica], group_size, sparse_keys)
    return reduced


def _reduce_dense(grads: list, sync, group_size: int, key: int, scope: str) -> list:
    flat = tf.concat([tf.reshape(g, [-1]) for g in grads], 0) if len(grads) > 1 \
        else tf.reshape(grads[0], [-1])
    compressor = make_compressor(_COMPRESSOR_NAMES(sync.compressor), scope)
    wire, ctx = compressor.compress(flat)
    summed = tf.raw_ops.CollectiveReduceV2(
        input=wire, group_size=group_size, group_key=COLLECTIVE_GROUP_KEY,
        instance_key=key, ordering_token=[], merge_op="Add", final_op="Div",
        max_subdivs_per_device=_RING_SUBDIVISIONS)
    mean = compressor.decompress(summed, ctx)
    sizes = [g.shape.num_elements() for g in grads]
    return [tf.reshape(piece, g.shape) for piece, g in zip(tf.split(mean, sizes), grads)]


def _gather_sparse(grad: tf.IndexedSlices, group_size: int, keys: tuple) -> tf.IndexedSlices:
    """All-gathers an IndexedSlices gradient and averages it.

    Replicas may hold different numbers of rows (a partition owns the rows whose
    ids fall in its range), but a gather needs equal shapes: every replica pads to
    one more than the largest count with rows of index -1, which are dropped after
    the gather. The extra row keeps the gather from ever being empty, which
    crashes the collective.
    """
    count_key, value_key, index_key = keys
    indices = tf.cast(grad.indices, tf.int64)
    count = tf.shape(indices, out_type=tf.int64)[:1]
    longest = tf.reduce_max(_gather(count, group_size, count_key))
    padding = longest + 1 - count[0]
    values = tf.pad(grad.values, [[0, padding]] + [[0, 0]] * (grad.values.shape.rank - 1))
    indices = tf.pad(indices, [[0, padding]], constant_values=-1)
    values = _gather(values, group_size, value_key)
    indices = _gather(indices, group_size, index_key)
    real = indices >= 0
    return tf.IndexedSlices(tf.boolean_mask(values, real) / float(group_size),
                            tf.boolean_mask(indices, real), grad.dense_shape)


def _gather(tensor: tf.Tensor, group_size: int, instance_key: int) -> tf.Tensor:
    return tf.raw_ops.CollectiveGatherV2(
        input=tensor, group_size=group_size, group_key=COLLECTIVE_GROUP_KEY,
        instance_key=instance_key, ordering_token=[])
