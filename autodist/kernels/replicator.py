"""Replicator: copies the user's model onto every local replica device.

The shared part of the graph (inputs, non-trainable variables, initial values)
is imported once under its original names; the replicated part (everything fed
by a batch or a trainable variable) is imported once per replica under
``AutoDist-Replica-<i>/`` with each replica reading its slice of every batched
input and its own view of every trainable variable; a loop of a replica that
takes a non-trainable variable stored on another device takes a copy on its
own.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import tensorflow as tf

from autodist import _tf_compat
from autodist.cross_replica import BATCH_ROWS, FIRST_ROW, is_cross_replica_sum, marked
from autodist.graph_defs import V1_LOOP_ENTERS, ancestors, data_inputs
from autodist.graph_item import (FUNCTIONAL_CONTROL_FLOW, KEYED_RANDOM_OPS, RESOURCE_WRITES,
                                 GraphItem, VariableReads, op_name, tensor_name,
                                 through_identities)
from autodist.kernel_context import KernelContext, replica_scope
from autodist.synchronizers.base import local_variable

_PLACEMENT_ATTRS = ("_class",)
_VARIABLE_OPS = ("VarHandleOp",)
_LOWER_ATTR = "_lower_using_switch_merge"
_LOOPS = ("While", "StatelessWhile")
# Where a loop or cond of a replica takes its own copy of a shared variable.
_LOOP_COPY = "autodist_loop_copy"


def subgraph_def(item: GraphItem, names: set, external: dict, deferred: list,
              device_for=lambda node: "", with_library: bool = True):
    """GraphDef of the ``names`` nodes, ready to import.

    Colocations are cleared and devices set by ``device_for(node)`` (the strategy
    decides placement, not the single-device graph). Control
    inputs leaving the subgraph are dropped and appended to ``deferred`` as
    (node name, source name) to be reconnected after import; data inputs leaving
    it are counted in ``external`` (tensor name -> None) for the caller to map.
    """
    graph_def = tf.compat.v1.GraphDef()
    graph_def.versions.CopyFrom(item.graph_def.versions)
    if with_library:
        graph_def.library.CopyFrom(item.graph_def.library)
    for node in item.graph_def.node:
        if node.name not in names:
            continue
        new = graph_def.node.add()
        new.CopyFrom(node)
        new.device = device_for(node)
        for attr in _PLACEMENT_ATTRS:
            if attr in new.attr:
                del new.attr[attr]
        del new.input[:]
        for inp in node.input:
            source = op_name(inp)
            if source in names:
                new.input.append(inp)
            elif inp.startswith("^"):
                deferred.append((node.name, source))
            else:
                new.input.append(inp)
                external[inp if ":" in inp else inp + ":0"] = None
    return graph_def


def _shared_variables(item: GraphItem) -> set:
    """The shared (non-trainable) variables' handle ops."""
    return {node.name for node in item.graph_def.node
            if node.name in item.shared and node.op in _VARIABLE_OPS}


def import_shared(item: GraphItem, ctx: KernelContext, deferred: list) -> None:
    """Imports the shared ops into the default graph under their original names.

    Non-trainable variables go to ``ctx.variable_device`` (the chief, so a cluster
    has one global step), ops using them directly follow them, the rest of the
    shared ops (inputs, pipelines) stay on this node's ``ctx.shared_device``.
    """
    variables = _shared_variables(item)

    def device_for(node) -> str:
        if node.name in variables:
            return ctx.variable_device
        if any(op_name(inp) in variables for inp in node.input if not inp.startswith("^")):
            return ""  # resource ops are colocated with their variable
        return ctx.shared_device

    external = {}
    graph_def = subgraph_def(item, item.shared, external, deferred, device_for)
    if external:
        raise NotImplementedError(
            f"Ops outside the model read {sorted(external)}, which AutoDist recreates per "
            "strategy (trainable variables or the optimizer's update); it cannot rewrite "
            "that graph.")
    tf.graph_util.import_graph_def(graph_def, name="")


@dataclasses.dataclass
class Replicas:
    """What ``replicate`` built besides the replicas' ops.

    Attributes:
        state_writes: the ops writing the merged assigns, to run with every
            training step.
        row_reads: variable name -> per replica, the ops reading it where it
            is stored: gathers of its rows, reads of its parts (see
            ``read_where_stored``).
    """

    state_writes: list
    row_reads: dict


