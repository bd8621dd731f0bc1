"""How a stored copy of a table runs its optimizer's traced update: on every row, or on
the rows its sparse gradient names.

Keras 3 updates a table densely even when its gradient names few rows: Adagrad takes
the square root of the whole accumulator, FTRL and Adam turn the gradient dense. For
an update that leaves a row and its slots as they are when the row has no gradient
(SGD, Adagrad, FTRL after its first step), running the same traced update on the
touched rows alone gives the same table: the rows of the copy and of its slots are
gathered into scratch variables of as many rows, the unchanged traced per-variable
stage runs on them, with the gradient's ids renumbered into them, and the rows are
written back. ``KerasOptimizerCall.update_modes`` decides, per variable, from the traced
update itself (``autodist/keras/update.py``), which hands each mode the import of its
per-variable stage.
"""
from __future__ import annotations

from typing import Callable, Dict, Optional

import tensorflow as tf

from autodist.graph_item import (UPDATE_BY_ROWS, UPDATE_BY_ROWS_AFTER_FIRST, UPDATE_BY_ROWS_LAZY,
                                 UPDATE_DENSE, PartUpdate)


# Imports a variable's traced per-variable stage against (state key -> the resource
# handle it reads and writes, the gradient it reads); returns the stage's write ops.
Stage = Callable[[Dict[str, tf.Tensor], object], list]


class UpdateMode:
    """How a variable's update runs on each stored copy. A mode is a class per kind.

    Attributes:
        name: what ``autodist explain`` and the strategy's description say.
    """

    name = ""

    def apply(self, state: Dict[str, tf.Variable], gradient, iteration: Optional[tf.Variable],
              stage: Stage) -> tf.Operation:
        """Runs ``stage`` on this copy; returns the op ending its update.

        Args:
            state: key -> the copy's variable and each of its slots.
            gradient: the copy's mean gradient.
            iteration: the optimizer's iteration count, read before this step's
                increment, or None.
            stage: imports the traced per-variable stage (may be called inside a
                branch of a ``tf.cond``).
        """
        raise NotImplementedError


class DenseUpdate(UpdateMode):
    """The traced update on every row of the copy, as Keras runs it on one device."""

    name = UPDATE_DENSE

    def apply(self, state, gradient, iteration, stage) -> tf.Operation:
        return tf.group(*stage({key: v.handle for key, v in state.items()}, gradient))


class RowUpdate(UpdateMode):
    """The traced update on the rows the step's gradient names, each once.

    Exact where a row without gradient and its slots do not change; duplicate ids
    keep their entries (the traced update decides whether it adds them).
    """

    name = UPDATE_BY_ROWS

    def apply(self, state, gradient, iteration, stage) -> tf.Operation:
        if not isinstance(gradient, tf.IndexedSlices):  # synchronized dense: every row
            return DenseUpdate().apply(state, gradient, iteration, stage)
        touched = _TouchedRows(state, gradient)
        with tf.control_dependencies(touched.gathers):
            return touched.update(stage)


class RowUpdateAfterFirst(RowUpdate):
    """Every row at the first step (iteration 0), the touched rows after it: for an
    update whose first step moves rows without gradient (Keras's FTRL sets them to
    their fixed point) and that leaves them as they are from then on.

    The first step runs the stage in place on the copy itself, as ``DenseUpdate``
    does, so it needs no more memory than Keras's own step. Each branch of a
    ``tf.cond`` imports the stage on its own: only the taken branch's writes run.
    (A ``tf.cond`` choosing between resource handles does not work: on TF 2.21 it
    returned the first branch's handle whatever the predicate.)
    """

    name = UPDATE_BY_ROWS_AFTER_FIRST

    def apply(self, state, gradient, iteration, stage) -> tf.Operation:
        if not isinstance(gradient, tf.IndexedSlices):
            return DenseUpdate().apply(state, gradient, iteration, stage)
        first = tf.equal(tf.raw_ops.ReadVariableOp(resource=iteration.handle,
                                                   dtype=iteration.dtype.base_dtype), 0)
        # Gathered at every step, the first too: a few rows, and the gathers stay in
        # this graph, where a step's trace shows how many rows each took.
        touched = _TouchedRows(state, gradient)

        def branch(update: Callable[[], tf.Operation]) -> Callable[[], tf.Tensor]:
            def run():
                with tf.control_dependencies([update()]):
                    return tf.constant(True)
            return run

        with tf.control_dependencies(touched.gathers):
            done = tf.cond(first,
                           branch(lambda: DenseUpdate().apply(state, gradient, iteration, stage)),
                           branch(lambda: touched.update(stage)))
        return done.op


