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

    Proxies exist with ``local_replication``, a staleness bound, or when the step
    is split (a collective step may only read local copies): replicas then read a
    local copy that is refreshed after updates, not the shared one. On a cluster
    a proxy starts from the shared value (the chief's initial value).

    Returns:
        (shared variable, list of what each replica reads)
    """
    with tf.device(ctx.tf_device(sync.reduction_destination)):
        shared = tf.Variable(initial_value, name=name)
    if not (sync.local_replication or sync.staleness > 0 or ctx.split_step):
        return shared, [shared] * ctx.num_replicas
    start = shared.read_value() if ctx.multi_node else initial_value
    proxies = []
    for replica in range(ctx.num_replicas):
        with tf.device(ctx.replica_tf_device(replica)):
            proxies.append(tf.Variable(start, trainable=False,
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


# Applications are never dropped as stale: the token queues below keep nodes in step.
_ALWAYS_FRESH = 2 ** 62


def node_contribution(grads: list, sync, ctx: KernelContext):
    """This node's share of a part's gradient: its replicas' sum / all replicas.

    The shares of all nodes add up to the mean over every replica of the
    cluster, whatever the number of replicas per node. With a
    ``transfer_destination``, or in a split step, the node sums its replicas'
    gradients on its own CPU and pushes one tensor; otherwise the sum happens
    on the destination, so every replica's gradient crosses the network.
    """
    if sync.transfer_destination or ctx.split_step:
        device = ctx.shared_device
    else:
        device = ctx.tf_device(sync.reduction_destination)
    with tf.device(device):
        total = _sum(grads)
        scale = 1.0 / ctx.total_replicas
        if isinstance(total, tf.IndexedSlices):
            return tf.IndexedSlices(total.values * scale, total.indices, total.dense_shape)
        return total * scale


def accumulate_across_nodes(name: str, contribution, shape: tuple, sync,
                            ctx: KernelContext):
    """Sends this node's contribution to the part's accumulator on its destination.

    Returns:
        (apply op, on the chief the sum of all nodes' contributions, else None)
    """
    if isinstance(contribution, tf.IndexedSlices):
        return _gather_across_nodes(name, contribution, shape, sync, ctx)
    with tf.device(ctx.tf_device(sync.reduction_destination)):
        # SUM: the contributions are already scaled to add up to the mean.
        accumulator = tf.compat.v1.ConditionalAccumulator(
            contribution.dtype, shape=shape, shared_name=f"{name}/accumulator",
            name=f"{name}/accumulator", reduction_type="SUM")
        apply = accumulator.apply_grad(contribution, local_step=_ALWAYS_FRESH)
        if not ctx.is_chief:
            return apply, None
        with tf.control_dependencies([apply]):
            mean = accumulator.take_grad(ctx.num_nodes)
    return apply, mean


def _gather_across_nodes(name: str, contribution: tf.IndexedSlices, shape: tuple, sync,
                         ctx: KernelContext):
    """A sparse part's contributions, concatenated in node order on the chief.

    Every node queues its rows on the destination, one queue per node; the chief
    takes one item from each, in node order. Duplicate rows stay as they are, in
    the order one device would see them: an optimizer that squares a sparse
    gradient's rows (Keras's Adam) must see the same rows as on one device.
    """
    def queue(node):
        return tf.queue.FIFOQueue(capacity=-1, dtypes=[contribution.dtype, tf.int64],
                                  shared_name=f"{name}/sparse_from_{node}",
                                  name=f"{name}/sparse_from_{node}")

    with tf.device(ctx.tf_device(sync.reduction_destination)):
        apply = queue(ctx.node_index).enqueue(
            [contribution.values, tf.cast(contribution.indices, tf.int64)])
        if not ctx.is_chief:
            return apply, None
        with tf.control_dependencies([apply]):
            pieces = [queue(node).dequeue() for node in range(ctx.num_nodes)]
        row_shape = tf.TensorShape(shape[1:])
        values = [tf.ensure_shape(v, tf.TensorShape([None]).concatenate(row_shape))
                  for v, _ in pieces]
        indices = [tf.ensure_shape(i, [None]) for _, i in pieces]
        mean = tf.IndexedSlices(tf.concat(values, 0), tf.concat(indices, 0),
                                tf.constant(shape, tf.int64))
    return apply, mean


def token_queue(worker: int, ctx: KernelContext, purpose: str = "sync_token",
                device: str = "") -> tf.queue.FIFOQueue:
    """The queue through which the chief lets worker ``worker`` go on.

    With the default ``purpose``, the worker's next step waits for a token; other
    purposes (e.g. a finished restore) get queues of their own. The queue lives
    on ``device``, by default the chief's.
    """
    name = f"autodist_{purpose}_{worker}"
    with tf.device(device or ctx.chief_device):
        return tf.queue.FIFOQueue(capacity=-1, dtypes=[tf.int64], shapes=[[]],
                                  shared_name=name, name=name)


def stash(name: str, contribution, ctx: KernelContext):
    """Keeps this node's contribution in local variables between a step's two runs.

    Returns:
        (op storing it, run by the collective run; the stored value, read by the
        PS run), a dense tensor or IndexedSlices like ``contribution``
    """
    def holder(value, suffix):
        return tf.Variable(tf.zeros([0] * value.shape.rank, value.dtype), shape=tf.TensorShape(None),
                           trainable=False, collections=[tf.compat.v1.GraphKeys.LOCAL_VARIABLES],
                           name=f"{name}/stash_{suffix}")

    with tf.device(ctx.shared_device):
        if isinstance(contribution, tf.IndexedSlices):
            indices = tf.cast(contribution.indices, tf.int64)
            values_var, indices_var = holder(contribution.values, "values"), holder(indices, "indices")
            store = tf.group(values_var.assign(contribution.values, read_value=False),
                             indices_var.assign(indices, read_value=False))
            return store, tf.IndexedSlices(values_var.read_value(), indices_var.read_value(),
                                           contribution.dense_shape)
        values_var = holder(contribution, "values")
        return values_var.assign(contribution, read_value=False), values_var.read_value()
