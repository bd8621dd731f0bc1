"""GraphItem: the user's single-device graph plus what AutoDist learned about it."""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import warnings
from typing import Dict, Iterable, List, Optional, Sequence

import numpy as np
import tensorflow as tf
from google.protobuf import message as protobuf_message

from autodist.cross_replica import FIRST_ROW, is_cross_replica_sum, marked
from autodist.gradient_seeds import gradient_seeds
from autodist.graph_defs import ancestors, data_inputs, op_name, tensor_name


# How an optimizer's update runs on a variable with a sparse gradient
# (``VariableInfo.update_mode``; the kinds are ``kernels/row_updates.py``'s modes).
UPDATE_DENSE = "dense"  # on every row, as on one device
UPDATE_BY_ROWS = "by rows"  # on the rows the step's gradient names, exactly
UPDATE_BY_ROWS_AFTER_FIRST = "by rows after the first step"  # every row at the first
UPDATE_BY_ROWS_LAZY = "by rows, lazy"  # by rows, as asked, where that is not exact
UPDATES_BY_ROWS = frozenset({UPDATE_BY_ROWS, UPDATE_BY_ROWS_AFTER_FIRST, UPDATE_BY_ROWS_LAZY})
"""The modes that run the update on the touched rows alone (after the first step)."""


@dataclasses.dataclass(frozen=True)
class VariableInfo:
    """A trainable variable as the builders and kernels see it.

    Attributes:
        name: variable op name without output index, e.g. ``"dense/kernel"``.
        shape: full static shape.
        dtype: numpy dtype name of the variable, e.g. ``"float32"``.
        sparse_grad: whether its gradient is an IndexedSlices (embedding lookups).
        has_grad: whether the optimizer receives a gradient for it.
        ready_rank: when its gradient is ready in the backward pass, as a rank
            among the variables with a gradient (0: first); all-reduce buckets
            are filled in this order. Equal ranks keep the variables' order.
        read_whole: whether an op of the model reads its whole value; False
            when it only gathers rows of it (``VariableReads``), so that a
            step reads the rows it touches wherever the variable is stored.
        needs_stitching: whether an op reads its whole value as one tensor;
            False when it only gathers rows of it or multiplies by it, so that
            a partitioned variable needs no stitched copy.
        updates_rows: whether the optimizer's update writes only the rows its
            sparse gradient names (a scatter, as SGD's; Adam's writes every
            row), so that a copy of the variable stays in step by those rows.
        rows_gathered: rows (with repeats) one replica's step gathers through
            ids of a fixed shape (a position table's ``range(length)``).
        rows_gathered_per_example: rows it gathers per example through ids
            with a batch dimension (8 for ids of shape ``[batch, 8]``). With
            neither known, one per example (see ``rows_touched``).
        slot_bytes: bytes of its optimizer slots (Adam's two moments: twice
            its own), which live wherever its update runs.
        update_mode: with a sparse gradient, how its update runs (``UPDATE_*``):
            on the rows the step touched where that is exact, else dense (or,
            where the strategy asks, lazily by rows: ``compile_strategy``).
        update_note: why the update stays dense, where it could not go by rows
            (and, for a lazy one, what that changes).
        lazy_refusal: with a sparse gradient, why its update cannot run lazily by
            rows (``lazy_row_update``), or empty.
    """

    name: str
    shape: tuple
    dtype: str
    sparse_grad: bool = False
    has_grad: bool = True
    ready_rank: int = 0
    read_whole: bool = False
    needs_stitching: bool = False
    updates_rows: bool = False
    rows_gathered: int = 0
    rows_gathered_per_example: int = 1
    slot_bytes: int = 0
    update_mode: str = ""
    update_note: str = ""
    lazy_refusal: str = ""

    def rows_touched(self, batch_size: int) -> int:
        """Rows one replica's step looks up (repeats counted, at most every row) with
        ``batch_size`` examples: what its sparse gradient and its gathers carry."""
        rows = self.rows_gathered + self.rows_gathered_per_example * batch_size
        return min(rows, int(self.shape[0])) if self.shape else rows

    @property
    def num_elements(self) -> int:
        count = 1
        for dim in self.shape:
            count *= int(dim)
        return count

    @property
    def size_bytes(self) -> int:
        return self.num_elements * np.dtype(self.dtype).itemsize


# Constants this large are weights built from arrays: said once, with the way out.
LARGE_CONSTANTS_BYTES = 64 * 2 ** 20
_BATCHED_INPUT_OPS = ("Placeholder", "PlaceholderWithDefault")
_UNSTABLE_ATTRS = ("value", "seed", "seed2")
_PER_REPLICA_INPUT_OPS = ("IteratorGetNext", "IteratorGetNextSync")


@dataclasses.dataclass(frozen=True)
class PartUpdate:
    """One stored copy of a variable (or of one of its parts) and its synchronized gradient.

    The optimizer call of a graph (``OptimizerCall`` for ``tf.compat.v1``
    optimizers, ``KerasOptimizerCall`` for Keras 3 ones) turns these into update
    ops through ``new_update(translate).apply(updates, global_step)``.

    Attributes:
        gradient: the mean gradient of this copy (a Tensor or IndexedSlices).
        variable: the stored copy to update.
        name: the original variable's name.
        part: which part of the variable this is (0 when it is whole).
        plan: how the variable is cut (a ``PartitionPlan``), or None when whole.
        shard: ``(offset, size)``: the copy holds ``size`` elements of the
            flattened part from ``offset`` on (the last shard padded with zeros
            past the part's end), or None when it holds the whole part.
        update_mode: how its update runs (``VariableInfo.update_mode`` as the
            strategy compiled it); empty: dense.
    """

    gradient: object
    variable: tf.Variable
    name: str
    part: int = 0
    plan: Optional[object] = None
    shard: Optional[tuple] = None
    update_mode: str = ""


