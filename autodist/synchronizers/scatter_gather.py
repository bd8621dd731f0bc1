"""An all-reduce without collective ops: a reduce-scatter and an all-gather over send/recv.

``AllReduceSynchronizer.Spec.SCATTER_GATHER``. Each node sums its own replicas'
gradients, cuts the sum into one slice per node, and enqueues slice ``j`` into
a queue on node ``j``. Node ``j`` sums the slices it receives, in node order
(so the sum is the same on every run), and enqueues that sum into a queue on
every other node, which concatenates the sums it receives. Every node sends and receives ``2 (n - 1) / n`` of the buffer, as in
a ring, but in two hops. A large slice goes in pieces, each summed on arrival.

The tensors travel by TensorFlow's send/recv, the path a parameter server's
gradients take, which copies less per byte than the collective ring's
``RecvBuf`` (``docs/notes/peers.md``). Queues are named after the group's key,
which every node computes alike, and live on the node that dequeues from them;
an enqueue placed on another node's device runs there within this node's
step, so no node needs a collective step id and a step may also run a
parameter server's ops.
"""
from __future__ import annotations

import itertools
from typing import Tuple

import numpy as np
import tensorflow as tf

from autodist.kernel_context import KernelContext
from autodist.network import ClusterView, seconds
from autodist.synchronizers.base import (CollectiveKeys, dense_by_dtype, flatten, piece_sizes,
                                         slice_sizes, stash, unflatten)
from autodist.synchronizers.compressor import compressor_class


def transfer_seconds(wire_bytes: np.ndarray, cluster: ClusterView) -> np.ndarray:
    """Seconds at nominal rate to reduce buffers of ``wire_bytes`` this way, one per buffer.

    Across ``m`` nodes each node sends and receives ``2 (m - 1) / m`` of a buffer
    over its NIC, the slowest NIC binding; its replicas meet in one local sum
    first, so the replicas per node do not count. On one node the local sum
    reads every replica's buffer once over the local bus.
    """
    nodes = len(cluster.replicas_per_node)
    if nodes > 1:
        gbps = min(cluster.nic_gbps[node] for node in cluster.replicas_per_node)
        return seconds(2.0 * (nodes - 1) / nodes * wire_bytes, gbps)
    return seconds((cluster.num_replicas - 1) * wire_bytes, cluster.local_gbps)


def _queue(key: int, phase: str, source: int, target: int, dtypes: list,
           shapes=None, piece: int = 0) -> tf.queue.FIFOQueue:
    """The queue carrying piece ``piece`` of ``phase``'s tensors of group ``key`` from
    node ``source`` to ``target``; every node names it alike, so all of them reach the
    same one."""
    name = f"autodist_scatter_gather_{key}_{phase}_{source}_to_{target}"
    if piece:
        name += f"_piece{piece}"
    return tf.queue.FIFOQueue(capacity=-1, dtypes=dtypes, shapes=shapes, shared_name=name,
                              name=name)


def sum_across_nodes(buffer: tf.Tensor, key: int,
                     ctx: KernelContext) -> Tuple[tf.Tensor, list]:
    """Every node's ``buffer`` (a flat dense tensor of this node) summed, on this node.

    A large slice travels and is summed in pieces of at most ``PIECE_BYTES``, each
    through its own queue (``base.carried`` says why).

    Args:
        key: the group's key, the same on every node.

    Returns:
        (the sum; the enqueues to other nodes' queues, which this node's step
        must run)
    """
    n, me = ctx.num_nodes, ctx.node_index
    if n == 1:
        with tf.device(ctx.shared_device):
            return buffer, []
    pieces = [piece_sizes(size, buffer.dtype.size)
              for size in slice_sizes(buffer.shape.num_elements(), n)]
    with tf.device(ctx.shared_device):
        flat = tf.split(buffer, [size for sizes in pieces for size in sizes])
    cuts = list(itertools.accumulate([0] + [len(sizes) for sizes in pieces]))
    slices = [flat[cuts[node]:cuts[node + 1]] for node in range(n)]

    def queue(phase, piece, source, target, size):
        return _queue(key, phase, source, target, [buffer.dtype], [[size]], piece)

    sends = []
    for node in range(n):
        if node != me:
            with tf.device(ctx.nodes[node]):
                sends.extend(queue("reduce", k, me, node, size).enqueue(piece)
                             for k, (piece, size) in enumerate(zip(slices[node], pieces[node])))
    with tf.device(ctx.shared_device):
        mine = [tf.add_n([piece if node == me else queue("reduce", k, node, me, size).dequeue()
                          for node in range(n)])
                for k, (piece, size) in enumerate(zip(slices[me], pieces[me]))]
    for node in range(n):
        if node != me:
            with tf.device(ctx.nodes[node]):
                sends.extend(queue("gather", k, me, node, size).enqueue(piece)
                             for k, (piece, size) in enumerate(zip(mine, pieces[me])))
    with tf.device(ctx.shared_device):
        mean = tf.concat([piece for node in range(n) for piece in
                          (mine if node == me else
                           [queue("gather", k, node, me, size).dequeue()
                            for k, size in enumerate(pieces[node])])], 0)
    return mean, sends


