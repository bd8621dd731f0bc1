"""Each replica's share scales its backward pass at the seed, not its gradients.

``gradient_seeds`` proves that a graph's gradients are linear in the constants
that start its backward pass; each replica then multiplies those by its share
of the cluster's rows, and the synchronizers add the replicas' contributions
up. No pass over the gradients' bytes is left: the model-sized products by a
row weight and the division of the mean are gone. Where the proof fails (a
loop, a non-linear custom gradient) the gradients themselves are scaled.
"""
from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from autodist import AutoDist
from autodist.gradient_seeds import gradient_seeds
from autodist.strategy import AllReduce, PartitionedPS
from test_keras import assert_same, snapshot

tf1 = tf.compat.v1


def _v1_graph(forward):
    """A graph computing ``loss = forward(x, w)``, its ``tf.gradients`` for ``w``."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf1.placeholder(tf.float32, [None, 3], name="x")
        w = tf1.get_variable("w", [3, 2], initializer=tf1.ones_initializer())
        loss = forward(x, w)
        grad, = tf.gradients(loss, [w])
    return graph, grad


def _seeds(graph, grads) -> frozenset:
    return gradient_seeds(graph.as_graph_def(), [g.name for g in grads])


def test_the_seed_of_tf_gradients_is_found():
    graph, grad = _v1_graph(lambda x, w: tf.reduce_mean(tf.square(tf.nn.relu(x @ w))))
    assert _seeds(graph, [grad]) == {"gradients/grad_ys_0/Const"}


def test_the_seed_of_a_tape_is_found():
    w = tf.Variable(tf.ones([3, 2]))

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.nn.softmax(x @ w))
        return tape.gradient(loss, w)

    concrete = step.get_concrete_function(tf.TensorSpec([None, 3]))
    seeds = _seeds(concrete.graph, [concrete.outputs[0]])
    assert len(seeds) == 1
    seed = concrete.graph.get_operation_by_name(next(iter(seeds)))
    assert seed.type == "Const" and float(tf.get_static_value(seed.outputs[0])) == 1.0


@pytest.mark.parametrize("forward", [
    # The gradient is linear in this 1 too, but the loss is scaled with it.
    lambda x, w: 1.0 * tf.reduce_mean(tf.square(x @ w)),
    lambda x, w: tf.reduce_mean(tf.square(1.0 - x @ w)),
], ids=["weight_of_the_loss", "one_minus"])
def test_a_constant_one_of_the_forward_pass_leaves_no_seed(forward):
    graph, grad = _v1_graph(forward)
    assert _seeds(graph, [grad]) == frozenset()


def test_a_gradient_not_linear_in_its_seed_has_none():
    @tf.custom_gradient
    def clipped(h):
        return tf.identity(h), lambda dy: tf.clip_by_value(dy, -0.1, 0.1)

    graph, grad = _v1_graph(lambda x, w: tf.reduce_mean(tf.square(clipped(x @ w))))
    assert _seeds(graph, [grad]) == frozenset()

    @tf.custom_gradient
    def squared(h):
        return tf.identity(h), lambda dy: dy * dy

    graph, grad = _v1_graph(lambda x, w: tf.reduce_mean(squared(x @ w)))
    assert _seeds(graph, [grad]) == frozenset()


def test_a_batch_normalization_s_backward_pass_is_linear_in_its_seed():
    # Its gradients reach the variables' gradients through others (the offset's
    # gradient also feeds the mean's): those are followed, not taken for the update.
    layer = keras.layers.BatchNormalization()
    layer.build((None, 3))
    w = tf.Variable(tf.ones([3, 3]))

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(layer(x @ w, training=True)))
        return tape.gradient(loss, [w, *layer.trainable_variables])

    concrete = step.get_concrete_function(tf.TensorSpec([None, 3]))
    assert len(_seeds(concrete.graph, concrete.outputs)) == 1


def test_a_loop_in_the_backward_pass_has_no_seed():
    def looped(x, w):
        _, h = tf1.while_loop(lambda i, h: i < 3, lambda i, h: (i + 1, tf.tanh(h @ tf.ones([2, 2]))),
                              [0, x @ w])
        return tf.reduce_mean(h)

    graph, grad = _v1_graph(looped)
    assert _seeds(graph, [grad]) == frozenset()


# ---------------------------------------------------------------- in training

ROWS, BATCH = 32, 7  # batches of 7 rows split 3/4, and the last one 2/2


def conv_model() -> keras.Model:
    """Convolutions both ways: a transposed convolution's gradients swap the
    positions a convolution's gradients are linear in."""
    keras.utils.set_random_seed(3)
    model = keras.Sequential([
        keras.Input((6, 6, 2)),
        keras.layers.Conv2D(3, 3, padding="same", activation="relu", name="conv"),
        keras.layers.MaxPooling2D(name="pool"),
        keras.layers.Conv2DTranspose(2, 3, strides=2, padding="same", name="up")], name="conv")
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"])
    return model


