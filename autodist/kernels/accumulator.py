"""Accumulator: gradient accumulation over several runs of the train op.

With ``k`` accumulation steps, runs ``0 .. k-2`` of a cycle keep each replica's
gradient on the replica's own device (no communication); run ``k-1`` hands
the synchronizer kinds the mean of the cycle's ``k`` gradients, and the
optimizer applies it once. With equal batches that is the gradient of the
loss averaged over the ``k`` batches' rows: single-device training on their
concatenation.

* A dense gradient is summed into one accumulator per replica, reset by the
  run that reads it.
* An ``IndexedSlices`` gradient stays sparse: run ``j`` stores its rows and
  indices in stash ``j`` (a variable of any row count), and the last run
  concatenates the stashes with its own rows, as one sparse gradient.

The session picks the op to run (``DistributedGraph.accumulate_ops``); this
module builds them.
"""
from __future__ import annotations

import dataclasses

import tensorflow as tf

from autodist.synchronizers.base import local_variable


@dataclasses.dataclass
class Accumulation:
    """The ops of one cycle of ``steps`` runs, gathered while gradients are wrapped.

    Attributes:
        steps: runs per cycle (``k``).
        runs: per run ``j < k-1`` of a cycle, the ops storing its gradients.
        resets: ops the last run adds, after reading the accumulators.
    """

    steps: int
    runs: list = dataclasses.field(init=False)
    resets: list = dataclasses.field(default_factory=list)

    def __post_init__(self):
        self.runs = [[] for _ in range(self.steps - 1)]

    def mean_gradient(self, gradient, device: str, name: str, shape: tuple):
        """The mean of the cycle's gradients, for the cycle's last run.

        Args:
            gradient: this run's gradient of one replica (a Tensor or IndexedSlices).
            device: the replica's device, home of its accumulators.
            name: a unique name scope for the accumulators.
            shape: the variable's shape.
        """
        with tf.device(device), tf.name_scope(f"{name}/accumulate"):
            if isinstance(gradient, tf.IndexedSlices):
                total = self._stashed(gradient, tf.TensorShape(shape[1:]))
                return tf.IndexedSlices(total.values / self.steps, total.indices,
                                        total.dense_shape)
            return self._summed(gradient) / self.steps

    def _summed(self, gradient: tf.Tensor) -> tf.Tensor:
        accumulator = local_variable(tf.zeros(gradient.shape, gradient.dtype), "accumulator")
        for run in self.runs:
            run.append(accumulator.assign_add(gradient, read_value=False))
        total = accumulator.read_value() + gradient
        with tf.control_dependencies([total]):
            self.resets.append(accumulator.assign(tf.zeros_like(gradient), read_value=False))
        return total

    def _stashed(self, gradient: tf.IndexedSlices, row_shape: tf.TensorShape
                 ) -> tf.IndexedSlices:
        rows = tf.reshape(gradient.values, [-1] + row_shape.as_list())
        values, indices = [], []
        for j, run in enumerate(self.runs):
            stash_values = local_variable(
                tf.zeros([0] + row_shape.as_list(), gradient.values.dtype), f"stash_{j}_values",
                tf.TensorShape([None]).concatenate(row_shape))
            stash_indices = local_variable(tf.zeros([0], gradient.indices.dtype),
                                            f"stash_{j}_indices", tf.TensorShape([None]))
            run.append(stash_values.assign(rows, read_value=False))
            run.append(stash_indices.assign(gradient.indices, read_value=False))
            values.append(stash_values.read_value())
            indices.append(stash_indices.read_value())
        return tf.IndexedSlices(tf.concat(values + [rows], 0),
                                tf.concat(indices + [gradient.indices], 0),
                                gradient.dense_shape)
