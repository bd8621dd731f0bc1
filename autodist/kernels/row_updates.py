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
update itself (``autodist/keras/update.py``), which imports its stages against the
``PartView`` a mode gives.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Dict, Optional

import tensorflow as tf

from autodist.graph_item import (UPDATE_BY_ROWS, UPDATE_BY_ROWS_AFTER_FIRST, UPDATE_BY_ROWS_LAZY,
                                 UPDATE_DENSE, PartUpdate)


@dataclasses.dataclass(frozen=True)
class PartView:
    """What a per-variable stage is imported against.

    Attributes:
        handles: state key (the variable's name, its slots' keys) -> the resource
            handle the stage reads and writes.
        gradient: the gradient the stage reads.
        ready: ops to run before the stage.
        finish: turns the stage's write ops into the op ending this copy's update.
    """

    handles: Dict[str, tf.Tensor]
    gradient: object
    ready: list
    finish: Callable[[list], tf.Operation]


class UpdateMode:
    """How a variable's update runs on each stored copy. A mode is a class per kind.

    Attributes:
        name: what ``autodist explain`` and the strategy's description say.
    """

    name = ""

    def view(self, state: Dict[str, tf.Variable], gradient,
             iteration: Optional[tf.Variable]) -> PartView:
        """The handles and gradient this copy's stage runs against.

        Args:
            state: key -> the copy's variable and each of its slots.
            gradient: the copy's mean gradient.
            iteration: the optimizer's iteration count, read before this step's
                increment, or None.
        """
        raise NotImplementedError


class DenseUpdate(UpdateMode):
    """The traced update on every row of the copy, as Keras runs it on one device."""

    name = UPDATE_DENSE

    def view(self, state, gradient, iteration) -> PartView:
        return PartView({key: v.handle for key, v in state.items()}, gradient, [],
                        lambda writes: tf.group(*writes))


class RowUpdate(UpdateMode):
    """The traced update on the rows the step's gradient names, each once.

    Exact where a row without gradient and its slots do not change; duplicate ids
    keep their entries (the traced update decides whether it adds them).
    """

    name = UPDATE_BY_ROWS

    def _rows(self, indices: tf.Tensor, num_rows: tf.Tensor,
              iteration: Optional[tf.Variable]) -> tuple:
        """(the copy's rows the stage runs on, each gradient entry's row among them)."""
        return tf.unique(indices, out_idx=tf.int64)

    def view(self, state, gradient, iteration) -> PartView:
        if not isinstance(gradient, tf.IndexedSlices):  # synchronized dense: every row
            return DenseUpdate().view(state, gradient, iteration)
        some = next(iter(state.values()))
        indices = tf.cast(gradient.indices, tf.int64)
        rows, local = self._rows(indices, tf.shape(some, out_type=tf.int64)[0], iteration)
        scratch, ready = {}, []
        for key, variable in state.items():
            handle, assign = _scratch_rows(variable, rows)
            scratch[key], ready = handle, ready + [assign]
        trailing = tf.shape(gradient.values, out_type=tf.int64)[1:]
        rows_gradient = tf.IndexedSlices(
            gradient.values, local, tf.concat([tf.shape(rows, out_type=tf.int64), trailing], 0))

        def finish(writes):
            with tf.control_dependencies(writes):
                back = [tf.raw_ops.ResourceScatterUpdate(
                    resource=state[key].handle, indices=rows,
                    updates=tf.raw_ops.ReadVariableOp(resource=handle,
                                                      dtype=state[key].dtype.base_dtype))
                    for key, handle in scratch.items()]
            return tf.group(*back)

        return PartView(scratch, rows_gradient, ready, finish)


class RowUpdateAfterFirst(RowUpdate):
    """Every row at the first step (iteration 0), the touched rows after it: for an
    update whose first step moves rows without gradient (Keras's FTRL sets them to
    their fixed point) and that leaves them as they are from then on."""

    name = UPDATE_BY_ROWS_AFTER_FIRST

    def _rows(self, indices, num_rows, iteration):
        first = tf.equal(tf.raw_ops.ReadVariableOp(resource=iteration.handle,
                                                   dtype=iteration.dtype.base_dtype), 0)
        return tf.cond(first, lambda: (tf.range(num_rows), indices),
                       lambda: tuple(tf.unique(indices, out_idx=tf.int64)))


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
