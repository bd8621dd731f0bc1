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
import functools
from typing import Callable, Optional

import numpy as np
import tensorflow as tf

from autodist import _keras_compat, _tf_compat
from autodist._tf_compat import eager_snapshot
from autodist.cross_replica import cross_replica_sum
from autodist.graph_item import RESOURCE_WRITES, GraphItem
from autodist.keras import captures, loss_scale
from autodist.keras.update import GraphInitialValue, KerasOptimizerCall
from autodist.session import as_tf_variable

_SCOPE = "step"
TRAIN_OP = "autodist_keras_train_op"
STATE_OP = "autodist_keras_state_updates"
# Keras variables this large, made in ``ad.scope()`` or by an optimizer's first
# step, get no value until used (``DeferredVariable``): the lifted graph computes
# their initial value, part by part where they are partitioned, so a node holds
# no copy of a table it does not own.
DEFERRED_VARIABLE_BYTES = 64 * 2 ** 20


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


def argument_spec(value, replicas: Optional[int] = None):
    """The ``tf.TensorSpec`` a step is traced with for one argument.

    Args:
        value: the argument.
        replicas: None to leave the leading dimension free; else the number of
            local replicas, to fix it at each replica's share of the rows.
    """
    if is_static(value):
        return value
    tensor = tf.convert_to_tensor(value)
    shape = tensor.shape.as_list()
    if shape:
        shape[0] = None if replicas is None else shape[0] // replicas
    return tf.TensorSpec(shape, tensor.dtype)


def signature(args: tuple, replicas: Optional[int] = None) -> str:
    """What a traced step is specific to: the arguments' structure, dtypes and shapes."""
    return repr(tf.nest.map_structure(lambda a: argument_spec(a, replicas), args))


def _leaf_kinds(args: tuple) -> Optional[list]:
    """Per argument leaf, what its signature depends on: a tensor's or array's type,
    dtype and whole shape, a static value's type and value. None when a leaf is
    anything else (a list to convert): only ``signature`` may say then."""
    kinds = []
    for leaf in tf.nest.flatten(args):
        if is_static(leaf):
            kinds.append((type(leaf), leaf))
        elif isinstance(leaf, (tf.Tensor, np.ndarray)):
            kinds.append((type(leaf), leaf.dtype, tuple(leaf.shape)))
        else:
            return None
    return kinds


class StepCache:
    """The steps lifted from one function, one per structure of its arguments.

    A step is traced with the batch dimension left free, so that one trace
    serves every batch size. A function that cannot be traced so (it computes
    with ``x.shape[0]``, which is then None) is traced again with each
    replica's rows as a static batch dimension, as ``tf.function`` would see a
    batch of that many rows; its steps are then specific to the batch size.

    Args:
        fn: the training step.
        replicas: the number of replicas on this node, which split each batch.
        open_step: makes the runnable step of a lifted one.
        autograph: whether to convert ``fn``'s Python control flow, as
            ``tf.function`` does; Keras's ``fit`` traces ``train_step`` without.
    """

    def __init__(self, fn: Callable, replicas: int, open_step: Callable[[LiftedStep], object],
                 autograph: bool = True):
        self._fn = fn
        self._autograph = autograph
        self._replicas = replicas
        self._open_step = open_step
        self._steps = {}  # signature -> its step
        self._static = set()  # free signatures whose function needs a static batch
        # The last arguments looked up, as (their structure, _leaf_kinds, their key):
        # arguments alike, as every batch of a fit but the last is, share the key
        # without the cost of a signature (a tenth of a millisecond and more).
        self._last = None

    def _key(self, args: tuple) -> str:
        kinds = _leaf_kinds(args)
        if self._last is not None and kinds is not None and kinds == self._last[1]:
            try:
                tf.nest.assert_same_structure(args, self._last[0], check_types=True)
                return self._last[2]
            except (TypeError, ValueError):
                pass
        key = signature(args)
        if key in self._static:
            key = signature(args, self._replicas)
        if kinds is not None:
            self._last = (tf.nest.map_structure(lambda _: 0, args), kinds, key)
        return key

    def find(self, args: tuple):
        """The step already lifted for ``args``, or None."""
        return self._steps.get(self._key(args))

    def add(self, args: tuple):
        """Lifts and opens the step for ``args``; returns it."""
        self._last = None  # its key may turn out static
        key = signature(args)
        try:
            traced = trace_step(self._fn, args, autograph=self._autograph)
        except Exception as err:  # pylint: disable=broad-except
            traced = self._trace_with_static_batch(args, err)
            self._static.add(key)
            key = signature(args, self._replicas)
        step = self._open_step(lift_step(traced))
        self._steps[key] = step
        return step

    def _trace_with_static_batch(self, args: tuple, free_error: Exception) -> TracedStep:
        rows = {tf.convert_to_tensor(a).shape[0] for a in tf.nest.flatten(args)
                if not is_static(a) and tf.convert_to_tensor(a).shape.rank}
        if not rows:
            raise free_error
        label = getattr(self._fn, "__name__", "the step")
        if None in rows:
            raise ValueError(
                f"AutoDist could not trace {label} with the batch dimension left free "
                f"({type(free_error).__name__}: {_last_line(free_error)}), and cannot trace "
                f"it with each replica's rows either: the batch size of its arguments is "
                f"unknown (a tensor of shape [None, ...], e.g. from a tf.data pipeline or a "
                f"graph). Pass eager tensors or numpy arrays (iterate the dataset in Python: "
                f"for x, y in dataset: {label}(x, y)), or compute with tf.shape(x)[0] "
                f"instead of x.shape[0].") from free_error
        uneven = sorted(r for r in rows if r % self._replicas)
        if uneven:
            raise ValueError(
                f"AutoDist could not trace {label} with the batch dimension left free "
                f"({type(free_error).__name__}: {_last_line(free_error)}), so it traces it "
                f"with each replica's rows; but a batch of {uneven[0]} rows does not split "
                f"evenly over {self._replicas} replicas. Feed batches of a multiple of "
                f"{self._replicas} rows, or compute with tf.shape(x)[0] instead of "
                "x.shape[0].") from free_error
        return trace_step(self._fn, args, self._replicas, self._autograph)


