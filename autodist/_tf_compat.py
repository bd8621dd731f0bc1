"""Every use of TensorFlow's private API lives here, so an upgrade touches one file.

What AutoDist needs that TensorFlow exposes no public hook for: capturing what a
``tf.compat.v1`` optimizer is asked to apply, re-using that optimizer's
hyper-parameters (and finding its non-slot state and the op updating each
variable) in the rewritten graph, a fast graph import, checkpoint entries
whose saved value and restore are custom, eager variables whose value comes
at their first use (``DeferredVariable``), and the executor that runs a
functional loop's body.
"""
from __future__ import annotations

import contextlib
import contextvars
import copy
import dataclasses
from typing import Callable, Iterator, Optional, Tuple

import numpy as np
import tensorflow as tf
from tensorflow.python.ops import gen_resource_variable_ops, resource_variable_ops

_V1Optimizer = tf.compat.v1.train.Optimizer
_COPY_MARK = "_autodist_copy"  # set on optimizer_for_graph's copies, which are not captured


@dataclasses.dataclass
class OptimizerCall:
    """One ``apply_gradients`` call seen while building the user's graph.

    Attributes:
        graph: the graph the call built ops in.
        optimizer: the optimizer object the user built.
        grads_and_vars: what it was asked to apply (tensors of the original graph).
        global_step: the step variable passed in, or None.
        update_op_names: every op the call created (slots, update ops, the result).
        result_op_name: the op ``apply_gradients`` returned (the user's train op).
        raw_gradients: variable name -> the gradient ``compute_gradients``
            returned for it in this graph, for each variable that has one, when
            some of them is not what this call applies (the user processed it
            in between, e.g. clipped it); else empty.
        loss_scale: always None (a graph's loss scale is the user's own arithmetic).
        lazy_refusal: why its update cannot run lazily by rows (``lazy_row_update``).
    """

    loss_scale = None
    lazy_refusal = ("its optimizer is a tf.compat.v1 one, whose own sparse kernels AutoDist "
                    "runs as they are (use a Keras optimizer, or tf.compat.v1's dense update)")
    graph: tf.Graph
    optimizer: _V1Optimizer
    grads_and_vars: list
    global_step: object
    update_op_names: frozenset
    result_op_name: str
    raw_gradients: dict = dataclasses.field(default_factory=dict)

    def _slots(self):
        """(variable, slot key, slot variable) of every slot the optimizer made."""
        for _, variable in self.grads_and_vars:
            for slot_name in self.optimizer.get_slot_names():
                slot = self.optimizer.get_slot(variable, slot_name)
                if slot is not None:
                    yield variable, slot_name, slot

    def slot_names(self) -> dict:
        """Original slot variable name -> (its variable's name, slot key)."""
        return {slot.op.name: (variable.op.name, key) for variable, key, slot in self._slots()}

    def slot_bytes(self) -> dict:
        """Variable name -> the bytes of its slots (of a fully defined shape)."""
        sizes = {}
        for variable, _, slot in self._slots():
            if slot.shape.is_fully_defined():
                sizes[variable.op.name] = (sizes.get(variable.op.name, 0)
                                           + slot.shape.num_elements()
                                           * slot.dtype.base_dtype.size)
        return sizes

    def non_slot_names(self) -> dict:
        """Original name of each non-slot variable (Adam's powers) -> its key."""
        return {variable.op.name: key for key, variable
                in optimizer_non_slot_variables(self.optimizer, self.graph).items()}

    def hyperparameters(self) -> dict:
        """Always empty: a ``tf.compat.v1`` optimizer's learning rate is a constant of
        the graph, or a variable the chief initializes."""
        return {}

    def update_modes(self) -> dict:
        """Always empty: a ``tf.compat.v1`` optimizer's sparse kernels write the rows of
        the gradient alone, and its update's writes tell (``GraphItem``)."""
        return {}

    def new_update(self, translate: Callable[[object], tf.Tensor]) -> "V1Update":
        """A fresh copy of the optimizer for the distributed graph (the default graph).

        Args:
            translate: maps a tensor or variable hyper-parameter of the original
                graph (a learning-rate placeholder) to its counterpart.
        """
        return V1Update(optimizer_for_graph(self.optimizer, translate))


