"""A node's replica gradients of a dense layer add up as one product over its rows.

The replicas' weight gradients ``x_r^T @ dy_r`` add up to one product of their
factors joined along the rows; the node computes that on its CPU, for the
whole variable or each of its parts, instead of a gradient per replica and
their sum. Each case proves the rewrite ran (the product on the node's CPU over
every row of the batch, the replicas' own products not run) and that training
equals single-device training.
"""
from __future__ import annotations

import contextlib

import keras
import numpy as np
import pytest
import tensorflow as tf

from autodist import AutoDist
from autodist.kernel_context import KernelContext
from autodist.kernels.node_products import NodeProduct, node_product
from autodist.partition import PartitionPlan
from autodist.strategy import PS, AllReduce, PartitionedPS
from test_keras import assert_same, snapshot

tf1 = tf.compat.v1

ROWS = 7  # split 3 / 4 between the two replicas


@pytest.mark.parametrize("transpose_a", [False, True])
@pytest.mark.parametrize("transpose_b", [False, True])
def test_the_replicas_products_add_up_to_one_product_of_their_joined_factors(
        transpose_a, transpose_b):
    rng = np.random.default_rng(0)
    graph = tf.Graph()
    with graph.as_default():
        products, want = [], 0.0
        for rows in (3, 4):
            left, right = rng.normal(size=(rows, 5)), rng.normal(size=(rows, 6))
            want = want + left.T @ right
            products.append(tf.linalg.matmul(
                tf.constant(left.T if not transpose_a else left, tf.float32),
                tf.constant(right if not transpose_b else right.T, tf.float32),
                transpose_a=transpose_a, transpose_b=transpose_b).op)
        node = NodeProduct(products, [], "/device:CPU:0", "node_product")
        rows_cut = PartitionPlan(axis=0, sizes=(2, 3), shape=(5, 6))
        columns_cut = PartitionPlan(axis=1, sizes=(4, 2), shape=(5, 6))
        sums = [node.whole(), node.part(rows_cut, 0), node.part(rows_cut, 1),
                node.part(columns_cut, 0), node.part(columns_cut, 1)]
        assert node.whole() is sums[0]  # built once
    with tf1.Session(graph=graph) as session:
        whole, *parts = session.run(sums)
    # float32 sums against float64's: an entry near zero needs the absolute bound.
    np.testing.assert_allclose(whole, want, rtol=1e-5, atol=1e-6)
    for got, expected in zip(parts, [want[:2], want[2:], want[:, :4], want[:, 4:]]):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


WIDTH = 600  # wide enough that the join's copy costs less than the sum it replaces


