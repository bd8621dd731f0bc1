"""A Keras 3 optimizer's update, recreated for every stored copy of the distributed graph.

A traced Keras step holds the optimizer's whole update (gradient clipping, weight
decay, the learning-rate schedule, the slots' and the variables' writes, the
iteration count) as plain ops. ``KerasOptimizerCall`` cuts that update into
three stages, from its ops' data and control edges alone, so that any Keras
optimizer works:

* common: what the update of several variables depends on (the learning rate
  at this iteration, a global gradient norm), computed once per update from
  the whole mean gradients;
* per variable: what only one variable's writes depend on, including the
  slots only it reads (Adam's moments). It is imported once per stored copy
  (or part), with slots of that copy's shape beside it;
* rest: writes nothing else depends on (the iteration count), run last.

The per-variable stage of a partitioned variable runs on each part; that is
what single-device training computes only when the update is elementwise,
which holds for SGD, Adam(W), RMSprop, Adagrad and the like. An update that
reduces over a variable (e.g. a per-layer norm) is refused for a partitioned
variable.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Optional

import numpy as np
import tensorflow as tf

from autodist._tf_compat import eager_snapshot
from autodist.graph_defs import ancestors
from autodist.graph_item import (RESOURCE_WRITES, UPDATE_BY_ROWS, UPDATE_BY_ROWS_AFTER_FIRST,
                                 UPDATE_DENSE, PartUpdate, op_name, tensor_name,
                                 through_identities)
from autodist.kernels import partitioner
from autodist.kernels.row_updates import (DenseUpdate, RowUpdate, RowUpdateAfterFirst, UpdateMode,
                                         mode_of)
from autodist.partition import PartitionPlan

# Ops whose result on a part of a variable is not that part of their result on it.
_NOT_ELEMENTWISE = ("Sum", "Mean", "Max", "Min", "Prod", "EuclideanNorm", "MatMul",
                    "BatchMatMulV2", "Transpose", "Reshape", "ArgMax", "ArgMin", "Cumsum",
                    "Einsum", "Tile", "Reverse", "ReverseV2")

# The check of ``KerasOptimizerCall.update_modes``: a sample part of a table, the rows
# a gradient names in it (one twice: rows 2, 4 and 5 have none), and an iteration
# far from the first (bias corrections, schedules).
_SAMPLE_ROWS = 6
_SAMPLE_IDS = (0, 1, 1, 3)
_UNTOUCHED = np.array([2, 4, 5])
_LATE_ITERATION = 1000

_COMBINES = ("combines the gradients of several variables (global_clipnorm, a "
             "LossScaleOptimizer's finite check)")


@dataclasses.dataclass(frozen=True)
class _Stages:
    common: frozenset
    per_variable: dict   # variable name -> frozenset of op names
    rest: frozenset
    slots: dict          # variable name -> tuple of state placeholder names
    non_slots: tuple     # state placeholder names read by every copy's update


@dataclasses.dataclass(frozen=True)
class GraphInitialValue:
    """The start of optimizer state that has no eager value yet (a ``DeferredVariable``).

    Attributes:
        build: builds the whole starting value in the current graph.
        variable: the eager variable, read (and so given its value) when a
            copy's piece cannot be built on its own.
    """

    build: Callable[[], tf.Tensor]
    variable: tf.Variable

    def piece(self, update: Optional[PartUpdate]) -> Optional[tf.Tensor]:
        """The piece ``update``'s copy holds, built in the graph: the whole value, or a
        part's rows where ``partitioner.part_rows`` can build them alone; else None."""
        whole = self.build()
        if update is None or update.plan is None and update.shard is None:
            return whole
        rows = (None if update.shard is not None
                else partitioner.part_rows(whole, update.plan, update.part))
        return None if rows is None else rows()