def lstm_model() -> keras.Model:
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((4, 2)), keras.layers.LSTM(3, name="lstm"),
                              keras.layers.Dense(1, name="out")], name="lstm")
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    return model


def _data(shape_x, shape_y):
    rng = np.random.default_rng(0)
    return (rng.normal(size=(ROWS,) + shape_x).astype("float32"),
            rng.normal(size=(ROWS,) + shape_y).astype("float32"))


def _fit_both(spec: str, builder, build, x, y):
    runs = []
    for ad in (None, AutoDist(resource_spec_file=spec, strategy_builder=builder)):
        if ad is None:
            model = build()
        else:
            with ad.scope():
                model = build()
        history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
        runs.append((snapshot(model, model.optimizer, history.history), model))
    return runs


def _scaled_gradients(model) -> int:
    """How many ops of the distributed graph multiply a replica's whole gradient."""
    distributed = model._autodist_fit.step.session.distributed
    graph, item = distributed.graph, distributed.item
    gradients = {f"AutoDist-Replica-{r}/{ref.values}"
                 for ref in item.gradients.values() for r in range(2)}
    return sum(1 for op in graph.get_operations()
               if op.type == "Mul" and any(t.name in gradients for t in op.inputs))


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("builder", [AllReduce, PartitionedPS])
def test_uneven_batches_train_as_on_one_device_with_the_seed_scaled(spec_path, builder):
    x, y = _data((6, 6, 2), (6, 6, 2))
    (want, _), (got, model) = _fit_both(spec_path, builder(), conv_model, x, y)
    assert_same(got, want, "conv")
    distributed = model._autodist_fit.step.session.distributed
    seeds = distributed.item.gradient_seeds
    assert len(seeds) == 1
    # Each replica reads the seed times its share of the rows: 3/7 and 4/7 of a
    # batch of 7.
    seed = f"{next(iter(seeds))}:0"
    shares = [op.outputs[0] for op in distributed.graph.get_operations()
              if op.name.startswith("autodist_contribution_shares/") and op.type == "Mul"
              and op.inputs[0].name == seed]
    batch = {distributed.graph.get_tensor_by_name(f"{name}:0"):
             np.zeros((BATCH, 6, 6, 2), np.float32)
             for name in distributed.item.batched_inputs}
    with tf1.Session(graph=distributed.graph) as session:
        np.testing.assert_allclose(session.run(shares, batch), [3 / 7, 4 / 7], rtol=1e-6)
    assert _scaled_gradients(model) == 0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_loop_s_gradients_are_scaled_instead(spec_path):
    x, y = _data((4, 2), (1,))
    (want, _), (got, model) = _fit_both(spec_path, AllReduce(), lstm_model, x, y)
    assert_same(got, want, "lstm")
    assert model._autodist_fit.step.session.distributed.item.gradient_seeds == frozenset()
    # Every variable's gradient, on each replica.
    assert _scaled_gradients(model) == 2 * len(model.trainable_variables)
