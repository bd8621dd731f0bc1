"""GraphTransformer: turns the single-device graph into this node's distributed graph.

The stages, each owned by one kernel module:

1. replicator.import_shared      inputs, non-trainable variables, initial values
2. storage (partitioner + synchronizers)
                                 each variable part placed per its synchronizer;
                                 partitioned variables re-stitched per replica
3. replicator.replicate          the model once per local replica; state the
                                 forward pass assigns merged into one write
4. synchronizers                 gradients weighted by each replica's rows, cut
                                 per part, then PS-averaged or all-reduced
                                 (grouped, compressed)
5. update                        the graph's optimizer update (``item.optimizer_call``)
                                 recreated for every stored copy; proxies refreshed
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import tensorflow as tf

from autodist import _tf_compat
from autodist.graph_item import GraphItem, PartUpdate
from autodist.kernels import partitioner, replicator
from autodist.kernels.all_reduce_synchronizer import (
    CollectiveKeys, all_reduce_group, create_all_reduce_storage)
from autodist.kernels.context import KernelContext, replica_scope
from autodist.kernels.ps_synchronizer import (
    accumulate_across_nodes, create_ps_storage, node_contribution, reduce_ps_gradients,
    refresh_proxies, stash, token_queue)
from autodist.strategy.compiler import CompiledStrategy, CompiledVariable


@dataclasses.dataclass
class PartStorage:
    """Where one variable part lives: its stored copies and what each replica reads."""

    part: object            # compiler.VariablePart
    copies: list            # PS: [shared]; AllReduce: [this node's copy]
    readers: list           # per replica
    origin: Optional[tf.Variable] = None  # AllReduce on a cluster: the chief's initial value


@dataclasses.dataclass
class VariableStorage:
    """Where a variable's parts live and what each replica reads.

    Ops that only some runs need (the full value, the initializer) are built on
    demand, in the graph's context: a large model would pay for them up front.
    """

    compiled: CompiledVariable
    parts: list
    handles: list           # per replica: the resource handle the model reads
    device: str             # where the full value is assembled

    def full_value(self) -> tf.Tensor:
        """The whole, synchronized value, as a fetch returns it."""
        with tf.device(self.device):
            reads = [p.copies[0].read_value() for p in self.parts]
            if self.compiled.plan is None:
                return reads[0]
            return partitioner.stitch(reads, self.compiled.plan)

    def initializer(self) -> tf.Operation:
        """Initializes every stored copy of the variable."""
        return tf.group(*[c.initializer for p in self.parts for c in p.copies + p.readers])


@dataclasses.dataclass
class DistributedGraph:
    """The rewritten graph and what the session needs to map user fetches onto it.

    Variables are initialized in two phases, the second reading the first:
    ``init_ops[0]`` everything this node initializes except ``derived`` copies
    (a cluster's AllReduce copies, proxies), ``init_ops[1]`` those copies. On a cluster a
    worker leaves the chief's variables to the chief and, between the phases,
    waits until ``chief_uninitialized`` (names of the chief's variables not yet
    initialized) is empty.
    """

    graph: tf.Graph
    item: GraphItem
    ctx: KernelContext
    storage: dict
    shared_variables: dict = dataclasses.field(default_factory=dict)  # name -> non-trainable
    optimizers: list = dataclasses.field(default_factory=list)  # updates' optimizer copies
    train_op: Optional[tf.Operation] = None
    ps_step_op: Optional[tf.Operation] = None  # a split step's second run, after train_op's
    init_ops: tuple = ()
    chief_uninitialized: Optional[tf.Tensor] = None

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
    result = DistributedGraph(graph=tf.Graph(), item=item, ctx=ctx, storage={})
    deferred = []
    with result.graph.as_default():
        replicator.import_shared(item, ctx, deferred)
        result.shared_variables = shared_variables = _register_shared_variables(item)
        for name, variable in compiled.variables.items():
            result.storage[name] = _create_storage(item, variable, ctx)
        state_writes = replicator.replicate(
            item, ctx, {n: s.handles for n, s in result.storage.items()}, deferred)
        sync = _synchronize(result)
        result.train_op, result.ps_step_op = _apply_updates(item, sync, shared_variables, ctx,
                                                            result.optimizers)
        if state_writes:
            result.train_op = tf.group(result.train_op, *state_writes,
                                       name="autodist_train_op_and_state")
        _reconnect(result, deferred)
        _plan_initialization(result, list(shared_variables.values()), sync)
    return result


def _plan_initialization(result: DistributedGraph, shared_variables: list,
                         sync: _Synchronized) -> None:
    ctx = result.ctx
    everything = (tf.compat.v1.global_variables() + tf.compat.v1.local_variables())
    derived = set()
    chief_owned = set(shared_variables) if ctx.shared_variables_on_chief else set()
    for storage in result.storage.values():
        for part in storage.parts:
            if part.origin is not None:
                chief_owned.add(part.origin)
                derived.update(part.copies)
            if part.part.is_ps:
                chief_owned.add(part.copies[0])
                if ctx.multi_node:
                    derived.update(r for r in part.readers if r is not part.copies[0])
    # The optimizer's slots of the shared PS variables exist only in the chief's graph.
    first = [v for v in everything if v not in derived and (ctx.is_chief or v not in chief_owned)]
    prefill = []
    if ctx.is_chief and ctx.multi_node:
        # Bounded staleness across nodes: workers may run `staleness` steps ahead,
        # and read each part at most its own staleness bound behind.
        workers = range(1, ctx.num_nodes)
        queues = [(token_queue(w, ctx), sync.staleness) for w in workers if sync.staleness]
        queues += [(_part_token_queue(p, w, ctx), p.part.synchronizer.staleness)
                   for p in sync.proxy_parts if p.part.synchronizer.staleness for w in workers]
        prefill = [queue.enqueue_many([tf.zeros([staleness], tf.int64)])
                   for queue, staleness in queues]
    result.init_ops = (tf.group(tf.compat.v1.variables_initializer(first), *prefill,
                                name="autodist_init"),
                       tf.compat.v1.variables_initializer([v for v in everything if v in derived],
                                                          name="autodist_init_copies"))
    if not ctx.is_chief:
        result.chief_uninitialized = tf.compat.v1.report_uninitialized_variables(
            sorted(chief_owned, key=lambda v: v.name))


def _create_storage(item: GraphItem, variable: CompiledVariable,
                    ctx: KernelContext) -> VariableStorage:
    graph = tf.compat.v1.get_default_graph()
    initial_value = graph.get_tensor_by_name(item.variables[variable.info.name].initial_value.name)
    values = ([initial_value] if variable.plan is None
              else partitioner.split_value(initial_value, variable.plan))
    parts = []
    for part, value in zip(variable.parts, values):
        if part.is_ps:
            shared, readers = create_ps_storage(part.name, value, part.synchronizer, ctx)
            parts.append(PartStorage(part, [shared], readers))
        else:
            copy, origin = create_all_reduce_storage(part.name, value, ctx)
            parts.append(PartStorage(part, [copy], [copy] * ctx.num_replicas, origin))
    if variable.plan is None:
        handles = [reader.handle for reader in parts[0].readers]
    else:
        handles = [_stitched_handle(variable, parts, replica, ctx)
                   for replica in range(ctx.num_replicas)]
    return VariableStorage(variable, parts, handles, ctx.shared_device)


def _stitched_handle(variable: CompiledVariable, parts: list, replica: int,
                     ctx: KernelContext) -> tf.Tensor:
    """A per-replica variable holding the re-stitched value, refreshed before reads.

    Any consumer of the variable (reads, gathers, loops) can use it unchanged.
    """
    with tf.device(ctx.replica_tf_device(replica)):
        stitched = tf.Variable(tf.zeros(variable.info.shape, variable.info.dtype),
                               trainable=False,
                               collections=[tf.compat.v1.GraphKeys.LOCAL_VARIABLES],
                               name=f"{replica_scope(replica)}/{variable.info.name}/stitched")
        refresh = stitched.assign(partitioner.stitch(
            [p.readers[replica].read_value() for p in parts], variable.plan))
        with tf.control_dependencies([refresh]):
            return tf.identity(stitched.handle)


@dataclasses.dataclass
class _Synchronized:
    """What the synchronizers produced for the update stage."""

    ps_updates: list = dataclasses.field(default_factory=list)   # PartUpdate of shared copies
    ar_updates: list = dataclasses.field(default_factory=list)   # PartUpdate of node's copies
    collectives: list = dataclasses.field(default_factory=list)  # other replicas' collectives
    proxy_parts: list = dataclasses.field(default_factory=list)  # PS parts read through proxies
    sent: list = dataclasses.field(default_factory=list)     # ops sending gradients to PS nodes
    stashed: list = dataclasses.field(default_factory=list)  # split step: ops keeping them
    staleness: int = 0     # largest staleness bound among PS parts


def _synchronize(result: DistributedGraph) -> _Synchronized:
    """Cuts gradients per part and reduces them per each part's synchronizer."""
    item, ctx = result.item, result.ctx
    out = _Synchronized()
    groups = {}
    weights = replicator.row_weights(item, ctx)
    for name, storage in result.storage.items():
        ref = item.gradients.get(name)
        if ref is None:
            continue
        per_replica = [_replica_gradient(result, ref, r, storage.compiled.info.shape)
                       for r in range(ctx.num_replicas)]
        if weights:
            per_replica = [_scaled(g, w) for g, w in zip(per_replica, weights)]
        plan = storage.compiled.plan
        if plan is not None:
            with tf.name_scope(f"{name}/partition_gradient"):
                cut = [partitioner.split_gradient(g, plan) for g in per_replica]
            per_part = [[cut[r][i] for r in range(ctx.num_replicas)]
                        for i in range(plan.num_parts)]
        else:
            per_part = [per_replica]
        for part_storage, grads in zip(storage.parts, per_part):
            part, sync = part_storage.part, part_storage.part.synchronizer
            update = functools.partial(_part_update, part_storage, name, plan)
            if not part.is_ps:
                groups.setdefault(sync.group, []).append((part_storage, grads, update))
                continue
            out.staleness = max(out.staleness, sync.staleness)
            if part_storage.readers[0] is not part_storage.copies[0]:
                out.proxy_parts.append(part_storage)
            if not ctx.multi_node:
                out.ps_updates.append(update(reduce_ps_gradients(grads, sync, ctx)))
                continue
            contribution = node_contribution(grads, sync, ctx)
            if ctx.split_step:
                store, contribution = stash(part.name, contribution, ctx)
                out.stashed.append(store)
            sent, mean = accumulate_across_nodes(part.name, contribution, part.shape, sync, ctx)
            out.sent.append(sent)
            if mean is not None:
                out.ps_updates.append(update(mean))
    keys = CollectiveKeys()
    for group in sorted(groups):
        members = groups[group]
        means, others = all_reduce_group(
            [(p.part.name, p.part.synchronizer, g) for p, g, _ in members], keys, ctx)
        out.ar_updates.extend(update(mean) for (_, _, update), mean in zip(members, means))
        out.collectives.extend(others)
    return out


def _part_update(storage: PartStorage, name: str, plan, mean) -> PartUpdate:
    return PartUpdate(mean, storage.copies[0], name, storage.part.index, plan)


def _scaled(gradient, weight: tf.Tensor):
    """``gradient`` times ``weight``, on the gradient's device."""
    values = gradient.values if isinstance(gradient, tf.IndexedSlices) else gradient
    with tf.device(values.device):
        scaled = values * tf.cast(weight, values.dtype)
    if isinstance(gradient, tf.IndexedSlices):
        return tf.IndexedSlices(scaled, gradient.indices, gradient.dense_shape)
    return scaled


def _replica_gradient(result: DistributedGraph, ref, replica: int, shape: tuple):
    values = result.replica_element(ref.values, replica)
    if not ref.sparse:
        # A traced step's gradient may lack its static shape; the kernels need it.
        return values if values.shape.is_fully_defined() else tf.reshape(values, shape)
    shape = result.replica_element(ref.dense_shape, replica) if ref.dense_shape else None
    return tf.IndexedSlices(values, result.replica_element(ref.indices, replica), shape)


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


def _apply_updates(item: GraphItem, sync: _Synchronized, shared_variables: dict,
                   ctx: KernelContext, optimizers: list) -> tuple:
    """Runs the user's optimizer on this node's copies, keeps nodes in step, refreshes proxies.

    On a cluster the chief alone updates the PS variables, then hands every
    worker a token; a worker waits for its token before its step ends, so its
    next step reads the updated values. A split step does the local part (the
    collectives, the AllReduce updates, stashing PS gradients) in its first run
    and the PS traffic in its second.

    Args:
        optimizers: receives every optimizer copy applying updates (their slots
            are the checkpoint's).

    Returns:
        (the train op, the op of a split step's second run or None)
    """
    graph = tf.compat.v1.get_default_graph()
    call = item.optimizer_call

    def translate(value):
        if value.op.name in call.update_op_names:
            return None  # prepared by apply_gradients itself, again in the new graph
        if isinstance(value, tf.Variable):
            return shared_variables[value.op.name].read_value()
        return graph.get_tensor_by_name(value.name)

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

    # One global step on the chief, or one per node counting in step with the others.
    counts_step = ctx.is_chief or not ctx.shared_variables_on_chief
    if not ctx.split_step:
        updates = sync.ps_updates + sync.ar_updates
        steps = list(sync.sent) + sync.collectives + (
            [apply(updates, counts_step)] if updates else [])
        return _end_step(steps, sync, ctx, updated, "autodist_train_op"), None
    local = [apply(sync.ar_updates, counts_step)] if sync.ar_updates else []
    first = tf.group(*sync.stashed, *sync.collectives, *local, name="autodist_train_op")
    # Each part's update waits for its own accumulated gradient only, so that its
    # proxies' refresh overlaps the pushes of the parts still arriving.
    steps = list(sync.sent) + ([apply(sync.ps_updates, False)] if sync.ps_updates else [])
    return first, _end_step(steps, sync, ctx, updated, "autodist_ps_step")


def _end_step(steps: list, sync: _Synchronized, ctx: KernelContext, updated: dict,
              name: str) -> tf.Operation:
    """After ``steps``: the chief's tokens to the workers (or a worker's wait), proxy refresh.

    Each proxy is refreshed as soon as its own part is updated (a worker learns
    of it through a token of that part): on a cluster, pulls of the parts
    updated first then overlap the pushes of the others.

    Args:
        updated: variable name -> the op updating it, for the updates this node applies.
    """
    if ctx.multi_node and (sync.sent or sync.proxy_parts):
        with tf.control_dependencies(steps):
            if ctx.is_chief:
                steps = [token_queue(w, ctx).enqueue(tf.constant(0, tf.int64))
                         for w in range(1, ctx.num_nodes)]
            else:
                steps = [token_queue(ctx.node_index, ctx).dequeue()]
    if not sync.proxy_parts:
        return tf.group(*steps, name=name)
    with tf.device(ctx.shared_device):
        counter = tf.Variable(0, dtype=tf.int64, trainable=False, name="autodist_step")
        step = counter.assign_add(1)
    refreshes, told = [], []
    for part in sync.proxy_parts:
        shared = part.copies[0]
        if shared.name in updated:  # this node updates the part, and tells the workers
            gate = [updated[shared.name]]
            with tf.control_dependencies(gate):
                told += [_part_token_queue(part, w, ctx).enqueue(tf.constant(0, tf.int64))
                         for w in range(1, ctx.num_nodes)]
        else:
            gate = [_part_token_queue(part, ctx.node_index, ctx).dequeue()]
        with tf.control_dependencies(gate):
            refreshes.append(refresh_proxies(shared, part.readers,
                                             part.part.synchronizer.staleness, step))
    return tf.group(*steps, *told, *refreshes, name=name)


def _part_token_queue(part: PartStorage, worker: int, ctx: KernelContext) -> tf.queue.FIFOQueue:
    """The queue telling worker ``worker`` that ``part`` is updated, beside the part.

    On the part's own device, a worker's wait and its read of the new value run
    there together, without a round trip of their own.
    """
    return token_queue(worker, ctx, f"updated_{part.part.name}",
                       device=ctx.tf_device(part.part.synchronizer.reduction_destination))


def _reconnect(result: DistributedGraph, deferred: list) -> None:
    """Restores control edges that pointed at ops AutoDist recreated."""
    graph, item = result.graph, result.item
    for node, source in deferred:
        if source in item.initializer_of:
            target = result.storage[item.initializer_of[source]].initializer()
        elif source in item.optimizer_call.update_op_names:
            target = result.train_op
        elif source in item.replicated:
            target = tf.group(*[result.replica_element(source, r)
                                for r in range(result.ctx.num_replicas)])
        else:
            target = graph.get_operation_by_name(source)
        _tf_compat.add_control_inputs(graph.get_operation_by_name(node), [target])