@dataclasses.dataclass(frozen=True)
class RowGather:
    """A read of some rows of a trainable variable, along axis 0.

    ``ResourceGather(variable, ids)`` (``tf.gather`` of a resource variable), or
    ``GatherV2(ReadVariableOp(variable), ids, axis=0)`` (Keras's ``Embedding``),
    neither with batch dimensions: the rows of a partitioned variable can come
    from the parts owning them, with no read of the whole value.

    Attributes:
        gather: the gathering op; its first output holds the rows.
        read: the ``ReadVariableOp`` a ``GatherV2`` gathers from, or None.
    """

    gather: str
    read: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class PartProduct:
    """A matrix product with a trainable variable's whole value as one factor.

    ``MatMul(a, ReadVariableOp(variable))``, ``MatMul(ReadVariableOp(variable), b)``
    or ``BatchMatMulV2`` of the same, either factor transposed: a partitioned
    variable's product can be summed or joined from products with its parts,
    with no op holding the whole value (``partitioner.PartProducts``).

    Attributes:
        matmul: the product's op.
        read: the ``ReadVariableOp`` it multiplies by.
        factor: which of its inputs the variable is (0 or 1).
    """

    matmul: str
    read: str
    factor: int


@dataclasses.dataclass(frozen=True)
class VariableReads:
    """How the replicated graph reads one trainable variable.

    Attributes:
        gathers: its ``RowGather`` reads.
        products: its ``PartProduct`` reads.
        unused: ``ReadVariableOp`` s whose value no op uses; only control edges
            wait for them (a traced step's ordering of reads before writes).
        whole: whether some other op reads its whole value in one tensor (a
            loop taking its handle, an elementwise op).
        waiting: op name -> the ops of ``gathers``, ``products`` and ``unused``
            it has control edges on.
    """

    gathers: tuple = ()
    products: tuple = ()
    unused: tuple = ()
    whole: bool = False
    waiting: dict = dataclasses.field(default_factory=dict)


def gradient_ref(grad) -> "GradientRef":
    """The names of a gradient's tensors (a Tensor or IndexedSlices)."""
    if isinstance(grad, tf.IndexedSlices):
        shape = grad.dense_shape.name if grad.dense_shape is not None else None
        return GradientRef(grad.values.name, grad.indices.name, shape)
    return GradientRef(grad.name)


@dataclasses.dataclass(frozen=True)
class GradientProcessing:
    """What one optimizer call does to its gradients between ``compute_gradients``
    and ``apply_gradients`` (clipping by global norm, scaling, any function).

    The distributed graph runs these ops once, on the averaged gradients, as
    single-device training runs them on the batch's gradient.

    Attributes:
        ops: names of the processing's ops in the original graph.
        raw: variable name -> its gradient as ``compute_gradients`` returned it.
        applied: variable name -> the processed gradient ``apply_gradients`` got.
    """

    ops: frozenset
    raw: dict
    applied: dict


@dataclasses.dataclass(frozen=True)
class GradientRef:
    """Names of a gradient's tensors in the original graph.

    A dense gradient has ``values`` only; an IndexedSlices gradient also has
    ``indices`` and, usually, ``dense_shape``.

    ``same_rows`` marks an IndexedSlices gradient whose indices every replica
    computes alike, whatever its rows (a position table looked up at
    ``range(sequence_length)``). Single-device training on the global batch
    gets those indices once, with the batch's values summed per index; so the
    replicas' gradients are synchronized as dense tensors (summed row by row),
    not gathered side by side, where an update squaring each gathered row
    (Adam, RMSprop) would square every replica's share apart.
    """

    values: str
    indices: Optional[str] = None
    dense_shape: Optional[str] = None
    same_rows: bool = False

    @property
    def sparse(self) -> bool:
        """Whether the graph computes it as an IndexedSlices."""
        return self.indices is not None

    @property
    def synchronized_sparse(self) -> bool:
        """Whether the replicas' gradients are synchronized as IndexedSlices."""
        return self.sparse and not self.same_rows


