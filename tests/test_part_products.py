"""Products with a partitioned variable multiply by its parts: no stitched copy.

A replica's ``matmul(a, variable)`` (either factor transposed, ``a`` a matrix or
a batch of them) of a partitioned variable sums the products of ``a``'s slices
with parts cut along the summed axis, and joins those with parts cut along the
output's columns. Each part is read once per step, where it is stored. Each
case checks the rewrite happened (no full-size copy on the node, every replica
multiplying by every part) and that training equals single-device training.
"""
from __future__ import annotations

import contextlib
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

from autodist import AutoDist
from autodist.strategy import PartitionedPS, RandomAxisPartitionAR
from test_equivalence import ATOL, RTOL
from test_keras import assert_same
from test_keras_patterns import ROWS, fit_both
from test_row_gathers import ThreePartPS, products_by_variable, variable_names

tf1 = tf.compat.v1

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

STEPS = 3
BATCH = 8


def multiplied(optimizer_fn, seed: int = 0):
    """``w`` [7, 5] and ``u`` [4, 5] multiplied by every way a model does.

    ``x @ w``, ``x^T^T @ w`` (``transpose_a``), a batch of sequences times ``w``
    (``BatchMatMulV2``), and ``h @ u^T`` (``transpose_b``); the backward pass
    multiplies by both again (transposed the other way).
    """
    tf1.set_random_seed(seed)
    rng = np.random.RandomState(seed)
    x = tf1.placeholder(tf.float32, [None, 7], name="x")
    sequences = tf1.placeholder(tf.float32, [None, 3, 7], name="sequences")
    y = tf1.placeholder(tf.float32, [None, 4], name="y")
    w = tf1.get_variable("w", [7, 5], use_resource=True,
                         initializer=tf1.random_normal_initializer(stddev=0.5, seed=seed + 1))
    u = tf1.get_variable("u", [4, 5], use_resource=True,
                         initializer=tf1.random_normal_initializer(stddev=0.5, seed=seed + 2))
    hidden = tf.tanh(tf.matmul(x, w) + tf.matmul(tf.transpose(x), w, transpose_a=True)
                     + tf.reduce_mean(tf.matmul(sequences, w), axis=1))
    loss = tf.reduce_mean(tf.square(tf.matmul(hidden, u, transpose_b=True) - y))
    train_op = optimizer_fn().minimize(loss, global_step=tf1.train.get_or_create_global_step())
    feeds = {x: rng.randn(BATCH, 7).astype(np.float32),
             sequences: rng.randn(BATCH, 3, 7).astype(np.float32),
             y: rng.randn(BATCH, 4).astype(np.float32)}
    return feeds, loss, train_op, [w, u]


def _train(ad=None):
    """(losses, final values, the distributed graph or None), on one device without ``ad``."""
    with tf.Graph().as_default():
        with ad.scope() if ad else contextlib.nullcontext():
            feeds, loss, train_op, variables = multiplied(lambda: tf1.train.AdamOptimizer(0.05))
            if ad:
                sess = ad.create_distributed_session()
            else:
                sess = tf1.Session()
                sess.run(tf1.global_variables_initializer())
            with sess:
                losses = [sess.run([loss, train_op], feeds)[0] for _ in range(STEPS)]
                return (losses, sess.run(variables),
                        sess.distributed.graph if ad else None)


@pytest.mark.parametrize("builder", [ThreePartPS, lambda: RandomAxisPartitionAR(seed=0),
                                     lambda: RandomAxisPartitionAR(seed=1)],
                         ids=["3 parts", "RandomAxisPartitionAR-0", "RandomAxisPartitionAR-1"])
def test_products_multiply_by_the_parts_and_train_as_on_one_device(spec_path, builder):
    want_losses, want, _ = _train()
    ad = AutoDist(resource_spec_file=spec_path, strategy_builder=builder())
    losses, got, graph = _train(ad)
    np.testing.assert_allclose(losses, want_losses, rtol=RTOL, atol=ATOL)
    for name, g, w in zip("wu", got, want):
        np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL, err_msg=name)

    stored = variable_names(graph)
    assert not [n for n in stored if n.endswith("/stitched")]
    axes = {v.var_name: v.partitioner for v in ad.strategy.node_config}
    products = products_by_variable(graph)
    for name in "wu":
        parts = sorted(n for n in stored if re.fullmatch(rf"{name}/part_\d+", n))
        assert len(parts) >= 2, (name, axes[name], sorted(stored))
        for part in parts:
            # Every replica multiplies by every part: the forward pass's products
            # and the backward pass's, all of them.
            by_replica = [p for p in products[part] if "where_stored" in p]
            assert {p.split("/")[0] for p in by_replica} == {
                "AutoDist-Replica-0", "AutoDist-Replica-1"}, (part, products)
        types = {graph.get_operation_by_name(p).type for part in parts for p in products[part]}
        assert types == ({"MatMul", "BatchMatMulV2"} if name == "w" else {"MatMul"}), types


def sequence_model() -> keras.Model:
    """A ``Dense`` over sequences and one over their mean."""
    keras.utils.set_random_seed(5)
    inputs = keras.Input((3, 6))
    hidden = keras.layers.Dense(10, activation="tanh", name="per_step")(inputs)
    pooled = keras.layers.GlobalAveragePooling1D()(hidden)
    model = keras.Model(inputs, keras.layers.Dense(2, name="out")(pooled))
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss="mse",
                  metrics=["mae"])
    return model


def test_keras_dense_layers_fit_on_parts_as_on_one_device(spec_path):
    rng = np.random.default_rng(6)
    x = rng.normal(size=(ROWS, 3, 6)).astype(np.float32)
    y = rng.normal(size=(ROWS, 2)).astype(np.float32)
    (want, _), (got, model) = fit_both(spec_path, PartitionedPS(), sequence_model, x, y,
                                       epochs=2)
    assert_same(got, want, "PartitionedPS")

    graph = model._autodist_fit.step.session.distributed.graph  # pylint: disable=protected-access
    stored = variable_names(graph)
    assert {"per_step/kernel/part_0", "per_step/kernel/part_1"} <= stored
    # The kernels are multiplied by; the biases, added whole, are stitched.
    assert sorted(n.split("/", 1)[1] for n in stored if n.endswith("/stitched")) == [
        "out/bias/stitched", "per_step/bias/stitched"]
    products = products_by_variable(graph)
    for part in ("per_step/kernel/part_0", "per_step/kernel/part_1"):
        # Keras's Dense over sequences is a tensordot: a MatMul of the reshaped input.
        assert {p.split("/")[0] for p in products[part] if "where_stored" in p} == {
            "AutoDist-Replica-0", "AutoDist-Replica-1"}, products