class LazyRowUpdate(RowUpdate):
    """The touched rows alone, where the strategy asks for it (``lazy_row_update``) though
    the update also changes rows without gradient: those keep their value and slots
    (lazy Adam), unlike on one device."""

    name = UPDATE_BY_ROWS_LAZY


UPDATE_MODES = {mode.name: mode for mode in (DenseUpdate(), RowUpdate(), RowUpdateAfterFirst(),
                                             LazyRowUpdate())}


def mode_of(update: PartUpdate) -> UpdateMode:
    """How ``update``'s copy runs its update: as the strategy compiled it, but a shard of
    a flattened part (a dense gradient) runs dense."""
    return UPDATE_MODES[update.update_mode if update.update_mode and update.shard is None
                        else UPDATE_DENSE]


class _TouchedRows:
    """Scratch copies of the rows a copy's sparse gradient names, each once, of the
    copy and of each of its slots, with the gradient's ids renumbered into them.

    Attributes:
        gathers: the ops filling the scratch copies; run them before ``update``.
    """

    def __init__(self, state: Dict[str, tf.Variable], gradient: tf.IndexedSlices):
        self._state = state
        indices = tf.cast(gradient.indices, tf.int64)
        self._rows, local = tf.unique(indices, out_idx=tf.int64)
        self._scratch, self.gathers = {}, []
        for key, variable in state.items():
            self._scratch[key], gather = _scratch_rows(variable, self._rows)
            self.gathers.append(gather)
        trailing = tf.shape(gradient.values, out_type=tf.int64)[1:]
        self._gradient = tf.IndexedSlices(
            gradient.values, local,
            tf.concat([tf.shape(self._rows, out_type=tf.int64), trailing], 0))

    def update(self, stage: Stage) -> tf.Operation:
        """Runs ``stage`` on the scratch rows and writes them back into the copy."""
        writes = stage(self._scratch, self._gradient)
        with tf.control_dependencies(writes):
            back = [tf.raw_ops.ResourceScatterUpdate(
                resource=self._state[key].handle, indices=self._rows,
                updates=tf.raw_ops.ReadVariableOp(resource=handle,
                                                  dtype=self._state[key].dtype.base_dtype))
                for key, handle in self._scratch.items()]
        return tf.group(*back)


def _scratch_rows(variable: tf.Variable, rows: tf.Tensor) -> tuple:
    """A resource variable of this step's ``rows`` of ``variable``, beside it.

    Raw ops: a scratch is in no collection, never saved, and takes a new number of
    rows at every step (``validate_shape=False``).

    Returns:
        (its handle, the op giving it the rows)
    """
    graph = tf.compat.v1.get_default_graph()
    dtype = variable.dtype.base_dtype
    name = graph.unique_name(f"{variable.op.name}/update_rows")
    handle = tf.raw_ops.VarHandleOp(dtype=dtype, shape=[None, *variable.shape[1:]],
                                    shared_name=name, name=name)
    assign = tf.raw_ops.AssignVariableOp(
        resource=handle, value=tf.raw_ops.ResourceGather(resource=variable.handle,
                                                         indices=rows, dtype=dtype,
                                                         name=f"{name}/gather"),
        validate_shape=False)
    return handle, assign