def _dense_model() -> keras.Model:
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((WIDTH,)),
                              keras.layers.Dense(512, activation="relu", name="h"),
                              keras.layers.Dense(2, name="out")], name="dense")
    # Adam's default epsilon (1e-7) turns the last bit of a near-zero gradient entry,
    # which the node's one product rounds differently from the replicas' sum, into
    # up to a whole step of difference; a larger one keeps the comparison on the sums.
    model.compile(optimizer=keras.optimizers.Adam(0.01, epsilon=1e-3), loss="mse",
                  metrics=["mae"])
    return model


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("builder", [AllReduce, PartitionedPS, PS])
def test_a_dense_model_trains_as_on_one_device_from_one_product_per_part(spec_path, builder):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4 * ROWS, WIDTH)).astype("float32")
    y = rng.normal(size=(4 * ROWS, 2)).astype("float32")
    runs = []
    for ad in (None, AutoDist(resource_spec_file=spec_path, strategy_builder=builder())):
        with ad.scope() if ad else contextlib.nullcontext():
            model = _dense_model()
        history = model.fit(x, y, batch_size=ROWS, epochs=2, shuffle=False, verbose=0)
        runs.append(snapshot(model, model.optimizer, history.history))
    assert_same(runs[1], runs[0], builder.__name__)
    distributed = model._autodist_fit.step.session.distributed
    # The wide kernel's sum is one product per part; the narrow one's is not worth a join.
    for kernel, expected in (("dense/h/kernel", True), ("dense/out/kernel", False)):
        parts = distributed.storage[kernel].compiled.plan
        products = [op for op in distributed.graph.get_operations()
                    if op.name.startswith(f"{kernel}/node_product") and op.type == "MatMul"]
        assert len(products) == ((parts.num_parts if parts else 1) if expected else 0)
        assert {op.device for op in products} <= {"/device:CPU:0"}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_step_runs_the_weight_gradient_once_over_the_node_s_rows(spec_path):
    """``w``'s gradient is one product: the node computes it over all 7 rows, and no
    replica runs its own. ``v``, used twice, has a sum of two products per replica
    (and is too narrow for a join to pay): no node product, and the replicas
    compute their gradients as before."""
    rng = np.random.default_rng(0)
    feeds_np = (rng.normal(size=(ROWS, WIDTH)).astype("float32"),
                rng.normal(size=(ROWS, 3)).astype("float32"))
    trained = []
    for ad in (None, AutoDist(resource_spec_file=spec_path, strategy_builder=AllReduce())):
        with tf.Graph().as_default(), ad.scope() if ad else contextlib.nullcontext():
            x = tf1.placeholder(tf.float32, [None, WIDTH], name="x")
            y = tf1.placeholder(tf.float32, [None, 3], name="y")
            w = tf1.get_variable("w", [WIDTH, 512],
                                 initializer=tf1.glorot_uniform_initializer(seed=1))
            v = tf1.get_variable("v", [512, 3], initializer=tf1.glorot_uniform_initializer(seed=2))
            hidden = tf.tanh(x @ w)
            loss = tf.reduce_mean(tf.square(hidden @ v + tf.tanh(hidden @ v) - y))
            train_op = tf1.train.GradientDescentOptimizer(0.1).minimize(loss)
            feeds = dict(zip((x, y), feeds_np))
            session = ad.create_distributed_session() if ad else tf1.Session()
            if not ad:
                session.run(tf1.global_variables_initializer())
            metadata = tf1.RunMetadata()
            for _ in range(2):
                session.run(train_op, feeds, run_metadata=metadata, options=tf1.RunOptions(
                    trace_level=tf1.RunOptions.FULL_TRACE))
            trained.append(session.run([w, v]))
    for got, want in zip(*reversed(trained)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    distributed = session.distributed
    ran = {node.node_name: (dev.device, node) for dev in metadata.step_stats.dev_stats
           for node in dev.node_stats}
    graph = distributed.graph

    def products(name):
        """Each replica's products summed into its gradient of ``name``, through identities."""
        found = []
        for replica in range(2):
            op = graph.get_tensor_by_name(
                f"AutoDist-Replica-{replica}/{distributed.item.gradients[name].values}").op
            for tensor in (op.inputs if op.type == "AddN" else [op.outputs[0]]):
                while tensor.op.type == "Identity":
                    tensor = tensor.op.inputs[0]
                found.append(tensor.op)
        assert {op.type for op in found} == {"MatMul"}
        return found

    product, = [op for op in graph.get_operations()
                if op.name.startswith("w/node_product") and op.type == "MatMul"]
    device, _ = ran[product.name]
    assert device.endswith("CPU:0")
    left = ran[product.inputs[0].op.name][1].output[0].tensor_description.shape
    assert [d.size for d in left.dim] == [ROWS, WIDTH]  # every row of the batch
    replica_products = products("w")
    assert len(replica_products) == 2 and not any(op.name in ran for op in replica_products)
    # v's replicas compute their two products each; the node adds their sums up.
    assert not any(op.name.startswith("v/node_product") for op in graph.get_operations())
    replica_products = products("v")
    assert len(replica_products) == 4 and all(op.name in ran for op in replica_products)


# One node's view with two CPU replicas.
CONTEXT = KernelContext(replica_devices=("localhost:CPU:0", "localhost:CPU:1"),
                        tf_devices={"localhost:CPU:0": "/device:CPU:0",
                                    "localhost:CPU:1": "/device:CPU:1"},
                        shared_device="/device:CPU:0", chief_device="/device:CPU:0",
                        node_index=0, num_nodes=1, group_size=2)


@pytest.mark.parametrize("inputs, joined", [
    ([None, 2048], True),       # a batch of vectors: the join copies little
    ([None, 2, 2048], True),    # of short sequences, still
    ([None, 64, 2048], False),  # of long ones, the join would copy more than it spares
    ([None, None, 2048], False),  # of sequences of unknown length: not judged, not joined
])
def test_the_node_joins_factors_only_where_the_copy_costs_less_than_the_sum(inputs, joined):
    graph = tf.Graph()
    with graph.as_default():
        grads = []
        for replica in range(2):
            with tf.device(f"/device:CPU:{replica}"):
                x = tf.reshape(tf1.placeholder(tf.float32, inputs), [-1, 2048])
                dy = tf.reshape(tf1.placeholder(tf.float32, inputs), [-1, 2048])
                grads.append(tf.linalg.matmul(x, dy, transpose_a=True))
        assert (node_product(grads, CONTEXT, "w") is not None) == joined
        assert node_product(grads[:1], CONTEXT, "w") is None  # one replica: nothing to add
        assert node_product([g + 1.0 for g in grads], CONTEXT, "w") is None  # not a product