class V1Update:
    """One copy of a ``tf.compat.v1`` optimizer applying updates in the distributed graph.

    Attributes:
        initial_values: always empty: the slots start from initializers in the graph.
    """

    def __init__(self, optimizer: _V1Optimizer):
        self._optimizer = optimizer
        self.initial_values = {}

    def apply(self, updates: list, global_step=None) -> tuple:
        """Applies each ``PartUpdate``'s gradient to its variable.

        Returns:
            (the op finishing the update, each update's own op, in order)
        """
        return apply_gradients_per_variable(
            self._optimizer, [(u.gradient, u.variable) for u in updates], global_step)

    def slot(self, copy: tf.Variable, key: str):
        """The slot ``key`` of the stored copy ``copy``, or None."""
        return self._optimizer.get_slot(copy, key)

    def non_slot_variables(self, graph: tf.Graph) -> dict:
        """Key -> this copy's non-slot variable in ``graph``."""
        return optimizer_non_slot_variables(self._optimizer, graph)


@contextlib.contextmanager
def capture_apply_gradients(record: Callable[[OptimizerCall], None]) -> Iterator[None]:
    """Within the block, report every ``tf.compat.v1`` ``apply_gradients`` call.

    ``compute_gradients`` calls are watched too, so that a call's
    ``raw_gradients`` name what the user applied something else in place of.
    The original methods are always restored on exit, also on error. Optimizers
    that override ``apply_gradients`` themselves are not seen.
    """
    original = _V1Optimizer.apply_gradients
    original_compute = _V1Optimizer.compute_gradients
    computed = {}  # (graph, variable name) -> the gradient compute_gradients returned

    def recording_compute_gradients(self, *args, **kwargs):
        grads_and_vars = original_compute(self, *args, **kwargs)
        graph = tf.compat.v1.get_default_graph()
        for grad, variable in grads_and_vars:
            if grad is not None:
                computed[(graph, variable.op.name)] = grad
        return grads_and_vars

    def recording_apply_gradients(self, grads_and_vars, global_step=None, name=None):
        if getattr(self, _COPY_MARK, False):  # AutoDist's own update, in the new graph
            return original(self, grads_and_vars, global_step=global_step, name=name)
        grads_and_vars = list(grads_and_vars)
        graph = tf.compat.v1.get_default_graph()
        before = {op.name for op in graph.get_operations()}
        result = original(self, grads_and_vars, global_step=global_step, name=name)
        created = frozenset(op.name for op in graph.get_operations()) - before
        applied = {variable.op.name: grad for grad, variable in grads_and_vars
                   if grad is not None and (graph, variable.op.name) in computed}
        raw = {name: computed[(graph, name)] for name in applied}
        if all(raw[name] is grad for name, grad in applied.items()):
            raw = {}  # applied as computed (``minimize``)
        record(OptimizerCall(graph, self, grads_and_vars, global_step, created, result.name, raw))
        return result

    _V1Optimizer.apply_gradients = recording_apply_gradients
    _V1Optimizer.compute_gradients = recording_compute_gradients
    try:
        yield
    finally:
        _V1Optimizer.apply_gradients = original
        _V1Optimizer.compute_gradients = original_compute


def optimizer_for_graph(optimizer: _V1Optimizer,
                        translate: Callable[[object], tf.Tensor]) -> _V1Optimizer:
    """Returns a copy of ``optimizer`` usable in another graph.

    Slot tables are emptied (they belong to the original graph) and tensor or
    variable hyper-parameters (a learning-rate placeholder, a decayed rate) are
    replaced by ``translate(value)``, their counterpart in the new graph.
    """
    clone = copy.copy(optimizer)
    setattr(clone, _COPY_MARK, True)
    for attr, value in vars(clone).items():
        if isinstance(value, dict):
            setattr(clone, attr, {})
        elif isinstance(value, (tf.Tensor, tf.Variable)):
            setattr(clone, attr, translate(value))
    return clone


def apply_gradients_per_variable(optimizer: _V1Optimizer, grads_and_vars: list,
                                 global_step=None) -> tuple:
    """``optimizer.apply_gradients``, also returning each variable's own update op.

    The returned op also finishes the optimizer's shared state (Adam's powers, the
    global step); each variable's update op lets a step act on that variable as
    soon as it alone is updated.

    Returns:
        (the op ``apply_gradients`` returned, the update op of each entry of
        ``grads_and_vars``, in order)
    """
    recorded = []
    finish = optimizer._finish  # pylint: disable=protected-access

    def recording_finish(update_ops, name_scope):
        recorded.extend(update_ops)
        return finish(update_ops, name_scope)

    optimizer._finish = recording_finish  # pylint: disable=protected-access
    try:
        result = optimizer.apply_gradients(grads_and_vars, global_step=global_step)
    finally:
        del optimizer._finish  # pylint: disable=protected-access
    if len(recorded) != len(grads_and_vars):
        raise RuntimeError(f"{type(optimizer).__name__} updated {len(recorded)} variables "
                           f"for {len(grads_and_vars)} gradients")
    return result, recorded


