"""Every use of Keras 3's private API lives here, so a Keras upgrade touches one file.

What the Keras front end needs that Keras exposes no public hook for: seeing
what a Keras optimizer is asked to apply while a step is traced, seeing an
optimizer applied eagerly inside ``ad.scope()`` (a loop AutoDist does not
distribute), and seeing which models are compiled there. Each is a patch of a
class method that a context manager always restores.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Iterator

import keras
import tensorflow as tf
from keras.src.optimizers import base_optimizer


@dataclasses.dataclass
class ApplyCall:
    """One Keras ``optimizer.apply`` (or ``apply_gradients``) call seen while tracing.

    Attributes:
        graph: the graph being traced when the call was made.
        optimizer: the Keras optimizer.
        grads: the gradients it was asked to apply (tensors of ``graph``, or None).
        variables: the Keras variables they belong to, in the same order.
        created: names of every op the call created (the optimizer's update).
    """

    graph: tf.Graph
    optimizer: keras.optimizers.Optimizer
    grads: list
    variables: list
    created: frozenset


@contextlib.contextmanager
def capture_optimizer_apply(record: Callable[[ApplyCall], None]) -> Iterator[None]:
    """Within the block, reports every outermost Keras ``optimizer.apply`` call.

    A wrapping optimizer (``LossScaleOptimizer``) calls its inner optimizer's
    ``apply``; only the outer call is reported. The original method is always
    restored on exit.
    """
    original = base_optimizer.BaseOptimizer.apply
    depth = [0]

    def recording_apply(self, grads, trainable_variables=None):
        if depth[0]:
            return original(self, grads, trainable_variables)
        grads = list(grads)
        variables = (list(trainable_variables) if trainable_variables is not None
                     else list(self.trainable_variables))
        graph = tf.compat.v1.get_default_graph()
        before = {op.name for op in graph.get_operations()}
        depth[0] += 1
        try:
            result = original(self, grads, trainable_variables)
        finally:
            depth[0] -= 1
        created = frozenset(op.name for op in graph.get_operations()) - before
        record(ApplyCall(graph, self, grads, variables, created))
        return result

    base_optimizer.BaseOptimizer.apply = recording_apply
    try:
        yield
    finally:
        base_optimizer.BaseOptimizer.apply = original


@contextlib.contextmanager
def report_eager_apply(record: Callable[[keras.optimizers.Optimizer], None]) -> Iterator[None]:
    """Within the block, reports every Keras ``optimizer.apply`` run eagerly (not traced).

    The original method is always restored on exit.
    """
    original = base_optimizer.BaseOptimizer.apply

    def reporting_apply(self, grads, trainable_variables=None):
        if tf.executing_eagerly():
            record(self)
        return original(self, grads, trainable_variables)

    base_optimizer.BaseOptimizer.apply = reporting_apply
    try:
        yield
    finally:
        base_optimizer.BaseOptimizer.apply = original


@contextlib.contextmanager
def capture_compile(record: Callable[[keras.Model], None]) -> Iterator[None]:
    """Within the block, reports every model right after its ``compile``.

    The original method is always restored on exit.
    """
    owner = keras.Model
    original = owner.compile

    def recording_compile(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        record(self)
        return result

    had_own = "compile" in owner.__dict__
    owner.compile = recording_compile
    try:
        yield
    finally:
        if had_own:
            owner.compile = original
        else:
            del owner.compile


def all_layers(model: keras.Model) -> list:
    """Every layer of ``model``, nested ones and ``model`` itself included."""
    return list(model._flatten_layers())  # pylint: disable=protected-access