class GraphItem:
    """The user's single-device graph, analysed once for the builders and kernels.

    Ops fall into three sets:

    * excluded: the trainable variables themselves, their initialisers and the
      optimizer's update stage. Kernels recreate these per strategy.
    * replicated: everything that depends on a batched input, a per-replica input
      (``IteratorGetNext``) or a trainable variable: the forward and backward pass.
    * shared: the rest (placeholders, non-trainable variables, initial values,
      input pipelines), kept once.

    Args:
        graph: the user's graph.
        optimizer_calls: what the optimizers were asked to apply while building
            it, one call per ``apply_gradients``: each has its graph,
            ``grads_and_vars``, ``global_step``, ``update_op_names``,
            ``result_op_name``, and ``slot_names()``, ``non_slot_names()`` and
            ``new_update(translate)`` for the distributed graph. Each call is
            synchronized and applied on its own, so that the graph may run
            them in separate train ops (a GAN's generator and discriminator).
        state_per_node: whether each node of a cluster keeps its own copy of the
            non-trainable variables (see ``KernelContext.state_per_node``).
        initial_values: placeholder tensor name -> a function returning the value
            to feed it when the variables are initialized: initial values held
            outside the graph (read when needed, not kept).

    Attributes:
        table_initializers: names of the ops initializing the graph's lookup tables.
        accumulation_steps: runs of the train op whose gradients one update
            applies (``AutoDist(accumulation_steps=...)``); 1 by default.
        gradients: variable name -> its gradient as the replicas compute it
            (before any processing the user applied).
        call_of: variable name -> the index of the optimizer call updating it.
        processing: optimizer call index -> its ``GradientProcessing``, for the
            calls that process their gradients before applying them.
        update_state: optimizer call index -> the non-trainable variables its
            update writes (a global step, a loss scale).
        read_by_control_flow: trainable variables whose handle a traced
            ``tf.while_loop`` or ``tf.cond`` takes (TensorFlow runs it where the
            variable is stored).
        reads: trainable variable name -> its ``VariableReads``.
        batch_totals: names of the sums over the batch a loss is normalized by
            (``_batch_totals``), which each replica takes as the whole step's.
        rows_multiplied: names of the forward pass's matrix products of two tensors
            of the batch's rows (``_rows_multiplied``: in-batch negatives).
        cross_replica_sums: names of the ops marked as sums over every replica
            (``cross_replica``: a synchronized batch normalization's statistics),
            in the graph's order (the forward pass's first).
        loss_scale_reads: names of the reads of a loss scale (the variable an
            optimizer call's loss is multiplied by before the gradients,
            ``loss_scale``) outside the update: shared ops, whose consumers are
            all replicated.
        gradient_seeds: the constants the gradients of the optimizer calls without
            a loss scale are linear in (``gradient_seeds.gradient_seeds``), or
            none: shared ops, whose consumers are all replicated.

    Raises:
        ValueError: when the graph has no captured optimizer call, or a variable
            gets a gradient from two calls.
    """

    def __init__(self, graph: tf.Graph, optimizer_calls: Sequence,
                 state_per_node: bool = False, initial_values: Optional[dict] = None):
        if not optimizer_calls:
            raise ValueError(
                "AutoDist found no optimizer in the graph: build the model and call a "
                "tf.compat.v1.train optimizer's minimize() or apply_gradients() inside "
                "ad.scope().")
        self.graph = graph
        self.optimizer_calls = tuple(optimizer_calls)
        self.update_op_names = frozenset().union(
            *(call.update_op_names for call in self.optimizer_calls))
        self.state_per_node = state_per_node
        self.initial_values = dict(initial_values or {})
        self.accumulation_steps = 1
        self.graph_def = _graph_def(graph)
        _warn_of_large_constants(self.graph_def)
        self._nodes = {node.name: node for node in self.graph_def.node}
        # Lookup tables are read-only state: every node initializes its own copy.
        self.table_initializers = tuple(
            op.name for op in graph.get_collection(tf.compat.v1.GraphKeys.TABLE_INITIALIZERS))
        with graph.as_default():
            self._trainables = [v for v in tf.compat.v1.trainable_variables()
                                if v.op.name not in self.update_op_names]
            trainable_names = {v.op.name for v in self._trainables}
            self.other_variables = [
                v for v in tf.compat.v1.global_variables() + tf.compat.v1.local_variables()
                if v.op.name not in self.update_op_names
                and v.op.name not in trainable_names]
        self.gradients = {}
        self.call_of = {}  # variable name -> index of the call applying its gradient
        for index, call in enumerate(self.optimizer_calls):
            for grad, var in call.grads_and_vars:
                if grad is None:
                    continue
                name = var.op.name
                if name in self.call_of:
                    raise ValueError(
                        f"AutoDist: variable '{name}' is updated by two optimizer calls "
                        f"(apply_gradients #{self.call_of[name] + 1} and #{index + 1}); each "
                        "variable must be updated by one optimizer (their states and "
                        "synchronizations would race).")
                self.call_of[name] = index
                # What the replicas compute and the kinds average: the raw gradient.
                self.gradients[name] = gradient_ref(call.raw_gradients.get(name, grad))
        self.variables = {v.op.name: v for v in self._trainables}
        self.update_state = self._update_state()
        self.loss_scale_reads = self._loss_scale_reads()
        self.gradient_seeds = self._gradient_seeds()
        self.read_by_control_flow = self._read_by_control_flow()
        self._classify_ops()
        self.batch_totals = self._batch_totals()
        self.cross_replica_sums = tuple(
            node.name for node in self.graph_def.node if is_cross_replica_sum(node))
        self.rows_multiplied = self._rows_multiplied()
        self._mark_same_rows()
        self.reads = self._variable_reads()
        ranks = self._ready_ranks()
        updates_rows = self._updated_by_rows()
        update_modes = self._update_modes(updates_rows)
        slot_bytes = self._slot_bytes()
        self.trainable_variables = [
            VariableInfo(name=v.op.name, shape=tuple(v.shape.as_list()),
                         dtype=v.dtype.base_dtype.name,
                         sparse_grad=self.gradients.get(
                             v.op.name, GradientRef("")).synchronized_sparse,
                         has_grad=v.op.name in self.gradients,
                         ready_rank=ranks.get(v.op.name, 0),
                         read_whole=(self.reads[v.op.name].whole
                                     or bool(self.reads[v.op.name].products)),
                         needs_stitching=self.reads[v.op.name].whole,
                         updates_rows=(v.op.name in updates_rows
                                       or update_modes.get(v.op.name, {}).get("update_mode")
                                       == UPDATE_BY_ROWS),
                         slot_bytes=slot_bytes.get(v.op.name, 0),
                         **update_modes.get(v.op.name, {}),
                         **self._rows_gathered(self.reads[v.op.name]))
            for v in self._trainables]
        # optimizer call index -> its gradient processing, where it has one
        self.processing = {index: self._processing(call)
                           for index, call in enumerate(self.optimizer_calls)
                           if call.raw_gradients}

    def _slot_bytes(self) -> Dict[str, int]:
        """Trainable variable name -> the bytes of its optimizer slots."""
        return {name: size for call in self.optimizer_calls
                for name, size in call.slot_bytes().items()}

    def _update_state(self) -> Dict[int, frozenset]:
        """Optimizer call index -> the non-trainable variables its update writes."""
        nodes = self._nodes
        others = {v.op.name for v in self.other_variables}
        written = {}
        for index, call in enumerate(self.optimizer_calls):
            names = set()
            for name in call.update_op_names:
                node = nodes.get(name)
                if node is None or node.op not in RESOURCE_WRITES:
                    continue
                target = through_identities(nodes, node.input[0])
                if target in others:
                    names.add(target)
            written[index] = frozenset(names)
        return written

    def _read_by_control_flow(self) -> frozenset:
        """Trainable variables whose handle a traced loop or cond takes (an LSTM's kernels)."""
        sources = {through_identities(self._nodes, inp) for node in self.graph_def.node
                   if node.op in FUNCTIONAL_CONTROL_FLOW
                   for inp in node.input if not inp.startswith("^")}
        return frozenset(sources & set(self.variables))

    def _variable_reads(self) -> Dict[str, VariableReads]:
        """Each trainable variable's ``VariableReads``, from its consumers in the replicated graph."""
        nodes = self._nodes
        data, control = {}, {}  # op name -> replicated ops using its output / waiting for it
        for node in self.graph_def.node:
            if node.name not in self.replicated:
                continue
            for inp in node.input:
                users = control if inp.startswith("^") else data
                users.setdefault(op_name(inp), []).append(node)
        reads = {}
        for name in self.variables:
            gathers, products, unused = [], [], []
            whole = bool(control.get(name))
            for user in data.get(name, []):
                if user.op == "ResourceGather" and not _batch_dims(user):
                    gathers.append(RowGather(user.name))
                elif user.op == "ReadVariableOp" and not data.get(user.name):
                    unused.append(user.name)
                elif user.op == "ReadVariableOp":
                    readers = data[user.name]
                    factors = [self._factor_of(r, user.name) for r in readers]
                    if all(f is not None or _gathers_rows(nodes, r, user.name)
                           for r, f in zip(readers, factors)):
                        for reader, factor in zip(readers, factors):
                            if factor is not None:
                                products.append(PartProduct(reader.name, user.name, factor))
                            else:
                                gathers.append(RowGather(reader.name, user.name))
                    else:
                        whole = True
                else:
                    whole = True
            waited = ({g.gather for g in gathers} | {g.read for g in gathers if g.read}
                      | {p.matmul for p in products} | {p.read for p in products} | set(unused))
            waiting = {}
            for op in sorted(waited):
                for node in control.get(op, []):
                    waiting.setdefault(node.name, []).append(op)
            reads[name] = VariableReads(tuple(gathers), tuple(products), tuple(unused), whole,
                                        {k: tuple(v) for k, v in waiting.items()})
        return reads

    def _factor_of(self, node, read: str) -> Optional[int]:
        """Which factor of ``node`` ``read`` (a matrix) is, if ``node`` is a matrix
        product with it as one factor only, the other of known rank (a product with
        parts slices it); else None."""
        if node.op not in _PRODUCTS:
            return None
        inputs = [op_name(i) for i in node.input if not i.startswith("^")][:2]
        if inputs.count(read) != 1:
            return None
        factor = inputs.index(read)
        factors = self.graph.get_operation_by_name(node.name).inputs
        if factors[factor].shape.rank != 2 or factors[1 - factor].shape.rank is None:
            return None
        return factor

    def _rows_gathered(self, reads: "VariableReads") -> Dict[str, int]:
        """``VariableInfo``'s row counts, from the static shapes of a variable's gathered ids.

        A leading dimension left free counts per example; ids of unknown rank,
        or a free inner dimension, count one row per example, as does a
        variable no gather reads (a sparse gradient from another op).
        """
        fixed, per_example = 0, 0
        for gather in reads.gathers:
            shape = self.graph.get_operation_by_name(gather.gather).inputs[1].shape
            dims = shape.as_list() if shape.rank is not None else [None, None]
            if None not in dims:
                fixed += math.prod(dims)
            elif dims[0] is None and None not in dims[1:]:
                per_example += math.prod(dims[1:])
            else:
                per_example += 1
        if not reads.gathers:
            per_example = 1
        return {"rows_gathered": fixed, "rows_gathered_per_example": per_example}

    def _updated_by_rows(self) -> frozenset:
        """Variables synchronized as IndexedSlices whose update only scatters into them.

        Judged from the single-device update's ops on the variable's handle:
        reads, and writes at the gradient's rows (``ResourceScatter*``,
        ``ResourceSparseApply*``); any other write (an assign of the whole
        value, a dense apply) changes rows the gradient does not name.
        """
        sparse = {name for name, ref in self.gradients.items() if ref.synchronized_sparse}
        writes = {name: [] for name in sparse}
        for name in self.update_op_names:
            node = self._nodes.get(name)
            if node is None or not node.input:
                continue
            target = through_identities(self._nodes, node.input[0])
            if target in writes and node.op not in _READS:
                writes[target].append(node.op)
        return frozenset(name for name, ops in writes.items()
                         if ops and all(op.startswith(_ROW_WRITES) for op in ops))

    def _update_modes(self, updates_rows: frozenset) -> Dict[str, dict]:
        """Variable with a sparse gradient -> its ``VariableInfo`` fields ``update_mode``,
        ``update_note`` and ``lazy_refusal``.

        An optimizer call that decides (a Keras optimizer, from its traced update)
        says; for the others the update's own writes tell: by rows when they
        scatter (``tf.compat.v1``'s sparse kernels), else dense.
        """
        modes = {name: (UPDATE_BY_ROWS, "") if name in updates_rows
                 else (UPDATE_DENSE, "its update writes every row")
                 for name, ref in self.gradients.items() if ref.synchronized_sparse}
        for call in self.optimizer_calls:
            modes.update({name: mode for name, mode in call.update_modes().items()
                          if name in modes})
        return {name: {"update_mode": mode, "update_note": note,
                       "lazy_refusal": self.optimizer_calls[self.call_of[name]].lazy_refusal}
                for name, (mode, note) in modes.items()}

    def _loss_scale_reads(self) -> frozenset:
        scales = {call.loss_scale for call in self.optimizer_calls if call.loss_scale}
        return frozenset(
            node.name for node in self.graph_def.node
            if node.op == "ReadVariableOp" and node.name not in self.update_op_names
            and op_name(node.input[0]) in scales)

    def _gradient_seeds(self) -> frozenset:
        """The seeds of the gradients of every call without a loss scale (whose reads
        carry each replica's share instead), found together: one tape's seed
        may start several calls' gradients."""
        unscaled = {index for index, call in enumerate(self.optimizer_calls)
                    if not call.loss_scale}
        return gradient_seeds(self.graph_def, [
            ref.values for name, ref in self.gradients.items() if self.call_of[name] in unscaled])

    @property
    def scaled_by_share(self) -> frozenset:
        """Shared ops whose value each replica multiplies by its share of the cluster's
        rows: the reads of a loss scale and the seeds of the gradients."""
        return self.loss_scale_reads | self.gradient_seeds

    @property
    def sums_over_replicas(self) -> bool:
        """Whether the step sums tensors over every replica of the cluster: marked sums
        (``cross_replica_sums``) or the totals a loss is divided by (``batch_totals``).
        On a cluster these are collectives across the nodes."""
        return bool(self.cross_replica_sums or self.batch_totals)

    def gradients_scaled_by_share(self, call: int) -> bool:
        """Whether optimizer call ``call``'s gradients come out of each replica already
        scaled by its share (through ``scaled_by_share``)."""
        return bool(self.optimizer_calls[call].loss_scale or self.gradient_seeds)

    def _ready_ranks(self) -> Dict[str, int]:
        """Variable name -> when its gradient is ready in the backward pass, as a rank (0: first).

        A gradient is ready after the longest chain of ops leading to it (its depth
        in the graph): backpropagation reaches the last layers' gradients first, and
        the first layers' after every layer above them. Ties keep the graph's order.
        A while loop's back edges (``NextIteration``) are not followed.
        """
        nodes = self._nodes
        position = {name: i for i, name in enumerate(nodes)}
        depth: Dict[str, int] = {}
        visiting = set()
        for ref in self.gradients.values():
            todo = [op_name(ref.values)]
            while todo:  # depth-first without recursion: graphs are deep
                name = todo[-1]
                if name in depth:
                    todo.pop()
                    continue
                inputs = [op_name(i) for i in nodes[name].input
                          if nodes[op_name(i)].op != "NextIteration"]
                if name not in visiting:
                    visiting.add(name)
                    todo.extend(i for i in inputs if i not in depth and i not in visiting)
                    continue
                depth[name] = 1 + max((depth.get(i, 0) for i in inputs), default=0)
                todo.pop()
        source = {var: op_name(ref.values) for var, ref in self.gradients.items()}
        order = sorted(source, key=lambda var: (depth[source[var]], position[source[var]]))
        return {var: rank for rank, var in enumerate(order)}

    def _processing(self, call) -> GradientProcessing:
        """The ops between a call's raw gradients and what it applied."""
        raw = {name: gradient_ref(grad) for name, grad in call.raw_gradients.items()}
        applied = {v.op.name: gradient_ref(g) for g, v in call.grads_and_vars
                   if g is not None and v.op.name in raw}
        consumers = self._data_consumers
        sources = {op_name(n) for ref in raw.values()
                   for n in (ref.values, ref.indices, ref.dense_shape) if n}
        downstream = self._downstream(c for s in sources for c in consumers.get(s, []))
        nodes = self._nodes
        ops, todo = set(), [op_name(n) for ref in applied.values()
                            for n in (ref.values, ref.indices, ref.dense_shape) if n]
        while todo:
            name = todo.pop()
            if name in ops or name in sources or name not in downstream:
                continue
            ops.add(name)
            todo.extend(op_name(i) for i in nodes[name].input if not i.startswith("^"))
        return GradientProcessing(frozenset(ops), raw, applied)

    def _classify_ops(self) -> None:
        nodes = self._nodes
        update_ops = self.update_op_names
        initializers = {v.initializer.name for v in self._trainables}
        is_initialized = {op.name for v in self._trainables
                          for op in v.op.outputs[0].consumers()
                          if op.type == "VarIsInitializedOp"}
        self.excluded = (set(update_ops) | set(self.variables) | initializers | is_initialized)
        self.initializer_of = {v.initializer.name: v.op.name for v in self._trainables}

        consumers = {name: [] for name in nodes}
        for node in self.graph_def.node:
            for inp in node.input:
                source = op_name(inp)
                if source in consumers:
                    consumers[source].append(node.name)
        self.batched_inputs = {
            node.name for node in self.graph_def.node
            if node.op in _BATCHED_INPUT_OPS and _is_batched(node)}
        seeds = set(self.variables) | self.batched_inputs | {
            node.name for node in self.graph_def.node if node.op in _PER_REPLICA_INPUT_OPS}
        replicated = set()
        frontier = [name for seed in seeds for name in consumers[seed]]
        frontier += [s for s in seeds if s not in self.variables and s not in self.batched_inputs]
        # Each replica weighs its loss scale or gradient seeds by its share of the rows
        # (replicator), so what reads them is per replica.
        frontier += [name for read in self.scaled_by_share for name in consumers[read]]
        while frontier:
            name = frontier.pop()
            if name in replicated or name in self.excluded:
                continue
            replicated.add(name)
            frontier.extend(consumers[name])
        self.replicated = replicated
        self.shared = set(nodes) - replicated - self.excluded

    def _batch_totals(self) -> frozenset:
        """The sums over a whole batch that a loss is divided by: ``Sum`` ops reducing
        every axis of a tensor computed from the batch alone (no trainable variable),
        whose value (through casts) is the divisor of a division.

        Keras normalizes a masked loss so (the sum of the mask: a padded sequence's
        tokens), and a loss reduced by ``mean_with_sample_weight`` (the sum of the
        sample weights). Computed from a replica's rows, such a total is not the
        batch's, and the replicas' losses would not add up to the single-device loss
        (the replicator gives every replica the whole step's total).
        """
        nodes = self._nodes
        divisors = set()
        for node in self.graph_def.node:
            if node.op in _DIVISIONS and node.name in self.replicated:
                divisors.add(through_identities(nodes, data_inputs(node)[1],
                                                ("Identity", "Cast")))
        totals = set()
        for name in divisors:
            node = nodes.get(name)
            if (node is None or node.op != "Sum" or name not in self.replicated
                    or not _reduces_every_axis(self.graph, name)):
                continue
            if ancestors(nodes, [name], control=False).isdisjoint(self.variables):
                totals.add(name)
        return frozenset(totals)

    @functools.cached_property
    def _data_consumers(self) -> Dict[str, List[str]]:
        """Op name -> the ops reading one of its outputs (data edges, not control edges)."""
        consumers: Dict[str, List[str]] = {}
        for node in self.graph_def.node:
            for inp in data_inputs(node):
                consumers.setdefault(op_name(inp), []).append(node.name)
        return consumers

    def _downstream(self, sources: Iterable[str]) -> set:
        """``sources`` and every op computed from them through data edges."""
        reached, todo = set(), list(sources)
        while todo:
            name = todo.pop()
            if name not in reached:
                reached.add(name)
                todo.extend(self._data_consumers.get(name, []))
        return reached

    def _rows_multiplied(self) -> tuple:
        """The forward pass's products of a batch's rows with the batch's rows.

        ``queries @ candidates.T`` scores every row against every row of the batch
        (in-batch negatives, a contrastive loss): on a replica, against its own
        rows only. A product contracting over the rows (``x.T @ dy``, a gradient)
        adds them up, as the replicas' gradients do; a side gathered over the
        replicas (``cross_replica.gather_batch``) holds every row.
        """
        from_rows = self._downstream(self.batched_inputs)
        gathered = self._downstream(node.name for node in self.graph_def.node
                                    if marked(node, FIRST_ROW))
        found = []
        for node in self.graph_def.node:
            if (node.op != "MatMul" or node.attr["transpose_a"].b
                    or any(part.startswith(("gradient_tape", "gradients"))
                           for part in node.name.split("/"))):
                continue
            operands = {op_name(i) for i in data_inputs(node)}
            if operands <= from_rows and operands.isdisjoint(gathered):
                found.append(node.name)
        return tuple(found)

    def _mark_same_rows(self) -> None:
        """Sets ``same_rows`` on the sparse gradients whose indices no replica's rows change."""
        sparse = {name: ref for name, ref in self.gradients.items() if ref.sparse}
        if not sparse:
            return
        levels = _replica_dependence(self.graph, self.graph_def, self.batched_inputs)
        for name, ref in sparse.items():
            if levels.get(op_name(ref.indices), _SAME) == _SAME:
                self.gradients[name] = dataclasses.replace(ref, same_rows=True)

    @property
    def fingerprint(self) -> str:
        """What every node of a job must build the same: the digest of the graph's
        structure, then one ``|name=digest`` per training setting.

        The structure leaves constant values and random seeds out: unseeded
        initializers differ from process to process, and on a cluster initial
        values come from the chief. The settings are what the step reads that no
        node gets from the chief: the optimizer's hyperparameters (a Keras
        learning rate) and the step's floating-point scalar constants (loss
        weights, rates, a ``tf.compat.v1`` optimizer's learning rate).
        """
        settings = {"constants": self._scalar_constants()}
        for index, call in enumerate(self.optimizer_calls):
            for key, value in sorted(call.hyperparameters().items()):
                settings[f"optimizer_{index}:{key}"] = np.asarray(value).tobytes()
        return self._structure_digest() + "".join(
            f"|{name}={hashlib.sha256(value).hexdigest()[:8]}"
            for name, value in settings.items())

    def _scalar_constants(self) -> bytes:
        """The values of the floating-point scalar constants that are not initial values."""
        initializers = {v.initializer.name for v in self._trainables + self.other_variables}
        only_initial = {}
        for node in self.graph_def.node:
            for inp in node.input:
                source = op_name(inp)
                only_initial[source] = only_initial.get(source, True) and node.name in initializers
        values = []
        for node in sorted(self.graph_def.node, key=lambda n: n.name):
            tensor = node.attr["value"].tensor if node.op == "Const" else None
            if (tensor is None or tensor.tensor_shape.dim or only_initial.get(node.name, False)
                    or not tf.dtypes.as_dtype(tensor.dtype).is_floating):
                continue
            values.append(f"{node.name}={tf.make_ndarray(tensor)!r}")
        return "\n".join(values).encode()

    def _structure_digest(self) -> str:
        digest = hashlib.sha256()
        for node in sorted(self.graph_def.node, key=lambda n: n.name):
            attrs = sorted(key for key in node.attr if key not in _UNSTABLE_ATTRS)
            digest.update(repr((node.name, node.op, list(node.input), attrs,
                                [node.attr[key].SerializeToString(deterministic=True)
                                 for key in attrs])).encode())
        for function in self.graph_def.library.function:
            digest.update(function.signature.name.encode())
        if self.accumulation_steps != 1:  # every node must sync in the same runs
            digest.update(f"accumulation_steps={self.accumulation_steps}".encode())
        return digest.hexdigest()[:16]

    def slot_names(self) -> dict:
        """Original slot variable name -> (its variable's name, slot key), of every call."""
        return {name: slot for call in self.optimizer_calls
                for name, slot in call.slot_names().items()}

    def call_of_op(self, name: str) -> Optional[int]:
        """The index of the optimizer call that created op ``name``, or None."""
        return next((index for index, call in enumerate(self.optimizer_calls)
                     if name in call.update_op_names), None)

    def is_replicated(self, tensor_or_op_name: str) -> bool:
        return op_name(tensor_or_op_name) in self.replicated