def optimizer_non_slot_variables(optimizer: _V1Optimizer, graph: tf.Graph) -> dict:
    """The optimizer's variables that belong to no slot (Adam's beta powers) in ``graph``.

    Returns:
        dict mapping the optimizer's own name for each (e.g. ``"beta1_power"``)
        to the variable
    """
    table = optimizer._non_slot_dict  # pylint: disable=protected-access
    return {name: variable for (name, owner), variable in table.items() if owner is graph}


def checkpoint_entry(name: str, value: Callable[[], tf.Tensor],
                     restore: Callable[[tf.Tensor], tf.Operation], *, dtype: tf.DType,
                     device: str, nbytes: int, slice_spec: str = ""):
    """An entry for ``piecewise_saver``: one variable, or one slice of it.

    Args:
        name: the name in the checkpoint.
        value: builds what is saved under it, when the save op is built.
        restore: builds the op that assigns a restored tensor wherever it belongs.
        dtype: the saved tensor's dtype.
        device: where the save reads it.
        nbytes: the saved tensor's size, which groups entries into shards.
        slice_spec: the slice of the full variable it holds (``Variable.SaveSliceInfo``'s
            ``spec``), or "" for the whole variable.
    """
    from tensorflow.python.training.saving import saveable_object

    class _Entry(saveable_object.SaveableObject):
        def restore(self, restored_tensors, restored_shapes):
            return restore(restored_tensors[0])

    spec = saveable_object.SaveSpec(value, slice_spec, name, dtype=dtype, device=device)
    # The Saver keys its entries by their own names: a slice's needs its own.
    entry = _Entry(None, [spec], f"{name}[{slice_spec}]" if slice_spec else name)
    entry.nbytes = nbytes
    return entry


def piecewise_saver(entries: list, shard_bytes: int, **options) -> tf.compat.v1.train.Saver:
    """A ``tf.compat.v1.train.Saver`` of ``checkpoint_entry`` s that holds one shard in
    memory at a time.

    Entries are packed, in order, into shards of up to ``shard_bytes`` (an entry
    larger than that is a shard of its own). With more than one shard, a save
    reads and writes one shard after the other into a directory beside the
    checkpoint, then merges them into one checkpoint; a restore reads and
    assigns one shard after the other. So the device doing it holds one shard,
    never the whole state. The files are an ordinary checkpoint either way:
    slices of one variable read back as the whole variable.

    Args:
        options: ``Saver``'s other arguments (``max_to_keep``, ...).
    """
    from tensorflow.python.training import saver as saver_lib

    shards = []
    for entry in entries:
        if not shards or sum(e.nbytes for e in shards[-1]) + entry.nbytes > shard_bytes:
            shards.append([])
        shards[-1].append(entry)
    if len(shards) < 2:
        return tf.compat.v1.train.Saver(entries, **options)

    class _ShardByShard(saver_lib.BulkSaverBuilder):
        def __init__(self):
            super().__init__()
            self._saved, self._restored = [], []

        def _GroupByDevices(self, saveables):  # pylint: disable=invalid-name
            return [(shard[0].device, shard) for shard in shards]

        # Each shard's ops wait for the previous shard's: its reads (built here,
        # from the entries' callables) do not start before that shard is written.
        def _AddSaveOps(self, filename_tensor, saveables):  # pylint: disable=invalid-name
            with tf.control_dependencies(self._saved):
                saved = super()._AddSaveOps(filename_tensor, saveables)
            self._saved = [saved]
            return saved

        def _AddRestoreOps(self, *args, **kwargs):  # pylint: disable=invalid-name
            with tf.control_dependencies(self._restored):
                restored = super()._AddRestoreOps(*args, **kwargs)
            self._restored = [restored]
            return restored

    return tf.compat.v1.train.Saver(entries, sharded=True, builder=_ShardByShard(), **options)