def replicate(item: GraphItem, ctx: KernelContext, variable_handles: dict,
              gather_rows: dict, part_products: dict, deferred: list) -> Replicas:
    """Imports one copy of the replicated ops per replica into the default graph.

    State that the forward pass assigns to a shared (non-trainable) variable
    is written once per step, merged from what every replica computed:

    * a float increment, ``v.assign(v + delta)`` with ``delta`` computed from
      the replica's rows (a metric's total and count): the replicas' deltas
      add up, as the rows they count do;
    * any other float assignment (a batch normalization's moving statistics):
      the mean of the replicas' values;
    * anything else (a random seed's counter): the first replica's value, so
      that it advances once per step.

    ``AssignAddVariableOp`` increments are left to every replica (they add up).

    Args:
        variable_handles: trainable variable name -> [resource handle per replica].
        gather_rows: trainable variable name -> ``f(replica, ids)``, the rows
            ``ids`` of its stored copies as the replica reads them; for the
            variables some gather reads (``GraphItem.reads``).
        part_products: trainable variable name -> ``f(replica)``, a
            ``partitioner.PartProducts`` of its parts as the replica reads them;
            for the partitioned variables read whole only by products.
        deferred: receives (node name in the new graph, source name) control
            edges to reconnect.
    """
    graph = tf.compat.v1.get_default_graph()
    external = {}
    local_deferred = []
    contributions = (contribution_shares(item, ctx)
                     if item.scaled_by_share and ctx.total_replicas > 1 else [])
    # The library came with the shared import (the loops' tuned functions come with
    # _tune_cpu_loops); each copy only adds its ops.
    graph_def = subgraph_def(item, item.replicated, external, local_deferred, with_library=False)
    merged = _defer_shared_assigns(item, graph_def)
    assigned = {name: [] for name in merged}
    row_reads = {name: [] for name in {**gather_rows, **part_products}}
    copied = {node.name for node in graph_def.node}
    loop_taken = _take_loop_copies(item, graph_def, external, ctx)
    _tune_cpu_loops(item, graph_def, ctx)
    salt = _salt_random_keys(graph_def)
    _sum_over_replicas(graph_def, ctx)
    replica_input = functools.partial(_replica_input, item, ctx, variable_handles, contributions)
    totals = _whole_step_totals(item, ctx, replica_input)
    positions = _row_positions(item, ctx)
    if ctx.num_replicas > 1:
        _refuse_v1_loops(graph_def, ctx.num_replicas)
    for replica in range(ctx.num_replicas):
        scope = replica_scope(replica)
        device = ctx.replica_tf_device(replica)
        input_map = {}
        with tf.device(device):
            for name in external:
                input_map[name] = replica_input(name, replica)
            input_map.update(totals[replica])
            input_map.update(positions[replica])
            for name in loop_taken:
                handle = graph.get_tensor_by_name(f"{name}:0")
                if not same_device(handle.device, device):
                    # TensorFlow runs a loop where the variables it takes are.
                    dtype = handle.op.get_attr("dtype")
                    handle = replica_copy_handle(name, handle.op.get_attr("shape"), dtype,
                                                 functools.partial(_read, handle, dtype),
                                                 replica, "loop_copy", ctx)
                input_map[f"{name}/{_LOOP_COPY}:0"] = handle
        if salt:
            input_map[salt] = tf.constant([replica * _SALT_STRIDE], tf.uint64)
        for node in graph_def.node:
            node.device = device
            _keep_functional(node)
        _tf_compat.import_graph_def(graph_def, input_map, scope)
        with tf.device(device):
            for name in row_reads:
                gather = gather_rows.get(name)
                products = part_products.get(name)
                row_reads[name].append(read_where_stored(
                    item.reads[name], scope, gather and functools.partial(gather, replica),
                    products and products(replica)))
        deferred.extend((f"{scope}/{node}", source) for node, source in local_deferred)
        for name, merge in merged.items():
            source = merge.delta or f"{name}:0"
            scoped = f"{scope}/{source}" if op_name(source) in copied else source
            assigned[name].append(graph.get_tensor_by_name(scoped))
    per_step = _per_step_scopes(item, merged, assigned)
    shares = None  # each replica's share of the rows, built when a scope needs it
    writes = []
    for name, merge in merged.items():
        values, handle = assigned[name], graph.get_tensor_by_name(merge.resource)
        with tf.device(handle.device):
            if merge.delta is None:
                value = (tf.add_n(values) / float(len(values)) if values[0].dtype.is_floating
                         else values[0])
            else:
                if _computed_once(values):
                    total = values[0]
                elif _scope(merge) in per_step:
                    if shares is None:
                        shares = _row_shares(item, ctx)
                    total = tf.add_n([tf.cast(share, v.dtype) * v
                                      for share, v in zip(shares, values)])
                else:
                    total = tf.add_n(values)
                value = tf.raw_ops.ReadVariableOp(resource=handle, dtype=total.dtype) + total
            writes.append(tf.raw_ops.AssignVariableOp(resource=handle, value=value,
                                                      name=f"{name}/merged"))
    return Replicas(writes, row_reads)


