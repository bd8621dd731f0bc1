"""Training cases on the logic of the original AutoDist's integration cases.

petuum/autodist ran a handful of scripts (``tests/integration/cases``) under each of
its strategies and checked only that they ran. Each function here is our own small
``tf.compat.v1`` graph doing what one of those scripts trained, sized to run in a
second: it adds its model to the default graph and returns a :class:`Case`. Initial
values and data depend only on ``seed``, so a single-device graph and an AutoDist
graph built by the same call start from, and are fed, the same values.

The originals called ``autodist.function`` on numpy arrays from inside a
``tf.Graph``; this AutoDist runs such graphs through ``ad.create_distributed_session()``
(``ad.function`` is its Keras / TF2 front, and refuses graph mode by name, see
``tests/test_original_autodist.py``). The originals' Keras (v2) optimizers are
``tf.compat.v1.train`` optimizers here: Keras 3's do not build into a v1 graph.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List

import keras
import numpy as np
import tensorflow as tf

tf1 = tf.compat.v1

STEPS = 3
# Every batch divides evenly over two replicas, so each replica's mean loss weighs
# as much as the other's and their mean is the global batch's.
BATCH = 8


@dataclasses.dataclass
class Case:
    """One training case in the default graph.

    Attributes:
        train_op: the update run at every step.
        logged: what the script logs from the training run (fetched with ``train_op``).
        after: what it logs after each step, read in a run of its own (a variable
            fetched in the training run may be read before or after its update).
        feeds: one feed dict per step.
        saved: the variables the script checkpoints (empty: it saves none).
    """

    train_op: tf.Operation
    logged: Dict[str, tf.Tensor]
    after: Dict[str, object]
    feeds: List[dict]
    saved: list = dataclasses.field(default_factory=list)


def _regression_data(rng: np.random.RandomState, rows: int, dtype=np.float64):
    """Samples of y = 3x + 2 + noise, as the originals' linear regressions drew them."""
    x = rng.randn(rows)
    return x.astype(dtype), (3.0 * x + 2.0 + rng.randn(rows)).astype(dtype)


def _apply(optimizer: tf1.train.Optimizer, loss: tf.Tensor, variables: list) -> tf.Operation:
    """``tf.gradients`` then ``apply_gradients``, the originals' way, counting the step."""
    gradients = tf.gradients(loss, variables)
    return optimizer.apply_gradients(zip(gradients, variables),
                                     global_step=tf1.train.get_or_create_global_step())


def linear_regression_whole_batch(seed: int = 0) -> Case:
    """v1_interface / c5: ``W * x + b`` against targets held in the graph as a constant.

    The placeholder has a fixed first dimension and the targets are not fed, so no
    replica can take a share of the rows: AutoDist runs the whole batch on every
    replica and must still apply one step's worth of update, not one per replica.
    The same batch is fed at every step, as in the original.
    """
    tf1.set_random_seed(seed)
    inputs, targets = _regression_data(np.random.RandomState(seed), 64, np.float32)
    x = tf1.placeholder(tf.float32, shape=[len(inputs)], name="x")
    w = tf.Variable(5.0, name="W")
    b = tf.Variable(0.0, name="b")
    loss = tf.reduce_mean(tf.square(w * x + b - tf.constant(targets)))
    train_op = _apply(tf1.train.GradientDescentOptimizer(0.01), loss, [w, b])
    return Case(train_op, {"loss": loss},
                {"step": tf1.train.get_global_step(), "b": b},
                [{x: inputs} for _ in range(STEPS)])


def linear_regression_float64(seed: int = 0) -> Case:
    """c0 / c10: float64 ``W`` and ``b`` fit on batches fed to ``[None]`` placeholders,
    then checkpointed with AutoDist's ``Saver([W, b])`` (c10).

    Each step feeds a new batch (the original's chief and worker each drew their own
    samples, i.e. each replica its rows of one global batch).
    """
    rng, x, y, w, b = _float64_scalars(seed)
    loss = tf.reduce_mean(tf.square(w * x + b - y))
    train_op = _apply(tf1.train.GradientDescentOptimizer(0.01), loss, [w, b])
    feeds = [dict(zip((x, y), _regression_data(rng, BATCH))) for _ in range(STEPS)]
    return Case(train_op, {"loss": loss}, {"step": tf1.train.get_global_step(), "b": b},
                feeds, saved=[w, b])