class KerasOptimizerCall:
    """The update a Keras optimizer applied in a traced step, lifted into ``graph``.

    Attributes (as ``GraphItem`` reads them):
        graph: the lifted tf.compat.v1 graph.
        grads_and_vars: (gradient, variable) pairs of ``graph``.
        global_step: always None (Keras counts its own iterations).
        update_op_names: every op of the update, the optimizer's state
            placeholders and the train op.
        result_op_name: the op running the whole update (the train op).
        state_bytes: optimizer state placeholder name -> its bytes (``slot_bytes``).
        loss_scale: the lifted variable the step multiplies its loss by before
            the gradients (a ``LossScaleOptimizer``'s scale), or None.
        lazy_refusal: always empty: AutoDist runs its traced update on gathered rows
            (``kernels/row_updates.py``), lazily where the strategy asks.

    Attributes (as ``KerasUpdate`` reads them):
        optimizer_name: the optimizer's class name, for error messages.
        state_values: optimizer state placeholder name -> a function returning its
            starting value (read when needed, not kept).
        variable_names: the updated variables' names.
        gradient_tensors: gradient tensor name -> (variable name, component
            ``dense``/``values``/``indices``/``dense_shape``, dtype).
        update_graph_def: the update's ops, each ``IdentityN`` split.
        nodes: node name -> NodeDef of ``update_graph_def``.
        stages: the update cut into common, per-variable and rest stages.

    Args:
        graph: the lifted graph.
        grads_and_vars: as above.
        update_ops: names of the update's ops in ``graph``.
        state: the optimizer's state in ``graph``: resource placeholder name ->
            a function returning the value it starts from (a numpy array).
        state_bytes: as above.
        result_op_name: the train op's name.
        optimizer_name: for error messages.
        loss_scale: as above.
    """

    global_step = None
    lazy_refusal = ""

    def __init__(self, graph: tf.Graph, grads_and_vars: list, update_ops: frozenset,
                 state: dict, state_bytes: dict, result_op_name: str, optimizer_name: str,
                 loss_scale: Optional[str] = None):
        self.graph = graph
        self.loss_scale = loss_scale
        self.grads_and_vars = grads_and_vars
        self.result_op_name = result_op_name
        self.update_op_names = frozenset(update_ops) | frozenset(state) | {result_op_name}
        self.optimizer_name = optimizer_name
        self.state_values = state
        self.state_bytes = state_bytes
        self.variable_names = [v.op.name for _, v in grads_and_vars]
        self.gradient_tensors = {}
        for grad, variable in grads_and_vars:
            if grad is None:
                continue
            if isinstance(grad, tf.IndexedSlices):
                components = {"values": grad.values, "indices": grad.indices}
                if grad.dense_shape is not None:
                    components["dense_shape"] = grad.dense_shape
            else:
                components = {"dense": grad}
            for key, tensor in components.items():
                self.gradient_tensors[tensor.name] = (variable.op.name, key, tensor.dtype)
        self.update_graph_def = _split_identity_n(_subgraph(graph.as_graph_def(), update_ops))
        self.nodes = {node.name: node for node in self.update_graph_def.node}
        self.stages = self._cut()
        self._update_modes = None

    @property
    def raw_gradients(self) -> dict:
        """Always empty: Keras processes gradients inside its update (``clipnorm``...),
        which ``KerasUpdate`` runs on the averaged gradient."""
        return {}

    def slot_names(self) -> dict:
        """Original slot name -> (its variable's name, slot key)."""
        return {slot: (name, slot) for name, slots in self.stages.slots.items()
                for slot in slots}

    def slot_bytes(self) -> dict:
        """Variable name -> the bytes of its slots."""
        return {name: sum(self.state_bytes[slot] for slot in slots)
                for name, slots in self.stages.slots.items()}

    def non_slot_names(self) -> dict:
        """Original name of each non-slot state variable (iterations) -> its key."""
        return {name: name for name in self.stages.non_slots}

    def hyperparameters(self) -> dict:
        """Key -> starting value of the floating-point non-slot state (the learning
        rate): what every node's update copy starts from its own model."""
        values = {key: self.state_values[key]() for key in self.stages.non_slots}
        return {key: value for key, value in values.items()
                if np.issubdtype(value.dtype, np.floating)}

    def new_update(self, translate=None) -> "KerasUpdate":
        """A fresh copy of the optimizer's state and update for the default graph."""
        del translate  # the update reads only its own state and the gradients
        return KerasUpdate(self)

    @functools.cached_property
    def iteration_key(self) -> Optional[str]:
        """The optimizer's iteration count among its non-slot state (its one integer
        scalar), or None."""
        counts = [key for key in self.stages.non_slots
                  if not isinstance(self.state_values[key], GraphInitialValue)
                  and np.issubdtype(self.state_values[key]().dtype, np.integer)]
        return counts[0] if len(counts) == 1 else None

    def update_modes(self) -> dict:
        """Variable with a sparse gradient -> (how its update runs on each stored copy,
        why it stays dense): by rows where the traced update leaves a row without
        gradient, and its slots, as they are, as its run on sample rows shows
        (``_SampleRowsCheck``). Decided once."""
        if self._update_modes is None:
            sparse = sorted({owner for owner, key, _ in self.gradient_tensors.values()
                             if key == "indices"})
            self._update_modes = _SampleRowsCheck(self, sparse).modes() if sparse else {}
        return self._update_modes

    def _writes(self, names) -> list:
        return [n for n in names if self.nodes[n].op in RESOURCE_WRITES]

    def _target(self, write: str) -> str:
        """The variable (op name) a write op writes."""
        return through_identities(self.nodes, self.nodes[write].input[0])

    def _ancestors(self, names) -> set:
        """Ops of the update that ``names`` depend on, themselves included.

        Control inputs count: a slot's read that follows its write only by a
        control edge (RMSprop reads the velocity it has just assigned) belongs with
        that write, in the same stage, or it reads the slot's old value.
        """
        return ancestors(self.nodes, names, control=True)

    def _reads(self, names) -> set:
        """Op names outside the update that ``names`` read."""
        return {op_name(i) for n in names for i in self.nodes[n].input
                if not i.startswith("^") and op_name(i) not in self.nodes}

    def _cut(self) -> _Stages:
        writes = self._writes(self.nodes)
        targets = {w: self._target(w) for w in writes}
        written_state = {t for t in targets.values() if t in self.state_values}
        slices = {v: self._ancestors([w for w in writes if targets[w] == v])
                  for v in self.variable_names}
        reads = {v: self._reads(ops) for v, ops in slices.items()}
        slots = {}
        for v in self.variable_names:
            others = set().union(*[r for w, r in reads.items() if w != v])
            slots[v] = tuple(sorted(s for s in reads[v] & written_state if s not in others))
        components = {v: slices[v] | self._ancestors([w for w in writes if targets[w] in slots[v]])
                      for v in self.variable_names}
        counts = {}
        for ops in components.values():
            for op in ops:
                counts[op] = counts.get(op, 0) + 1
        common = frozenset(op for op, count in counts.items() if count > 1)
        per_variable = {v: frozenset(ops - common) for v, ops in components.items()}
        # Writes nothing else depends on, and what only they read; ops reaching no
        # write (a gradient's unused identity) are left out.
        rest = frozenset(self._ancestors([w for w in writes if w not in counts]) - set(counts))
        owned = {s for names in slots.values() for s in names}
        non_slots = tuple(sorted(s for s in self.state_values if s not in owned))
        return _Stages(common, per_variable, rest, slots, non_slots)