# The group of every replica's device, apart from the synchronizers' groups, and the
# first of its instance keys for the marked sums. The sums the replicator adds itself
# on a cluster (the gathered batch's row counts, the batch totals) take the keys below.
_REPLICA_GROUP_KEY = 2
_REPLICA_INSTANCE_KEYS = 1 << 20
_ROW_COUNTS_KEY = _REPLICA_INSTANCE_KEYS - 1
_FIRST_TOTAL_KEY = _REPLICA_INSTANCE_KEYS - 2  # then downwards, one per total


def _sum_over_cluster(values: list, ctx: KernelContext, instance_key: int) -> list:
    """Per local replica, the sum of ``values`` (one tensor per local replica, of one
    shape on every replica of the cluster) over every replica of every node."""
    sums = []
    for replica, value in enumerate(values):
        with tf.device(ctx.replica_tf_device(replica)):
            flat = tf.reshape(value, [-1])  # a collective takes no scalar
            summed = tf.raw_ops.CollectiveReduceV2(
                input=flat, group_size=ctx.total_replicas, group_key=_REPLICA_GROUP_KEY,
                instance_key=instance_key, ordering_token=[], merge_op="Add",
                final_op="Id")
            sums.append(tf.reshape(summed, tf.shape(value)))
    return sums


def _sum_over_replicas(graph_def, ctx: KernelContext) -> None:
    """Turns the marked sums over the replicas (``cross_replica``) into collective sums.

    Every replica's copy holds the same marked ops, so that the n-th of them (by
    name) sums the same tensor on every replica, under the same instance key:
    one per size of the tensor (n + marks * size), since a collective's shape is
    fixed per key and a gathered batch's rows change from batch to batch.
    """
    sums = sorted((node for node in graph_def.node if is_cross_replica_sum(node)),
                  key=lambda node: node.name)
    if not sums or ctx.total_replicas == 1:
        return  # a mark is an identity

    def new_node(name: str, op: str, inputs: tuple = ()):
        node = graph_def.node.add()
        node.name, node.op = f"autodist_cross_replica/{name}", op
        node.input.extend(inputs)
        node.attr["T" if inputs else "dtype"].type = tf.int32.as_datatype_enum
        return node.name

    def constant(name: str, value: int) -> str:
        node_name = new_node(name, "Const")
        graph_def.node[-1].attr["value"].tensor.CopyFrom(tf.make_tensor_proto(value, tf.int32))
        return node_name

    group_size = constant("group_size", ctx.total_replicas)
    group_key = constant("group_key", _REPLICA_GROUP_KEY)
    marks = constant("marks", len(sums))
    for index, node in enumerate(sums):
        value, size = data_inputs(node)
        first = constant(f"first_key_{index}", _REPLICA_INSTANCE_KEYS + index)
        instance_key = new_node(f"instance_key_{index}", "AddV2", (
            first, new_node(f"key_stride_{index}", "Mul", (size, marks))))
        controls = [i for i in node.input if i.startswith("^")]
        dtype = node.attr["T"].list.type[0]
        node.op = "CollectiveReduceV2"
        node.attr.clear()
        node.attr["T"].type = dtype
        node.attr["merge_op"].s = b"Add"
        node.attr["final_op"].s = b"Id"
        del node.input[:]
        node.input.extend([value, group_size, group_key, instance_key] + controls)


def _row_positions(item: GraphItem, ctx: KernelContext) -> list:
    """Per replica, what it reads for the marked row counts and first rows of a
    gathered batch (``cross_replica.gather_batch``): the global batch's rows, and
    the index of the replica's first row in it (as ``_batch_slice`` cuts the
    node's batch, after the earlier nodes' rows on a cluster).

    Returns:
        per local replica, {a marked tensor's name: its value}.

    Raises:
        NotImplementedError: for a step that gathers rows but is fed no batch.
    """
    counts = [node.name for node in item.graph_def.node if marked(node, BATCH_ROWS)]
    firsts = [node.name for node in item.graph_def.node if marked(node, FIRST_ROW)]
    if not counts and not firsts:
        return [{} for _ in range(ctx.num_replicas)]
    if not item.batched_inputs:
        raise NotImplementedError(
            f"The step gathers a batch's rows over the replicas ('{(counts + firsts)[0]}', "
            "autodist.gather_batch) but is fed no batch AutoDist splits; feed the batch "
            "as the step's arguments.")
    graph = tf.compat.v1.get_default_graph()
    batch = graph.get_tensor_by_name(sorted(item.batched_inputs)[0] + ":0")
    n = ctx.num_replicas
    with tf.device(ctx.shared_device), tf.name_scope("autodist_row_positions"):
        size = tf.shape(batch)[0]
        if ctx.multi_node:
            # The gathered batch is every node's rows, in node order: this node's start
            # after the earlier nodes' rows. Each node's replica 0 tells its row count;
            # every replica reads the sum (a collective's output left unread would
            # leave the others waiting for it).
            mine = tf.one_hot(ctx.node_index, ctx.num_nodes, dtype=tf.int64) * tf.cast(
                size, tf.int64)
            told = [mine] + [tf.zeros_like(mine)] * (n - 1)
            node_rows = [tf.cast(rows, tf.int32)
                         for rows in _sum_over_cluster(told, ctx, _ROW_COUNTS_KEY)]
            starts = [tf.reduce_sum(rows[:ctx.node_index]) for rows in node_rows]
            totals = [tf.reduce_sum(rows) for rows in node_rows]
        else:
            starts, totals = [0] * n, [size] * n
        return [{**{f"{name}:0": totals[r] for name in counts},
                 **{f"{name}:0": starts[r] + _first_row(size, r, n) for name in firsts}}
                for r in range(n)]