def eager_snapshot(variable: tf.Variable) -> np.ndarray:
    """An eager variable's value now, as a read-only array sharing TensorFlow's buffer,
    read eagerly even where a graph is the default (initializing a session).

    No bytes are copied: a later write of the variable gets a buffer of its own,
    leaving the snapshot as it was (at the cost of one copy, while it is kept).
    A ``DeferredVariable`` first gets its value.
    """
    from tensorflow.python.eager import context
    if isinstance(variable, DeferredVariable):
        variable.materialize()
    with context.eager_mode():
        return np.asarray(variable.read_value())


def called_flat(concrete) -> Callable:
    """A call of the traced ``concrete`` function (a ``ConcreteFunction``) on its flat
    tensor arguments, returning its outputs in their structure: its atomic
    function called directly, about 50 us of Python where calling ``concrete``
    spends 150 to 500 us binding, flattening and checking. ``concrete`` itself
    where its outputs hold anything but tensors."""
    structure = concrete.structured_outputs
    if structure is not None and not all(
            isinstance(t, tf.Tensor) for t in tf.nest.flatten(structure)):
        return concrete
    atomic = concrete._inference_function  # pylint: disable=protected-access
    captures = list(concrete.captured_inputs)

    def call(*tensors):
        outputs = atomic.call_flat(*tensors, *captures)
        return None if structure is None else tf.nest.pack_sequence_as(structure, outputs)

    return call


class EagerVariables:
    """Reads or assigns a fixed list of eager variables with as little per-call
    overhead as eager TensorFlow allows (for the small state AutoDist copies at
    every step). Both work even where a graph is the default.

    A few variables go through one raw eager op each (``ReadVariableOp``,
    ``AssignVariableOp``): about 20 to 70 us an op here, right after a step.
    More than ``PER_OP_LIMIT`` go through one call of a traced function
    (``called_flat``), their values packed one flat tensor per dtype: a call's
    cost grows with its number of arguments and results, not with their bytes.

    Args:
        variables: the variables, each with a fully defined shape.
    """

    PER_OP_LIMIT = 12

    def __init__(self, variables: list):
        from tensorflow.python.eager import context
        self._variables = list(variables)
        self._shapes = [v.shape.as_list() for v in self._variables]
        self._packed = len(self._variables) > self.PER_OP_LIMIT
        if not self._packed:
            return
        groups = {}  # dtype -> the indices of its variables, in order
        for index, variable in enumerate(self._variables):
            groups.setdefault(variable.dtype, []).append(index)
        self._groups = list(groups.items())
        sizes = [v.shape.num_elements() for v in self._variables]
        # per dtype, where each of its variables ends in the packed tensor
        self._ends = [np.cumsum([sizes[i] for i in indices]).tolist()
                      for _, indices in self._groups]
        signature = [tf.TensorSpec([ends[-1]], dtype)
                     for (dtype, _), ends in zip(self._groups, self._ends)]
        with context.eager_mode():
            read = tf.function(self._read_packed).get_concrete_function()
            self._assign_traced = tf.function(
                self._assign_packed, input_signature=signature).get_concrete_function()
        self._read, self._assign = called_flat(read), called_flat(self._assign_traced)

    @property
    def packed(self) -> bool:
        """Whether the values travel packed, through one traced call each way."""
        return self._packed

    def _read_packed(self) -> list:
        return [tf.concat([tf.reshape(self._variables[i].read_value(), [-1]) for i in indices],
                          axis=0) for _, indices in self._groups]

    def _assign_packed(self, *packed) -> None:
        for (_, indices), ends, flat in zip(self._groups, self._ends, packed):
            for index, start, end in zip(indices, [0] + ends[:-1], ends):
                self._variables[index].assign(tf.reshape(flat[start:end], self._shapes[index]))

    def read(self) -> list:
        """The variables' values now, as arrays of their own."""
        from tensorflow.python.eager import context
        with context.eager_mode():
            if not self._packed:
                return [gen_resource_variable_ops.read_variable_op(v.handle, v.dtype).numpy()
                        for v in self._variables]
            packed = [t.numpy() for t in self._read()]
        values = [None] * len(self._variables)
        for (_, indices), ends, flat in zip(self._groups, self._ends, packed):
            for index, part in zip(indices, np.split(flat, ends[:-1])):
                values[index] = part.reshape(self._shapes[index]).copy()
        return values

    def assign(self, values: list) -> None:
        """Assigns ``values`` (arrays, in the variables' order)."""
        from tensorflow.python.eager import context
        with context.eager_mode():
            if not self._packed:
                for variable, shape, value in zip(self._variables, self._shapes, values):
                    array = np.asarray(value, dtype=variable.dtype.as_numpy_dtype)
                    gen_resource_variable_ops.assign_variable_op(
                        variable.handle, tf.constant(array.reshape(shape)))
                return
            packed = [tf.constant(np.concatenate([
                np.asarray(values[i], dtype=dtype.as_numpy_dtype).reshape(-1) for i in indices]))
                for dtype, indices in self._groups]
            self._assign(*packed)


