"""What a traced Keras step reads besides its variables: metrics' names and lookup tables.

A traced step captures resources by handle alone. Lifting it needs to know
more about some of them, which only the Keras objects the step reaches can
tell: a metric variable's Keras path (TensorFlow's eager name may differ) and
the contents of a lookup table (``StringLookup``, ``IntegerLookup``,
``TextVectorization``). These objects are found where steps keep them: the
model of a ``train_step`` (``fn.__self__``), and the models, layers and
metrics that the function's closure or the globals it names hold.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import keras
import numpy as np
import tensorflow as tf

from autodist import _keras_compat
from autodist.session import as_tf_variable

# Tables whose contents ``LookupTableExportV2`` reads; a lifted step holds a copy.
_EXPORTABLE_TABLES = (tf.lookup.StaticHashTable, tf.lookup.experimental.MutableHashTable)


@dataclasses.dataclass(frozen=True)
class TableContents:
    """A lookup table's keys and values, read eagerly."""

    keys: np.ndarray
    values: np.ndarray

    def lifted_handle(self) -> tf.Tensor:
        """A read-only table with these contents in the default graph: its handle.

        Its initializer joins the graph's ``TABLE_INITIALIZERS``, which AutoDist
        runs on every node with the variables' initializers.
        """
        initializer = tf.lookup.KeyValueTensorInitializer(self.keys, self.values)
        default = tf.zeros([], tf.as_dtype(self.values.dtype))  # each lookup has its own
        return tf.lookup.StaticHashTable(initializer, default).resource_handle


def reachable_owners(fn: Callable,
                     kinds: tuple = (keras.layers.Layer, keras.metrics.Metric)) -> list:
    """The Keras models, layers and metrics that the step ``fn`` can reach.

    Args:
        fn: the step.
        kinds: the types kept (``(object,)``: everything reached, e.g. to look
            for what Keras 3 types cannot tell, a tf_keras optimizer).
    """
    python_function = getattr(fn, "python_function", fn)
    function = getattr(python_function, "__func__", python_function)
    instance = getattr(python_function, "__self__", None)
    owners = [instance]
    if instance is not None and not isinstance(instance, keras.layers.Layer):
        # A method of a trainer class (``@ad.function`` on a method): what it holds.
        owners += list(getattr(instance, "__dict__", {}).values())
    owners += [cell.cell_contents for cell in getattr(function, "__closure__", None) or ()
               if _has_contents(cell)]
    code, names = getattr(function, "__code__", None), getattr(function, "__globals__", {})
    owners += [names[name] for name in (code.co_names if code else ()) if name in names]
    return [o for o in owners if isinstance(o, kinds)]


def metric_paths(owners: list) -> dict:
    """id of a metric's ``tf.Variable`` -> its Keras path, for the metrics of ``owners``."""
    paths = {}
    for owner in owners:
        if isinstance(owner, keras.Model):
            variables = owner.metrics_variables
        elif isinstance(owner, keras.metrics.Metric):
            variables = owner.variables
        else:
            continue
        for variable in variables:
            paths[id(as_tf_variable(variable))] = variable.path
    return paths


def lookup_tables(owners: list) -> dict:
    """id of a lookup table's resource handle -> its ``TableContents``, for ``owners``' layers."""
    tables = {}
    for owner in owners:
        if not isinstance(owner, keras.layers.Layer):
            continue
        for layer in _keras_compat.all_layers(owner):  # the owner included
            for value in vars(layer).values():
                if isinstance(value, _EXPORTABLE_TABLES):
                    keys, values = tf.raw_ops.LookupTableExportV2(
                        table_handle=value.resource_handle, Tkeys=value.key_dtype,
                        Tvalues=value.value_dtype)
                    tables[id(value.resource_handle)] = TableContents(keys.numpy(),
                                                                      values.numpy())
    return tables


def _has_contents(cell) -> bool:
    try:
        cell.cell_contents  # pylint: disable=pointless-statement
    except ValueError:  # a free variable not yet bound
        return False
    return True