def _replica_input(item: GraphItem, ctx: KernelContext, variable_handles: dict,
                   contributions: list, name: str, replica: int) -> tf.Tensor:
    """What replica ``replica``'s copy reads for the tensor ``name`` from outside it."""
    graph = tf.compat.v1.get_default_graph()
    source = op_name(name)
    if source in item.variables:
        return variable_handles[source][replica]
    if source in item.batched_inputs:
        return _batch_slice(graph.get_tensor_by_name(name), replica, ctx.num_replicas)
    if source in item.scaled_by_share and contributions:
        value = graph.get_tensor_by_name(name)
        with tf.name_scope(f"autodist_contribution_shares/replica_{replica}"):
            return value * tf.cast(contributions[replica], value.dtype)
    if source in item.shared:
        return graph.get_tensor_by_name(name)
    raise NotImplementedError(
        f"The model reads '{name}', produced by the optimizer's update; "
        "AutoDist cannot replicate that graph.")


def _whole_step_totals(item: GraphItem, ctx: KernelContext, replica_input) -> list:
    """Per replica, what it reads for each of the step's batch totals (``GraphItem.batch_totals``).

    A replica divides the loss of its rows by the total over the whole step's rows
    times its share of them: weighted by that share (``contribution_shares``), the
    replicas' losses and gradients then add up to the single-device ones, whose
    total counts every row. Each replica's own total is computed once more, from
    its rows, outside its copy of the model (which needs the others' totals).

    Args:
        replica_input: ``f(tensor name, replica)``, what a replica reads for a tensor
            from outside its copy (``_replica_input``).

    Returns:
        per local replica, {a total's tensor name in the graph to import: its value}.
    """
    if not item.batch_totals or ctx.total_replicas == 1:
        return [{} for _ in range(ctx.num_replicas)]
    nodes = {node.name: node for node in item.graph_def.node}
    external = {}
    graph_def = subgraph_def(item, ancestors(nodes, item.batch_totals, control=False)
                             & item.replicated, external, [], with_library=False)
    graph = tf.compat.v1.get_default_graph()
    own = []
    for replica in range(ctx.num_replicas):
        device = ctx.replica_tf_device(replica)
        with tf.device(device):
            input_map = {name: replica_input(name, replica) for name in external}
        for node in graph_def.node:
            node.device = device
        scope = f"autodist_batch_totals/{replica_scope(replica)}"
        _tf_compat.import_graph_def(graph_def, input_map, scope)
        own.append([graph.get_tensor_by_name(f"{scope}/{name}:0")
                    for name in sorted(item.batch_totals)])
    shares = contribution_shares(item, ctx)
    with tf.name_scope("autodist_batch_totals"):
        if ctx.multi_node:  # per replica, each total summed over every node's replicas
            wholes = list(zip(*[_sum_over_cluster(list(values), ctx, _FIRST_TOTAL_KEY - index)
                                for index, values in enumerate(zip(*own))]))
        else:
            with tf.device(ctx.shared_device):
                wholes = [[tf.add_n(list(values)) for values in zip(*own)]] * ctx.num_replicas
        return [{f"{name}:0": whole * tf.cast(share, whole.dtype)
                 for name, whole in zip(sorted(item.batch_totals), replica_wholes)}
                for share, replica_wholes in zip(shares, wholes)]


