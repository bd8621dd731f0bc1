"""The PS synchronizer on a cluster: where a node's gradients are summed, when proxies refresh."""
import dataclasses

import pytest
import tensorflow as tf

import models
from autodist import _tf_compat
from autodist.graph_item import GraphItem
from autodist.kernel_context import KernelContext
from autodist.synchronizers.base import Member
from autodist.synchronizers.ps import node_contribution
from autodist.kernels.transformer import transform
from autodist.resource_spec import ResourceSpec
from autodist.strategy import common
from autodist.strategy.compiler import compile_strategy
from autodist.strategy.ps_builders import PSLoadBalancing

CHIEF, WORKER = "/job:worker/task:0/device:CPU:0", "/job:worker/task:1/device:CPU:0"
DEVICES = {"10.0.0.1:CPU:0": CHIEF, "10.0.0.2:CPU:0": WORKER,
           "10.0.0.2:CPU:1": "/job:worker/task:1/device:CPU:1"}
# The worker's view of a cluster: the chief with one replica, the worker with two.
WORKER_CONTEXT = KernelContext(replica_devices=("10.0.0.2:CPU:0", "10.0.0.2:CPU:1"),
                               tf_devices=DEVICES, shared_device=WORKER, chief_device=CHIEF,
                               node_index=1, num_nodes=2, group_size=3, has_remote_ops=True)


def _contribution(transfer_destination: str, node_sum: bool = False) -> tf.Tensor:
    """The worker's contribution of two replica gradients; with ``node_sum``, the node
    also knows their sum as one tensor (``kernels.node_products``)."""
    sync = common.ps_node_config("w", "10.0.0.1:CPU:0",
                                 transfer_destination=transfer_destination).PSSynchronizer
    with tf.Graph().as_default():
        grads = [tf.constant([1.0, 2.0]), tf.constant([3.0, 4.0])]
        with tf.device(WORKER):
            known = tf.constant([4.0, 6.0], name="node_sum")
        member = Member(None, grads, None, node_sum=(lambda: known) if node_sum else None)
        return node_contribution(member, sync, WORKER_CONTEXT)


@pytest.mark.parametrize("node_sum", [False, True])
def test_without_a_transfer_destination_the_server_sums_every_replicas_gradient(node_sum):
    summed = _contribution("", node_sum)
    assert summed.device == CHIEF
    assert summed.op.type == "AddN"  # of both replicas' gradients, which travel


@pytest.mark.parametrize("named", ["10.0.0.1:CPU:0", "10.0.0.2:CPU:0"])
def test_with_a_transfer_destination_each_node_sums_on_its_own_cpu(named):
    # Whatever device is named, the worker's two gradients leave it as one sum.
    summed = _contribution(named)
    assert summed.device == WORKER
    assert summed.op.type == "AddN"
    assert _contribution(named, node_sum=True).op.name == "node_sum"


# When a proxy is refreshed: as soon as its own part is updated, so on a cluster
# the pulls of parts updated first overlap the pushes of the others.
CHIEF_CONTEXT = KernelContext(replica_devices=("10.0.0.1:CPU:0",), tf_devices=DEVICES,
                              shared_device=CHIEF, chief_device=CHIEF, node_index=0,
                              num_nodes=2, group_size=3, has_remote_ops=True)
SPEC = {"nodes": [{"address": "10.0.0.1", "cpus": [0], "chief": True},
                  {"address": "10.0.0.2", "cpus": [0, 1]}]}


def _transformed(ctx: KernelContext, staleness: int = 0, all_reduced: tuple = ()) -> tuple:
    """(this node's graph, the strategy) of the dense MLP, every variable behind proxies
    but those in ``all_reduced``."""
    calls = []
    with tf.Graph().as_default() as graph, _tf_compat.capture_apply_gradients(calls.append):
        models.dense_mlp(lambda: tf.compat.v1.train.GradientDescentOptimizer(0.1))
    item = GraphItem(graph, calls)
    spec = ResourceSpec.from_dict(SPEC)
    strategy = PSLoadBalancing(local_proxy_variable=True, sync=not staleness,
                               staleness=staleness).build(item, spec)
    for index, node in enumerate(strategy.node_config):
        if node.var_name in all_reduced:
            strategy.node_config[index].CopyFrom(common.ar_node_config(node.var_name, 0))
    return transform(item, compile_strategy(strategy, item, spec), ctx).graph, strategy