def through_identities(nodes: dict, name: str, ops: tuple = ("Identity",)) -> str:
    """The op behind tensor or op ``name``, past any ``Identity`` ops (or any of
    ``ops``: ``Cast`` too, for a value's origin) within ``nodes``."""
    name = op_name(name)
    while name in nodes and nodes[name].op in ops:
        name = op_name(nodes[name].input[0])
    return name


def _batch_dims(node) -> int:
    """A gather's ``batch_dims`` (read without adding the attribute to the NodeDef)."""
    return node.attr["batch_dims"].i if "batch_dims" in node.attr else 0


def _reduces_every_axis(graph: tf.Graph, name: str) -> bool:
    """Whether the reduction op ``name`` reduces its input to one value."""
    op = graph.get_operation_by_name(name)
    rank = op.inputs[0].shape.rank
    axes = tf.get_static_value(op.inputs[1])
    if not rank or axes is None:
        return False
    return {int(a) % rank for a in np.reshape(axes, -1)} == set(range(rank))


def _gathers_rows(nodes: dict, node, params: str) -> bool:
    """Whether ``node`` is ``GatherV2(params, ids, axis=0)`` with no batch dimensions."""
    if node.op != "GatherV2" or _batch_dims(node):
        return False
    inputs = data_inputs(node)
    axis = nodes.get(op_name(inputs[2]))
    return (op_name(inputs[0]) == params and op_name(inputs[1]) != params
            and axis is not None and axis.op == "Const"
            and tf.make_ndarray(axis.attr["value"].tensor).item() == 0)