def _refuse_v1_loops(graph_def, num_replicas: int) -> None:
    """Refuses to copy a ``tf.compat.v1`` loop (control flow v1) onto several replicas.

    TensorFlow knows such a loop by the frame name of its ``Enter`` ops, so the
    replicas' copies would run as one loop with several loop conditions, which
    its executor rejects at the first run ("Invalid loop structure").

    Raises:
        NotImplementedError: naming the first ``Enter`` op and its loop.
    """
    for node in graph_def.node:
        if node.op in V1_LOOP_ENTERS:
            frame = node.attr["frame_name"].s.decode()
            raise NotImplementedError(
                f"AutoDist cannot copy the tf.compat.v1 loop {frame!r} onto {num_replicas} "
                f"replicas: it is built with control flow v1 ({node.op} op {node.name!r}, "
                f"as tf.compat.v1.disable_control_flow_v2() makes tf.compat.v1.while_loop "
                f"and dynamic_rnn build it), whose copies TensorFlow would run as one loop. "
                f"Build the graph with control flow v2, TensorFlow's default: call "
                f"tf.compat.v1.enable_control_flow_v2() before building it, or drop the "
                f"disable_control_flow_v2() (or tf.compat.v1.disable_v2_behavior()) call.")


def _take_loop_copies(item: GraphItem, graph_def, external: dict, ctx: KernelContext) -> list:
    """Points the functional loops and conds of the replicated ``graph_def`` that take
    a shared variable's handle, stored (``import_shared``) off some replica's device,
    at a name of its own, ``<variable>/autodist_loop_copy``, for ``replicate`` to map
    per replica: the variable, or a copy of it on a replica's device, as a loop there
    cannot take a handle of another device's. Drops the ``external`` inputs nothing
    else takes.

    Returns:
        the variables taken so.

    Raises:
        NotImplementedError: naming the loop, for a shared variable that a loop or
            cond may write (a copy would lose the write).
    """
    graph = tf.compat.v1.get_default_graph()
    replicas = [ctx.replica_tf_device(replica) for replica in range(ctx.num_replicas)]
    variables = {name for name in _shared_variables(item)
                 if not all(same_device(graph.get_operation_by_name(name).device, device)
                            for device in replicas)}
    nodes = {n.name: n for n in item.graph_def.node}
    functions = {f.signature.name: f for f in item.graph_def.library.function}
    taken = set()
    for node in graph_def.node:
        if node.op not in FUNCTIONAL_CONTROL_FLOW:
            continue
        for index, inp in enumerate(node.input):
            source = None if inp.startswith("^") else through_identities(nodes, inp)
            if source not in variables:
                continue
            if _writes_resources(node, functions):
                raise NotImplementedError(
                    f"AutoDist cannot replicate the loop or cond '{node.name}': it takes the "
                    f"non-trainable variable '{source}' and writes a variable, and its "
                    "replicas on other devices would each write a copy of their own. Read "
                    "the variable before the loop, or write it after.")
            node.input[index] = f"{source}/{_LOOP_COPY}:0"
            taken.add(source)
    left = {tensor_name(inp) for node in graph_def.node for inp in node.input}
    for name in [name for name in external if name not in left]:
        del external[name]
    return sorted(taken)


def _writes_resources(node, functions: dict) -> bool:
    """Whether a functional control-flow ``node``'s functions, or those they call, hold
    an op writing a resource variable."""
    pending, seen = [node], set()
    while pending:
        current = pending.pop()
        for value in current.attr.values():
            names = ([value.func.name] if value.HasField("func")
                     else [f.name for f in value.list.func])
            for name in names:
                if name in functions and name not in seen:
                    seen.add(name)
                    pending.extend(functions[name].node_def)
        if current.op in RESOURCE_WRITES:
            return True
    return False


def _read(handle: tf.Tensor, dtype: tf.DType) -> tf.Tensor:
    """A read of ``handle``'s variable, on its device."""
    with tf.device(handle.device):
        return tf.raw_ops.ReadVariableOp(resource=handle, dtype=dtype)


def replica_copy_handle(name: str, shape, dtype, value, replica: int, label: str,
                        ctx: KernelContext) -> tf.Tensor:
    """A variable on the replica's device holding ``value()``, refreshed before reads.

    Any consumer of the variable (reads, gathers, loops) can use it unchanged: a
    partitioned variable's parts re-stitched, or a copy of a variable stored on
    another device for a ``tf.while_loop`` or ``tf.cond`` taking it, which
    TensorFlow places with its variables.
    """
    with tf.device(ctx.replica_tf_device(replica)):
        copy = local_variable(tf.zeros(shape, dtype), f"{replica_scope(replica)}/{name}/{label}")
        refresh = copy.assign(value())
        with tf.control_dependencies([refresh]):
            return tf.identity(copy.handle)


