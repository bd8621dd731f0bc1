"""tf_keras (Keras 2) models and optimizers under AutoDist, run in a process of their own.

``TF_USE_LEGACY_KERAS`` is read when TensorFlow is imported, so ``tests/test_tf_keras.py``
runs this script in a fresh process. Usage::

    python tf_keras_job.py SPEC legacy   # TF_USE_LEGACY_KERAS=1: tf.keras is tf_keras
    python tf_keras_job.py SPEC plain    # the variable unset: ``import tf_keras``

Each scenario is run, its outcome recorded (the error's type and message, or
what training did), and one line ``RESULT <json>`` printed at the end. A
package that cannot be imported is reported as ``UNAVAILABLE <package>: <error>``.
"""
import json
import sys

import numpy as np
import tensorflow as tf

from autodist import AutoDist
from autodist.strategy import AllReduce

tf1 = tf.compat.v1
ROWS = 8


def _outcome(run) -> dict:
    """``run()``'s result, or the error it raised."""
    try:
        return {"error": None, **run()}
    except Exception as err:  # pylint: disable=broad-except  (recorded for the test)
        return {"error": type(err).__name__, "message": str(err)}


def _trained_silently(ad: AutoDist, model, train) -> dict:
    """Runs ``train()`` and tells whether it changed the weights with no AutoDist strategy
    (tf_keras's own loop, on one device)."""
    before = [np.array(w) for w in model.get_weights()]
    train()
    changed = any(not np.array_equal(b, a) for b, a in zip(before, model.get_weights()))
    return {"silent": bool(changed and ad.strategy is None)}


def _data():
    rng = np.random.RandomState(0)
    return rng.randn(ROWS, 3).astype("float32"), rng.randn(ROWS, 1).astype("float32")


def fit_scenario(spec: str, tfk) -> dict:
    """A tf_keras Sequential compiled inside ad.scope(), then fit."""
    ad = AutoDist(resource_spec_file=spec, strategy_builder=AllReduce())
    x, y = _data()

    def run():
        with ad.scope():
            model = tfk.Sequential([tfk.layers.Dense(4, input_shape=(3,)), tfk.layers.Dense(1)])
            model.compile(optimizer=tfk.optimizers.SGD(0.1), loss="mse")
        return _trained_silently(ad, model, lambda: model.fit(x, y, batch_size=ROWS,
                                                              epochs=2, verbose=0))
    return _outcome(run)


def function_scenario(spec: str, tfk, legacy_optimizer: bool) -> dict:
    """A custom step through ad.function applying a tf_keras optimizer: a global
    optimizer in a function, or (``legacy_optimizer``) a legacy one held by a trainer
    whose method is the step."""
    ad = AutoDist(resource_spec_file=spec, strategy_builder=AllReduce())
    x, y = _data()
    with ad.scope():
        model = tfk.Sequential([tfk.layers.Dense(1, input_shape=(3,))])
        optimizer = (tfk.optimizers.legacy.Adam(0.1) if legacy_optimizer
                     else tfk.optimizers.SGD(0.1))

    def loss_and_grads(features, labels):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(features) - labels))
        return loss, tape.gradient(loss, model.trainable_variables)

    class Trainer:
        def __init__(self):
            self.optimizer = optimizer

        def train_step(self, features, labels):
            loss, grads = loss_and_grads(features, labels)
            self.optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss

    def train_step(features, labels):
        loss, grads = loss_and_grads(features, labels)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    step = ad.function(Trainer().train_step if legacy_optimizer else train_step)
    return _outcome(lambda: _trained_silently(ad, model, lambda: step(x, y)))


def _two_tower_class(tfrs):
    class TwoTower(tfrs.Model):
        """A tiny retrieval model: a user and an item embedding, in-batch softmax."""

        def __init__(self):
            super().__init__()
            self.users = tf.keras.layers.Embedding(10, 4)
            self.items = tf.keras.layers.Embedding(20, 4)
            self.task = tfrs.tasks.Retrieval()

        def compute_loss(self, features, training=False):
            return self.task(self.users(features["user"]), self.items(features["item"]))
    return TwoTower


def _two_tower_data() -> dict:
    return {"user": np.arange(ROWS, dtype="int64") % 10,
            "item": np.arange(ROWS, dtype="int64") % 20}


def tfrs_fit_scenario(spec: str, tfrs) -> dict:
    """A TensorFlow Recommenders two-tower model compiled inside ad.scope(), then fit."""
    ad = AutoDist(resource_spec_file=spec, strategy_builder=AllReduce())
    data = tf.data.Dataset.from_tensor_slices(_two_tower_data()).batch(ROWS)

    def run():
        with ad.scope():
            model = _two_tower_class(tfrs)()
            model.compile(optimizer=tf.keras.optimizers.Adagrad(0.1))
        # The weights are made by the first step, so a fit that ends without
        # AutoDist's strategy trained on one device.
        model.fit(data, epochs=1, verbose=0)
        return {"silent": ad.strategy is None}
    return _outcome(run)


