"""Traces a Keras 3 / TF2 training step and lifts it into a ``tf.compat.v1`` graph.

A traced step (a ``FuncGraph``) holds no variables: every variable it uses is a
captured resource. Lifting imports the traced ops into a new graph in which
each captured variable of the model (weights, batch-norm statistics, metrics,
seeds) is a graph variable starting at its current value, and each variable
of the optimizer is a resource placeholder that the update stage replaces by
state of its own per stored copy (``update.py``). The result is analysed into
a ``GraphItem`` like any ``tf.compat.v1`` graph, so that every builder,
kernel, cluster path and checkpoint works on it unchanged.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np
import tensorflow as tf

from autodist import _keras_compat
from autodist.graph_item import GraphItem
from autodist.keras.update import RESOURCE_WRITES, KerasOptimizerCall
from autodist.session import as_tf_variable

_SCOPE = "step"
TRAIN_OP = "autodist_keras_train_op"
STATE_OP = "autodist_keras_state_updates"


@dataclasses.dataclass
class LiftedStep:
    """A traced step as a ``tf.compat.v1`` graph AutoDist can distribute.

    Attributes:
        item: the analysed graph.
        inputs: the step's tensor arguments' placeholders, in ``tf.nest.flatten`` order.
        outputs: the step's flat outputs: tensors of ``item.graph`` or constant values.
        structure: the step's structured outputs, to pack ``outputs`` into.
        variables: name of each graph variable or optimizer state placeholder ->
            the eager ``tf.Variable`` it stands for.
    """

    item: GraphItem
    inputs: list
    outputs: list
    structure: object
    variables: dict


def is_static(value) -> bool:
    """Whether a step's argument is a Python value the trace keeps, not a fed tensor."""
    return value is None or isinstance(value, (bool, int, float, str))


def argument_spec(value):
    """The ``tf.TensorSpec`` a step is traced with for one argument (leading dim free)."""
    if is_static(value):
        return value
    tensor = tf.convert_to_tensor(value)
    shape = tensor.shape.as_list()
    if shape:
        shape[0] = None
    return tf.TensorSpec(shape, tensor.dtype)


def signature(args: tuple) -> str:
    """What a traced step is specific to: the arguments' structure, dtypes and shapes."""
    return repr(tf.nest.map_structure(argument_spec, args))