def same_device(a: str, b: str) -> bool:
    """Whether two device names name one device (a field one leaves out matches any)."""
    spec_a, spec_b = tf.DeviceSpec.from_string(a), tf.DeviceSpec.from_string(b)
    fields = ("job", "replica", "task", "device_type", "device_index")
    return all(getattr(spec_a, f) is None or getattr(spec_b, f) is None
               or getattr(spec_a, f) == getattr(spec_b, f) for f in fields)


def read_where_stored(reads: VariableReads, scope: str, gather, products) -> list:
    """Points one replica's reads of a variable at where it is stored: a partitioned
    variable's parts, a parameter server's variable. No op of the replica then
    reads the variable whole for them.

    Ops that waited for a replaced read wait for what replaced it; edges to a
    read whose value nothing uses are dropped.

    Args:
        gather: ``f(ids)``, the rows ``ids`` read where they are stored, for
            the replica's gathers; None leaves them.
        products: a ``partitioner.PartProducts`` for the replica's products
            with the variable; None leaves them.

    Returns:
        the new ops reading the variable (gathers, reads of parts).
    """
    graph = tf.compat.v1.get_default_graph()
    instead = {name: [] for name in reads.unused}  # original op -> what to wait for instead
    sites = []  # (an op replaced, its replacement, the original ops it stands for)
    # Products left as they are keep their reads, and so do gathers sharing those.
    kept = set() if products else {site.read for site in reads.products}
    for site in reads.gathers if gather else ():
        if site.read in kept:
            continue
        old = graph.get_operation_by_name(f"{scope}/{site.gather}")
        with tf.name_scope(f"{scope}/{site.gather}/where_stored/"):
            sites.append((old, gather(old.inputs[1]), (site.gather, site.read)))
    for site in reads.products if products else ():
        old = graph.get_operation_by_name(f"{scope}/{site.matmul}")
        transposes = (("transpose_a", "transpose_b") if old.type == "MatMul"
                      else ("adj_x", "adj_y"))
        with tf.name_scope(f"{scope}/{site.matmul}/where_stored/"):
            sites.append((old, products.matmul(old.inputs[1 - site.factor], site.factor,
                                               *map(old.get_attr, transposes)),
                          (site.matmul, site.read)))
    new = [value.op for _, value, _ in sites] + (products.reads if products else [])
    for old, value, replaced in sites:
        value.set_shape(old.outputs[0].shape)
        for consumer in old.outputs[0].consumers():
            for index, tensor in enumerate(consumer.inputs):
                if tensor.name == old.outputs[0].name:
                    _tf_compat.replace_input(consumer, index, value)
        for name in filter(None, replaced):
            instead.setdefault(name, []).append(value.op)
    for waiter, ops in reads.waiting.items():
        replaced = [op for op in ops if op in instead]
        _tf_compat.replace_control_inputs(
            graph.get_operation_by_name(f"{scope}/{waiter}"),
            [graph.get_operation_by_name(f"{scope}/{op}") for op in replaced],
            [replacement for op in replaced for replacement in instead[op]])
    return new


def _keep_functional(node) -> None:
    """Has a traced ``tf.while_loop`` or ``tf.cond`` run as a function on its replica's device.

    TensorFlow would lower it into switch and merge ops for the session, and its
    body's ops, which carry no device, would land on the first CPU: every
    iteration of the other replicas' loops (an LSTM's) would then cross devices.
    """
    if node.op in FUNCTIONAL_CONTROL_FLOW and _LOWER_ATTR in node.attr:
        node.attr[_LOWER_ATTR].b = False


def _tune_cpu_loops(item: GraphItem, graph_def, ctx: KernelContext) -> None:
    """Has the replicated functional loops of CPU replicas run their condition and
    body as a CPU runs them fastest.

    A loop calls them as functions every iteration, and TensorFlow treats those
    functions apart from the session's graph:

    * its default executor hands each of their ops to the inter-op thread pool:
      a cost per op that outweighs a recurrent cell's small products (an LSTM
      over half a batch of 32 rows spent about a tenth of its two-replica step
      on it). The single-threaded executor runs the ops in order on the loop's
      thread. It cannot run control flow, so a loop whose functions hold any
      keeps the default.
    * its oneDNN pass, which gives the graph's float32 products oneDNN's
      kernel, does not reach them; they get it here, in copies of the
      functions (``_tf_compat.with_onednn_matmuls``), added to the graph.

    Both are for CPUs only: the single-threaded executor has no device context
    but the CPU's, and oneDNN's kernel is a CPU kernel, so a GPU node's replicas
    (a node's replicas are all its GPUs or all its CPUs) keep their loops as
    they are. (TensorFlow places a loop with the variables it reads, so a body
    is never cut between devices.)
    """
    if tf.DeviceSpec.from_string(ctx.replica_tf_device(0)).device_type != "CPU":
        return
    library = {function.signature.name: function for function in item.graph_def.library.function}
    single_threaded = _tf_compat.single_threaded_functions(item.graph_def.library)
    onednn = _tf_compat.onednn_matmuls()
    variants = {}  # a loop function's name -> its oneDNN copy, or None
    for node in graph_def.node:
        if node.op not in _LOOPS:
            continue
        if {node.attr["cond"].func.name, node.attr["body"].func.name} <= single_threaded:
            _tf_compat.run_loop_single_threaded(node)
        for key in ("cond", "body") if onednn else ():
            name = node.attr[key].func.name
            if name not in variants:
                variants[name] = _tf_compat.with_onednn_matmuls(library[name])
            if variants[name] is not None:
                node.attr[key].func.name = variants[name].signature.name
    added = tf.compat.v1.GraphDef()
    added.library.function.extend(v for v in variants.values() if v is not None)
    if added.library.function:
        tf.graph_util.import_graph_def(added, name="")


