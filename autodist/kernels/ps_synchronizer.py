"""PS synchronizer: one shared copy of a variable part on its reduction destination.

Replicas read it (or a local proxy of it), their gradients are averaged on the
destination (optionally summed per node first on a transfer destination) and the
optimizer updates the shared copy once per step.
"""
from __future__ import annotations

import tensorflow as tf

from autodist.kernels.context import KernelContext, replica_scope


def create_ps_storage(name: str, initial_value: tf.Tensor, sync, ctx: KernelContext):
    """Creates the shared variable and, when asked for, the replicas' proxies.

    Proxies exist with ``local_replication`` or a staleness bound: replicas then
    read a local copy that is refreshed after updates, not the shared one.

    Returns:
        (shared variable, list of what each replica reads)
    """
    with tf.device(ctx.tf_device(sync.reduction_destination)):
        shared = tf.Variable(initial_value, name=name)
    if not (sync.local_replication or sync.staleness > 0):
        return shared, [shared] * ctx.num_replicas
    proxies = []
    for replica in range(ctx.num_replicas):
        with tf.device(ctx.replica_tf_device(replica)):
            proxies.append(tf.Variable(initial_value, trainable=False,
                                       name=f"{replica_scope(replica)}/{name}/proxy"))
    return shared, proxies


def reduce_ps_gradients(grads: list, sync, ctx: KernelContext):
    """Averages the replicas' gradients of one part on its destination.

    Args:
        grads: one dense tensor or IndexedSlices per replica.
        sync: the part's PSSynchronizer.

    Returns:
        the mean gradient, dense or IndexedSlices like the inputs.
    """
    num = float(len(grads))
    if sync.transfer_destination:
        with tf.device(ctx.tf_device(sync.transfer_destination)):
            grads = [_sum(grads)]
    with tf.device(ctx.tf_device(sync.reduction_destination)):
        total = _sum(grads)
        if isinstance(total, tf.IndexedSlices):
            return tf.IndexedSlices(total.values / num, total.indices, total.dense_shape)
        return total / num


def _sum(grads: list):
    if len(grads) == 1:
        return grads[0]
    if isinstance(grads[0], tf.IndexedSlices):
        # Duplicate rows stay; the optimizers sum duplicate indices themselves.
        return tf.IndexedSlices(tf.concat([g.values for g in grads], 0),
                                tf.concat([tf.cast(g.indices, tf.int64) for g in grads], 0),
                                grads[0].dense_shape)
    return tf.add_n(grads)


def refresh_proxies(shared: tf.Variable, proxies: list, staleness: int,
                    step: tf.Tensor) -> tf.Operation:
    """Copies the shared value to the proxies; with staleness s, every s + 1 steps."""
    def copy():
        value = shared.read_value()
        return tf.group(*[p.assign(value) for p in proxies])
    if staleness == 0:
        return copy()
    return tf.cond(tf.equal(step % (staleness + 1), 0), lambda: tf.group(copy()), tf.no_op)