def _is_batched(node) -> bool:
    """A placeholder whose first dimension is unknown holds a batch."""
    shape = node.attr["shape"].shape
    return not shape.unknown_rank and len(shape.dim) >= 1 and shape.dim[0].size == -1


# Divisions of a loss by a normalizer (the divisor is the second input).
_DIVISIONS = ("DivNoNan", "RealDiv", "Div")
# Matrix products a partitioned factor can be cut out of (``PartProduct``).
_PRODUCTS = ("MatMul", "BatchMatMulV2")
# A traced tf.while_loop or tf.cond: ops running functions of the graph's library.
FUNCTIONAL_CONTROL_FLOW = ("While", "StatelessWhile", "If", "StatelessIf", "Case",
                           "StatelessCase")
# Ops writing a resource variable's value (the first input is the variable).
RESOURCE_WRITES = ("AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp",
                   "ResourceScatterAdd", "ResourceScatterSub", "ResourceScatterUpdate",
                   "ResourceScatterMul", "ResourceScatterDiv", "ResourceScatterMin",
                   "ResourceScatterMax", "ResourceScatterNdUpdate", "ResourceScatterNdAdd",
                   "ResourceScatterNdSub")

# Ops reading a resource variable (the first input) without writing it.
_READS = ("ReadVariableOp", "ResourceGather", "ResourceGatherNd", "VariableShape",
          "VarIsInitializedOp")
