"""Every use of Keras 3's private API lives here, so a Keras upgrade touches one file.

What the Keras front end needs that Keras exposes no public hook for: seeing
what a Keras optimizer is asked to apply while a step is traced (and having a
``LossScaleOptimizer`` apply through AutoDist's version of its step), seeing an
optimizer applied eagerly inside ``ad.scope()`` (a loop AutoDist does not
distribute), seeing which models are compiled there, and creating large
variables without a value (``defer_large_variables``). Each is a patch of a
class method that a context manager always restores.

It also tells tf_keras (Keras 2, ``tf.keras`` under TF_USE_LEGACY_KERAS) apart,
which AutoDist does not distribute: a tf_keras model compiled inside
``ad.scope()`` and a tf_keras optimizer applied in a traced step, found in the
modules the process has loaded, never by importing tf_keras.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import types
from typing import Callable, Iterator, Optional

import keras
import numpy as np
import tensorflow as tf
from keras.src.backend.tensorflow import core as tf_backend
from keras.src.backend.tensorflow import nn as tf_nn
from keras.src.initializers import random_initializers
from keras.src.optimizers import base_optimizer, loss_scale_optimizer
from keras.src.saving import saving_lib

from autodist import _tf_compat


@dataclasses.dataclass
class ApplyCall:
    """One Keras ``optimizer.apply`` (or ``apply_gradients``) call seen while tracing.

    Attributes:
        graph: the graph being traced when the call was made.
        optimizer: the Keras optimizer.
        grads: the gradients it was asked to apply (tensors of ``graph``, or None).
        variables: the Keras variables they belong to, in the same order.
        created: names of every op the call created (the optimizer's update).
        applied_if: a scalar bool tensor of ``graph``, or None: the writes of
            ``conditional`` take effect only where it is true (a
            ``LossScaleOptimizer``'s finite check).
        conditional: names of the ops ``applied_if`` gates.
        loss_scale: the variable the step multiplies its loss by before the
            gradients (a ``LossScaleOptimizer``'s scale), or None.
    """

    graph: tf.Graph
    optimizer: keras.optimizers.Optimizer
    grads: list
    variables: list
    created: frozenset
    applied_if: Optional[tf.Tensor] = None
    conditional: frozenset = frozenset()
    loss_scale: Optional[tf.Variable] = None


@dataclasses.dataclass(frozen=True)
class ConditionalUpdate:
    """What a ``LossScaleOptimizer``'s apply without a ``tf.cond`` reports.

    Attributes:
        applied_if: the scalar bool tensor that gates ``conditional``'s writes.
        conditional: names of the inner optimizer's ops.
        loss_scale: the optimizer's loss scale variable.
    """

    applied_if: tf.Tensor
    conditional: frozenset
    loss_scale: tf.Variable


LossScaleApply = Callable[[keras.optimizers.LossScaleOptimizer, list, Optional[list]],
                          ConditionalUpdate]


@contextlib.contextmanager
def capture_optimizer_apply(record: Callable[[ApplyCall], None],
                            loss_scale_apply: Optional[LossScaleApply] = None
                            ) -> Iterator[None]:
    """Within the block, reports every outermost Keras ``optimizer.apply`` call.

    A wrapping optimizer (``LossScaleOptimizer``) calls its inner optimizer's
    ``apply``; only the outer call is reported. With ``loss_scale_apply``, a
    ``LossScaleOptimizer`` applies through it instead of its own ``apply``
    (which applies the inner optimizer inside a ``tf.cond``). The original
    methods are always restored on exit.
    """
    base_apply = base_optimizer.BaseOptimizer.apply
    own_apply = loss_scale_optimizer.LossScaleOptimizer.__dict__["apply"]
    depth = [0]

    def recording(apply, conditional_update: bool):
        def recording_apply(self, grads, trainable_variables=None):
            if depth[0]:
                return apply(self, grads, trainable_variables)
            grads = list(grads)
            variables = (list(trainable_variables) if trainable_variables is not None
                         else list(self.trainable_variables))
            graph = tf.compat.v1.get_default_graph()
            before = {op.name for op in graph.get_operations()}
            depth[0] += 1
            try:
                result = apply(self, grads, trainable_variables)
            finally:
                depth[0] -= 1
            created = frozenset(op.name for op in graph.get_operations()) - before
            call = ApplyCall(graph, self, grads, variables, created)
            if conditional_update:
                call.applied_if, call.conditional = result.applied_if, result.conditional
                call.loss_scale = result.loss_scale
                result = None
            record(call)
            return result
        return recording_apply

    base_optimizer.BaseOptimizer.apply = recording(base_apply, False)
    if loss_scale_apply is not None:
        loss_scale_optimizer.LossScaleOptimizer.apply = recording(loss_scale_apply, True)
    try:
        yield
    finally:
        base_optimizer.BaseOptimizer.apply = base_apply
        loss_scale_optimizer.LossScaleOptimizer.apply = own_apply


def trainable_variables(optimizer: keras.optimizers.Optimizer) -> list:
    """The variables a built optimizer applies gradients to, when ``apply`` names none."""
    return list(optimizer._trainable_variables)  # pylint: disable=protected-access


def overwrites_with_gradient(optimizer: keras.optimizers.Optimizer, variable) -> bool:
    """Whether ``optimizer`` sets ``variable`` to its gradient rather than applying it
    (a variable with ``overwrite_with_gradient``, such as float8 scales)."""
    return optimizer._overwrite_variable_with_gradient(variable)  # pylint: disable=protected-access


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
    # Where ``compile`` is defined (Keras's Trainer), not ``keras.Model``: Keras compiles
    # a model it loads (``keras.models.load_model``) only when the model's class resolves
    # ``compile`` to that class's own, so a replacement on ``keras.Model`` would leave a
    # model loaded in the scope uncompiled, with no loss.
    owner = next(cls for cls in keras.Model.__mro__ if "compile" in vars(cls))
    original = vars(owner)["compile"]

    def recording_compile(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        record(self)
        return result

    owner.compile = recording_compile
    try:
        yield
    finally:
        owner.compile = original


# tf_keras (Keras 2, which ``tf.keras`` is under TF_USE_LEGACY_KERAS) is looked up
# where a process has already loaded it and never imported: AutoDist must not load
# a second Keras into a process that does not use it.
_TF_KERAS = "tf_keras"
_TF_KERAS_MODELS = (("tf_keras.src.engine.training", "Model"),
                    ("tf_keras.src.engine.training_v1", "Model"))  # the latter: graph mode
_TF_KERAS_OPTIMIZERS = (("tf_keras.src.optimizers.optimizer", "_BaseOptimizer"),
                        ("tf_keras.src.optimizers.legacy.optimizer_v2", "OptimizerV2"))
_LEGACY_KERAS_ENV = "TF_USE_LEGACY_KERAS"


def _loaded_classes(names: tuple) -> list:
    """The classes of ``names`` ((module, class) pairs) whose modules are loaded."""
    found = (getattr(sys.modules.get(module), name, None) for module, name in names)
    return [cls for cls in found if isinstance(cls, type)]


def legacy_keras_setting() -> Optional[str]:
    """``"TF_USE_LEGACY_KERAS=<value>"`` when that setting makes ``tf.keras`` tf_keras
    (the values TensorFlow's own test accepts), else None."""
    value = os.environ.get(_LEGACY_KERAS_ENV, "")
    return f"{_LEGACY_KERAS_ENV}={value}" if value in ("1", "true", "True") else None


@contextlib.contextmanager
def refuse_tf_keras_compile(refuse: Callable[[object], None],
                            imported_inside: Callable[[], None]) -> Iterator[None]:
    """Within the block, a tf_keras (Keras 2) model's ``compile`` calls
    ``refuse(model)`` first, which is to raise.

    Only a tf_keras already loaded when the block starts can be watched (it is
    never imported here; under TF_USE_LEGACY_KERAS TensorFlow's import loads it).
    When the block loads it, ``imported_inside()`` is called on a normal exit.
    Keras 3's ``compile`` is untouched. The original methods are always restored
    on exit.
    """
    owners = _loaded_classes(_TF_KERAS_MODELS)
    loaded_before = _TF_KERAS in sys.modules
    originals = [(owner, owner.__dict__.get("compile")) for owner in owners]

    def refusing(original):
        def refusing_compile(self, *args, **kwargs):
            refuse(self)
            return original(self, *args, **kwargs)
        return refusing_compile

    for owner, original in originals:
        if original is not None:
            owner.compile = refusing(original)
    try:
        yield
    finally:
        for owner, original in originals:
            if original is not None:
                owner.compile = original
    if not loaded_before and _TF_KERAS in sys.modules:
        imported_inside()


def tf_keras_optimizers_applied(objects: list, graph: tf.Graph) -> list:
    """The tf_keras (Keras 2) optimizers a traced step applied.

    Looks among ``objects`` (what the step reaches) and their attributes (a
    model's ``optimizer``) for tf_keras optimizers whose step count ``graph``
    captures, which their ``apply_gradients`` increments.

    Args:
        objects: the objects the step reaches.
        graph: the step's traced ``FuncGraph``.

    Returns:
        the optimizers, each once, in the order found ([] when tf_keras is not loaded).
    """
    bases = tuple(_loaded_classes(_TF_KERAS_OPTIMIZERS))
    if not bases:
        return []
    captured = {id(external) for external, _ in graph.captures}
    candidates = list(objects)
    for obj in objects:
        if not isinstance(obj, types.ModuleType):  # a module's names are not the step's
            candidates += list(getattr(obj, "__dict__", {}).values())
    found = []
    for candidate in candidates:
        if not isinstance(candidate, bases) or any(candidate is f for f in found):
            continue
        # ``_iterations``: both tf_keras optimizer kinds keep it; ``iterations``
        # would create one on an optimizer never applied.
        count = getattr(candidate, "_iterations", None)
        if id(getattr(count, "handle", None)) in captured:
            found.append(candidate)
    return found


def compile_state(model: keras.Model) -> tuple:
    """What a ``compile`` call makes anew: the optimizer, the loss and the metrics
    containers (identities, which change with every ``compile``)."""
    return (id(model.optimizer), id(model._compile_loss),  # pylint: disable=protected-access
            id(model._compile_metrics))  # pylint: disable=protected-access


def all_layers(model: keras.Model) -> list:
    """Every layer of ``model``, nested ones and ``model`` itself included."""
    return list(model._flatten_layers())  # pylint: disable=protected-access


@contextlib.contextmanager
def synchronized_moments(cross_replica_sum: Callable[[tf.Tensor], tf.Tensor]) -> Iterator[None]:
    """Within the block, ``BatchNormalization(synchronized=True)`` computes its batch
    statistics from sums passed through ``cross_replica_sum``.

    Keras sums them through ``tf.distribute``'s replica context, which in a step
    traced for AutoDist is the default one (a single replica). The original
    function is always restored on exit.
    """
    original = tf_nn._compute_moments_sync  # pylint: disable=protected-access

    def moments(x, axes, keepdims):
        # The mean and variance from the sums of x and x**2 and the count, as Keras's.
        total = cross_replica_sum(tf.reduce_sum(x, axis=axes, keepdims=True))
        squares = cross_replica_sum(tf.reduce_sum(tf.square(x), axis=axes, keepdims=True))
        count = cross_replica_sum(tf.reduce_sum(tf.ones_like(x), axis=axes, keepdims=True))
        mean = tf.math.divide_no_nan(total, count)
        variance = tf.maximum(tf.math.divide_no_nan(squares, count) - tf.square(mean), 0.0)
        if not keepdims:
            mean, variance = tf.squeeze(mean, axes), tf.squeeze(variance, axes)
        return mean, variance

    tf_nn._compute_moments_sync = moments  # pylint: disable=protected-access
    try:
        yield
    finally:
        tf_nn._compute_moments_sync = original  # pylint: disable=protected-access


@contextlib.contextmanager
def defer_large_variables(min_bytes: int) -> Iterator[None]:
    """Within the block, eager Keras variables (not scalars) of ``min_bytes`` or more
    whose initializer is a function of shape and dtype alone are created as
    ``DeferredVariable`` s.

    Such a variable takes its initializer's value at its first use, the value it
    would have had at creation (Keras draws a random initializer's seed when the
    initializer is made). An initializer that may draw from shared state (a
    ``SeedGenerator`` seed, a user's own function) is run at creation as usual.
    The original method is always restored on exit.
    """
    owner = tf_backend.Variable
    original = owner._initialize_with_initializer  # pylint: disable=protected-access

    def initialize(self, initializer):
        shape, dtype = tuple(self._shape), self._dtype  # pylint: disable=protected-access
        size = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        with tf.init_scope():  # a tf.compat.v1 graph's variables are the graph's own
            eager = tf.executing_eagerly()
        if not eager or size < min_bytes or not shape or not _pure_initializer(initializer):
            return original(self, initializer)
        self._initialize(_tf_compat.DeferredVariable(  # pylint: disable=protected-access
            lambda: initializer(shape, dtype=dtype), shape=shape, dtype=dtype,
            trainable=self.trainable, name=self.name))
        return None

    owner._initialize_with_initializer = initialize  # pylint: disable=protected-access
    try:
        yield
    finally:
        owner._initialize_with_initializer = original  # pylint: disable=protected-access


@contextlib.contextmanager
def deferred_variables_saved_in_pieces() -> Iterator[None]:
    """Within the block, a Keras ``.weights.h5`` save (``save_weights``, ``save``)
    writes each model or optimizer variable still without a value of its own
    (a ``DeferredVariable`` kept by AutoDist) piece by piece into its dataset,
    fetching one piece at a time, and leaves it without a value.

    Other variables, and sharded or bfloat16 saves, are written as Keras writes
    them. The original methods are always restored on exit.
    """
    store, optimizer = saving_lib.H5IOStore, base_optimizer.BaseOptimizer
    set_item, save_state = store.__setitem__, optimizer.save_own_variables

    def set_in_pieces(self, key, value):
        deferred = _deferred(value)
        if deferred is None or self.mode not in ("w", "a") or deferred.dtype == tf.bfloat16:
            return set_item(self, key, value)
        if not self._h5_entry_initialized:  # pylint: disable=protected-access
            self._create_h5_group(self._h5_entry_path)  # pylint: disable=protected-access
        dataset = self._h5_entry_group.create_dataset(  # pylint: disable=protected-access
            key, shape=tuple(deferred.shape), dtype=deferred.dtype.as_numpy_dtype)
        for index, piece in deferred.value_in_pieces():
            dataset[index] = piece
        return None

    def save_optimizer_state(self, target):
        # Keras's own writes ``variable.numpy()``, which gives the variable a value.
        for index, variable in enumerate(self.variables):
            target[str(index)] = variable if _deferred(variable) is not None else variable.numpy()

    store.__setitem__, optimizer.save_own_variables = set_in_pieces, save_optimizer_state
    try:
        yield
    finally:
        store.__setitem__, optimizer.save_own_variables = set_item, save_state


def _deferred(value) -> Optional[_tf_compat.DeferredVariable]:
    """The ``DeferredVariable`` behind a Keras variable, while it has no value; else None."""
    inner = getattr(value, "_value", None)
    if isinstance(inner, _tf_compat.DeferredVariable) and inner.deferred:
        return inner
    return None


def _pure_initializer(initializer) -> bool:
    """Whether ``initializer(shape, dtype)`` always gives the same value: one of Keras's
    own, with an integer seed when it is random."""
    if not isinstance(initializer, keras.initializers.Initializer):
        return False
    if not type(initializer).__module__.startswith("keras."):
        return False
    return (not isinstance(initializer, random_initializers.RandomInitializer)
            or isinstance(initializer.seed, int))
