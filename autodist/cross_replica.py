"""Sums and gathers over every replica inside a step: marked while tracing, made real
per replica.

A step written for one device cannot name the other replicas. Where a single
device's computation needs the whole batch of a tensor that depends on the
weights (a synchronized batch normalization's statistics, the candidates of
in-batch negatives), the step marks it: ``cross_replica_sum`` marks a sum and
its gradient (replica r's rows reach every replica's loss through it, so the
gradient is summed over the replicas too), and ``gather_batch`` places a
replica's rows at their place in the batch and sums. The replicator turns a
marked sum into a collective sum over every replica of every node, and gives
each replica the global batch's row count and its first row's index for the
marked ones (on a cluster, every node's rows in node order).
"""
from __future__ import annotations

import re
from typing import Tuple

import tensorflow as tf

SUM = "autodist_cross_replica_sum"
BATCH_ROWS = "autodist_batch_rows"
FIRST_ROW = "autodist_first_row"


def _marked(mark: str) -> re.Pattern:
    return re.compile(rf"(^|/){mark}(_\d+)?$")


_MARKED = {mark: _marked(mark) for mark in (SUM, BATCH_ROWS, FIRST_ROW)}


def cross_replica_sum(value: tf.Tensor) -> tf.Tensor:
    """``value`` summed over every replica of the step (itself on one device)."""

    @tf.custom_gradient
    def summed(tensor):
        def gradient(upstream):
            return _marked_sum(upstream)
        return _marked_sum(tensor), gradient

    return summed(value)


def _marked_sum(tensor: tf.Tensor) -> tf.Tensor:
    # The mark carries the tensor's size, which tells its shape apart from run to run
    # (a gathered batch's rows): a collective is bound to one shape per instance key.
    return tf.identity_n([tensor, tf.size(tensor)], name=SUM)[0]


def gather_batch(rows: tf.Tensor) -> Tuple[tf.Tensor, tf.Tensor]:
    """The rows of ``rows`` from every replica, in the global batch's order, and the
    index of this replica's first row among them.

    On one device (outside AutoDist) that is ``(rows, 0)``. Under AutoDist each
    replica computes the rows of its share of the batch; gathered, they are what
    a single device computes for the whole batch, and the gradient of each row
    flows back to the replica that computed it. So in-batch negatives train
    exactly: score every replica's queries against the gathered candidates, and
    take the label of query i as ``first + i``::

        candidates, first = autodist.gather_batch(candidate_embeddings)
        logits = tf.matmul(queries, candidates, transpose_b=True)
        labels = first + tf.range(tf.shape(queries)[0])
        loss = keras.losses.sparse_categorical_crossentropy(labels, logits,
                                                            from_logits=True)

    Args:
        rows: a tensor whose first dimension is the batch's (a replica's rows).

    Returns:
        (every replica's rows, this replica's first row's index: an int32 scalar)
    """
    own = tf.shape(rows)[0]
    batch = tf.identity(own, name=BATCH_ROWS)
    first = tf.identity(tf.zeros([], tf.int32), name=FIRST_ROW)
    # Each replica places its rows at their place in a batch of zeros; the sum
    # over the replicas holds every row, and its gradient is each row's own.
    padding = tf.concat([[[first, batch - first - own]],
                         tf.zeros([tf.rank(rows) - 1, 2], tf.int32)], axis=0)
    return cross_replica_sum(tf.pad(rows, padding)), first


def marked(node, mark: str) -> bool:
    """Whether a NodeDef is marked ``mark``: an ``Identity`` marked ``BATCH_ROWS`` or
    ``FIRST_ROW``, or an ``IdentityN`` of a tensor and its size marked ``SUM``."""
    op = "IdentityN" if mark == SUM else "Identity"
    return node.op == op and bool(_MARKED[mark].search(node.name))


def is_cross_replica_sum(node) -> bool:
    """Whether a NodeDef is a marked sum over the replicas (inputs: the tensor, its size)."""
    return marked(node, SUM)