def lift_step(fn: Callable, args: tuple) -> LiftedStep:
    """Traces ``fn(*args)`` and lifts it.

    Args:
        fn: the step: computes gradients and applies them with one Keras optimizer.
        args: example arguments (their structure, dtypes and shapes beyond the
            batch dimension are what the step is traced for).

    Raises:
        ValueError: when the step applies no optimizer.
        NotImplementedError: when it applies several, or captures what cannot be lifted.
    """
    python_function = getattr(fn, "python_function", fn)  # a tf.function's own body
    specs = tf.nest.map_structure(argument_spec, args)
    calls = []
    with _keras_compat.capture_optimizer_apply(calls.append):
        concrete = tf.function(python_function).get_concrete_function(*specs)
    traced = concrete.graph
    calls = [c for c in calls if c.graph is traced]
    label = getattr(python_function, "__name__", "the step")
    if not calls:
        raise ValueError(
            f"AutoDist found no optimizer update in {label}: apply the gradients with a "
            "Keras optimizer (optimizer.apply_gradients or optimizer.apply) inside it.")
    if len(calls) > 1:
        raise NotImplementedError(
            f"AutoDist supports one optimizer update per step; {label} applies "
            f"{len(calls)} ({', '.join(type(c.optimizer).__name__ for c in calls)}).")
    call = calls[0]
    trainable = {id(as_tf_variable(v)) for v in call.variables}
    optimizer_state = {id(as_tf_variable(v)) for v in call.optimizer.variables}
    by_handle = {id(v.handle): v for v in traced.variables}

    # Read eagerly, before entering the new graph.
    values = {id(v): v.numpy() for v in traced.variables}
    constants = {id(e): e.numpy() for e, _ in traced.captures
                 if id(e) not in by_handle and e.dtype != tf.resource}
    graph = tf.Graph()
    variables, state_values, input_map = {}, {}, {}
    with graph.as_default():
        for external, internal in traced.captures:
            variable = by_handle.get(id(external))
            if variable is None:
                if external.dtype == tf.resource:
                    raise NotImplementedError(
                        f"{label} uses a resource AutoDist cannot distribute "
                        f"({internal.name}); only variables and constants may be captured.")
                input_map[internal.name] = tf.constant(constants[id(external)])
                continue
            name = variable.name.split(":")[0]  # Keras 3 names it by its path
            value = values[id(variable)]
            if id(variable) in optimizer_state:
                placeholder = tf.compat.v1.placeholder(tf.resource, [], name=name)
                state_values[placeholder.op.name] = value
                variables[placeholder.op.name] = variable
                input_map[internal.name] = placeholder
                continue
            initial = tf.zeros(value.shape, value.dtype) if not np.any(value) else value
            lifted = tf.compat.v1.Variable(initial, trainable=id(variable) in trainable,
                                           name=name, use_resource=True, dtype=variable.dtype)
            variables[lifted.op.name] = variable
            input_map[internal.name] = lifted.handle
        tf.graph_util.import_graph_def(traced.as_graph_def(), input_map=input_map, name=_SCOPE)

        def lifted_tensor(tensor):
            return graph.get_tensor_by_name(f"{_SCOPE}/{tensor.name}")

        grads_and_vars = []
        lifted_variables = {id(variables[n]): n for n in variables}
        for grad, variable in zip(call.grads, call.variables):
            name = lifted_variables[id(as_tf_variable(variable))]
            lifted_variable = _graph_variable(graph, name)
            if isinstance(grad, tf.IndexedSlices):
                grad = tf.IndexedSlices(
                    lifted_tensor(grad.values), lifted_tensor(grad.indices),
                    None if grad.dense_shape is None else lifted_tensor(grad.dense_shape))
            elif grad is not None:
                grad = lifted_tensor(grad)
            grads_and_vars.append((grad, lifted_variable))
        update_ops = frozenset(f"{_SCOPE}/{name}" for name in call.created)
        writes = [graph.get_operation_by_name(n) for n in sorted(update_ops)
                  if graph.get_operation_by_name(n).type in RESOURCE_WRITES]
        tf.group(*writes, name=TRAIN_OP)
        # Stateful ops a tf.function runs although nothing reads them (a metric's
        # update, a dropout seed's advance): every step runs them.
        state_ops = [graph.get_operation_by_name(f"{_SCOPE}/{op.name}")
                     for op in traced.control_outputs
                     if f"{_SCOPE}/{op.name}" not in update_ops]
        tf.group(*state_ops, name=STATE_OP)
    optimizer_call = KerasOptimizerCall(graph, grads_and_vars, update_ops, state_values,
                                        TRAIN_OP, type(call.optimizer).__name__)
    # Every node's model reads its metrics and batch-norm statistics back.
    item = GraphItem(graph, [optimizer_call], state_per_node=True)
    num_inputs = len([s for s in tf.nest.flatten(specs) if isinstance(s, tf.TensorSpec)])
    inputs = [lifted_tensor(t) for t in traced.inputs[:num_inputs]]
    structure = concrete.structured_outputs
    outputs = [lifted_tensor(t) if isinstance(t, tf.Tensor) else t
               for t in tf.nest.flatten(structure)]
    return LiftedStep(item, inputs, outputs, structure, variables)


def _graph_variable(graph: tf.Graph, name: str) -> tf.Variable:
    for variable in graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES):
        if variable.op.name == name:
            return variable
    raise KeyError(name)