class KerasUpdate:
    """One copy of a Keras optimizer's state and update in the distributed graph.

    Args:
        call: what the optimizer did in the traced step.

    Attributes:
        initial_values: placeholder tensor name -> a function returning the value
            to feed it at initialization: the starting state held outside the graph.
    """

    def __init__(self, call: KerasOptimizerCall):
        self._call = call
        self._slots = {}      # (stored copy name, slot key) -> variable
        self._non_slots = {}  # key -> variable
        self.initial_values = {}
        self.stand_ins = []  # of the model's variables, in ``apply_alone``

    def slot(self, copy: tf.Variable, key: str) -> Optional[tf.Variable]:
        """The slot ``key`` of the stored copy ``copy``, or None."""
        return self._slots.get((copy.name, key))

    def non_slot_variables(self, graph: tf.Graph) -> dict:
        """Key -> this copy's non-slot state variable (none outside this copy's graph)."""
        return {k: v for k, v in self._non_slots.items() if v.graph is graph}

    def apply(self, updates: list, global_step=None) -> tuple:
        """Updates every ``PartUpdate``'s copy with its mean gradient.

        Returns:
            (the op finishing the whole update, each update's own op, in order)

        Raises:
            NotImplementedError: when the update cannot be computed from what
                this copy holds (see the module's docstring).
        """
        del global_step  # Keras counts its own iterations
        call, stages = self._call, self._call.stages
        with tf.device(updates[0].variable.device):
            for key in stages.non_slots:
                self._non_slots[key] = _state_variable(call.state_values[key], f"{key}/copy",
                                                       self.initial_values)
            state_handles = {key: v.handle for key, v in self._non_slots.items()}
            common = self._import(stages.common, self._common_inputs(updates, state_handles),
                                  "keras_update/common")
        per_variable = [self._apply_part(update, common, state_handles, mode_of(update))
                        for update in updates]

        def no_gradient(name):
            raise NotImplementedError(
                f"{call.optimizer_name}'s update reads the gradient {name} after every "
                "variable's update; AutoDist cannot rewrite that update.")

        rest_inputs = self._inputs(stages.rest, no_gradient, state_handles, common)
        with tf.control_dependencies(per_variable), tf.device(updates[0].variable.device):
            rest = self._import(stages.rest, rest_inputs, "keras_update/rest")
        # A write of the common stage (Nadam's running momentum product) runs once
        # per update, before the per-variable stages (see ``_apply_part``).
        finish = tf.group(*per_variable, *self._writes(rest))
        return finish, per_variable

    def _apply_part(self, update: PartUpdate, common: dict, state_handles: dict,
                    mode: UpdateMode) -> tf.Operation:
        call, stages = self._call, self._call.stages
        ops = stages.per_variable[update.name]
        if update.plan is not None or update.shard is not None:
            reducing = sorted({call.nodes[op].op for op in ops} & set(_NOT_ELEMENTWISE))
            if reducing:
                raise NotImplementedError(
                    f"AutoDist cannot cut '{update.name}' under {call.optimizer_name}: "
                    f"its update is not elementwise (it uses {', '.join(reducing)}); use a "
                    "strategy that keeps the variable whole.")
        return self._import_part(update, common, state_handles, mode)

    def _import_part(self, update: PartUpdate, common: dict, state_handles: dict,
                     mode: UpdateMode) -> tf.Operation:
        """Imports the per-variable stage for ``update``'s copy, run as ``mode`` says."""
        call, stages = self._call, self._call.stages
        ops = stages.per_variable[update.name]
        with tf.device(update.variable.device):
            state = {update.name: update.variable}
            for key in stages.slots[update.name]:
                slot = _state_variable(call.state_values[key], f"{update.variable.op.name}/{key}",
                                       self.initial_values, update)
                self._slots[(update.variable.name, key)] = slot
                state[key] = slot
            graph = tf.compat.v1.get_default_graph()

            def stage(handles: dict, gradient_value) -> list:
                def gradient(name):
                    owner, key, dtype = call.gradient_tensors[name]
                    if owner != update.name:
                        raise NotImplementedError(
                            f"{call.optimizer_name}'s update of '{update.name}' reads the "
                            f"gradient of '{owner}'; AutoDist cannot rewrite that update.")
                    return _component(gradient_value, key, dtype, update.variable)

                inputs = self._inputs(ops, gradient, {**state_handles, **handles}, common, graph)
                return self._writes(self._import(ops, _captured(inputs),
                                                 f"keras_update/{update.variable.op.name}"))

            # The traced step writes the variable after the forward pass has read it;
            # those control edges lead out of the update and are not imported. Writes
            # that do not read the gradient (AdamW's weight decay) would otherwise race
            # the replicas' reads: the stage waits for the mean gradient, which the
            # replicas compute from what they read. It also waits for the common
            # stage's writes, whose state it may read (Nadam's momentum product).
            with tf.control_dependencies(
                    tf.nest.flatten(update.gradient, expand_composites=True)
                    + self._writes(common)):
                return mode.apply(state, update.gradient,
                                  self._non_slots.get(call.iteration_key), stage)

    def apply_alone(self, update: PartUpdate, mode: UpdateMode) -> tf.Operation:
        """Updates ``update``'s copy alone, as ``mode`` says, with the other variables'
        gradients zero where the common stage reads them: the sample run of
        ``_SampleRowsCheck``. The iteration count is left as it is."""
        call, stages = self._call, self._call.stages
        for key in stages.non_slots:
            self._non_slots[key] = _state_variable(call.state_values[key], f"{key}/copy",
                                                   self.initial_values)
        state_handles = {key: v.handle for key, v in self._non_slots.items()}
        read = {op_name(i) for op in stages.per_variable[update.name]
                for i in call.nodes[op].input} & stages.common
        needed = frozenset(ancestors(call.nodes, read, control=True)) & stages.common
        # A variable of the model the update reads (a LossScaleOptimizer's scale) is
        # not in this graph: one starting at 1 stands in.
        for source in {op_name(i) for op in needed | stages.per_variable[update.name]
                       for i in call.nodes[op].input if not i.startswith("^")}:
            if source in call.nodes or source in call.state_values or source in call.variable_names:
                continue
            original = call.graph.get_operation_by_name(source)
            if original.type == "VarHandleOp":
                stand_in = tf.Variable(tf.ones(original.get_attr("shape"),
                                               original.get_attr("dtype")), trainable=False)
                self.stand_ins.append(stand_in)
                state_handles[source] = stand_in.handle
        shapes = {v.op.name: v.shape.as_list() for _, v in call.grads_and_vars}

        def gradient(name):
            owner, key, dtype = call.gradient_tensors[name]
            if owner == update.name:
                return _component(update.gradient, key, dtype, update.variable)
            shape = shapes[owner]
            return {"dense": lambda: tf.zeros(shape, dtype),
                    "values": lambda: tf.zeros([0, *shape[1:]], dtype),
                    "indices": lambda: tf.zeros([0], dtype),
                    "dense_shape": lambda: tf.constant(shape, dtype)}[key]()

        common = self._import(needed, self._inputs(needed, gradient, state_handles, {}),
                              "keras_update/common")
        return self._import_part(update, common, state_handles, mode)

    def _common_inputs(self, updates: list, state_handles: dict) -> dict:
        call = self._call
        by_name = {}
        for update in updates:
            by_name.setdefault(update.name, []).append(update)

        def gradient(name):
            owner, key, dtype = call.gradient_tensors[name]
            parts = by_name.get(owner)
            if parts is None:
                raise NotImplementedError(
                    f"{call.optimizer_name}'s update {_COMBINES}, but '{owner}' is "
                    "updated elsewhere under this strategy; use a strategy whose updates "
                    "all run on one node (all PS or all AllReduce).")
            if any(p.shard is not None for p in parts):
                raise NotImplementedError(
                    f"{call.optimizer_name}'s update {_COMBINES}, but the gradient of "
                    f"'{owner}' is sharded across replicas under this strategy; use a "
                    "strategy that keeps its updates whole.")
            if parts[0].plan is None:
                return _component(parts[0].gradient, key, dtype, parts[0].variable)
            parts = sorted(parts, key=lambda u: u.part)
            if len(parts) != parts[0].plan.num_parts:
                raise NotImplementedError(
                    f"{call.optimizer_name}'s update {_COMBINES}, but the parts of "
                    f"'{owner}' are updated on several nodes under this strategy.")
            # Stitched as the traced update saw it: a sparse gradient stays sparse, as
            # the update may read its indices and values (a dense stitch has neither).
            return _component(partitioner.stitch_gradient([p.gradient for p in parts],
                                                          parts[0].plan), key, dtype, None)

        handles = dict(state_handles)
        for update in updates:
            if update.plan is None and update.shard is None:
                handles[update.name] = update.variable.handle
        return self._inputs(call.stages.common, gradient, handles, {})

    def _inputs(self, ops, gradient, handles: dict, common: dict,
                graph: Optional[tf.Graph] = None) -> dict:
        """The input map of a stage: its outside reads mapped into the distributed graph
        (``graph``, by default the current one)."""
        call = self._call
        graph = graph or tf.compat.v1.get_default_graph()
        mapped = {}
        for node_name in ops:
            for inp in call.nodes[node_name].input:
                source = op_name(inp)
                if inp.startswith("^") or source in ops:
                    continue
                name = tensor_name(inp)
                if name in mapped:
                    continue
                if source in common:
                    mapped[name] = common[source].outputs[int(name.split(":")[1])]
                elif name in call.gradient_tensors:
                    mapped[name] = gradient(name)
                elif source in handles:
                    mapped[name] = handles[source]
                elif source in call.state_values or source in call.variable_names:
                    raise NotImplementedError(
                        f"{call.optimizer_name}'s update reads '{source}' in a way AutoDist "
                        "cannot give every stored copy its own; it cannot rewrite it.")
                else:  # a shared tensor of the lifted graph, imported under its name
                    mapped[name] = graph.get_tensor_by_name(name)
        return mapped

    def _import(self, ops, input_map: dict, scope: str) -> dict:
        """Imports the stage's ops; returns op name -> the op in the new graph."""
        if not ops:
            return {}
        graph_def = _subgraph(self._call.update_graph_def, ops)
        names = [node.name for node in graph_def.node]
        imported = tf.graph_util.import_graph_def(graph_def, input_map=input_map,
                                                  return_elements=names, name=scope)
        return dict(zip(names, imported))

    def _writes(self, imported: dict) -> list:
        """The write ops among an imported stage's ops."""
        return [op for name, op in imported.items()
                if self._call.nodes[name].op in RESOURCE_WRITES]