def _computed_once(values: list) -> bool:
    """Whether every replica's value is the same shared tensor, computed from no replica's rows."""
    return len({v.name for v in values}) == 1


def _scope(merge: "_Merge") -> str:
    """The name scope of the variable a merge writes: the object owning it (a metric)."""
    return _owner(op_name(merge.resource))


def _owner(variable: str) -> str:
    """A variable name's scope, or "" (no owner to group by) for a top-level name."""
    return variable.rpartition("/")[0]


def _per_step_scopes(item: GraphItem, merged: dict, assigned: dict) -> set:
    """Scopes of variables that count steps, not rows: a metric fed one value per step.

    A ``keras.metrics.Mean`` fed a scalar (a ``train_step``'s loss tracker, the
    loss of one output) adds the value to its total and 1 to its count: the
    count's increment is computed from no replica's rows (it runs once, in the
    shared graph). Every replica's value then stands for the whole batch, so
    the totals of that scope add the replicas' values weighted by their shares
    of the rows (their mean, with an even split), not their sum; a metric
    counting rows adds them up.
    """
    scopes = set()
    for name, merge in merged.items():
        values = assigned[name]
        if merge.delta is not None and len(values) > 1 and _computed_once(values):
            scopes.add(_scope(merge))
    nodes = {node.name: node for node in item.graph_def.node}
    for node in item.graph_def.node:
        if node.op != "AssignVariableOp" or node.name not in item.shared:
            continue
        variable = nodes.get(op_name(node.input[0]))
        if (variable is not None and variable.op in _VARIABLE_OPS
                and tf.as_dtype(node.attr["dtype"].type).is_floating
                and _increment(nodes, node.input[1], variable.name) is not None):
            scopes.add(_owner(variable.name))
    return scopes - {""}


def _row_shares(item: GraphItem, ctx: KernelContext) -> list:
    """Each local replica's share of the step's rows (1/n each without a fed batch)."""
    weights = row_weights(item, ctx)
    if not weights:
        return [1.0 / ctx.num_replicas] * ctx.num_replicas
    return [w / float(ctx.num_replicas) for w in weights]


@dataclasses.dataclass(frozen=True)
class _Merge:
    """A replicated assign to a shared variable, merged over the replicas."""

    resource: str          # the variable's handle (shared, original name)
    delta: Optional[str]   # for a float increment, the tensor it adds


_SALT = "autodist_replica_salt"
_SALT_STRIDE = 0x9E3779B97F4A7C15  # spreads the replicas' keys apart


def _salt_random_keys(graph_def) -> str:
    """Makes each replica draw its own random numbers (e.g. dropout masks).

    A traced Keras step derives the key of its stateless random ops from a
    shared seed; left alone, every replica would draw the same mask for its
    rows. Each such op's key is XORed with a per-replica salt, 0 on replica 0.

    Returns:
        the salt placeholder's tensor name to map per replica, or "" when the
        graph has no such op.
    """
    keyed = [node for node in graph_def.node if node.op in KEYED_RANDOM_OPS]
    if not keyed:
        return ""
    salt = graph_def.node.add()
    salt.name, salt.op = _SALT, "Placeholder"
    salt.attr["dtype"].type = tf.uint64.as_datatype_enum
    for node in keyed:
        xor = graph_def.node.add()
        xor.name, xor.op = f"{node.name}/salted_key", "BitwiseXor"
        xor.attr["T"].type = tf.uint64.as_datatype_enum
        xor.input.extend([node.input[1], _SALT])
        node.input[1] = xor.name
    return f"{_SALT}:0"