# Prefixes of the ops writing a resource variable at given rows only.
_ROW_WRITES = ("ResourceScatter", "ResourceSparseApply")

# How a tensor depends on a replica's rows: not at all, only through the batch
# dimension of a shape vector (element 0 of ``tf.shape(batch)``), or otherwise.
_SAME, _BATCH_DIM, _BY_ROWS = 0, 1, 2
# Stateless random ops whose inputs are (shape, key, counter, alg); the replicator
# salts their keys, so that every replica draws its own numbers.
KEYED_RANDOM_OPS = ("StatelessRandomUniformV2", "StatelessRandomNormalV2",
                    "StatelessTruncatedNormalV2", "StatelessRandomUniformIntV2",
                    "StatelessRandomUniformFullIntV2")
# Ops drawing other numbers on every replica.
_PER_REPLICA_RANDOM_OPS = KEYED_RANDOM_OPS + ("RandomUniform", "RandomStandardNormal",
                                              "TruncatedNormal", "RandomUniformInt",
                                              "RandomShuffle", "Multinomial")


def _replica_dependence(graph: tf.Graph, graph_def, batched_inputs: set) -> Dict[str, int]:
    """Op name -> how its outputs depend on the replica's rows (``_SAME`` ... ``_BY_ROWS``).

    ``tf.range(tf.shape(x)[-1])`` depends on no replica's rows: a shape's element
    other than the batch dimension is the same on every replica. Anything else
    reading the rows, a fed batch or a per-replica input does. Loops make the
    graph cyclic, so the levels only rise until they are stable.
    """
    nodes = list(graph_def.node)
    levels: Dict[str, int] = {}
    changed = True
    while changed:
        changed = False
        for node in nodes:
            level = _dependence(graph, node, levels, batched_inputs)
            if level > levels.get(node.name, _SAME):
                levels[node.name] = level
                changed = True
    return levels