class _SampleRowsCheck:
    """Decides how the update of each variable with a sparse gradient runs, from the
    traced update run on sample rows.

    Per variable: its first ``_SAMPLE_ROWS`` rows (random values), its slots' starting
    rows and the optimizer's real non-slot state, held twice: one copy updated dense,
    one by rows. A gradient names rows ``_SAMPLE_IDS``; the rows it does not name must
    stay bitwise as they were, and finite, in the table and every slot, and the copy
    updated by rows must equal the dense one bitwise. Both from the starting state and
    from the state two updates of every row reached (Adam's zero moments decay to zero:
    only a reached state shows them move), at the first iteration and a late one.

    Outcome: by rows where everything holds; by rows after the first step where only
    the first step moves untouched rows (Keras's FTRL) and a third copy, run as
    ``RowUpdateAfterFirst`` in chunks of 2 rows, equals the dense one bitwise at the
    first iteration; else dense.
    """

    def __init__(self, call: KerasOptimizerCall, names: list):
        self._call, self._names = call, names

    def modes(self) -> dict:
        """Variable name -> (update mode, why it is dense)."""
        modes, samples, feeds = {}, {}, {}
        graph = tf.Graph()
        with graph.as_default():
            for name in self._names:
                try:
                    samples[name] = _Sample(self._call, name, feeds)
                except (NotImplementedError, ValueError, TypeError, KeyError) as err:
                    # KeyError: the update reads a tensor of the model (a loss scale).
                    modes[name] = (UPDATE_DENSE, _cannot_sample(err))
            # Only the samples built whole: a failed one may lack its starting values.
            initialize = tf.compat.v1.variables_initializer(
                [v for sample in samples.values() for v in sample.variables])
        with tf.compat.v1.Session(graph=graph) as session:
            session.run(initialize, {name: value() for name, value in feeds.items()})
            for name, sample in samples.items():
                try:
                    modes[name] = sample.decide(session)
                except tf.errors.OpError as err:
                    modes[name] = (UPDATE_DENSE, _cannot_sample(err))
        return modes