def _increment(nodes: dict, value: str, variable: str) -> Optional[str]:
    """The ``delta`` of a value ``read(variable) + delta``, or None for another value."""
    node = nodes.get(through_identities(nodes, value))
    if node is None or node.op not in ("AddV2", "Add"):
        return None
    first, second = [i for i in node.input if not i.startswith("^")][:2]
    for read, delta in ((first, second), (second, first)):
        reader = nodes.get(through_identities(nodes, read))
        if (reader is not None and reader.op == "ReadVariableOp"
                and op_name(reader.input[0]) == variable):
            return tensor_name(delta)
    return None


def _defer_shared_assigns(item: GraphItem, graph_def) -> dict:
    """Turns the replicated graph's assigns to shared variables into plain values.

    Each such ``AssignVariableOp`` becomes an ``Identity`` of the value it would
    write (control edges to it still hold), so that every replica's value can be
    merged into one write.

    Returns:
        node name -> how to merge it
    """
    nodes = {node.name: node for node in item.graph_def.node}
    merged = {}
    for node in graph_def.node:
        if node.op != "AssignVariableOp":
            continue
        resource, value = node.input[0], node.input[1]
        source = nodes.get(op_name(resource))
        if source is None or source.name not in item.shared or source.op not in _VARIABLE_OPS:
            continue
        dtype = node.attr["dtype"].type
        delta = (_increment(nodes, value, source.name)
                 if tf.as_dtype(dtype).is_floating else None)
        merged[node.name] = _Merge(tensor_name(resource), delta)
        controls = [inp for inp in node.input if inp.startswith("^")]
        node.op = "Identity"
        node.attr.clear()
        node.attr["T"].type = dtype
        del node.input[:]
        node.input.extend([value] + controls)
    return merged


def _first_row(size: tf.Tensor, replica: int, num_replicas: int) -> tf.Tensor:
    """The index of replica i's first row in a batch of ``size`` rows: i*B/n."""
    return size * replica // num_replicas


def _batch_slice(batch: tf.Tensor, replica: int, num_replicas: int) -> tf.Tensor:
    """Rows [i*B/n, (i+1)*B/n) of a batch: replica i's share."""
    size = tf.shape(batch, out_type=tf.int64)[0]
    return batch[_first_row(size, replica, num_replicas):
                 _first_row(size, replica + 1, num_replicas)]


def gradient_weights(item: GraphItem, ctx: KernelContext, call: int) -> list:
    """Per replica, the factor of its gradient that makes it the replica's contribution.

    The synchronizers add the replicas' contributions up: each is its gradient
    times its share of the cluster's rows (``contribution_shares``). Where the
    backward pass already carries that share (its seeds or loss scale are
    scaled, ``GraphItem.gradients_scaled_by_share``), the factor is 1.

    Returns:
        one scalar per local replica, or [] when every factor is 1.
    """
    if ctx.total_replicas == 1 or item.gradients_scaled_by_share(call):
        return []
    return contribution_shares(item, ctx)


def contribution_shares(item: GraphItem, ctx: KernelContext) -> list:
    """Per local replica, its share of the rows the whole cluster trains on in a step.

    Each replica's loss is the mean over its own rows; so weighted, its
    gradient holds each row's term as the single-device gradient of the whole
    batch does, and the replicas' gradients add up to that gradient. Scaled at
    the backward pass's start, the float16 values of a mixed-precision
    backward pass are also the ones a single device computes (the same
    overflow, the same skipped step).

    Returns:
        one float or float64 scalar tensor per local replica.
    """
    scale = ctx.num_replicas / ctx.total_replicas
    with tf.device(ctx.shared_device), tf.name_scope("autodist_contribution_shares"):
        return [share * scale for share in _row_shares(item, ctx)]


def row_weights(item: GraphItem, ctx: KernelContext) -> list:
    """Per replica, its share of the batch's rows times the number of replicas.

    A replica's gradient of a loss averaged over its rows, scaled by this
    weight, averages over the replicas to the gradient of the loss averaged
    over the whole batch, also when the rows do not split evenly (the last
    batch of an epoch); with an even split every weight is 1.

    Returns:
        one float64 scalar per local replica, or [] when the graph has no fed
        batch or a single replica.
    """
    if not item.batched_inputs or ctx.num_replicas == 1:
        return []
    graph = tf.compat.v1.get_default_graph()
    batch = graph.get_tensor_by_name(sorted(item.batched_inputs)[0] + ":0")
    n = ctx.num_replicas
    with tf.device(ctx.shared_device), tf.name_scope("autodist_row_weights"):
        size = tf.shape(batch, out_type=tf.int64)[0]
        return [tf.cast(n * (_first_row(size, r + 1, n) - _first_row(size, r, n)), tf.float64)
                / tf.cast(size, tf.float64) for r in range(n)]
