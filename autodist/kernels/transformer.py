"""GraphTransformer: turns the single-device graph into this node's distributed graph.

The stages, each owned by one kernel module:

1. replicator.import_shared      inputs, non-trainable variables, initial values
2. storage (partitioner + synchronizer kinds)
                                 each variable part stored as its kind says;
                                 partitioned variables that some op reads whole
                                 (other than gathers and products) re-stitched
                                 once per node for its CPU replicas
3. replicator.replicate          the model once per local replica, its gathers
                                 of a variable's rows reading them where they
                                 are stored, its products with a partitioned
                                 variable multiplying by the parts; state the
                                 forward pass assigns merged into one write
4. accumulator, synchronizer kinds, gradient_processing
                                 gradients weighted by each replica's rows (and
                                 accumulated over runs), cut per part, reduced
                                 by each part's kind, then processed as the user
                                 did between compute_gradients and
                                 apply_gradients
5. update                        each optimizer call of the graph
                                 (``item.optimizer_calls``) recreated for every
                                 stored copy of its variables; then each kind's
                                 end-of-step work
6. fills                         large fills (zero starts) kept from being
                                 folded into constants the session would keep

Stages 4 and 5 run once per optimizer call, with kind instances of its own, so
that each call's train op synchronizes and updates its own variables only.

The kinds (``autodist/synchronizers/``) own everything that differs between
them; this module only routes parts to them.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import tensorflow as tf

from autodist import _tf_compat
from autodist.graph_item import GraphItem, PartUpdate, VariableInfo
from autodist.kernel_context import KernelContext, replica_scope
from autodist.kernels import fills, gradient_processing, node_products, partitioner, replicator
from autodist.kernels.accumulator import Accumulation
from autodist.strategy.compiler import CompiledStrategy, CompiledVariable
from autodist.synchronizers import KINDS
from autodist.synchronizers.base import CollectiveKeys, Member, PartStorage, Reduced


@dataclasses.dataclass
class VariableStorage:
    """Where a variable's parts live and what each replica reads.

    Ops that only some runs need (the initializer) are built on
    demand, in the graph's context: a large model would pay for them up front.
    """

    compiled: CompiledVariable
    parts: list
    handles: list           # per replica: the resource handle the model reads
    device: str             # where the full value is assembled

    def gather_rows(self, replica: int, ids: tf.Tensor) -> tf.Tensor:
        """``tf.gather(variable, ids)`` as replica ``replica`` reads it, where the rows are stored."""
        if self.compiled.plan is not None:
            return partitioner.gather_rows([p.readers[replica] for p in self.parts], ids,
                                           self.compiled.plan)
        handle = self.handles[replica]
        with tf.device(handle.device):
            return tf.raw_ops.ResourceGather(resource=handle, indices=ids,
                                             dtype=tf.as_dtype(self.compiled.info.dtype))

    def part_products(self, replica: int) -> partitioner.PartProducts:
        """Products with the partitioned variable as replica ``replica`` computes them."""
        return partitioner.PartProducts([p.readers[replica] for p in self.parts],
                                        self.compiled.plan)

    def initializer(self) -> tf.Operation:
        """Initializes every stored copy of the variable on this node."""
        return tf.group(*[v.initializer for p in self.parts
                          for v in p.synchronizer.initialized_with_part(p)])


@dataclasses.dataclass
class UpdateOps:
    """What runs one optimizer call of the original graph (one train op).

    Attributes:
        train_op: the step: reduce, update, end-of-step work.
        remote_step_op: a split step's second run, after ``train_op``'s, or None.
        accumulate_ops: with gradient accumulation over k runs, what runs
            0 .. k-2 of a cycle run instead of ``train_op`` (see ``accumulator``).
        optimizers: the optimizer copies applying its updates (their slots are
            the checkpoint's).
    """

    train_op: tf.Operation
    remote_step_op: Optional[tf.Operation] = None
    accumulate_ops: tuple = ()
    optimizers: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class DistributedGraph:
    """The rewritten graph and what the session needs to map user fetches onto it.

    Variables are initialized in two phases, the second reading the first:
    ``init_ops[0]`` everything this node initializes except ``derived`` copies
    (a cluster's AllReduce copies, proxies), ``init_ops[1]`` those copies. On a cluster a
    worker leaves the chief's variables to the chief and, between the phases,
    waits until ``chief_uninitialized`` (names of the chief's variables not yet
    initialized) is empty. Both phases feed ``initial_values`` (placeholder name
    -> a function returning its value): the starting values held outside the graph.
    ``row_reads`` (variable name -> per replica, the ops reading it where it is
    stored: gathers of its rows, reads of its parts) come before the variable's
    update. On the chief of a cluster, ``release_after_start`` drops the
    ``start_only`` variables (the origins every node's copies start from), to run
    once every node has initialized.
    """

    graph: tf.Graph
    item: GraphItem
    ctx: KernelContext
    storage: dict
    shared_variables: dict = dataclasses.field(default_factory=dict)  # name -> non-trainable
    updates: list = dataclasses.field(default_factory=list)  # UpdateOps per optimizer call
    init_ops: tuple = ()
    chief_uninitialized: Optional[tf.Tensor] = None
    initial_values: dict = dataclasses.field(default_factory=dict)
    row_reads: dict = dataclasses.field(default_factory=dict)
    start_only: list = dataclasses.field(default_factory=list)
    release_after_start: Optional[tf.Operation] = None

    def replica_element(self, name: str, replica: int):
        """The replica's copy of an op or tensor of the original graph."""
        scoped = f"{replica_scope(replica)}/{name}" if self.item.is_replicated(name) else name
        if ":" in scoped:
            return self.graph.get_tensor_by_name(scoped)
        return self.graph.get_operation_by_name(scoped)


def transform(item: GraphItem, compiled: CompiledStrategy, ctx: KernelContext) -> DistributedGraph:
    """Builds this node's distributed graph.

    Args:
        item: the analysed single-device graph.
        compiled: the validated strategy.
        ctx: this node's replicas, the cluster's devices.

    Returns:
        DistributedGraph
    """
    result = DistributedGraph(graph=tf.Graph(), item=item, ctx=ctx, storage={},
                              initial_values=dict(item.initial_values))
    deferred = []
    keys = CollectiveKeys()
    # Kind instances per optimizer call: a kind keeps what its end of step needs.
    per_call = [{field: kind(dataclasses.replace(ctx, update_index=index), keys)
                 for field, kind in KINDS.items()}
                for index in range(len(item.optimizer_calls))]
    foreign = set()
    with result.graph.as_default():
        replicator.import_shared(item, ctx, deferred)
        result.shared_variables = shared_variables = _register_shared_variables(item)
        for name, variable in compiled.variables.items():
            result.storage[name] = _create_storage(item, variable, ctx,
                                                   per_call[item.call_of.get(name, 0)])
        replicas = replicator.replicate(
            item, ctx, {n: s.handles for n, s in result.storage.items()},
            {n: s.gather_rows for n, s in result.storage.items() if item.reads[n].gathers},
            {n: s.part_products for n, s in result.storage.items()
             if _read_by_parts(item, s.compiled) and item.reads[n].products},
            deferred)
        result.row_reads, state_writes = replicas.row_reads, replicas.state_writes
        for index, synchronizers in enumerate(per_call):
            accumulation = Accumulation(item.accumulation_steps)
            reduced = _synchronize(result, index, synchronizers, accumulation)
            if index in item.processing:
                reduced = gradient_processing.process(item, index, reduced, ctx)
            update = UpdateOps(train_op=None)
            update.train_op, update.remote_step_op, foreign_here = _apply_updates(
                item, index, reduced, list(synchronizers.values()),
                shared_variables, ctx, update.optimizers)
            foreign |= foreign_here
            if state_writes or accumulation.resets:
                update.train_op = tf.group(update.train_op, *state_writes, *accumulation.resets,
                                           name="autodist_train_op_and_state")
            update.accumulate_ops = tuple(
                tf.group(*run, *state_writes, name=f"autodist_accumulate_{j}")
                for j, run in enumerate(accumulation.runs))
            result.updates.append(update)
            for optimizer in update.optimizers:
                result.initial_values.update(optimizer.initial_values)
        _reconnect(result, deferred)
        fills.keep_large_fills(result.graph)
        _plan_initialization(result, list(shared_variables.values()),
                             [s for synchronizers in per_call for s in synchronizers.values()],
                             foreign)
    return result


def _plan_initialization(result: DistributedGraph, shared_variables: list,
                         synchronizers: list, foreign: set) -> None:
    """Which variables this node initializes, in which phase (see ``DistributedGraph``).

    Args:
        foreign: variables another node initializes (the slots of its updates).
    """
    ctx = result.ctx
    everything = (tf.compat.v1.global_variables() + tf.compat.v1.local_variables())
    derived, elsewhere = set(), set(foreign)
    chief_owned = set(shared_variables) if ctx.shared_variables_on_chief else set()
    for storage in result.storage.values():
        for part in storage.parts:
            ownership = part.synchronizer.initialization(part)
            chief_owned.update(ownership.chief)
            derived.update(ownership.derived)
            elsewhere.update(ownership.elsewhere)
            result.start_only.extend(ownership.start_only)
    everything = [v for v in everything if v not in elsewhere]
    # What the chief owns (a PS variable and its slots) exists in its graph alone.
    first = [v for v in everything if v not in derived and (ctx.is_chief or v not in chief_owned)]
    prefill = [op for synchronizer in synchronizers for op in synchronizer.chief_init_ops()]
    prefill += [result.graph.get_operation_by_name(name) for name in result.item.table_initializers]
    result.init_ops = (tf.group(tf.compat.v1.variables_initializer(first), *prefill,
                                name="autodist_init"),
                       tf.compat.v1.variables_initializer([v for v in everything if v in derived],
                                                          name="autodist_init_copies"))
    if not ctx.is_chief:
        result.chief_uninitialized = tf.compat.v1.report_uninitialized_variables(
            sorted(chief_owned, key=lambda v: v.name))
    elif result.start_only:
        result.release_after_start = tf.group(
            *[_destroyed(v) for v in result.start_only],
            name="autodist_release_after_start")


def _destroyed(variable: tf.Variable) -> tf.Operation:
    """Drops ``variable`` from its device's resources, freeing its value's memory."""
    with tf.device(variable.device):
        return tf.raw_ops.DestroyResourceOp(resource=variable.handle, ignore_lookup_error=True)


def _create_storage(item: GraphItem, variable: CompiledVariable, ctx: KernelContext,
                    synchronizers: dict) -> VariableStorage:
    graph = tf.compat.v1.get_default_graph()
    initial_value = graph.get_tensor_by_name(item.variables[variable.info.name].initial_value.name)
    values = ([initial_value] if variable.plan is None
              else partitioner.initial_parts(initial_value, variable.plan,
                                             [synchronizers[part.kind.field].value_device(part)
                                              for part in variable.parts]))
    parts = [synchronizers[part.kind.field].create_storage(part, value)
             for part, value in zip(variable.parts, values)]
    handles = []
    stitched_on_host = None  # the CPU replicas' one stitched copy, made at first need
    for replica in range(ctx.num_replicas):
        readers = [p.readers[replica] for p in parts]
        if _read_by_parts(item, variable):
            handles.append(_unbacked_handle(variable, replica, ctx))
        elif variable.plan is not None:
            def stitch(r=readers):
                return partitioner.stitch([reader.read_value() for reader in r], variable.plan)
            if (_on_cpu(ctx.replica_tf_device(replica))
                    and variable.info.name not in item.read_by_control_flow):
                # CPU replicas share the host's memory: one copy serves them all, and
                # is stitched once per step (a loop taking it would run where it is).
                if stitched_on_host is None:
                    stitched_on_host = _replica_copy_handle(variable, stitch, replica,
                                                            "stitched", ctx)
                handles.append(stitched_on_host)
            else:
                handles.append(_replica_copy_handle(variable, stitch, replica, "stitched",
                                                    ctx))
        elif (variable.info.name in item.read_by_control_flow
              and not replicator.same_device(readers[0].device,
                                             ctx.replica_tf_device(replica))):
            # A loop taking the variable would run where the variable is stored.
            handles.append(_replica_copy_handle(variable, readers[0].read_value, replica,
                                                "replica_copy", ctx))
        else:
            handles.append(readers[0].handle)
    return VariableStorage(variable, parts, handles, ctx.shared_device)


def _read_by_parts(item: GraphItem, variable: CompiledVariable) -> bool:
    """Whether every read of a variable goes to its parts (gathers of rows, products),
    so that no op needs its whole value in one tensor."""
    return variable.plan is not None and not item.reads[variable.info.name].whole


def _replica_copy_handle(variable: CompiledVariable, value, replica: int, label: str,
                         ctx: KernelContext) -> tf.Tensor:
    """``replicator.replica_copy_handle`` for a trainable variable of the strategy."""
    return replicator.replica_copy_handle(variable.info.name, variable.info.shape,
                                          variable.info.dtype, value, replica, label, ctx)


def _unbacked_handle(variable: CompiledVariable, replica: int, ctx: KernelContext) -> tf.Tensor:
    """A handle of the variable's shape and dtype that no value backs.

    A partitioned variable that the replica only gathers rows of needs no
    stitched copy: its gathers read the parts (``VariableStorage.gather_rows``).
    The ops of the original graph that this handle feeds are left unused by
    that rewrite; were one run, it would fail on the missing variable.
    """
    with tf.device(ctx.replica_tf_device(replica)):
        name = f"{replica_scope(replica)}/{variable.info.name}/unbacked"
        return tf.raw_ops.VarHandleOp(dtype=tf.as_dtype(variable.info.dtype),
                                      shape=variable.info.shape, shared_name=name, name=name)


def _on_cpu(device: str) -> bool:
    return tf.DeviceSpec.from_string(device).device_type == "CPU"


def _synchronize(result: DistributedGraph, call: int, synchronizers: dict,
                 accumulation: Accumulation) -> Reduced:
    """Cuts the gradients of optimizer call ``call`` per part; each part's kind reduces them.

    Args:
        accumulation: receives the ops keeping gradients between runs, when a
            cycle has several.
    """
    item, ctx = result.item, result.ctx
    members = {field: [] for field in synchronizers}
    weights = replicator.gradient_weights(item, ctx, call)
    for name, storage in result.storage.items():
        ref = item.gradients.get(name)
        if ref is None or item.call_of[name] != call:
            continue
        row_reads = result.row_reads.get(name)
        per_replica = [_replica_gradient(result, ref, r, storage.compiled.info.shape,
                                         row_reads[r] if row_reads else [])
                       for r in range(ctx.num_replicas)]
        if weights:
            per_replica = [_scaled(g, w) for g, w in zip(per_replica, weights)]
        if accumulation.steps > 1:
            per_replica = [
                accumulation.mean_gradient(g, ctx.replica_tf_device(r),
                                           f"{replica_scope(r)}/{name}",
                                           storage.compiled.info.shape)
                for r, g in enumerate(per_replica)]
        plan = storage.compiled.plan
        if plan is not None:
            with tf.name_scope(f"{name}/partition_gradient"):
                cut = [partitioner.split_gradient(g, plan) for g in per_replica]
            per_part = [[cut[r][i] for r in range(ctx.num_replicas)]
                        for i in range(plan.num_parts)]
        else:
            per_part = [per_replica]
        product = node_products.node_product(per_replica, ctx, name)
        for index, (part_storage, grads) in enumerate(zip(storage.parts, per_part)):
            update = functools.partial(_part_update, part_storage, storage.compiled.info, plan)
            node_sum = None
            if product is not None:
                node_sum = (product.whole if plan is None
                            else functools.partial(product.part, plan, index))
            members[part_storage.part.kind.field].append(
                Member(part_storage, grads, update, storage.compiled.info.updates_rows,
                       node_sum))
    out = Reduced()
    for field, synchronizer in synchronizers.items():  # in the registry's order, on every node
        if members[field]:
            reduced = synchronizer.synchronize(members[field])
            for column in dataclasses.fields(Reduced):
                getattr(out, column.name).extend(getattr(reduced, column.name))
    return out


def _part_update(storage: PartStorage, info: VariableInfo, plan, mean) -> PartUpdate:
    return PartUpdate(mean, storage.copies[0], info.name, storage.part.index, plan,
                      update_mode=info.update_mode)


def _scaled(gradient, weight: tf.Tensor):
    """``gradient`` times ``weight``, on the gradient's device."""
    values = gradient.values if isinstance(gradient, tf.IndexedSlices) else gradient
    with tf.device(values.device):
        scaled = values * tf.cast(weight, values.dtype)
    if isinstance(gradient, tf.IndexedSlices):
        return tf.IndexedSlices(scaled, gradient.indices, gradient.dense_shape)
    return scaled


def _replica_gradient(result: DistributedGraph, ref, replica: int, shape: tuple, reads: list):
    """The replica's gradient of a variable, once its reads of the variable are done.

    Args:
        reads: the replica's reads of the variable where it is stored (gathers
            of its rows, reads of its parts), which the update must not overtake.
    """
    values = result.replica_element(ref.values, replica)
    if reads:
        with tf.device(values.device), tf.control_dependencies(reads):
            values = tf.identity(values)
    if not ref.sparse:
        # A traced step's gradient may lack its static shape; the kernels need it.
        return values if values.shape.is_fully_defined() else tf.reshape(values, shape)
    indices = result.replica_element(ref.indices, replica)
    if ref.same_rows:  # summed row by row across replicas, as one batch's gradient is
        with tf.device(values.device):
            return partitioner.densify(tf.IndexedSlices(values, indices), shape[0])
    dense_shape = result.replica_element(ref.dense_shape, replica) if ref.dense_shape else None
    return tf.IndexedSlices(values, indices, dense_shape)


def _register_shared_variables(item: GraphItem) -> dict:
    """Python objects (and collection entries) for the imported non-trainable variables."""
    graph = tf.compat.v1.get_default_graph()
    local = {v.op.name for v in item.graph.get_collection(tf.compat.v1.GraphKeys.LOCAL_VARIABLES)}
    variables = {}
    for original in item.other_variables:
        variable = _tf_compat.variable_from_graph(original, graph)
        key = (tf.compat.v1.GraphKeys.LOCAL_VARIABLES if original.op.name in local
               else tf.compat.v1.GraphKeys.GLOBAL_VARIABLES)
        graph.add_to_collection(key, variable)
        variables[original.op.name] = variable
    return variables


def _apply_updates(item: GraphItem, index: int, reduced: Reduced, synchronizers: list,
                   shared_variables: dict, ctx: KernelContext, optimizers: list) -> tuple:
    """Runs optimizer call ``index`` on this node's copies, then each kind's end of the step.

    A split step does the local part (the collectives, their updates, stashing
    gradients for other nodes) in its first run and the traffic to other nodes'
    devices in its second.

    Args:
        optimizers: receives every optimizer copy applying updates (their slots
            are the checkpoint's).

    Returns:
        (the train op, the op of a split step's second run or None, the variables
        of the foreign updates' optimizer copies, which another node initializes)

    Raises:
        NotImplementedError: when the update writes state each node keeps (a
            Keras loss scale) and not every node applies the whole update.
    """
    graph = tf.compat.v1.get_default_graph()
    call = item.optimizer_calls[index]

    def translate(value):
        if value.op.name in item.update_op_names:
            return None  # prepared by apply_gradients itself, again in the new graph
        if isinstance(value, tf.Variable):
            return shared_variables[value.op.name].read_value()
        return graph.get_tensor_by_name(value.name)

    _check_state_per_node(item, index, ctx)
    updated = {}  # variable name -> the op updating it

    def apply(updates, count_step):
        # A fresh copy per call: each keeps its own non-slot state (Adam's powers).
        optimizer = call.new_update(translate)
        optimizers.append(optimizer)
        global_step = (shared_variables[call.global_step.op.name]
                       if count_step and call.global_step is not None else None)
        op, per_variable = optimizer.apply(updates, global_step)
        updated.update((u.variable.name, op) for u, op in zip(updates, per_variable))
        return op

    def after_local_updates():
        return [op for synchronizer in synchronizers
                for op in synchronizer.after_local_updates(updated)]

    def end_step(steps, name):
        for synchronizer in synchronizers:
            steps = synchronizer.end_step(steps, updated)
        return tf.group(*steps, name=name)

    # One global step on the chief, or one per node counting in step with the others.
    counts_step = ctx.is_chief or not ctx.shared_variables_on_chief
    if not ctx.split_step:
        updates = reduced.remote_updates + reduced.local_updates
        steps = reduced.remote_ops + reduced.local_ops + (
            [apply(updates, counts_step)] if updates else [])
        train_op, remote_op = end_step(steps + after_local_updates(), "autodist_train_op"), None
    else:
        local = [apply(reduced.local_updates, counts_step)] if reduced.local_updates else []
        train_op = tf.group(*reduced.local_ops, *local, *after_local_updates(),
                            name="autodist_train_op")
        # Each part's update waits for its own gradient only, so that its proxies'
        # refresh overlaps the pushes of the parts still arriving.
        steps = reduced.remote_ops + (
            [apply(reduced.remote_updates, False)] if reduced.remote_updates else [])
        remote_op = end_step(steps, "autodist_remote_step")
    foreign = set()
    if reduced.foreign_updates:
        before = set(tf.compat.v1.global_variables() + tf.compat.v1.local_variables())
        apply(reduced.foreign_updates, False)  # for the slots only: never run here
        after = tf.compat.v1.global_variables() + tf.compat.v1.local_variables()
        foreign = {v for v in after if v not in before}
    return train_op, remote_op, foreign


def _check_state_per_node(item: GraphItem, index: int, ctx: KernelContext) -> None:
    """Refuses a cluster strategy under which the nodes' copies of the state the
    update writes would drift apart: each node keeps its own copy (a Keras model's
    loss scale, read by its forward pass), so each must apply the whole update."""
    state = item.update_state[index]
    if not ctx.state_per_node or not state or not ctx.multi_node or ctx.updates_on_every_node:
        return
    raise NotImplementedError(
        f"AutoDist cannot keep {sorted(state)} in step on every node under this strategy: "
        "the optimizer's update writes it (a LossScaleOptimizer's loss scale, under mixed "
        "precision) and every node's model reads it, but the strategy updates some "
        "variables on one node only (a parameter server's, or a shard's). Use AllReduce "
        "for every variable on a cluster, or train on one node.")


def _reconnect(result: DistributedGraph, deferred: list) -> None:
    """Restores control edges that pointed at ops AutoDist recreated."""
    graph, item = result.graph, result.item
    for node, source in deferred:
        if source in item.initializer_of:
            target = result.storage[item.initializer_of[source]].initializer()
        elif item.call_of_op(source) is not None:
            target = result.updates[item.call_of_op(source)].train_op
        elif source in item.replicated:
            target = tf.group(*[result.replica_element(source, r)
                                for r in range(result.ctx.num_replicas)])
        else:
            target = graph.get_operation_by_name(source)
        _tf_compat.add_control_inputs(graph.get_operation_by_name(node), [target])