def session_callable(session: tf.compat.v1.Session, fetches: list,
                     feeds: list) -> Callable[..., list]:
    """Runs ``fetches`` (tensors and ops) on values for the tensors ``feeds``, given in
    their order, through the session's C++ callable (``Session::MakeCallable``):
    about 30 us of Python a run, where ``Session.run`` spends 200 to 500 us
    building and reading its dicts. Returns what ``Session.run(fetches)`` does
    for a list (None for an op). The values must be arrays of the feeds' dtypes
    and shapes: the callable converts nothing."""
    from tensorflow.core.protobuf import config_pb2
    tensors = list(dict.fromkeys(f.name for f in fetches if isinstance(f, tf.Tensor)))
    options = config_pb2.CallableOptions(
        feed=[t.name for t in feeds], fetch=tensors,
        target=list(dict.fromkeys(f.name for f in fetches if isinstance(f, tf.Operation))))
    made = session._make_callable_from_options(options)  # pylint: disable=protected-access
    where = [tensors.index(f.name) if isinstance(f, tf.Tensor) else None for f in fetches]

    def run(*values) -> list:
        fetched = made(*values)
        return [None if index is None else fetched[index] for index in where]

    return run


_LIFTING = contextvars.ContextVar("autodist_lifting", default=False)


@contextlib.contextmanager
def lifting() -> Iterator[None]:
    """Within the block, tracing a step and lifting it leaves ``DeferredVariable`` s
    without a value: AutoDist reads their shape and dtype, never their value."""
    token = _LIFTING.set(True)
    try:
        yield
    finally:
        _LIFTING.reset(token)


class DeferredVariable(resource_variable_ops.UninitializedVariable):
    """An eager resource variable that gets its value at its first use.

    Until then it has a handle, a shape and a dtype but no buffer: a large
    table AutoDist keeps in parts on other nodes costs this process nothing.
    Any use of it outside ``lifting()`` (a read, a write, a ``tf.function``
    capturing it) first assigns ``source()``: its initial value, or once AutoDist
    has trained it, AutoDist's value (``defer``).

    Args:
        initial_value: builds the initial value in the current graph or eagerly
            (a Keras initializer's call: deterministic, so every call agrees).
        shape, dtype, trainable, name: as ``tf.Variable``'s.
    """

    def __init__(self, initial_value: Callable[[], tf.Tensor], *, shape, dtype,
                 trainable: bool, name: str):
        self._source = initial_value
        self._on_set = None
        self._pieces = None
        super().__init__(shape=shape, dtype=dtype, trainable=trainable, name=name)
        self.initial_value_fn = initial_value

    @property
    def deferred(self) -> bool:
        """Whether it still has no value of its own."""
        return self._source is not None

    @property
    def at_initial_value(self) -> bool:
        """Whether it has no value of its own yet and will take its initial value."""
        return self._source is self.initial_value_fn

    @property
    def handle(self):
        if self._source is not None and not _LIFTING.get():
            self.materialize()
        return self._handle

    def materialize(self) -> None:
        """Gives it its value now, if it has none."""
        if self._source is None:
            return
        from tensorflow.python.eager import context
        source, self._source = self._source, None
        with context.eager_mode():  # also inside a tf.compat.v1 graph
            self.assign(source())
        if self._on_set is not None:
            self._on_set(self)

    def defer(self, source: Callable, on_set: Optional[Callable] = None,
              pieces: Optional[Callable[[], Iterator[Tuple[tuple, np.ndarray]]]] = None
              ) -> None:
        """Takes the value from ``source()`` at the next use, and then calls
        ``on_set(self)``; only while it has no value of its own.

        Args:
            pieces: yields the same value as ``(index, array)`` pieces, one at a
                time (``value_in_pieces``).
        """
        assert self.deferred, "a variable with a value is written, not deferred"
        self._source, self._on_set, self._pieces = source, on_set, pieces

    def value_in_pieces(self) -> Iterator[Tuple[tuple, np.ndarray]]:
        """Its value as ``(index, array)`` pieces, ``value[index] = array``: while it
        has no value of its own and its source comes in pieces, one piece at a time
        without giving it a value; else the whole value."""
        if self._source is not None and self._pieces is not None:
            yield from self._pieces()
        else:
            yield (slice(None),) * len(self.shape), eager_snapshot(self)