class _Sample:
    """One variable's sample rows, updated dense and by rows (see ``_SampleRowsCheck``)."""

    def __init__(self, call: KerasOptimizerCall, name: str, feeds: dict):
        variable = next(v for _, v in call.grads_and_vars if v.op.name == name)
        shape = variable.shape.as_list()
        if None in shape or shape[0] < _SAMPLE_ROWS:
            raise ValueError(f"it has fewer than {_SAMPLE_ROWS} rows")
        self._call = call
        self._dtype = variable.dtype.base_dtype
        self._ids = tf.compat.v1.placeholder(tf.int64, [None])
        self._values = tf.compat.v1.placeholder(self._dtype, [None, *shape[1:]])
        gradient = tf.IndexedSlices(self._values, self._ids,
                                    tf.constant([_SAMPLE_ROWS, *shape[1:]], tf.int64))
        plan = PartitionPlan(0, (_SAMPLE_ROWS, shape[0] - _SAMPLE_ROWS), tuple(shape))
        self._copies = []
        modes = [DenseUpdate(), RowUpdate()]
        if call.iteration_key is not None:  # the first step in chunks of 2 of the 6 rows
            modes.append(RowUpdateAfterFirst(chunk_rows=2))
        for mode in modes:
            update = KerasUpdate(call)
            table = tf.Variable(tf.zeros([_SAMPLE_ROWS, *shape[1:]], self._dtype),
                                name=f"{name}/sample")
            finish = update.apply_alone(PartUpdate(gradient, table, name, 0, plan), mode)
            feeds.update(update.initial_values)
            state = ([table] + [update.slot(table, key) for key in call.stages.slots[name]]
                     + [update.non_slot_variables(tf.compat.v1.get_default_graph())[key]
                        for key in call.stages.non_slots])
            self._copies.append(_SampleCopy(state, finish, update.stand_ins))
        self.variables = [v for copy in self._copies for v in copy.variables + copy.stand_ins]
        self._rows_like = [i for i, v in enumerate(self._copies[0].variables)
                           if v.shape.rank and v.shape[0] == _SAMPLE_ROWS]
        iteration = call.iteration_key
        self._iteration = (None if iteration is None else
                           1 + len(call.stages.slots[name]) + call.stages.non_slots.index(iteration))

    def decide(self, session: tf.compat.v1.Session) -> tuple:
        """(update mode, why it is dense), from runs of its copies in ``session``."""
        rng = np.random.default_rng(0)
        dense, rows, *after_first = self._copies

        def gradient(ids):
            values = rng.normal(size=(len(ids), *self._values.shape[1:]))
            return {self._ids: np.array(ids),
                    self._values: values.astype(self._dtype.as_numpy_dtype)}

        start = dense.read(session)
        start[0] = (0.5 * rng.normal(size=start[0].shape)).astype(start[0].dtype)
        dense.write(session, start)
        for _ in range(2):
            session.run(dense.finish, gradient(range(_SAMPLE_ROWS)))
        reached = dense.read(session)
        iterations = (None,) if self._iteration is None else (0, _LATE_ITERATION)
        outcome = {}  # (state, iteration) -> (untouched rows moved, by rows == dense)
        first_step_same = True  # RowUpdateAfterFirst == dense at iteration 0
        for label, state in (("start", start), ("reached", reached)):
            for iteration in iterations:
                if iteration is not None:
                    state = list(state)
                    state[self._iteration] = np.array(iteration, state[self._iteration].dtype)
                for copy in self._copies:
                    copy.write(session, state)
                session.run([copy.finish for copy in self._copies], gradient(_SAMPLE_IDS))
                after, by_rows = dense.read(session), rows.read(session)
                moved = any(not np.array_equal(after[i][_UNTOUCHED], state[i][_UNTOUCHED])
                            or not np.isfinite(after[i]).all() for i in self._rows_like)
                same = all(np.array_equal(after[i], by_rows[i]) for i in self._rows_like)
                outcome[label, iteration] = (moved, same)
                if iteration == 0:
                    first = after_first[0].read(session)
                    first_step_same &= all(np.array_equal(after[i], first[i])
                                           for i in self._rows_like)
        if all(not moved and same for moved, same in outcome.values()):
            return UPDATE_BY_ROWS, ""
        if (self._iteration is not None and first_step_same
                and all(outcome["reached", iteration] == (False, True) for iteration in iterations)):
            return UPDATE_BY_ROWS_AFTER_FIRST, ""
        if any(moved for moved, _ in outcome.values()):
            return UPDATE_DENSE, (f"{self._call.optimizer_name}'s update changes rows that have "
                                  "no gradient: moments that decay, or weight decay")
        return UPDATE_DENSE, (f"{self._call.optimizer_name}'s update of the touched rows "
                              "alone differs from its update of the whole table")


