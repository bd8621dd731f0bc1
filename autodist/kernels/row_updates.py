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

    The first step runs the stage on the touched rows with the whole gradient, then on
    the other rows, ``chunk_rows`` at a time, with none: Keras's dense step holds
    several temporaries the size of the table, this one the size of a chunk. (A row's
    update is its own: ``_SampleRowsCheck`` chose this mode only where this first
    step equals the dense one.) Each branch of a ``tf.cond`` on the iteration imports
    the stage on its own, and only the taken branch's writes run. (A ``tf.cond``
    choosing between resource handles does not work: on TF 2.21 it returned the first
    branch's handle whatever the predicate.)
    """

    name = UPDATE_BY_ROWS_AFTER_FIRST

    def __init__(self, chunk_rows: int = 1 << 16):
        self.chunk_rows = chunk_rows

    def apply(self, state, gradient, iteration, stage) -> tf.Operation:
        if not isinstance(gradient, tf.IndexedSlices):
            return DenseUpdate().apply(state, gradient, iteration, stage)
        first = tf.equal(tf.raw_ops.ReadVariableOp(resource=iteration.handle,
                                                   dtype=iteration.dtype.base_dtype), 0)
        # Gathered at every step, the first too: a few rows, and the gathers stay in
        # this graph, where a step's trace shows how many rows each took.
        touched = _TouchedRows(state, gradient)
        chunk = {key: _scratch_handle(v, "first_step_rows") for key, v in state.items()}

        def first_step() -> tf.Operation:
            with tf.control_dependencies([touched.update(stage)]):
                return self._update_untouched(state, gradient, touched.rows, chunk, stage)

        def branch(update: Callable[[], tf.Operation]) -> Callable[[], tf.Tensor]:
            def run():
                with tf.control_dependencies([update()]):
                    return tf.constant(True)
            return run

        with tf.control_dependencies(touched.gathers):
            done = tf.cond(first, branch(first_step), branch(lambda: touched.update(stage)))
        return done.op

    def _update_untouched(self, state: Dict[str, tf.Variable], gradient: tf.IndexedSlices,
                          touched: tf.Tensor, scratch: Dict[str, tf.Tensor],
                          stage: Stage) -> tf.Operation:
        """Runs ``stage`` with no gradient on the rows not in ``touched``, chunk by chunk."""
        num_rows = tf.shape(next(iter(state.values())), out_type=tf.int64)[0]
        untouched = tf.tensor_scatter_nd_update(tf.ones([num_rows], tf.bool), touched[:, None],
                                                tf.zeros_like(touched, tf.bool))
        trailing = tf.shape(gradient.values, out_type=tf.int64)[1:]
        size = tf.constant(self.chunk_rows, tf.int64)

        def update_chunk(index):
            span = tf.range(index * size, tf.minimum((index + 1) * size, num_rows))
            rows = tf.boolean_mask(span, tf.gather(untouched, span))
            no_gradient = tf.IndexedSlices(
                tf.zeros(tf.concat([[0], trailing], 0), gradient.values.dtype),
                tf.zeros([0], tf.int64), tf.concat([tf.shape(rows, out_type=tf.int64), trailing], 0))
            with tf.control_dependencies(_gather_rows(state, scratch, rows)):
                writes = stage(scratch, no_gradient)
            with tf.control_dependencies([_write_back(state, scratch, rows, writes)]):
                return index + 1

        chunks = (num_rows + size - 1) // size
        [done] = tf.while_loop(lambda index: index < chunks, update_chunk,
                               [tf.constant(0, tf.int64)])
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
        rows: the copy's rows the gradient names, each once.
        gathers: the ops filling the scratch copies; run them before ``update``.
    """

    def __init__(self, state: Dict[str, tf.Variable], gradient: tf.IndexedSlices):
        self._state = state
        self.rows, local = tf.unique(tf.cast(gradient.indices, tf.int64), out_idx=tf.int64)
        self._scratch = {key: _scratch_handle(v, "update_rows") for key, v in state.items()}
        self.gathers = _gather_rows(state, self._scratch, self.rows)
        trailing = tf.shape(gradient.values, out_type=tf.int64)[1:]
        self._gradient = tf.IndexedSlices(
            gradient.values, local,
            tf.concat([tf.shape(self.rows, out_type=tf.int64), trailing], 0))

    def update(self, stage: Stage) -> tf.Operation:
        """Runs ``stage`` on the scratch rows and writes them back into the copy."""
        return _write_back(self._state, self._scratch, self.rows,
                           stage(self._scratch, self._gradient))


def _scratch_handle(variable: tf.Variable, purpose: str) -> tf.Tensor:
    """A resource variable for some rows of ``variable``, beside it.

    Raw ops: a scratch is in no collection, never saved, and takes a new number of
    rows at every use (``_gather_rows``).
    """
    name = tf.compat.v1.get_default_graph().unique_name(f"{variable.op.name}/{purpose}")
    return tf.raw_ops.VarHandleOp(dtype=variable.dtype.base_dtype,
                                  shape=[None, *variable.shape[1:]], shared_name=name, name=name)


def _gather_rows(state: Dict[str, tf.Variable], scratch: Dict[str, tf.Tensor],
                 rows: tf.Tensor) -> list:
    """The ops giving each scratch handle ``rows`` of its variable."""
    return [tf.raw_ops.AssignVariableOp(
        resource=scratch[key],
        value=tf.raw_ops.ResourceGather(resource=variable.handle, indices=rows,
                                        dtype=variable.dtype.base_dtype,
                                        name=f"{scratch[key].op.name}/gather"),
        validate_shape=False) for key, variable in state.items()]


def _write_back(state: Dict[str, tf.Variable], scratch: Dict[str, tf.Tensor], rows: tf.Tensor,
                after: list) -> tf.Operation:
    """Writes each scratch handle's values into ``rows`` of its variable, after ``after``."""
    with tf.control_dependencies(after):
        return tf.group(*[tf.raw_ops.ResourceScatterUpdate(
            resource=variable.handle, indices=rows,
            updates=tf.raw_ops.ReadVariableOp(resource=scratch[key],
                                              dtype=variable.dtype.base_dtype))
            for key, variable in state.items()])