def _ancestors(op: tf.Operation) -> set:
    seen, todo = set(), [op]
    while todo:
        current = todo.pop()
        for parent in [t.op for t in current.inputs] + list(current.control_inputs):
            if parent not in seen:
                seen.add(parent)
                todo.append(parent)
    return seen


def _refreshes(graph: tf.Graph) -> dict:
    """Variable name -> the ops refreshing its proxies (not their initializers)."""
    found = {}
    for op in graph.get_operations():
        target = op.inputs[0].op.name if op.type == "AssignVariableOp" else ""
        if target.endswith("/proxy") and not op.name.startswith(target):
            found.setdefault(target.split("/")[1], []).append(op)
    return found


def _shared_name(queue_op: tf.Operation) -> str:
    return queue_op.get_attr("shared_name").decode()


def test_a_worker_refreshes_each_proxy_on_its_parts_own_token():
    graph, strategy = _transformed(WORKER_CONTEXT)
    destinations = {n.var_name: n.PSSynchronizer.reduction_destination
                    for n in strategy.node_config}
    refreshes = _refreshes(graph)
    assert sorted(refreshes) == ["b1", "w1", "w2"]
    assert len(set(destinations.values())) == 2  # parts on both nodes
    for name, ops in refreshes.items():
        assert len(ops) == 2  # one proxy per local replica
        for op in ops:
            queues = [a for a in _ancestors(op) if a.type == "FIFOQueueV2"]
            # Only this part's queue, beside the part; not the whole step's token.
            assert [_shared_name(q) for q in queues] == [f"autodist_updated_{name}_1"]
            assert queues[0].device == DEVICES[destinations[name]]


def test_the_chief_refreshes_each_proxy_after_its_own_update_only():
    graph, _ = _transformed(CHIEF_CONTEXT)
    updates = {op.inputs[0].op.name: op for op in graph.get_operations()
               if op.type == "ResourceApplyGradientDescent"}
    assert sorted(updates) == ["b1", "w1", "w2"]
    for name, ops in _refreshes(graph).items():
        before = _ancestors(ops[0])
        assert {n for n, update in updates.items() if update in before} == {name}
        # And it lets the worker know, through that part's queue.
        told = [op for op in graph.get_operations() if op.type == "QueueEnqueueV2"
                and updates[name] in _ancestors(op)
                and _shared_name(op.inputs[0].op).startswith("autodist_updated_")]
        assert [_shared_name(op.inputs[0].op) for op in told] == [f"autodist_updated_{name}_1"]


def test_in_a_split_step_each_update_waits_for_its_own_gradients_only():
    # PS and AllReduce on a cluster split the step; the PS run's updates must not
    # wait for every push, or no proxy refresh could overlap a push.
    graph, _ = _transformed(dataclasses.replace(CHIEF_CONTEXT, has_collectives=True),
                            all_reduced=("b1",))
    updates = {op.inputs[0].op.name: op for op in graph.get_operations()
               if op.type == "ResourceApplyGradientDescent"}
    pushes = {op.inputs[0].op.name.split("/")[0]: op for op in graph.get_operations()
              if op.type == "ResourceAccumulatorApplyGradient"}
    assert sorted(pushes) == ["w1", "w2"]
    for name in ("w1", "w2"):
        assert {n for n, push in pushes.items() if push in _ancestors(updates[name])} == {name}
    assert sorted(_refreshes(graph)) == ["w1", "w2"]


def test_with_staleness_the_chief_prefills_each_parts_queue():
    graph, _ = _transformed(CHIEF_CONTEXT, staleness=2)
    prefilled = sorted(_shared_name(op.inputs[0].op) for op in graph.get_operations()
                       if op.type == "QueueEnqueueManyV2")
    assert prefilled == ["autodist_sync_token_1", "autodist_updated_b1_1",
                         "autodist_updated_w1_1", "autodist_updated_w2_1"]