class _SampleCopy:
    """A copy of a sample's state (table, slots, non-slot state) and its update."""

    def __init__(self, variables: list, finish: tf.Operation, stand_ins: list):
        self.variables, self.finish, self.stand_ins = variables, finish, stand_ins
        self._feeds = [tf.compat.v1.placeholder(v.dtype.base_dtype, v.shape) for v in variables]
        self._assign = tf.group(*[v.assign(f) for v, f in zip(variables, self._feeds)])
        self._reads = [v.read_value() for v in variables]

    def read(self, session) -> list:
        return session.run(self._reads)

    def write(self, session, values: list) -> None:
        session.run(self._assign, dict(zip(self._feeds, values)))


def _cannot_sample(error: Exception) -> str:
    # An OpError's cause is its last line of its own (after the stack, before [[node]]).
    lines = [line for line in str(error).splitlines() if line.strip()
             and not line.startswith((" ", "\t", "[[")) and not line.rstrip().endswith(":")]
    message = lines[-1] if lines else ""
    return f"its update could not run on sample rows ({type(error).__name__}: {message[:200]})"


def _state_variable(value_of, name: str, feeds: dict,
                    update: Optional[PartUpdate] = None) -> tf.Variable:
    """A variable of the optimizer's state starting at the value ``value_of`` returns
    (or a ``GraphInitialValue`` builds), or at the piece of it that ``update``'s copy
    holds (its part, its shard).

    A non-zero start is fed at initialization (``feeds``: placeholder name -> a
    function returning it), not held in the graph.
    """
    name = name.replace(":", "_")
    if isinstance(value_of, GraphInitialValue):
        start = value_of.piece(update)
        if start is not None:
            return tf.Variable(start, trainable=False, name=name)
        value_of = functools.partial(eager_snapshot, value_of.variable)
    value = _piece(value_of(), update)
    if not value.any():
        return tf.Variable(tf.zeros(value.shape, value.dtype), trainable=False, name=name)
    initial = tf.compat.v1.placeholder(value.dtype, value.shape,
                                       name=f"{name}/initial_value_feed")
    feeds[initial.name] = lambda: _piece(value_of(), update)
    return tf.Variable(initial, trainable=False, name=name)


