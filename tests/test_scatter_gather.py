"""The scatter-gather all-reduce (``Spec.SCATTER_GATHER``): a node's graph on a cluster,
its slices and queues, and the compiler's rule for a group's spec.

Its training results are checked against one device in test_equivalence (one node)
and test_multinode (two and three nodes, with and without a split step)."""
import socket
import threading

import numpy as np
import pytest
import tensorflow as tf

import models
from autodist import _tf_compat
from autodist.graph_item import GraphItem
from autodist.kernel_context import KernelContext
from autodist.kernels.transformer import transform
from autodist.proto import synchronizers_pb2
from autodist.resource_spec import ResourceSpec
from autodist.strategy import AllReduce, StrategyError
from autodist.strategy.compiler import compile_strategy
from autodist.synchronizers import base
from autodist.synchronizers.base import piece_sizes
from autodist.synchronizers.scatter_gather import node_buffer, slice_sizes, sum_across_nodes

pytestmark = pytest.mark.timeout(60)

SG = synchronizers_pb2.AllReduceSynchronizer.SCATTER_GATHER
NODES = ("/job:worker/task:0/device:CPU:0", "/job:worker/task:1/device:CPU:0",
         "/job:worker/task:2/device:CPU:0")
DEVICES = {"10.0.0.1:CPU:0": NODES[0], "10.0.0.2:CPU:0": NODES[1],
           "10.0.0.2:CPU:1": "/job:worker/task:1/device:CPU:1", "10.0.0.3:CPU:0": NODES[2]}
SPEC = {"nodes": [{"address": "10.0.0.1", "cpus": [0], "chief": True},
                  {"address": "10.0.0.2", "cpus": [0, 1]},
                  {"address": "10.0.0.3", "cpus": [0]}]}
# The second node's view: two of the cluster's four replicas are its own.
CONTEXT = KernelContext(replica_devices=("10.0.0.2:CPU:0", "10.0.0.2:CPU:1"),
                        tf_devices=DEVICES, shared_device=NODES[1], chief_device=NODES[0],
                        node_index=1, num_nodes=3, group_size=4,
                        all_replicas=("10.0.0.1:CPU:0", "10.0.0.2:CPU:0", "10.0.0.2:CPU:1",
                                      "10.0.0.3:CPU:0"),
                        node_devices=NODES, has_remote_ops=True)


def test_slices_are_as_even_as_can_be():
    assert slice_sizes(10, 3) == [4, 3, 3]
    assert slice_sizes(9, 3) == [3, 3, 3]
    assert slice_sizes(2, 3) == [1, 1, 0]


def _item(model):
    calls = []
    with tf.Graph().as_default() as graph, _tf_compat.capture_apply_gradients(calls.append):
        model(lambda: tf.compat.v1.train.GradientDescentOptimizer(0.1))
    return GraphItem(graph, calls)


def _node_graph(model, builder=None):
    item = _item(model)
    spec = ResourceSpec.from_dict(SPEC)
    strategy = (builder or AllReduce(all_reduce_spec="SCATTER_GATHER")).build(item, spec)
    return transform(item, compile_strategy(strategy, item, spec), CONTEXT).graph, item


def test_a_node_sums_its_replicas_then_sends_each_node_its_slice_and_gathers_the_sums():
    graph, item = _node_graph(models.dense_mlp)
    ops = graph.get_operations()
    assert not [op for op in ops if op.type.startswith("Collective")]
    elements = sum(v.num_elements for v in item.trainable_variables)  # one group
    sizes = slice_sizes(elements, 3)
    enqueues = {op.inputs[0].op.name: op for op in ops if op.type == "QueueEnqueueV2"}
    queue_device = {name.split("/")[0]: op.device for name, op in enqueues.items()}
    # Its slices of the replicas' sum go to nodes 0 and 2, on their devices ...
    for node, phase in ((0, "reduce"), (2, "reduce"), (0, "gather"), (2, "gather")):
        name = next(n for n in queue_device if n.endswith(f"_{phase}_1_to_{node}"))
        assert queue_device[name] == NODES[node], name
    reduce_in = [op for op in ops if op.type == "QueueEnqueueV2"
                 and op.inputs[0].op.name.endswith("_reduce_1_to_0")][0]
    assert reduce_in.inputs[1].shape.num_elements() == sizes[0]
    assert reduce_in.inputs[1].op.inputs[0].op.type == "AddN"  # the node's two replicas
    # ... and it dequeues the others' slices and sums on its own CPU.
    dequeues = [op for op in ops if op.type == "QueueDequeueV2"]
    assert {op.device for op in dequeues} == {NODES[1]}
    assert sorted(op.outputs[0].shape.num_elements() for op in dequeues) == sorted(
        [sizes[1], sizes[1], sizes[0], sizes[2]])


def test_sparse_rows_travel_to_every_node_through_queues():
    graph, _ = _node_graph(models.embedding)
    ops = graph.get_operations()
    assert not [op for op in ops if op.type.startswith("Collective")]
    rows = [op for op in ops if op.type == "QueueEnqueueV2"
            and "_rows_" in op.inputs[0].op.name]
    assert sorted(op.device for op in rows) == [NODES[0], NODES[2]]
    assert all(op.inputs[2].dtype == tf.int64 for op in rows)  # indices ride along


def test_a_group_mixing_specs_is_refused():
    item = _item(models.dense_mlp)
    spec = ResourceSpec.from_dict(SPEC)
    strategy = AllReduce().build(item, spec)
    strategy.node_config[0].AllReduceSynchronizer.spec = SG
    with pytest.raises(StrategyError, match=r"all-reduce group 0 mixes specs \(.*'w1' "
                                            r"SCATTER_GATHER"):
        compile_strategy(strategy, item, spec)