def variable_from_graph(variable: tf.Variable, graph: tf.Graph) -> tf.Variable:
    """Rebuilds the Python object of ``variable`` from its ops imported into ``graph``."""
    with graph.as_default():
        return type(variable).from_proto(variable.to_proto())


def graph_element_name(variable: tf.Variable) -> str:
    """Name of the tensor a session fetches for ``variable`` (its cached read)."""
    return variable._graph_element.name  # pylint: disable=protected-access


def add_control_inputs(op: tf.Operation, control_ops: list) -> None:
    """Makes ``op`` run after ``control_ops`` (an edge added after import)."""
    op._add_control_inputs(control_ops)  # pylint: disable=protected-access


def replace_input(op: tf.Operation, index: int, tensor: tf.Tensor) -> None:
    """Makes ``op`` read ``tensor`` as its input ``index`` (an edge changed after import)."""
    op._update_input(index, tensor)  # pylint: disable=protected-access


def replace_control_inputs(op: tf.Operation, old: list, new: list) -> None:
    """Makes ``op`` wait for ``new`` instead of ``old`` (edges changed after import)."""
    names = {o.name for o in old}
    kept = [c for c in op.control_inputs if c.name not in names]
    op._remove_all_control_inputs()  # pylint: disable=protected-access
    op._add_control_inputs(kept + list(new))  # pylint: disable=protected-access


def import_graph_def(graph_def, input_map: dict, prefix: str) -> None:
    """Imports ``graph_def`` into the default graph, keeping its NodeDef devices.

    Unlike ``tf.graph_util.import_graph_def`` it skips the per-op Python
    post-processing (device scopes, colocation attributes), which dominates the
    rewrite of large graphs: callers set every device in the NodeDefs and strip
    colocations. When no scope of the graph could change an op (control
    dependencies, colocation, attribute, kernel-label or gradient-override
    scopes) it only wraps each new op in its Python object: the scopes' work
    and the pass over every op's inputs (for those scopes and for control-flow
    contexts, which an import never restores) have nothing to do. Functions of
    the library must already be in the graph.
    """
    from tensorflow.python.client import pywrap_tf_session as c_api
    from tensorflow.python.framework import c_api_util, importer

    graph = tf.compat.v1.get_default_graph()
    options = c_api_util.ScopedTFImportGraphDefOptions()
    importer._PopulateTFImportGraphDefOptions(  # pylint: disable=protected-access
        options.options, prefix, input_map, None, False)
    with graph._mutation_lock():  # pylint: disable=protected-access
        buffer = c_api.TF_NewBufferFromString(graph_def.SerializeToString())
        try:
            with graph._c_graph.get() as c_graph:  # pylint: disable=protected-access
                results = c_api.TF_GraphImportGraphDefWithResults(c_graph, buffer, options.options)
            c_api_util.ScopedTFImportGraphDefResults(results)
        finally:
            c_api.TF_DeleteBuffer(buffer)
        # pylint: disable=protected-access
        scoped = (graph._control_dependencies_stack or graph._colocation_stack
                  or graph._attr_scope_map or graph._op_to_kernel_label_map
                  or graph._gradient_override_map)
        if scoped:
            graph._add_new_tf_operations(compute_devices=False)
            return
        for c_op in graph.new_operations():
            op = tf.Operation._from_c_op(c_op=c_op, g=graph)
            graph._names_in_use.setdefault(op.name.lower(), 1)