def _piece(value: np.ndarray, update: Optional[PartUpdate]) -> np.ndarray:
    """The piece of an optimizer state's value that ``update``'s copy holds."""
    if update is not None and update.plan is not None:
        value = np.split(value, np.cumsum(update.plan.sizes)[:-1],
                         axis=update.plan.axis)[update.part]
    if update is not None and update.shard is not None:
        offset, size = update.shard
        value = value.reshape(-1)[offset:offset + size]
        value = np.pad(value, (0, size - len(value)))
    return value


def _captured(inputs: dict) -> dict:
    """``inputs`` usable in the current graph: inside a branch of a ``tf.cond``,
    ``import_graph_def`` takes only that branch's tensors, so the outer ones are
    captured into it."""
    graph = tf.compat.v1.get_default_graph()
    return {name: t if t.graph is graph else tf.identity(t) for name, t in inputs.items()}


def _component(gradient, key: str, dtype: tf.DType, variable: Optional[tf.Variable]
               ) -> tf.Tensor:
    """One tensor of a synchronized gradient, in the dtype the traced update reads."""
    if key == "dense":
        tensor = tf.convert_to_tensor(gradient)
    else:
        gradient = partitioner.as_indexed_slices(gradient)  # one synchronized dense
        if key == "dense_shape" and gradient.dense_shape is None:
            tensor = tf.shape(variable, out_type=dtype)
        else:
            tensor = getattr(gradient, key)
    # The synchronizers carry indices as int64; a traced update may read int32.
    return tensor if tensor.dtype == dtype else tf.cast(tensor, dtype)