def _dependence(graph: tf.Graph, node, levels: dict, batched_inputs: set) -> int:
    if (node.name in batched_inputs or node.op in _PER_REPLICA_INPUT_OPS
            or node.op in _PER_REPLICA_RANDOM_OPS):
        return _BY_ROWS
    data = [levels.get(op_name(i), _SAME) for i in node.input if not i.startswith("^")]
    highest = max(data, default=_SAME)
    if node.op == "Rank" or highest == _SAME:
        return _SAME
    if node.op == "Shape":
        return _BATCH_DIM
    if node.op == "StridedSlice" and data[0] == _BATCH_DIM and max(data[1:]) == _SAME:
        index = _shape_element(graph, node)
        if index is not None and index != 0:
            return _SAME
    return _BY_ROWS


def _shape_element(graph: tf.Graph, node) -> Optional[int]:
    """The element a ``StridedSlice`` takes out of a shape vector (``shape[k]``), or None."""
    if not node.attr["shrink_axis_mask"].i & 1:
        return None
    begin = graph.get_operation_by_name(op_name(node.input[1]))
    if begin.type != "Const":
        return None
    values = tf.make_ndarray(begin.get_attr("value")).reshape(-1)
    rank = graph.get_tensor_by_name(tensor_name(node.input[0])).shape
    if len(values) != 1 or rank.rank != 1:
        return None
    index = int(values[0])
    if index < 0:
        if rank[0] is None:
            return None
        index += int(rank[0])
    return index