def sparse_embedding(seed: int = 0) -> Case:
    """c2: an embedding looked up by token ids and averaged over each sequence, a ReLU
    layer and a logistic loss, trained with Adagrad (a sparse gradient for the table).

    The original trained IMDB reviews (10000 words, 256 tokens); ours draws 12 ids per
    row from 40 words, so ids repeat inside a replica's rows and across replicas. The
    variables are ``tf.Variable`` with seeded uniform initial values, as there.
    """
    tf1.set_random_seed(seed)
    rng = np.random.RandomState(seed)
    vocab, width, hidden, length = 40, 6, 5, 12
    ids = tf1.placeholder(tf.int32, [None, length], name="ids")
    labels = tf1.placeholder(tf.float32, [None], name="labels")
    emb = tf.Variable(tf.random.uniform([vocab, width], seed=seed + 1), name="emb")
    w1 = tf.Variable(tf.random.uniform([width, hidden], seed=seed + 2), name="w1")
    b1 = tf.Variable(tf.zeros([hidden]), name="b1")
    w2 = tf.Variable(tf.random.uniform([hidden, 1], -1.0, 1.0, seed=seed + 3), name="w2")
    b2 = tf.Variable(tf.zeros([1]), name="b2")
    pooled = tf.reduce_mean(tf.nn.embedding_lookup(emb, ids), axis=1)
    logits = tf.squeeze(tf.matmul(tf.nn.relu(tf.matmul(pooled, w1) + b1), w2) + b2, axis=1)
    loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=labels, logits=logits))
    train_op = _apply(tf1.train.AdagradOptimizer(0.5), loss, [emb, w1, b1, w2, b2])
    feeds = [{ids: rng.randint(0, vocab, size=(BATCH, length)).astype(np.int32),
              labels: rng.randint(0, 2, size=BATCH).astype(np.float32)}
             for _ in range(STEPS)]
    return Case(train_op, {"loss": loss}, {"step": tf1.train.get_global_step()}, feeds)


def keras_cnn(seed: int = 0) -> Case:
    """c1 / c3: Keras layers (a convolution, max pooling, a softmax layer) called on
    image placeholders, a Keras sparse categorical cross-entropy, numpy batches fed.

    The original's ``Dropout(0.1)`` is left out: its masks are random per run, so no
    two trainings (distributed or not) draw the same ones. Its Keras SGD is a
    momentum optimizer here, whose slots are compared too. The images are random
    8x8 ones rather than Fashion-MNIST (no downloads).
    """
    tf1.set_random_seed(seed)
    rng = np.random.RandomState(seed)
    images = tf1.placeholder(tf.float32, [None, 8, 8, 1], name="images")
    labels = tf1.placeholder(tf.int32, [None], name="labels")
    # Explicit names: Keras numbers unnamed layers with a process-wide counter.
    layers = [
        keras.layers.Conv2D(4, 3, activation="relu", name="conv",
                            kernel_initializer=keras.initializers.GlorotUniform(seed=seed + 1)),
        keras.layers.MaxPooling2D(name="pool"),
        keras.layers.Flatten(name="flatten"),
        keras.layers.Dense(10, activation="softmax", name="dense",
                           kernel_initializer=keras.initializers.GlorotUniform(seed=seed + 2)),
    ]
    probabilities = images
    for layer in layers:
        probabilities = layer(probabilities)
    loss = keras.losses.SparseCategoricalCrossentropy()(labels, probabilities)
    variables = [v.value for layer in layers for v in layer.trainable_weights]
    train_op = _apply(tf1.train.MomentumOptimizer(0.1, momentum=0.9), loss, variables)
    feeds = [{images: rng.rand(BATCH, 8, 8, 1).astype(np.float32),
              labels: rng.randint(0, 10, size=BATCH).astype(np.int32)}
             for _ in range(STEPS)]
    return Case(train_op, {"loss": loss}, {"step": tf1.train.get_global_step()}, feeds)


def _float64_scalars(seed: int) -> tuple:
    """The float64 regressions' start: a seeded numpy generator, fed ``x`` and ``y``
    of one value a row, and the scalars ``W`` (5) and ``b`` (0)."""
    tf1.set_random_seed(seed)
    x = tf1.placeholder(tf.float64, shape=[None], name="x")
    y = tf1.placeholder(tf.float64, shape=[None], name="y")
    w = tf.Variable(5.0, name="W", dtype=tf.float64)
    b = tf.Variable(0.0, name="b", dtype=tf.float64)
    return np.random.RandomState(seed), x, y, w, b