def _subgraph(graph_def, keep) -> tf.compat.v1.GraphDef:
    """GraphDef of the nodes in ``keep``, unplaced; control inputs from outside dropped."""
    out = tf.compat.v1.GraphDef()
    out.versions.CopyFrom(graph_def.versions)
    out.library.CopyFrom(graph_def.library)
    for node in graph_def.node:
        if node.name not in keep:
            continue
        new = out.node.add()
        new.CopyFrom(node)
        new.device = ""
        if "_class" in new.attr:
            del new.attr["_class"]
        del new.input[:]
        new.input.extend(i for i in node.input
                         if not (i.startswith("^") and op_name(i) not in keep))
    return out


def _split_identity_n(graph_def) -> tf.compat.v1.GraphDef:
    """One ``Identity`` per output of every ``IdentityN``.

    Keras passes all gradients through one ``IdentityN``; split, each variable's
    gradient has its own op, so that the variable's update stands alone.
    """
    out = tf.compat.v1.GraphDef()
    out.versions.CopyFrom(graph_def.versions)
    out.library.CopyFrom(graph_def.library)
    renamed, controls_of = {}, {}
    for node in graph_def.node:
        if node.op != "IdentityN":
            continue
        data = [i for i in node.input if not i.startswith("^")]
        controls_of[node.name] = [f"^{node.name}/split_{k}" for k in range(len(data))]
        for k in range(len(data)):
            renamed[f"{node.name}:{k}"] = f"{node.name}/split_{k}:0"
        renamed[node.name] = f"{node.name}/split_0:0"
    for node in graph_def.node:
        if node.op == "IdentityN":
            controls = [i for i in node.input if i.startswith("^")]
            data = [i for i in node.input if not i.startswith("^")]
            for k, inp in enumerate(data):
                new = out.node.add()
                new.name, new.op = f"{node.name}/split_{k}", "Identity"
                new.input.extend([inp] + controls)
                new.attr["T"].type = node.attr["T"].list.type[k]
            continue
        new = out.node.add()
        new.CopyFrom(node)
        del new.input[:]
        for inp in node.input:
            if inp.startswith("^") and inp[1:] in controls_of:
                new.input.extend(controls_of[inp[1:]])
            else:
                new.input.append(renamed.get(inp, inp))
    return out