def gather_rows(values: tf.Tensor, indices: tf.Tensor, key: int,
                ctx: KernelContext) -> Tuple[tf.Tensor, tf.Tensor, list]:
    """Every node's rows of a sparse gradient, concatenated in node order, on this node.

    Args:
        values: this node's rows (its replicas', concatenated).
        indices: their int64 row ids.
        key: the gradient's key, the same on every node.

    Returns:
        (values, indices, the enqueues to other nodes' queues)
    """
    n, me = ctx.num_nodes, ctx.node_index
    if n == 1:
        return values, indices, []
    rows_shape = tf.TensorShape([None]).concatenate(values.shape[1:])

    def queue(source, target):
        # Row counts differ from node to node and step to step: the queue holds any shape.
        return _queue(key, "rows", source, target, [values.dtype, tf.int64])

    def received(node):
        node_values, node_indices = queue(node, me).dequeue()
        return tf.ensure_shape(node_values, rows_shape), tf.ensure_shape(node_indices, [None])

    sends = []
    for node in range(n):
        if node != me:
            with tf.device(ctx.nodes[node]):
                sends.append(queue(me, node).enqueue([values, indices]))
    with tf.device(ctx.shared_device):
        pieces = [(values, indices) if node == me else received(node) for node in range(n)]
        return (tf.concat([v for v, _ in pieces], 0), tf.concat([i for _, i in pieces], 0),
                sends)


def reduce_group(members: list, keys: CollectiveKeys, ctx: KernelContext) -> tuple:
    """Reduces the gradients of one ``SCATTER_GATHER`` group without collective ops.

    This node's replicas' gradients are summed on its CPU first, so a node sends
    one buffer per dtype whatever its replicas. In a split step the sums are
    stored by the first run and exchanged by the second.

    Args:
        members: list of (part name, its AllReduceSynchronizer, this node's
            contributions: one per local replica, or their sum) in a fixed order,
            the dense ones agreeing on the compressor.
        keys: hands out the keys naming the group's queues.

    Returns:
        (list parallel to ``members`` of the mean gradient on this node's CPU; ops
        storing the sums, for a split step's first run; the enqueues to other
        nodes' queues)
    """
    means = [None] * len(members)
    stores, sends = [], []

    def exchanged(value, name):
        if not ctx.split_step:
            return value
        store, stored = stash(f"{name}/scatter_gather", value, ctx)
        stores.append(store)
        if isinstance(stored, tf.IndexedSlices):
            return stored
        with tf.device(ctx.shared_device):
            return tf.ensure_shape(stored, value.shape)  # the stash holds any shape

    for dense in dense_by_dtype(members):
        key = keys.take()
        name, sync, _ = members[dense[0]]
        with tf.device(ctx.shared_device):
            buffer = node_buffer([members[i][2] for i in dense])
            compressor = compressor_class(sync.compressor)(f"{name}/scatter_gather")
            wire, state = compressor.compress(buffer)
        mean, sent = sum_across_nodes(exchanged(wire, name), key, ctx)
        sends.extend(sent)
        with tf.device(ctx.shared_device):
            mean = compressor.decompress(mean, state)
            for i, grad in zip(dense, unflatten(mean, [members[i][2][0] for i in dense])):
                means[i] = grad
    for i, (name, _, grads) in enumerate(members):
        if not isinstance(grads[0], tf.IndexedSlices):
            continue
        key = keys.take()
        with tf.device(ctx.shared_device):
            rows = exchanged(tf.IndexedSlices(
                tf.concat([g.values for g in grads], 0),
                tf.concat([tf.cast(g.indices, tf.int64) for g in grads], 0),
                grads[0].dense_shape), name)
        values, indices, sent = gather_rows(rows.values, rows.indices, key, ctx)
        sends.extend(sent)
        with tf.device(ctx.shared_device):
            means[i] = tf.IndexedSlices(values, indices, grads[0].dense_shape)
    return means, stores, sends


def node_buffer(contributions: list) -> tf.Tensor:
    """This node's sum of a group's dense gradients as one flat buffer, member after
    member: the same layout on every node, whichever members it got summed.

    ``contributions`` holds each member's, one per local replica or their sum. A
    run of members given alike is flattened per replica and added up once (a
    group of many small gradients costs a join per replica and one sum).
    """
    pieces = []
    for _, run in itertools.groupby(contributions, key=len):
        run = list(run)
        flats = [flatten([member[r] for member in run]) for r in range(len(run[0]))]
        pieces.append(tf.add_n(flats) if len(flats) > 1 else flats[0])
    return tf.concat(pieces, 0) if len(pieces) > 1 else pieces[0]
