"""``ad.function``: a Keras / TF2 training step run data-parallel by AutoDist.

The step is traced once, lifted into a graph (``step.py``) and distributed
like any ``tf.compat.v1`` graph. AutoDist's copies of the variables are then
the ones that train; after every call their values are copied back into the
eager variables (the model's weights, the optimizer's state, the metrics), so
that Keras code run between steps (``evaluate``, ``predict``, ``save``,
callbacks) sees the trained values in the single-device layout. Values that
Keras code changes between steps (``set_weights``, ``load_weights``) are copied
the other way before the next step.
"""
from __future__ import annotations

import functools
from typing import Callable, Optional

import numpy as np
import tensorflow as tf

from autodist.kernels.locations import Locator
from autodist.keras.step import STATE_OP, LiftedStep, is_static, lift_step, signature
from autodist.session import DistributedSession


class DistributedStep:
    """A lifted step and the session running it.

    Args:
        lifted: the step as a graph.
        session: AutoDist's session on its distributed graph.
    """

    def __init__(self, lifted: LiftedStep, session: DistributedSession):
        self._lifted = lifted
        self._session = session
        distributed = session.distributed
        locator = Locator(distributed)
        self._reads, self._writes = [], []
        # Model state that is neither trained nor the optimizer's (metrics,
        # batch-norm statistics, seeds): small, and reset by Keras between epochs.
        self._forward_state = set()
        # The optimizer's slots: as large as the weights (Adam: twice), read by
        # Keras code between epochs rather than between batches.
        self._slots = set()
        slots = lifted.item.slot_names()
        with distributed.graph.as_default(), tf.device(distributed.ctx.shared_device):
            for name, variable in lifted.variables.items():
                location = locator.find(name)
                if location is None:
                    continue
                if name in distributed.shared_variables:
                    self._forward_state.add(id(variable))
                if name in slots:
                    self._slots.add(id(variable))
                if location.value is not None:
                    self._reads.append((variable, location.value()))
                placeholder = tf.compat.v1.placeholder(variable.dtype, variable.shape)
                self._writes.append((variable, placeholder, location.restore(placeholder)))
        self._synced = {}  # id of an eager variable -> the value last copied either way
        self._fetch_outputs = [o for o in lifted.outputs if isinstance(o, tf.Tensor)]

    @property
    def session(self) -> DistributedSession:
        return self._session

    def run(self, args: tuple, fetch_outputs: bool = True):
        """One training step on the global batch ``args``; returns the step's outputs.

        Args:
            args: the step's arguments, as traced.
            fetch_outputs: whether to compute the step's outputs (``fit`` reads
                its logs from the metrics instead).
        """
        values = [a for a in tf.nest.flatten(args) if not is_static(a)]
        feeds = dict(zip(self._lifted.inputs, [_as_numpy(v) for v in values]))
        fetches = [self._lifted.item.optimizer_calls[0].result_op_name, STATE_OP]
        if fetch_outputs:
            fetches += self._fetch_outputs
        results = iter(self._session.run(fetches, feed_dict=feeds)[2:])
        if not fetch_outputs:
            return None
        flat = [next(results) if isinstance(o, tf.Tensor) else o for o in self._lifted.outputs]
        return tf.nest.pack_sequence_as(self._lifted.structure, flat)

    def copy_to_eager(self, forward_state_only: bool = False, slots: bool = True) -> None:
        """Copies AutoDist's values into the eager variables.

        Args:
            forward_state_only: copy only the state the forward pass writes
                (metrics, batch-norm statistics, seeds), not the weights and the
                optimizer's state.
            slots: also copy the optimizer's slots.
        """
        reads = [(v, t) for v, t in self._reads
                 if (not forward_state_only or id(v) in self._forward_state)
                 and (slots or id(v) not in self._slots)]
        values = self._session.tf_session.run([tensor for _, tensor in reads])
        for (variable, _), value in zip(reads, values):
            variable.assign(value)
            self._synced[id(variable)] = value

    def copy_from_eager_if_changed(self, forward_state_only: bool = False) -> None:
        """Copies the eager variables' values to AutoDist's where Keras code changed them.

        Only values copied out before are compared: until the first copy,
        AutoDist's values are those the eager variables had when traced.

        Args:
            forward_state_only: check only the state the forward pass writes.
        """
        feeds, ops = {}, []
        for variable, placeholder, restore in self._writes:
            if forward_state_only and id(variable) not in self._forward_state:
                continue
            synced = self._synced.get(id(variable))
            if synced is None:
                continue
            value = variable.numpy()
            if np.array_equal(synced, value):
                continue
            feeds[placeholder] = value
            ops.append(restore)
            self._synced[id(variable)] = value
        if ops:
            self._session.tf_session.run(ops, feed_dict=feeds)


class DistributedFunction:
    """What ``ad.function(fn)`` returns: call it with the global batch.

    Args:
        open_session: opens AutoDist's session on a lifted step's graph.
        fn: the training step.
    """

    def __init__(self, open_session: Callable[[LiftedStep], DistributedSession], fn: Callable):
        functools.update_wrapper(self, fn)
        self._open_session = open_session
        self._fn = fn
        self._step: Optional[DistributedStep] = None  # the step that ran last
        self._steps = {}  # signature of the arguments -> its step

    @property
    def step(self) -> Optional[DistributedStep]:
        """The distributed step that ran last, once the function has been called."""
        return self._step

    def __call__(self, *args):
        key = signature(args)
        if key not in self._steps:  # traced for these arguments' structure and dtypes
            lifted = lift_step(self._fn, args)
            self._steps[key] = DistributedStep(lifted, self._open_session(lifted))
        else:
            self._steps[key].copy_from_eager_if_changed()
        self._step = self._steps[key]
        outputs = self._step.run(args)
        self._step.copy_to_eager()
        return outputs


def _as_numpy(value):
    return value.numpy() if hasattr(value, "numpy") else np.asarray(value)