def test_only_a_collective_spec_needs_collective_steps():
    from autodist.synchronizers import KINDS
    kind = KINDS["AllReduceSynchronizer"]
    config = synchronizers_pb2.AllReduceSynchronizer(spec=SG)
    assert not kind.uses_collectives(config) and kind.uses_remote_ops(config)
    config.spec = synchronizers_pb2.AllReduceSynchronizer.AUTO
    assert kind.uses_collectives(config) and not kind.uses_remote_ops(config)


def test_a_node_s_buffer_keeps_the_members_order_whichever_it_got_summed():
    """A member may come as each replica's gradient or as the node's sum already (one
    product over its rows, kernels.node_products); a node with one replica gets every
    member alike. The buffers must line up element by element across nodes."""
    a = [tf.constant([[1.0, 2.0]]), tf.constant([[10.0, 20.0]])]
    summed = [tf.constant([5.0, 6.0, 7.0])]
    c = [tf.constant([100.0]), tf.constant([200.0])]
    two_replicas = node_buffer([a, summed, c])
    one_replica = node_buffer([[a[0]], summed, [c[0]]])
    np.testing.assert_array_equal(two_replicas.numpy(), [11, 22, 5, 6, 7, 300])
    np.testing.assert_array_equal(one_replica.numpy(), [1, 2, 5, 6, 7, 100])


def test_a_large_slice_travels_in_pieces_no_larger_than_the_bound(monkeypatch):
    monkeypatch.setattr(base, "PIECE_BYTES", 16)
    graph, item = _node_graph(models.dense_mlp)
    elements = sum(v.num_elements for v in item.trainable_variables)
    sizes = slice_sizes(elements, 3)
    enqueues = [op for op in graph.get_operations() if op.type == "QueueEnqueueV2"
                and "_reduce_1_to_0" in op.inputs[0].op.name]
    want = piece_sizes(sizes[0], 4)
    assert len(want) > 1 and max(want) * 4 <= 16
    assert sorted(op.inputs[1].shape.num_elements() for op in enqueues) == sorted(want)
    # Each piece of this node's own slice is summed on its own.
    sums = [op for op in graph.get_operations() if op.type == "AddN" and any(
        i.op.type == "QueueDequeueV2" and "_reduce_" in i.op.name for i in op.inputs)]
    assert len(sums) == len(piece_sizes(sizes[1], 4))


def _free_ports(count: int) -> list:
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("localhost", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def test_two_nodes_exchange_a_buffer_in_pieces_and_both_get_the_sum(monkeypatch):
    """Two TensorFlow servers in this process stand for two nodes; each node's graph
    is built for its own context, as every node builds its own, and run at once."""
    monkeypatch.setattr(base, "PIECE_BYTES", 64)
    cluster = tf.train.ClusterSpec({"worker": [f"localhost:{p}" for p in _free_ports(2)]})
    servers = [tf.distribute.Server(cluster, "worker", task) for task in range(2)]
    nodes = tuple(f"/job:worker/task:{task}/device:CPU:0" for task in range(2))
    replicas = ("10.0.0.1:CPU:0", "10.0.0.2:CPU:0")
    values = [np.arange(101, dtype=np.float32) * (task + 1) for task in range(2)]
    graphs, results = [], {}
    for task in range(2):
        ctx = KernelContext(replica_devices=(replicas[task],),
                            tf_devices=dict(zip(replicas, nodes)), shared_device=nodes[task], chief_device=nodes[0], node_index=task,
                            num_nodes=2, group_size=2, all_replicas=replicas, node_devices=nodes,
                            has_remote_ops=True)
        with tf.Graph().as_default() as graph:
            with tf.device(nodes[task]):
                buffer = tf.constant(values[task])
            total, sends = sum_across_nodes(buffer, 7, ctx)
            graphs.append((graph, total, sends))
    sent = [len(sends) for _, _, sends in graphs]
    assert sent == [2 * len(piece_sizes(50, 4))] * 2  # 101 elements: slices of 51 and 50

    def run(task):
        graph, total, sends = graphs[task]
        with tf.compat.v1.Session(servers[task].target, graph=graph) as sess:
            results[task] = sess.run([total, sends])[0]

    threads = [threading.Thread(target=run, args=(task,)) for task in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    for task in range(2):
        np.testing.assert_array_equal(results[task], values[0] + values[1])


def test_a_value_carried_to_another_device_goes_in_pieces(monkeypatch):
    monkeypatch.setattr(base, "PIECE_BYTES", 40)
    with tf.Graph().as_default() as graph:
        value = tf.reshape(tf.range(60, dtype=tf.float32), [6, 10])
        moved = base.carried(value, "/device:CPU:0", "/device:CPU:1")
        small = tf.constant([1.0, 2.0])
        assert base.carried(small, "/device:CPU:0", "/device:CPU:1") is small
        split = [op for op in graph.get_operations() if op.type == "SplitV"]
        assert len(split) == 1 and len(split[0].outputs) == 6  # 60 floats, 10 per piece
        assert split[0].device == "/device:CPU:0"
        assert moved.op.inputs[0].op.device == "/device:CPU:1"
        config = tf.compat.v1.ConfigProto(device_count={"CPU": 2})
        with tf.compat.v1.Session(graph=graph, config=config) as sess:
            np.testing.assert_array_equal(*sess.run([moved, value]))