# The attribute TensorFlow's function runtime reads, from a function's
# instantiation attributes, to choose the executor that runs it.
_EXECUTOR_ATTR = "_executor"
_SINGLE_THREADED_EXECUTOR = b"SINGLE_THREADED_EXECUTOR"
# Ops that executor refuses (control-flow primitives) or that would bring them
# or leave its one thread waiting: nested functional control flow and calls
# (lowered or inlined when the body is instantiated), the sends and receives of
# a body cut between devices, collectives (matched by prefix).
_NOT_SINGLE_THREADED = frozenset({
    "Switch", "RefSwitch", "Merge", "RefMerge", "Enter", "RefEnter", "Exit", "RefExit",
    "NextIteration", "RefNextIteration", "LoopCond", "ControlTrigger",
    "While", "StatelessWhile", "If", "StatelessIf", "Case", "StatelessCase", "For",
    "PartitionedCall", "StatefulPartitionedCall", "RemoteCall", "SymbolicGradient",
    "_Send", "_Recv", "_HostSend", "_HostRecv", "Send", "Recv"})


def single_threaded_functions(library) -> frozenset:
    """Names of the FunctionDefLibrary's functions TF's single-threaded executor can run."""
    defined = {function.signature.name for function in library.function}
    return frozenset(
        function.signature.name for function in library.function
        if not any(node.op in _NOT_SINGLE_THREADED or node.op in defined
                   or node.op.startswith("Collective") for node in function.node_def))


def run_loop_single_threaded(node) -> None:
    """Has a While NodeDef's condition and body run on TF's single-threaded executor.

    That executor runs a function's ops one after the other on the calling
    thread; the default one hands every ready op to the inter-op thread pool.
    """
    for key in ("cond", "body"):
        node.attr[key].func.attr[_EXECUTOR_ATTR].s = _SINGLE_THREADED_EXECUTOR


# oneDNN's matrix product, and the kernel label TensorFlow's oneDNN graph pass
# gives the ops it swaps in for its own.
_ONEDNN_MATMUL = "_MklMatMul"
_ONEDNN_LABEL = b"MklNameChangeOp"
_ONEDNN_SUFFIX = "_autodist_onednn"


def onednn_matmuls() -> bool:
    """Whether TensorFlow runs a graph's float32 products with oneDNN's kernel (an x86
    build with oneDNN, and ``TF_ENABLE_ONEDNN_OPTS`` not 0)."""
    from tensorflow.python.framework import op_def_registry
    from tensorflow.python.util import _pywrap_util_port

    return bool(_pywrap_util_port.IsMklEnabled()) and op_def_registry.get(
        _ONEDNN_MATMUL) is not None


def with_onednn_matmuls(function):
    """A copy of a FunctionDef whose float32 ``MatMul`` ops run oneDNN's kernel, under a
    name of its own; None when it has no such op.

    TensorFlow's oneDNN pass makes that swap in a session's graph, but not in
    the functions a functional loop calls each iteration, which then run
    Eigen's kernel: a sequential product that packs the whole weight matrix at
    every call (an LSTM's step over a replica's 16 rows spent more time
    packing than multiplying).
    """
    if not any(map(_is_float32_matmul, function.node_def)):
        return None
    variant = copy.deepcopy(function)
    variant.signature.name = function.signature.name + _ONEDNN_SUFFIX
    for node in filter(_is_float32_matmul, variant.node_def):
        node.op = _ONEDNN_MATMUL
        node.attr["_kernel"].s = _ONEDNN_LABEL
    return variant


def _is_float32_matmul(node) -> bool:
    return node.op == "MatMul" and node.attr["T"].type == tf.float32.as_datatype_enum


def record_checkpoint(saver: tf.compat.v1.train.Saver, path: str, save_dir: str,
                      latest_filename: str, meta_graph_suffix: str) -> None:
    """What ``saver.save(..., write_state=True)`` does after writing ``path``.

    Records the checkpoint among the saver's last ones, rewrites the state file
    (atomically) and deletes the checkpoints ``max_to_keep`` no longer keeps; so a
    caller can write more files (the meta graph) before the state names ``path``.
    """
    from tensorflow.python.checkpoint import checkpoint_management

    # pylint: disable=protected-access
    saver._RecordLastCheckpoint(path)
    checkpoint_management.update_checkpoint_state_internal(
        save_dir=save_dir, model_checkpoint_path=path,
        all_model_checkpoint_paths=saver.last_checkpoints, latest_filename=latest_filename,
        save_relative_paths=saver._save_relative_paths)
    saver._MaybeDeleteOldCheckpoints(meta_graph_suffix=meta_graph_suffix)