def while_loop(seed: int = 0) -> Case:
    """c4: ``state <- sigmoid(W * state + b)`` three times in a ``tf.while_loop``, the
    result fit to a linear target, float64 ``W`` and ``b``, plain gradient descent."""
    rng, x, y, w, b = _float64_scalars(seed)
    _, state = tf.while_loop(lambda step, _: step < 3,
                             lambda step, state: (step + 1, tf.sigmoid(w * state + b)),
                             [tf.constant(0), x])
    loss = tf.reduce_mean(tf.square(state - y))
    # A larger step than the original's 0.01: the sigmoids' small gradients would move
    # the variables by less than the comparison's tolerance.
    train_op = _apply(tf1.train.GradientDescentOptimizer(0.5), loss, [w, b])
    feeds = []
    for _ in range(STEPS):
        inputs, targets = _regression_data(rng, BATCH)
        feeds.append({x: inputs, y: targets / 10.0})
    return Case(train_op, {"loss": loss}, {"step": tf1.train.get_global_step(), "b": b}, feeds)


def dynamic_lstm(seed: int = 0) -> Case:
    """c6: a peephole LSTM run over padded sequences by a ``tf.while_loop`` reading a
    ``TensorArray``, each row's state frozen past its sequence length (``tf.where``),
    then a projection by a square matrix and a softmax cross-entropy, trained with Adam.

    The original used ``tf.compat.v1.nn.rnn_cell.LSTMCell(use_peepholes=True)`` (gone
    with Keras 3: the cell is written out here) under control flow v1, which AutoDist
    refuses on several replicas by name; ours is the default control flow v2. Its
    inputs were graph constants; ours are fed, so the replicas split the batch.
    """
    tf1.set_random_seed(seed)
    rng = np.random.RandomState(seed)
    units, features, max_steps = 5, 5, 3
    inputs = tf1.placeholder(tf.float32, [None, max_steps, features], name="inputs")
    lengths = tf1.placeholder(tf.int32, [None], name="lengths")
    targets = tf1.placeholder(tf.float32, [None, units], name="targets")

    def weight(name, shape, offset):
        return tf1.get_variable(name, shape, use_resource=True,
                                initializer=tf1.glorot_uniform_initializer(seed=seed + offset))

    with tf1.variable_scope("lstm"):
        kernel = weight("kernel", [features + units, 4 * units], 1)
        bias = tf1.get_variable("bias", [4 * units], use_resource=True,
                                initializer=tf1.zeros_initializer())
        peep_i = weight("w_i_diag", [1, units], 2)
        peep_f = weight("w_f_diag", [1, units], 3)
        peep_o = weight("w_o_diag", [1, units], 4)
    projection = weight("qq", [units, units], 5)

    time_major = tf.TensorArray(tf.float32, size=max_steps).unstack(
        tf.transpose(inputs, [1, 0, 2]))

    def body(t, c, h):
        gates = tf.matmul(tf.concat([time_major.read(t), h], axis=1), kernel) + bias
        i, j, f, o = tf.split(gates, 4, axis=1)
        new_c = tf.sigmoid(f + 1.0 + peep_f * c) * c + tf.sigmoid(i + peep_i * c) * tf.tanh(j)
        new_h = tf.sigmoid(o + peep_o * new_c) * tf.tanh(new_c)
        done = tf.expand_dims(t >= lengths, 1)
        return t + 1, tf.where(done, c, new_c), tf.where(done, h, new_h)

    zeros = tf.zeros(tf.stack([tf.shape(inputs)[0], units]))
    _, _, h = tf.while_loop(lambda t, c, h: t < max_steps, body, [tf.constant(0), zeros, zeros])
    loss = tf.reduce_mean(tf.nn.softmax_cross_entropy_with_logits(
        labels=targets, logits=tf.matmul(h, projection)))
    variables = [kernel, bias, peep_i, peep_f, peep_o, projection]
    train_op = _apply(tf1.train.AdamOptimizer(0.1), loss, variables)
    feeds = [{inputs: rng.rand(BATCH, max_steps, features).astype(np.float32),
              # lengths 0..max_steps: some rows never step, some run the whole loop
              lengths: rng.randint(0, max_steps + 1, size=BATCH).astype(np.int32),
              targets: rng.dirichlet(np.ones(units), size=BATCH).astype(np.float32)}
             for _ in range(STEPS)]
    return Case(train_op, {"loss": loss}, {"step": tf1.train.get_global_step()}, feeds)


CASES = {
    "v1_interface-whole_batch": linear_regression_whole_batch,
    "c0_c10-float64_regression_saved": linear_regression_float64,
    "c2-sparse_embedding_adagrad": sparse_embedding,
    "c1_c3-keras_cnn_momentum": keras_cnn,
    "c4-while_loop": while_loop,
    "c6-dynamic_lstm_adam": dynamic_lstm,
}