def _graph_losses(spec: str, build, steps: int = 3) -> dict:
    """``build()``'s training in a tf.compat.v1 graph (it returns feeds, a loss and a
    tf.compat.v1.train op) through ad.create_distributed_session(), and on one device."""
    with tf.Graph().as_default():
        feeds, loss, train = build()
        with tf1.Session() as sess:
            sess.run(tf1.global_variables_initializer())
            single = [float(sess.run([loss, train], feeds)[0]) for _ in range(steps)]
    ad = AutoDist(resource_spec_file=spec, strategy_builder=AllReduce())

    def run():
        with tf.Graph().as_default(), ad.scope():
            feeds, loss, train = build()
            with ad.create_distributed_session() as sess:
                losses = [float(sess.run([loss, train], feeds)[0]) for _ in range(steps)]
        return {"losses": losses, "single": single, "distributed": ad.strategy is not None}
    return _outcome(run)


def keras2_graph_scenario(spec: str) -> dict:
    """The way out the refusal names: tf_keras layers called in a tf.compat.v1 graph,
    trained by a tf.compat.v1.train optimizer through ad.create_distributed_session()."""
    x, y = _data()

    def build():
        tf1.set_random_seed(0)
        features = tf1.placeholder(tf.float32, [None, 3])
        labels = tf1.placeholder(tf.float32, [None, 1])
        # tf_keras draws an unseeded initializer's seed in Python, not from the graph's.
        seeded = tf.keras.initializers.GlorotUniform
        hidden = tf.keras.layers.Dense(4, activation="relu",
                                       kernel_initializer=seeded(seed=1))(features)
        out = tf.keras.layers.Dense(1, kernel_initializer=seeded(seed=2))(hidden)
        loss = tf.reduce_mean(tf.square(out - labels))
        train = tf1.train.GradientDescentOptimizer(0.1).minimize(loss)
        return {features: x, labels: y}, loss, train
    return _graph_losses(spec, build)


def tfrs_graph_scenario(spec: str, tfrs) -> dict:
    """The same way out for the two-tower model: its loss in a tf.compat.v1 graph.

    Its in-batch softmax takes each replica's own rows as negatives (as under
    tf.distribute), so its losses are not a single device's.
    """
    features = _two_tower_data()

    def build():
        tf1.set_random_seed(0)
        user = tf1.placeholder(tf.int64, [None])
        item = tf1.placeholder(tf.int64, [None])
        loss = _two_tower_class(tfrs)().compute_loss({"user": user, "item": item})
        train = tf1.train.GradientDescentOptimizer(0.5).minimize(loss)
        return {user: features["user"], item: features["item"]}, loss, train
    return _graph_losses(spec, build)


def keras3_scope_scenario(spec: str) -> dict:
    """A Keras 3 model compiled and fit in ad.scope(): AutoDist imports no tf_keras."""
    import keras  # pylint: disable=import-outside-toplevel
    ad = AutoDist(resource_spec_file=spec, strategy_builder=AllReduce())
    x, y = _data()
    with ad.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.fit(x, y, batch_size=ROWS, epochs=1, verbose=0)
    return {"tf_keras_loaded": "tf_keras" in sys.modules, "distributed": ad.strategy is not None}


def _imported(name: str):
    try:
        return __import__(name)
    except ImportError as err:
        print(f"UNAVAILABLE {name}: {err}", flush=True)
        sys.exit(0)


def main(spec: str, mode: str) -> None:
    results = {}
    if mode == "legacy":
        _imported("tf_keras")
        tfrs = _imported("tensorflow_recommenders")
        results["fit"] = fit_scenario(spec, tf.keras)
        results["function"] = function_scenario(spec, tf.keras, legacy_optimizer=False)
        results["function_legacy"] = function_scenario(spec, tf.keras, legacy_optimizer=True)
        results["tfrs_fit"] = tfrs_fit_scenario(spec, tfrs)
        results["keras2_graph"] = keras2_graph_scenario(spec)
        results["tfrs_graph"] = tfrs_graph_scenario(spec, tfrs)
    else:
        results["keras3"] = keras3_scope_scenario(spec)
        tf_keras = _imported("tf_keras")
        results["fit"] = fit_scenario(spec, tf_keras)
        results["function"] = function_scenario(spec, tf_keras, legacy_optimizer=False)
    print("RESULT " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