_HOW_TO_START_LARGE_VARIABLES = (
    "A variable built from an array (tf.Variable(numpy_array)) keeps its value in the "
    "graph. Create it with an initializer instead (tf.compat.v1.get_variable(name, shape, "
    "initializer=...)) and load its values with autodist.checkpoint.Saver.restore, or "
    "assign them once the session runs.")


def _graph_def(graph: tf.Graph):
    """``graph``'s GraphDef; a graph over protobuf's 2 GB limit is refused by name."""
    try:
        return graph.as_graph_def()
    except (ValueError, protobuf_message.DecodeError) as error:
        sizes = {op.name: op.outputs[0].shape.num_elements() * op.outputs[0].dtype.size
                 for op in graph.get_operations()
                 if op.type == "Const" and op.outputs[0].shape.is_fully_defined()}
        raise ValueError(
            f"AutoDist cannot read the graph: it is larger than protobuf's 2 GB limit, its "
            f"constants holding {sum(sizes.values()) / 2 ** 30:.2f} GB "
            f"({_largest(sizes)}). {_HOW_TO_START_LARGE_VARIABLES}") from error


def _warn_of_large_constants(graph_def) -> None:
    """Says once which constants make the graph heavy (every stage copies them)."""
    sizes = {}
    for node in graph_def.node:
        if node.op == "Const":
            sizes[node.name] = node.attr["value"].tensor.ByteSize()
    if sum(sizes.values()) >= LARGE_CONSTANTS_BYTES:
        warnings.warn(
            f"AutoDist: the graph holds {sum(sizes.values()) / 2 ** 20:.0f} MB of constants "
            f"({_largest(sizes)}), which every stage of the rewrite copies. "
            f"{_HOW_TO_START_LARGE_VARIABLES}", stacklevel=3)


def _largest(sizes: dict, count: int = 3) -> str:
    """The ``count`` largest entries of name -> bytes of 1 MB or more, as
    "'name' 12.0 MB, ..."."""
    ranked = sorted(((n, b) for n, b in sizes.items() if b >= 2 ** 20),
                    key=lambda item: -item[1])[:count]
    return ", ".join(f"{name!r} {size / 2 ** 20:.1f} MB" for name, size in ranked)