def _last_line(error: Exception) -> str:
    """An error's last line (a traced function's error starts with its stack), cut short."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return (lines[-1] if lines else "")[:200]


@dataclasses.dataclass
class TracedStep:
    """A step traced by ``tf.function``, before lifting.

    Attributes:
        label: the function's name, for messages.
        concrete: the concrete function.
        specs: the argument specs it was traced for.
        function: the step as given.
        calls: the Keras optimizer ``apply`` calls made while tracing it, in
            the step's own graph (not inside a ``tf.cond`` or loop).
        nested_calls: those made inside a ``tf.cond`` or loop of the step.
    """

    label: str
    concrete: object
    specs: object
    function: Callable
    calls: list
    nested_calls: list


def trace_step(fn: Callable, args: tuple, replicas: Optional[int] = None,
               autograph: bool = True) -> TracedStep:
    """Traces ``fn(*args)``, recording the optimizer updates it makes.

    Args:
        fn: the step.
        args: example arguments (their structure, dtypes and shapes beyond the
            batch dimension are what the step is traced for).
        replicas: None to trace with the batch dimension free; else the number
            of local replicas, to trace with each one's share of ``args``'s rows.
        autograph: whether to convert the step's Python control flow.
    """
    python_function = getattr(fn, "python_function", fn)  # a tf.function's own body
    specs = tf.nest.map_structure(lambda a: argument_spec(a, replicas), args)
    calls = []
    with _keras_compat.capture_optimizer_apply(calls.append, loss_scale.apply_without_cond), \
            _keras_compat.synchronized_moments(cross_replica_sum), \
            _keras_compat.defer_large_variables(DEFERRED_VARIABLE_BYTES), _tf_compat.lifting():
        concrete = tf.function(python_function, autograph=autograph).get_concrete_function(
            *specs)
    return TracedStep(getattr(python_function, "__name__", "the step"), concrete, specs, fn,
                      calls=[c for c in calls if c.graph is concrete.graph],
                      nested_calls=[c for c in calls if c.graph is not concrete.graph])


def lift_step(traced_step: TracedStep) -> LiftedStep:
    """Lifts a traced step into a ``tf.compat.v1`` graph.

    Raises:
        ValueError: when the step applies no optimizer.
        NotImplementedError: when it applies several, or captures what cannot be lifted.
    """
    with _tf_compat.lifting():
        return _lift(traced_step)


# What every refusal of tf_keras (Keras 2) offers instead.
TF_KERAS_WAYS_OUT = (
    "Build the model and its optimizer with Keras 3 (import keras; keras.layers, "
    "keras.Model, keras.optimizers) inside ad.scope(); or, for a model that needs Keras 2 "
    "(TensorFlow Recommenders, TF-Ranking), call its layers in a tf.compat.v1 graph, "
    "minimize the loss with a tf.compat.v1.train optimizer inside ad.scope() and train "
    "with ad.create_distributed_session(), without compile and fit.")


def _refuse_tf_keras_optimizers(traced_step: TracedStep) -> None:
    """Names the tf_keras (Keras 2) optimizers a step without a Keras 3 update applied.

    Raises:
        NotImplementedError: when the step applied one.
    """
    applied = _keras_compat.tf_keras_optimizers_applied(
        captures.reachable_owners(traced_step.function, kinds=(object,)),
        traced_step.concrete.graph)
    if not applied:
        return
    names = ", ".join(type(o).__name__ for o in applied)
    kind = "optimizers" if len(applied) > 1 else "optimizer"
    setting = _keras_compat.legacy_keras_setting()
    why = f" (tf.keras is tf_keras because {setting} is set)" if setting else ""
    raise NotImplementedError(
        f"AutoDist distributes Keras 3 optimizers (and tf.compat.v1.train optimizers in a "
        f"tf.compat.v1 graph), and {traced_step.label} applies the tf_keras (Keras 2) "
        f"{kind} {names}{why}. {TF_KERAS_WAYS_OUT}")


def _lift(traced_step: TracedStep) -> LiftedStep:
    label, concrete, specs, calls = (traced_step.label, traced_step.concrete,
                                     traced_step.specs, traced_step.calls)
    traced = concrete.graph
    if not calls and traced_step.nested_calls:
        optimizer = type(traced_step.nested_calls[0].optimizer).__name__
        raise NotImplementedError(
            f"AutoDist does not distribute an optimizer update made inside a tf.cond or "
            f"loop: {label} applies {optimizer}'s update there. Apply it unconditionally "
            "(a skipped step can apply zero gradients), outside the tf.cond.")
    if not calls:
        _refuse_tf_keras_optimizers(traced_step)
        raise ValueError(
            f"AutoDist found no optimizer update in {label}: apply the gradients with a "
            "Keras 3 optimizer (keras.optimizers; optimizer.apply_gradients or "
            "optimizer.apply) inside it.")
    if len(calls) > 1:
        raise NotImplementedError(
            f"AutoDist supports one optimizer update per step; {label} applies "
            f"{len(calls)} ({', '.join(type(c.optimizer).__name__ for c in calls)}).")
    call = calls[0]
    if getattr(call.optimizer, "use_ema", False):
        raise NotImplementedError(
            f"AutoDist does not keep an optimizer's moving average of the weights: "
            f"{type(call.optimizer).__name__} in {label} is created with use_ema=True; "
            "create it with use_ema=False.")
    trainable = {id(as_tf_variable(v)) for v in call.variables}
    by_handle = {id(v.handle): v for v in traced.variables}
    # Optimizer state the step also reads outside the update (a loss scale) is
    # lifted as a variable of the model; the rest is the update's own per copy.
    captured = {id(e): i for e, i in traced.captures}
    optimizer_state = {id(v) for v in map(as_tf_variable, call.optimizer.variables)
                       if not _read_outside(captured.get(id(v.handle)), call.created)}

    owners = captures.reachable_owners(traced_step.function)
    paths = captures.metric_paths(owners)
    # Read eagerly, before entering the new graph.
    tables = captures.lookup_tables(owners) if any(
        e.dtype == tf.resource and id(e) not in by_handle for e, _ in traced.captures) else {}
    constants = {id(e): e.numpy() for e, _ in traced.captures
                 if id(e) not in by_handle and e.dtype != tf.resource}
    graph = tf.Graph()
    variables, state_values, state_bytes, input_map, initial_values = {}, {}, {}, {}, {}
    with graph.as_default():
        for external, internal in traced.captures:
            variable = by_handle.get(id(external))
            if variable is None:
                if external.dtype != tf.resource:
                    input_map[internal.name] = tf.constant(constants[id(external)])
                elif id(external) in tables:  # read-only: each node holds a copy
                    input_map[internal.name] = tables[id(external)].lifted_handle()
                else:
                    raise NotImplementedError(
                        f"{label} uses a resource AutoDist cannot distribute "
                        f"({internal.name}): only variables, constants and the lookup "
                        "tables of Keras layers (StringLookup, IntegerLookup, "
                        "TextVectorization) may be captured. Run the layer that holds it "
                        "in the input pipeline (dataset.map) instead.")
                continue
            # Keras 3 names a variable by its path, but TensorFlow's eager names may
            # be uniquified per scope ("sum_loss_1/count" beside "sum_loss/total");
            # a metric's variables keep their path, which groups them (replicator).
            name = paths.get(id(variable), variable.name.split(":")[0])
            # Still at its initializer's value, never set: its graph computes it.
            deferred = getattr(variable, "at_initial_value", False)
            if id(variable) in optimizer_state:
                placeholder = tf.compat.v1.placeholder(tf.resource, [], name=name)
                state_values[placeholder.op.name] = (
                    GraphInitialValue(variable.initial_value_fn, variable) if deferred
                    else functools.partial(eager_snapshot, variable))
                state_bytes[placeholder.op.name] = ((variable.shape.num_elements() or 0)
                                                    * variable.dtype.size)
                variables[placeholder.op.name] = variable
                input_map[internal.name] = placeholder
                continue
            value = None if deferred else eager_snapshot(variable)
            if deferred:  # computed where it is stored, part by part if partitioned
                with tf.name_scope(f"{name}/initial_value"):
                    initial = variable.initial_value_fn()
            elif np.any(value):
                # Fed at initialization: a weight's bytes never enter a GraphDef, which
                # is serialized, digested and copied by every stage, and capped at 2 GB.
                initial = tf.compat.v1.placeholder(variable.dtype, value.shape,
                                                   name=f"{name}/initial_value_feed")
                initial_values[initial.name] = functools.partial(eager_snapshot, variable)
            else:
                initial = tf.zeros(value.shape, value.dtype)
            lifted = tf.compat.v1.Variable(initial, trainable=id(variable) in trainable,
                                           name=name, use_resource=True, dtype=variable.dtype)
            variables[lifted.op.name] = variable
            input_map[internal.name] = lifted.handle
        num_inputs = len([s for s in tf.nest.flatten(specs) if isinstance(s, tf.TensorSpec)])
        graph_def = _batch_inputs(traced.as_graph_def(), traced.inputs[:num_inputs])
        outputs = [t for t in tf.nest.flatten(concrete.structured_outputs)
                   if isinstance(t, tf.Tensor)]
        tf.graph_util.import_graph_def(_outputs_before_update(graph_def, outputs, call.created),
                                       input_map=input_map, name=_SCOPE)

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
        if call.applied_if is not None:
            gated = [f"{_SCOPE}/{n}" for n in sorted(call.conditional)
                     if graph.get_operation_by_name(f"{_SCOPE}/{n}").type in RESOURCE_WRITES]
            update_ops |= {op.name for op in loss_scale.gate_writes(
                graph, gated, lifted_tensor(call.applied_if))}
        writes = [graph.get_operation_by_name(n) for n in sorted(update_ops)
                  if graph.get_operation_by_name(n).type in RESOURCE_WRITES]
        tf.group(*writes, name=TRAIN_OP)
        # Stateful ops a tf.function runs although nothing reads them (a metric's
        # update, a dropout seed's advance): every step runs them.
        state_ops = [graph.get_operation_by_name(f"{_SCOPE}/{op.name}")
                     for op in traced.control_outputs
                     if f"{_SCOPE}/{op.name}" not in update_ops]
        tf.group(*state_ops, name=STATE_OP)
    loss_scale_name = (None if call.loss_scale is None
                       else lifted_variables[id(as_tf_variable(call.loss_scale))])
    optimizer_call = KerasOptimizerCall(graph, grads_and_vars, update_ops, state_values,
                                        state_bytes, TRAIN_OP, type(call.optimizer).__name__,
                                        loss_scale_name)
    # Every node's model reads its metrics and batch-norm statistics back.
    item = GraphItem(graph, [optimizer_call], state_per_node=True,
                     initial_values=initial_values)
    inputs = [lifted_tensor(t) for t in traced.inputs[:num_inputs]]
    structure = concrete.structured_outputs
    outputs = [lifted_tensor(t) if isinstance(t, tf.Tensor) else t
               for t in tf.nest.flatten(structure)]
    return LiftedStep(item, inputs, outputs, structure, variables)


def _batch_inputs(graph_def, inputs: list):
    """``graph_def`` with its input placeholders taking batches of any size.

    A step traced with each replica's rows as a static batch dimension still
    takes the global batch, which the replicator splits (see ``StepCache``).
    """
    names = {t.op.name for t in inputs if t.shape.rank}
    for node in graph_def.node:
        if node.name in names:
            node.attr["shape"].shape.dim[0].size = -1
    return graph_def


def _outputs_before_update(graph_def, outputs: list, update_ops: frozenset):
    """``graph_def`` with the step's outputs no longer waiting for the optimizer's update.

    ``tf.function`` makes its outputs wait for every stateful op; AutoDist runs
    the update itself, and in the runs of an accumulation cycle not at all, so
    an output fetched must not pull the update in.
    """
    names = {t.op.name for t in outputs}
    # The outputs wait for the stateful ops through a NoOp grouping them.
    names |= {i[1:] for node in graph_def.node if node.name in names
              for i in node.input if i.startswith("^")}
    for node in graph_def.node:
        if node.name in names:
            kept = [i for i in node.input if not (i.startswith("^") and i[1:] in update_ops)]
            del node.input[:]
            node.input.extend(kept)
    return graph_def


def _read_outside(placeholder: Optional[tf.Tensor], update_ops: frozenset) -> bool:
    """Whether a captured variable's placeholder feeds an op outside the update."""
    return placeholder is not None and any(op.name not in update_ops
                                           for op in placeholder.consumers())


def _graph_variable(graph: tf.Graph, name: str) -> tf.Variable:
    for variable in graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES):
        if variable.op.name == name:
            return variable
    raise KeyError(name)
