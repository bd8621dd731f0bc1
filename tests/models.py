"""Small models shared by the end-to-end tests.

Every builder adds its model to the current default graph and returns a
:class:`Model`. Initial values depend only on ``seed`` (graph-level seed plus
explicit initializer seeds), so a single-device graph and an AutoDist graph
built by the same call start from identical values. Every batch has
``BATCH_SIZE`` rows, divisible by 2 and 4 replicas.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Dict, List

import keras
import numpy as np
import tensorflow as tf

tf1 = tf.compat.v1

BATCH_SIZE = 8
EMBEDDING_ROWS = 50
# Repeats within every half and quarter of the batch, and across them, so the
# sparse gradient has duplicate indices inside one replica and between replicas.
EMBEDDING_IDS = np.array([3, 3, 7, 49, 7, 7, 0, 12], dtype=np.int32)


@dataclasses.dataclass
class Model:
    """One model in the default graph.

    Attributes:
        feeds: placeholder -> numpy global batch.
        loss: scalar float loss (mean over the batch).
        train_op: the optimizer's ``minimize`` result.
        variables: trainable variables in creation order, as the user holds them
            (``tf.Variable``, or Keras variables for the Keras model).
    """

    feeds: Dict[tf.Tensor, np.ndarray]
    loss: tf.Tensor
    train_op: tf.Operation
    variables: List[object]


OptimizerFn = Callable[[], tf1.train.Optimizer]


def as_tf_variable(variable) -> tf.Variable:
    """The ``tf.Variable`` behind a Keras 3 variable (or the variable itself)."""
    return variable if isinstance(variable, tf.Variable) else variable.value


def _get_variable(name: str, shape, seed: int, stddev: float = 0.5) -> tf.Variable:
    return tf1.get_variable(name, shape, initializer=tf1.random_normal_initializer(
        stddev=stddev, seed=seed), use_resource=True)


def _minimize(optimizer_fn: OptimizerFn, loss: tf.Tensor) -> tf.Operation:
    global_step = tf1.train.get_or_create_global_step()
    return optimizer_fn().minimize(loss, global_step=global_step)


def dense_mlp(optimizer_fn: OptimizerFn, seed: int = 0) -> Model:
    """Two-layer tanh MLP from raw TensorFlow ops."""
    tf1.set_random_seed(seed)
    rng = np.random.RandomState(seed)
    x = tf1.placeholder(tf.float32, [None, 6], name="x")
    y = tf1.placeholder(tf.float32, [None, 3], name="y")
    w1 = _get_variable("w1", [6, 4], seed + 1)
    b1 = tf1.get_variable("b1", [4], initializer=tf1.constant_initializer(0.1), use_resource=True)
    w2 = _get_variable("w2", [4, 3], seed + 2)
    hidden = tf.tanh(tf.matmul(x, w1) + b1)
    loss = tf.reduce_mean(tf.square(tf.matmul(hidden, w2) - y))
    feeds = {x: rng.randn(BATCH_SIZE, 6).astype(np.float32),
             y: rng.randn(BATCH_SIZE, 3).astype(np.float32)}
    return Model(feeds, loss, _minimize(optimizer_fn, loss), [w1, b1, w2])


def keras_mlp(optimizer_fn: OptimizerFn, seed: int = 0) -> Model:
    """Keras 3 Dense layers on a placeholder; the variables are Keras variables."""
    tf1.set_random_seed(seed)
    rng = np.random.RandomState(seed)
    x = tf1.placeholder(tf.float32, [None, 6], name="x")
    y = tf1.placeholder(tf.float32, [None, 2], name="y")
    # Explicit layer names keep variable names stable across graphs: Keras
    # otherwise numbers layers with a process-wide counter.
    hidden = keras.layers.Dense(
        5, activation="tanh", name="hidden",
        kernel_initializer=keras.initializers.GlorotUniform(seed=seed + 1),
        bias_initializer=keras.initializers.RandomNormal(stddev=0.1, seed=seed + 2))
    out = keras.layers.Dense(
        2, name="out", kernel_initializer=keras.initializers.GlorotUniform(seed=seed + 3))
    loss = tf.reduce_mean(tf.square(out(hidden(x)) - y))
    feeds = {x: rng.randn(BATCH_SIZE, 6).astype(np.float32),
             y: rng.randn(BATCH_SIZE, 2).astype(np.float32)}
    variables = [hidden.kernel, hidden.bias, out.kernel, out.bias]
    return Model(feeds, loss, _minimize(optimizer_fn, loss), variables)


def embedding(optimizer_fn: OptimizerFn, seed: int = 0) -> Model:
    """Embedding lookup (an IndexedSlices gradient) followed by a dense layer."""
    tf1.set_random_seed(seed)
    rng = np.random.RandomState(seed)
    ids = tf1.placeholder(tf.int32, [None], name="ids")
    y = tf1.placeholder(tf.float32, [None, 3], name="y")
    table = _get_variable("embedding", [EMBEDDING_ROWS, 8], seed + 1)
    w = _get_variable("w", [8, 3], seed + 2)
    looked_up = tf.nn.embedding_lookup(table, ids)
    loss = tf.reduce_mean(tf.square(tf.matmul(tf.tanh(looked_up), w) - y))
    feeds = {ids: EMBEDDING_IDS.copy(), y: rng.randn(BATCH_SIZE, 3).astype(np.float32)}
    return Model(feeds, loss, _minimize(optimizer_fn, loss), [table, w])


def rnn(optimizer_fn: OptimizerFn, seed: int = 0, steps: int = 5, body: str = "plain") -> Model:
    """A tanh RNN unrolled by ``tf.while_loop`` with shared weights.

    ``body``: "plain", or "cond": a ``tf.cond`` in the loop's body.
    """
    tf1.set_random_seed(seed)
    rng = np.random.RandomState(seed)
    x = tf1.placeholder(tf.float32, [None, steps, 4], name="x")
    y = tf1.placeholder(tf.float32, [None, 2], name="y")
    wx = _get_variable("rnn/wx", [4, 6], seed + 1)
    wh = _get_variable("rnn/wh", [6, 6], seed + 2, stddev=0.3)
    b = tf1.get_variable("rnn/b", [6], initializer=tf1.zeros_initializer(), use_resource=True)
    wo = _get_variable("out/w", [6, 2], seed + 3)
    time_major = tf.transpose(x, [1, 0, 2])

    def body_fn(t, h):
        pre = tf.matmul(time_major[t], wx) + tf.matmul(h, wh) + b
        if body == "cond":
            pre = tf.cond(tf.equal(t % 2, 0), lambda: pre, lambda: 0.5 * pre)
        return t + 1, tf.tanh(pre)

    h0 = tf.zeros(tf.stack([tf.shape(x)[0], 6]))
    _, h = tf1.while_loop(lambda t, h: t < steps, body_fn, [tf.constant(0), h0])
    loss = tf.reduce_mean(tf.square(tf.matmul(h, wo) - y))
    feeds = {x: rng.randn(BATCH_SIZE, steps, 4).astype(np.float32),
             y: rng.randn(BATCH_SIZE, 2).astype(np.float32)}
    return Model(feeds, loss, _minimize(optimizer_fn, loss), [wx, wh, b, wo])


def partitionable(optimizer_fn: OptimizerFn, seed: int = 0) -> Model:
    """Variables shaped for partitioners: an odd axis 0, wide axis 1, a sparse table.

    ``odd`` [7, 4] splits unevenly along axis 0; ``wide`` [4, 10] and ``table``
    [12, 6] can be split along either axis; ``bias`` [3] only along axis 0.
    """
    tf1.set_random_seed(seed)
    rng = np.random.RandomState(seed)
    x = tf1.placeholder(tf.float32, [None, 7], name="x")
    ids = tf1.placeholder(tf.int32, [None], name="ids")
    y = tf1.placeholder(tf.float32, [None, 3], name="y")
    odd = _get_variable("odd", [7, 4], seed + 1)
    wide = _get_variable("wide", [4, 10], seed + 2)
    table = _get_variable("table", [12, 6], seed + 3)
    proj = _get_variable("proj", [16, 3], seed + 4)
    bias = tf1.get_variable("bias", [3], initializer=tf1.constant_initializer(0.2),
                            use_resource=True)
    dense = tf.tanh(tf.matmul(tf.tanh(tf.matmul(x, odd)), wide))
    sparse = tf.gather(table, ids)
    logits = tf.matmul(tf.concat([dense, sparse], axis=1), proj) + bias
    loss = tf.reduce_mean(tf.square(logits - y))
    feeds = {x: rng.randn(BATCH_SIZE, 7).astype(np.float32),
             ids: np.array([1, 1, 11, 5, 5, 0, 11, 6], dtype=np.int32),
             y: rng.randn(BATCH_SIZE, 3).astype(np.float32)}
    return Model(feeds, loss, _minimize(optimizer_fn, loss), [odd, wide, table, proj, bias])


def gathered(optimizer_fn: OptimizerFn, seed: int = 0) -> Model:
    """Tables read by row gathers: ``table`` only so, ``tied`` also multiplied by.

    ``table`` [13, 4] (13 rows part unevenly) is looked up by ids of shape [B, 2]
    with ``tf.nn.embedding_lookup``; ``tied`` [9, 4] is gathered with
    ``tf.gather`` and multiplied by (transposed), as a language model ties its
    input and output embeddings; ``out`` [13, 2] is multiplied by and read whole
    by a penalty on its squares. The ids repeat within each half and quarter of
    the batch and across them.
    """
    tf1.set_random_seed(seed)
    rng = np.random.RandomState(seed)
    ids = tf1.placeholder(tf.int32, [None, 2], name="ids")
    x = tf1.placeholder(tf.float32, [None, 4], name="x")
    y = tf1.placeholder(tf.float32, [None, 2], name="y")
    table = _get_variable("table", [13, 4], seed + 1)
    tied = _get_variable("tied", [9, 4], seed + 2)
    out = _get_variable("out", [13, 2], seed + 3)
    pooled = tf.reduce_sum(tf.nn.embedding_lookup(table, ids), axis=1)
    hidden = tf.tanh(pooled + tf.gather(tied, ids[:, 0] % 9))
    logits = tf.matmul(tf.concat([hidden, tf.matmul(x, tied, transpose_b=True)], 1), out)
    loss = tf.reduce_mean(tf.square(logits - y)) + 0.01 * tf.reduce_sum(tf.square(out))
    feeds = {ids: np.array([[1, 12], [1, 1], [5, 0], [12, 3],
                            [5, 7], [12, 12], [0, 1], [3, 5]], dtype=np.int32),
             x: rng.randn(BATCH_SIZE, 4).astype(np.float32),
             y: rng.randn(BATCH_SIZE, 2).astype(np.float32)}
    return Model(feeds, loss, _minimize(optimizer_fn, loss), [table, tied, out])


def two_dtypes(optimizer_fn: OptimizerFn, seed: int = 0) -> Model:
    """A float64 layer between float32 ones: all-reduce groups holding two dtypes."""
    tf1.set_random_seed(seed)
    rng = np.random.RandomState(seed)
    x = tf1.placeholder(tf.float32, [None, 5], name="x")
    y = tf1.placeholder(tf.float32, [None, 3], name="y")
    w1 = _get_variable("w1", [5, 4], seed + 1)
    w2 = tf1.get_variable("w2", [4, 4], tf.float64, use_resource=True,
                          initializer=tf1.random_normal_initializer(stddev=0.5, seed=seed + 2))
    w3 = _get_variable("w3", [4, 3], seed + 3)
    hidden = tf.tanh(tf.matmul(tf.cast(tf.tanh(tf.matmul(x, w1)), tf.float64), w2))
    loss = tf.reduce_mean(tf.square(tf.matmul(tf.cast(hidden, tf.float32), w3) - y))
    feeds = {x: rng.randn(BATCH_SIZE, 5).astype(np.float32),
             y: rng.randn(BATCH_SIZE, 3).astype(np.float32)}
    return Model(feeds, loss, _minimize(optimizer_fn, loss), [w1, w2, w3])


@dataclasses.dataclass
class GanModel:
    """A GAN-like pair of models, each trained by its own optimizer.

    Attributes:
        feeds: placeholder -> numpy global batch (noise and real samples).
        d_train: the discriminator's update (also counts the global step).
        g_train: the generator's update.
        variables: generator then discriminator variables.
    """

    feeds: Dict[tf.Tensor, np.ndarray]
    d_train: tf.Operation
    g_train: tf.Operation
    variables: List[tf.Variable]


def gan(optimizer_fn: OptimizerFn, seed: int = 0) -> GanModel:
    """A generator and a discriminator, each with its own ``optimizer_fn()`` optimizer."""
    tf1.set_random_seed(seed)
    rng = np.random.RandomState(seed)
    noise = tf1.placeholder(tf.float32, [None, 4], name="noise")
    real = tf1.placeholder(tf.float32, [None, 3], name="real")
    with tf1.variable_scope("generator"):
        g1 = _get_variable("g1", [4, 5], seed + 1)
        g2 = _get_variable("g2", [5, 3], seed + 2)
    with tf1.variable_scope("discriminator"):
        d1 = _get_variable("d1", [3, 4], seed + 3)
        d2 = _get_variable("d2", [4, 1], seed + 4)
    fake = tf.matmul(tf.tanh(tf.matmul(noise, g1)), g2)

    def logit(samples):
        return tf.matmul(tf.tanh(tf.matmul(samples, d1)), d2)

    d_loss = tf.reduce_mean(tf.nn.softplus(-logit(real)) + tf.nn.softplus(logit(fake)))
    g_loss = tf.reduce_mean(tf.nn.softplus(-logit(fake)))
    d_train = optimizer_fn().minimize(d_loss, var_list=[d1, d2],
                                      global_step=tf1.train.get_or_create_global_step())
    g_train = optimizer_fn().minimize(g_loss, var_list=[g1, g2])
    feeds = {noise: rng.randn(BATCH_SIZE, 4).astype(np.float32),
             real: (rng.randn(BATCH_SIZE, 3) + 1.0).astype(np.float32)}
    return GanModel(feeds, d_train, g_train, [g1, g2, d1, d2])


MODELS = {
    "dense": dense_mlp,
    "keras": keras_mlp,
    "embedding": embedding,
    "rnn": rnn,
    "partitionable": partitionable,
    "gathered": gathered,
    "two_dtypes": two_dtypes,
}
# The RNN with a loop body AutoDist runs differently (not in the builder matrix).
LOOP_VARIANTS = {"rnn_with_cond": functools.partial(rnn, body="cond")}
