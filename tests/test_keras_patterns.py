"""Patterns of real Keras scripts that once trained silently differently under AutoDist.

Each case runs the pattern on a single device and through AutoDist on the same
global batches and compares weights, the optimizer's variables (its learning
rate included) and every logged value; each also checks that the run was
distributed the way the fix says (which gradients travel dense, what the
step's placeholders take).
"""
from __future__ import annotations

import contextlib
import functools
import os
import re
import signal
import socket
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

from autodist import AutoDist
from autodist.graph_item import GraphItem
from autodist.keras import saving
from autodist.strategy import AllReduce, PartitionedPS
from test_keras import BUILDERS, assert_same, snapshot

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

ROWS, BATCH = 32, 8


def data(seed: int = 0, features: int = 4):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(ROWS, features)).astype(np.float32)
    return x, (x.sum(axis=1, keepdims=True) + 0.1 * rng.normal(size=(ROWS, 1))).astype(np.float32)


def fit_both(spec: str, builder, build, x, y, callbacks=lambda: [], epochs: int = 3):
    """(single device, AutoDist) runs of ``build()``'s compiled model, as ``Trained``."""
    runs = []
    for distributed in (False, True):
        if distributed:
            ad = AutoDist(resource_spec_file=spec, strategy_builder=builder)
            with ad.scope():
                model = build()
        else:
            model = build()
        history = model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0,
                            callbacks=callbacks())
        runs.append((snapshot(model, model.optimizer, history.history), model))
    return runs


def mlp(optimizer) -> keras.Model:
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu", name="hidden"),
                              keras.layers.Dense(1, name="out")], name="mlp")
    model.compile(optimizer=optimizer, loss="mse", metrics=["mae"])
    return model


# ----------------------------------------------------------------------------- 1. learning rates

LR_CALLBACKS = {
    # Training stops moving after the first epoch.
    "LearningRateScheduler": lambda: [keras.callbacks.LearningRateScheduler(
        lambda epoch, rate: 0.0 if epoch > 0 else rate)],
    # Fires at the end of every epoch: the loss never improves by 100.
    "ReduceLROnPlateau": lambda: [keras.callbacks.ReduceLROnPlateau(
        monitor="loss", factor=0.2, patience=0, min_delta=100.0)],
}


@pytest.mark.parametrize("callback", LR_CALLBACKS)
@pytest.mark.parametrize("builder", ["AllReduce", "PartitionedPS"])
def test_a_learning_rate_set_by_a_callback_takes_effect_at_the_next_step(spec_path, callback,
                                                                          builder):
    x, y = data()
    (want, single), (got, model) = fit_both(
        spec_path, BUILDERS[builder](), lambda: mlp(keras.optimizers.SGD(0.05, momentum=0.5)),
        x, y, LR_CALLBACKS[callback])
    assert_same(got, want, f"{callback} under {builder}")
    assert float(model.optimizer.learning_rate) == pytest.approx(
        float(single.optimizer.learning_rate))
    assert float(single.optimizer.learning_rate) < 0.05 * 0.2 + 1e-9  # the callback acted


def test_a_learning_rate_set_between_batches_is_used_by_the_next_batch(spec_path):
    class HalveEachBatch(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            self.model.optimizer.learning_rate.assign(self.model.optimizer.learning_rate * 0.5)

    x, y = data()
    (want, _), (got, _) = fit_both(spec_path, AllReduce(),
                                   lambda: mlp(keras.optimizers.Adam(0.05)), x, y,
                                   lambda: [HalveEachBatch()], epochs=2)
    assert_same(got, want, "learning rate halved before every batch")


class StopAtBatch(keras.callbacks.Callback):
    """Fails the first fit it is in, in its given epoch's given batch (a crash)."""

    autodist_reads_weights = False

    def __init__(self, epoch: int, batch: int):
        super().__init__()
        self._at, self._epoch, self.fired = (epoch, batch), 0, False

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if not self.fired and (self._epoch, batch) == self._at:
            self.fired = True
            raise RuntimeError("stopped")


def test_backup_and_restore_resumes_from_its_backup_in_the_same_process(spec_path, tmp_path):
    # The first fit dies two batches into epoch 1; the second, with the same callbacks,
    # loads the backup of epoch 0's end in on_train_begin and trains epochs 1 and 2
    # from it, not from the batches trained after the backup.
    x, y = data()
    runs = []
    for distributed in (False, True):
        backup = keras.callbacks.BackupAndRestore(str(tmp_path / str(distributed)))
        stop = StopAtBatch(epoch=1, batch=1)
        if distributed:
            with AutoDist(resource_spec_file=spec_path, strategy_builder=AllReduce()).scope():
                model = mlp(keras.optimizers.Adam(0.05))
        else:
            model = mlp(keras.optimizers.Adam(0.05))
        with pytest.raises(RuntimeError, match="stopped"):
            model.fit(x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0,
                      callbacks=[backup, stop])
        crashed = snapshot(model, model.optimizer)
        history = model.fit(x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0,
                            callbacks=[backup, stop])
        runs.append((crashed, snapshot(model, model.optimizer, history.history), stop.fired))
    (want_crashed, want, fired_single), (got_crashed, got, fired) = runs
    assert fired and fired_single
    # The model holds what trained before the error, as on one device.
    assert_same(got_crashed, want_crashed, "after the failed fit")
    assert len(want.history["loss"]) == 2  # epochs 1 and 2, resumed
    assert_same(got, want, "resumed by BackupAndRestore")


def test_weights_a_callback_sets_at_an_epoch_s_start_are_trained_from(spec_path):
    class ShrinkAtEpochStart(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.model.set_weights([w * 0.5 for w in self.model.get_weights()])

    x, y = data()
    (want, _), (got, _) = fit_both(spec_path, AllReduce(),
                                   lambda: mlp(keras.optimizers.SGD(0.05, momentum=0.5)), x, y,
                                   lambda: [ShrinkAtEpochStart()])
    assert_same(got, want, "weights halved at every epoch's start")


# ----------------------------------------------------------------------------- 2. loss trackers

class TrackedModel(keras.Model):
    """A ``train_step`` written as the Keras guide shows, with its own trackers."""

    def __init__(self):
        super().__init__(name="tracked")
        self.hidden = keras.layers.Dense(8, activation="relu", name="hidden")
        self.out = keras.layers.Dense(1, name="out")
        self.loss_tracker = keras.metrics.Mean(name="loss")
        self.mae_metric = keras.metrics.MeanAbsoluteError(name="mae")

    def call(self, x):
        return self.out(self.hidden(x))

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            prediction = self(x, training=True)
            loss = keras.ops.mean(keras.ops.square(prediction - y))
        gradients = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(gradients, self.trainable_variables))
        self.loss_tracker.update_state(loss)
        self.mae_metric.update_state(y, prediction)
        return {"loss": self.loss_tracker.result(), "mae": self.mae_metric.result()}

    @property
    def metrics(self):
        return [self.loss_tracker, self.mae_metric]


def tracked_model() -> keras.Model:
    keras.utils.set_random_seed(2)
    model = TrackedModel()
    model.compile(optimizer=keras.optimizers.Adam(0.01))
    return model


def two_headed_model() -> keras.Model:
    keras.utils.set_random_seed(3)
    inputs = keras.Input((4,), name="features")
    hidden = keras.layers.Dense(8, activation="relu", name="hidden")(inputs)
    model = keras.Model(inputs, {"sum": keras.layers.Dense(1, name="sum")(hidden),
                                 "sign": keras.layers.Dense(1, name="sign")(hidden)},
                        name="two_heads")
    model.compile(optimizer=keras.optimizers.Adam(0.01),
                  loss={"sum": "mse", "sign": keras.losses.BinaryCrossentropy(from_logits=True)},
                  loss_weights={"sum": 1.0, "sign": 0.5})
    return model


@pytest.mark.parametrize("builder", ["AllReduce", "Parallax"])
def test_a_mean_tracker_fed_one_loss_per_step_logs_the_single_device_loss(spec_path, builder):
    x, y = data(4)
    (want, _), (got, _) = fit_both(spec_path, BUILDERS[builder](), tracked_model, x, y)
    assert_same(got, want, f"train_step with a loss tracker under {builder}")


def test_each_output_s_loss_of_a_multi_output_model_is_logged_as_on_one_device(spec_path):
    x, y = data(5)
    targets = {"sum": y, "sign": (y > 0).astype(np.float32)}
    (want, _), (got, _) = fit_both(spec_path, AllReduce(), two_headed_model, x, targets)
    assert {"sum_loss", "sign_loss"} <= set(want.history)
    assert_same(got, want, "loss dict with loss_weights")


# ----------------------------------------------------------------------------- 3. positions

MAXLEN, VOCABULARY = 6, 20


class TokenAndPositionEmbedding(keras.layers.Layer):
    """Token embedding plus a learned position embedding, as transformer examples write it."""

    def __init__(self, dynamic_length: bool, **kwargs):
        super().__init__(**kwargs)
        self.dynamic_length = dynamic_length
        self.tokens = keras.layers.Embedding(VOCABULARY, 8, name="tokens")
        self.positions = keras.layers.Embedding(MAXLEN, 8, name="positions")

    def call(self, ids):
        length = tf.shape(ids)[-1] if self.dynamic_length else MAXLEN
        return self.tokens(ids) + self.positions(tf.range(0, length))


def positional_model(dynamic_length: bool, optimizer: str) -> keras.Model:
    keras.utils.set_random_seed(6)
    ids = keras.Input((MAXLEN,), dtype="int32")
    hidden = TokenAndPositionEmbedding(dynamic_length, name="embed")(ids)
    hidden = keras.layers.GlobalAveragePooling1D()(hidden)
    model = keras.Model(ids, keras.layers.Dense(2, name="out")(hidden), name="positional")
    model.compile(optimizer=keras.optimizers.get({"class_name": optimizer,
                                                  "config": {"learning_rate": 0.01}}),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


@pytest.mark.parametrize("builder", ["AllReduce", "PS", "PartitionedPS", "Parallax"])
@pytest.mark.parametrize("dynamic_length", [False, True], ids=["maxlen", "tf.shape"])
def test_a_position_table_trains_as_on_one_device(spec_path, builder, dynamic_length):
    rng = np.random.default_rng(7)
    ids = rng.integers(0, VOCABULARY, (ROWS, MAXLEN)).astype(np.int32)
    labels = rng.integers(0, 2, ROWS)
    (want, _), (got, model) = fit_both(
        spec_path, BUILDERS[builder](), lambda: positional_model(dynamic_length, "Adam"),
        ids, labels, epochs=2)
    assert_same(got, want, f"positions under {builder}")
    # Every replica looks up rows 0..5 of the position table: their gradients are
    # summed row by row (dense on the wire); the tokens' are gathered side by side.
    infos = {i.shape: i for i in model._autodist_fit.step.session.distributed.item
             .trainable_variables}
    assert not infos[(MAXLEN, 8)].sparse_grad  # the position table
    assert infos[(VOCABULARY, 8)].sparse_grad  # the token table


@pytest.mark.parametrize("optimizer", ["RMSprop", "Adagrad", "SGD"])
def test_a_position_table_under_other_optimizers(spec_path, optimizer):
    rng = np.random.default_rng(8)
    ids = rng.integers(0, VOCABULARY, (ROWS, MAXLEN)).astype(np.int32)
    labels = rng.integers(0, 2, ROWS)
    (want, _), (got, _) = fit_both(spec_path, PartitionedPS(),
                                   lambda: positional_model(False, optimizer), ids, labels,
                                   epochs=2)
    assert_same(got, want, f"positions under {optimizer}")


def test_indices_that_depend_on_the_batch_are_not_the_same_rows():
    """Only a shape's non-batch elements are the same on every replica."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.int32, [None, 5])
        table = tf.compat.v1.get_variable("table", [10, 3], use_resource=True)
        by_length = tf.gather(table, tf.range(tf.shape(x)[-1]))
        by_batch = tf.gather(tf.compat.v1.get_variable("rows", [10, 3], use_resource=True),
                             tf.range(tf.shape(x)[0]))
        by_ids = tf.gather(tf.compat.v1.get_variable("ids", [10, 3], use_resource=True), x)
        loss = (tf.reduce_sum(by_length) + tf.reduce_sum(by_batch)
                + tf.reduce_sum(by_ids))
        calls = []
        from autodist import _tf_compat
        with _tf_compat.capture_apply_gradients(calls.append):
            tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss)
    item = GraphItem(graph, calls)
    assert {name: ref.same_rows for name, ref in item.gradients.items()} == {
        "table": True, "rows": False, "ids": False}


# ----------------------------------------------------------------------------- 5. x.shape[0]

def summed_loss_step(model, optimizer):
    def train_step(x, y):
        with tf.GradientTape() as tape:
            squared = tf.reduce_sum(tf.square(model(x, training=True) - y))
            loss = squared / x.shape[0]  # the batch's static size
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        return loss
    return train_step


def test_a_function_reading_the_static_batch_size_matches_tf_function(spec_path):
    x, y = data(9)
    batches = [(x[i:i + BATCH], y[i:i + BATCH]) for i in range(0, ROWS, BATCH)]

    def model_and_optimizer():
        keras.utils.set_random_seed(9)
        return (keras.Sequential([keras.Input((4,)), keras.layers.Dense(1, name="out")],
                                 name="linear"),
                keras.optimizers.Adam(0.01))

    model, optimizer = model_and_optimizer()
    step = tf.function(summed_loss_step(model, optimizer))
    want = snapshot(model, optimizer, losses=[step(a, b) for a, b in batches])
    ad = AutoDist(resource_spec_file=spec_path, strategy_builder=AllReduce())
    with ad.scope():
        model, optimizer = model_and_optimizer()
        step = ad.function(summed_loss_step(model, optimizer))
    got = snapshot(model, optimizer, losses=[step(a, b) for a, b in batches])
    assert_same(got, want, "a loss divided by x.shape[0]")
    # Traced with each replica's 4 rows, x.shape[0] is 4 in each replica's graph,
    # while the step's placeholders still take the global batch, which is split.
    item = step.step.session.distributed.item
    shapes = sorted(item.graph.get_tensor_by_name(f"{name}:0").shape.as_list()
                    for name in item.batched_inputs)
    assert shapes == [[None, 1], [None, 4]]
    divisors = [op for op in item.graph.get_operations() if op.type == "RealDiv"
                and op.inputs[1].op.type == "Const"]
    assert divisors
    assert {float(tf.make_ndarray(op.inputs[1].op.get_attr("value"))) for op in divisors} == {4.0}

    with pytest.raises(ValueError, match=(
            r"could not trace train_step with the batch dimension left free .*None values "
            r"not supported.*a batch of 7 rows does not split evenly over 2 replicas")):
        step(x[:7], y[:7])


def test_fit_of_a_train_step_reading_the_static_batch_size(spec_path):
    class StaticBatchModel(keras.Model):
        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(tf.square(self(x, training=True) - y)) / x.shape[0]
            gradients = tape.gradient(loss, self.trainable_variables)
            self.optimizer.apply_gradients(zip(gradients, self.trainable_variables))
            return {"loss": loss}

    def build():
        keras.utils.set_random_seed(10)
        inputs = keras.Input((4,))
        model = StaticBatchModel(inputs, keras.layers.Dense(1, name="out")(inputs))
        model.compile(optimizer=keras.optimizers.SGD(0.05))
        return model

    x, y = data(10)
    (want, _), (got, _) = fit_both(spec_path, PartitionedPS(), build, x, y, epochs=2)
    assert_same(got, want, "train_step dividing by x.shape[0]")


# ----------------------------------------------------------------------------- 6. lookup tables

def lookup_model() -> keras.Model:
    keras.utils.set_random_seed(11)
    city = keras.Input((1,), dtype="string", name="city")
    code = keras.Input((1,), dtype="int64", name="code")
    ids = keras.layers.StringLookup(vocabulary=["oslo", "rome", "lima"], name="city_ids")(city)
    codes = keras.layers.IntegerLookup(vocabulary=[10, 20, 30], name="code_ids")(code)
    hidden = keras.layers.Concatenate(name="joined")([
        keras.layers.Flatten()(keras.layers.Embedding(4, 3, name="city_table")(ids)),
        keras.layers.Flatten()(keras.layers.Embedding(4, 2, name="code_table")(codes))])
    model = keras.Model([city, code], keras.layers.Dense(1, name="out")(hidden), name="lookups")
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return model


@pytest.mark.parametrize("builder", ["AllReduce", "PartitionedPS", "Parallax"])
def test_lookup_layers_inside_the_model_train_as_on_one_device(spec_path, builder):
    rng = np.random.default_rng(11)
    cities = rng.choice(["oslo", "rome", "lima", "kyiv"], (ROWS, 1))  # kyiv: out of vocabulary
    codes = rng.choice([10, 20, 30, 40], (ROWS, 1)).astype(np.int64)
    y = rng.normal(size=(ROWS, 1)).astype(np.float32)

    def dataset():
        return tf.data.Dataset.from_tensor_slices(((cities, codes), y)).batch(BATCH)

    runs = []
    for distributed in (False, True):
        if distributed:
            ad = AutoDist(resource_spec_file=spec_path, strategy_builder=BUILDERS[builder]())
            with ad.scope():
                model = lookup_model()
        else:
            model = lookup_model()
        history = model.fit(dataset(), epochs=2, verbose=0)
        runs.append(snapshot(model, model.optimizer, history.history))
    assert_same(runs[1], runs[0], f"lookup layers under {builder}")
    # Each table is held once on this node, and every replica looks its rows up in it.
    distributed_graph = model._autodist_fit.step.session.distributed
    tables = [op for op in distributed_graph.graph.get_operations() if op.type == "HashTableV2"]
    assert len(tables) == 2
    finds = [op for op in distributed_graph.graph.get_operations()
             if op.type == "LookupTableFindV2"]
    assert sorted(op.name.split("/")[0] for op in finds) == [
        "AutoDist-Replica-0", "AutoDist-Replica-0", "AutoDist-Replica-1", "AutoDist-Replica-1"]
    assert {op.inputs[0].op.name for op in finds} == {op.name for op in tables}


def test_a_state_scalar_the_update_writes_once_for_every_variable(spec_path):
    """Nadam's momentum product: written once per update, read by every variable's update."""
    def build():
        keras.backend.clear_session()  # the product's automatic name, "variable", alike
        return mlp(keras.optimizers.Nadam(0.01))

    x, y = data(12)
    (want, _), (got, _) = fit_both(spec_path, PartitionedPS(), build, x, y, epochs=2)
    assert_same(got, want, "Nadam")
    assert 0 < float(want.optimizer_variables[want.optimizer_names.index("variable")]) < 1


# ----------------------------------------------------------------------------- smaller items

def test_an_eager_training_loop_inside_the_scope_warns_once_naming_ad_function(spec_path):
    x, y = data(13)
    ad = AutoDist(resource_spec_file=spec_path, strategy_builder=AllReduce())
    with ad.scope():
        model = mlp(keras.optimizers.SGD(0.01))
        with pytest.warns(UserWarning, match=r"SGD.apply ran eagerly inside ad.scope\(\).*"
                                             r"one device.*@ad.function") as caught:
            for start in range(0, ROWS, BATCH):  # no decorator: eager
                with tf.GradientTape() as tape:
                    loss = tf.reduce_mean(tf.square(model(x[start:start + BATCH]) - y[start:start + BATCH]))
                grads = tape.gradient(loss, model.trainable_variables)
                model.optimizer.apply_gradients(zip(grads, model.trainable_variables))
    assert len([w for w in caught if "ran eagerly" in str(w.message)]) == 1


def test_importing_autodist_after_tensorflow_adds_no_warning_to_fit(spec_path, tmp_path):
    """TensorFlow warns when an op it ran gets an attribute; AutoDist sets none after a run."""
    script = tmp_path / "after_tensorflow.py"
    script.write_text(f"""
import tensorflow as tf
import keras
import numpy as np
from autodist import AutoDist
ad = AutoDist({spec_path!r})
with ad.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile("adam", "mse", metrics=["mae"])
model.fit(np.ones((16, 4), "float32"), np.ones((16, 1), "float32"), epochs=2, verbose=0)
print("trained")
""")
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "trained" in done.stdout
    assert "was changed by setting attribute" not in done.stderr, done.stderr[-2000:]


# ----------------------------------------------------------------------------- loops

class ScaledCell(keras.layers.Layer):
    """An RNN cell reading a non-trainable weight every step (``keras.layers.RNN`` runs
    it in a loop); with ``counts``, also counting its calls into a non-trainable."""

    def __init__(self, units: int, counts: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.units, self.state_size, self._counts = units, units, counts

    def build(self, input_shape):
        self.kernel = self.add_weight(shape=(input_shape[-1], self.units), name="kernel")
        self.scale = self.add_weight(shape=(), initializer=keras.initializers.Constant(0.5),
                                     trainable=False, name="scale")
        self.calls = self.add_weight(shape=(), initializer="zeros", trainable=False,
                                     name="calls")

    def call(self, inputs, states):
        if self._counts:
            self.calls.assign_add(1.0)
        output = keras.ops.tanh(keras.ops.matmul(inputs, self.kernel) * self.scale + states[0])
        return output, [output]


def scaled_rnn(counts: bool = False) -> keras.Model:
    keras.utils.set_random_seed(4)
    model = keras.Sequential([keras.Input((5, 3)),
                              keras.layers.RNN(ScaledCell(4, counts, name="cell"), name="rnn"),
                              keras.layers.Dense(1, name="out")], name="scaled_rnn")
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"])
    return model


def sequences():
    rng = np.random.default_rng(5)
    x = rng.normal(size=(ROWS, 5, 3)).astype(np.float32)
    return x, x.sum(axis=(1, 2))[:, None].astype(np.float32)


@pytest.mark.parametrize("builder", ["AllReduce", "PS"])
def test_a_loop_reading_a_non_trainable_weight_runs_on_every_replica(spec_path, builder):
    """The second replica's loop cannot take the handle of a variable on the first CPU:
    it reads a copy on its own device, refreshed every step."""
    (want, _), (got, model) = fit_both(spec_path, BUILDERS[builder](), scaled_rnn, *sequences(),
                                       epochs=2)
    assert_same(got, want, f"a loop reading a non-trainable weight under {builder}")
    graph = model._autodist_fit.step.session.distributed.graph
    loops = [op for op in graph.get_operations() if op.type in ("While", "StatelessWhile")]
    assert {op.name.split("/")[0] for op in loops} == {"AutoDist-Replica-0", "AutoDist-Replica-1"}
    copies = [op for op in graph.get_operations()
              if op.type == "VarHandleOp" and op.name.endswith("scale/loop_copy")]
    assert [(op.name.split("/")[0], op.device.split("/")[-1]) for op in copies] == [
        ("AutoDist-Replica-1", "device:CPU:1")]


def test_a_loop_writing_a_non_trainable_variable_is_refused_by_name(spec_path):
    ad = AutoDist(resource_spec_file=spec_path, strategy_builder=AllReduce())
    with ad.scope():
        model = scaled_rnn(counts=True)
    with pytest.raises(NotImplementedError, match=r"cannot replicate the loop or cond "
                                                  r"'.*while': it takes the non-trainable "
                                                  r"variable '.*(scale|calls)'"):
        model.fit(*sequences(), batch_size=BATCH, epochs=1, verbose=0)


# ----------------------------------------------------------------------------- ad.function calls

def keyword_step_run(scope, function):
    """Two steps called with keyword arguments, as a ``tf.function`` may be."""
    x, y = data()
    keras.utils.set_random_seed(6)
    with scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        optimizer = keras.optimizers.SGD(0.1)

    @function
    def train(features, targets, weight=1.0):
        with tf.GradientTape() as tape:
            loss = weight * keras.ops.mean(keras.ops.square(model(features) - targets))
        optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
        return loss

    losses = [float(train(x[:BATCH], targets=y[:BATCH])),
              float(train(targets=y[BATCH:2 * BATCH], features=x[BATCH:2 * BATCH], weight=0.5))]
    return losses, model.get_weights(), train


def test_ad_function_binds_keyword_arguments_as_tf_function_does(spec_path):
    want_losses, want_weights, _ = keyword_step_run(contextlib.nullcontext, tf.function)
    ad = AutoDist(resource_spec_file=spec_path, strategy_builder=AllReduce())
    losses, weights, train = keyword_step_run(ad.scope, ad.function)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    for got, want in zip(weights, want_weights):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    x, _ = data()
    with pytest.raises(TypeError, match=r"^train\(\): missing a required argument: 'targets'"):
        train(features=x[:BATCH])


def test_ad_function_names_a_keyword_only_parameter(spec_path):
    ad = AutoDist(resource_spec_file=spec_path, strategy_builder=AllReduce())

    @ad.function
    def train(features, *, targets):
        return features + targets

    with pytest.raises(TypeError, match=r"arguments of train by position, but \['targets'\] "
                                        r"are keyword-only"):
        train(np.ones((2, 1), np.float32), targets=np.ones((2, 1), np.float32))


def test_batches_alike_find_their_step_without_a_signature(spec_path, monkeypatch):
    """A batch of the last one's structure, dtypes and shapes reuses its step's key; a
    batch of other rows, or another dtype, is looked up by its signature."""
    from autodist.keras import step as step_module
    signatures = []
    original = step_module.signature
    monkeypatch.setattr(step_module, "signature",
                        lambda *args: signatures.append(args) or original(*args))
    ad = AutoDist(resource_spec_file=spec_path, strategy_builder=AllReduce())
    with ad.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        optimizer = keras.optimizers.SGD(0.1)

    @ad.function
    def train(features, targets):
        with tf.GradientTape() as tape:
            loss = keras.ops.mean(keras.ops.square(model(features) - targets))
        optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
        return loss

    x, y = data()
    train(x[:BATCH], y[:BATCH])
    train(x[BATCH:2 * BATCH], y[BATCH:2 * BATCH])  # the first lookup after the trace
    traced, step = len(signatures), train.step
    train(x[:BATCH], y[:BATCH])
    assert len(signatures) == traced
    train(tf.constant(x[:BATCH]), tf.constant(y[:BATCH]))  # a tensor, not an array
    train(tf.constant(x[BATCH:2 * BATCH]), tf.constant(y[BATCH:2 * BATCH]))
    assert len(signatures) == traced + 1
    train(x[:BATCH - 2], y[:BATCH - 2])  # fewer rows: the same step, its batch dimension free
    assert len(signatures) == traced + 2
    assert train.step is step


# ----------------------------------------------------------------------------- compile again

def test_compiling_again_outside_the_scope_trains_with_the_new_optimizer_and_loss(spec_path):
    """A second ``compile`` after a first ``fit`` need not be inside ``ad.scope()``."""
    x, y = data()
    runs = []
    for distributed in (False, True):
        if distributed:
            ad = AutoDist(resource_spec_file=spec_path, strategy_builder=AllReduce())
            with ad.scope():
                model = mlp(keras.optimizers.SGD(0.05))
        else:
            model = mlp(keras.optimizers.SGD(0.05))
        first = model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mae")
        second = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
        runs.append((snapshot(model, model.optimizer, second.history), first.history))
    (want, want_first), (got, got_first) = runs
    np.testing.assert_allclose(got_first["loss"], want_first["loss"], rtol=1e-5)
    assert_same(got, want, "fit, compile(Adam, 'mae') outside the scope, fit")
    assert want.history["loss"][0] > 0.1  # the mean absolute error, not 0.0


# ----------------------------------------------------------------------------- nodes agree

def lifted_fit_step(optimizer, loss_weight: float = 0.2, seed: int = 1):
    """The lifted ``train_step`` of a two-output model, as a node of a job builds it."""
    from autodist.keras import step
    keras.utils.clear_session()  # each node names its layers in a fresh process
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(8, activation="relu", name="hidden")(inputs)
    model = keras.Model(inputs, [keras.layers.Dense(1, name="a")(hidden),
                                 keras.layers.Dense(1, name="b")(hidden)], name="two_heads")
    model.compile(optimizer=optimizer, loss=["mse", "mse"], loss_weights=[1.0, loss_weight])
    x, y = data()
    model.fit(x, (y, y), batch_size=BATCH, verbose=0)  # builds the optimizer
    return step.lift_step(step.trace_step(model.train_step, ((x, (y, y)),), autograph=False))


def test_nodes_compiled_with_other_settings_are_named_by_the_fingerprint():
    """A node's fingerprint is its graph's structure, then its training settings. In one
    process the traced functions' names differ from trace to trace (in a job each node
    traces once, in its own process), so this test compares the settings alone."""
    from autodist.cluster.service import FingerprintMismatchError
    # Named as a fresh process would name them: the settings' keys are op names.
    adam = functools.partial(keras.optimizers.Adam, name="adam")
    chief = lifted_fit_step(adam(0.01)).item.fingerprint
    structure, settings = chief.split("|", 1)
    # Other initial weights come from the chief: the same settings.
    assert lifted_fit_step(keras.optimizers.Adam(0.01), seed=2).item.fingerprint.split(
        "|", 1)[1] == settings
    other_rate = lifted_fit_step(keras.optimizers.Adam(0.02)).item.fingerprint
    other_weight = lifted_fit_step(keras.optimizers.Adam(0.01), loss_weight=0.5).item.fingerprint
    for worker, differs in ((other_rate, r"optimizer_0:adam/learning_rate differ"),
                            (other_weight, r"constants differ")):
        worker = f"{structure}|{worker.split('|', 1)[1]}"
        message = str(FingerprintMismatchError("10.0.0.2", worker, chief))
        assert re.search(rf"'10.0.0.2' builds the chief's graph but trains with other "
                         rf"settings: {differs}", message), message


@pytest.mark.parametrize("callback, decision", [
    (keras.callbacks.EarlyStopping(monitor="loss", patience=1), "stops training"),
    (keras.callbacks.ReduceLROnPlateau(monitor="loss"), "sets the learning rate"),
])
def test_a_callback_deciding_from_a_nodes_logs_is_refused_on_a_cluster(callback, decision):
    """Each node logs its own rows' metrics: one node would stop, or change its learning
    rate, and not another."""
    from autodist.keras.fit import distribute_fit
    model = mlp(keras.optimizers.SGD(0.05))
    distribute_fit(model, lambda lifted: pytest.fail("no step may run"), replicas=1,
                   on_cluster=True)
    x, y = data()
    with pytest.raises(NotImplementedError, match=rf"{type(callback).__name__} "
                                                  rf"\(monitor='loss'\) would decide per node: "
                                                  rf"it {decision}"):
        model.fit(x, y, batch_size=BATCH, callbacks=[callback], verbose=0)


# ----------------------------------------------------------------------------- saves

SAVES_FOREVER = """
import sys
import keras
from autodist import AutoDist
ad = AutoDist(sys.argv[1])
with ad.scope():
    model = keras.Sequential([keras.Input((1024,)), keras.layers.Dense(4096),
                              keras.layers.Dense(4096)])  # 84 MB of weights
    model.compile(optimizer="sgd", loss="mse")
while True:
    model.save_weights(sys.argv[2])
    print("saved", flush=True)
"""


@pytest.mark.timeout(120)
def test_a_save_cut_by_sigkill_leaves_the_previous_file_whole(spec_path, tmp_path):
    """``save_weights`` (and so ``ModelCheckpoint``) writes aside and renames."""
    import time
    path = tmp_path / "model.weights.h5"
    job = subprocess.Popen([sys.executable, "-c", SAVES_FOREVER, spec_path, str(path)],
                           stdout=subprocess.PIPE, text=True,
                           env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    killed_save = tmp_path / f".model.autodist-{socket.gethostname()}-{job.pid}.weights.h5"
    try:
        assert job.stdout.readline().strip() == "saved"  # a whole file is in place
        deadline = time.monotonic() + 60
        while not killed_save.exists():  # the next save has begun writing aside
            assert time.monotonic() < deadline, "no save began within 60 s"
            time.sleep(0.001)
        job.kill()
        job.wait()
    finally:
        if job.poll() is None:
            job.kill()
    model = keras.Sequential([keras.Input((1024,)), keras.layers.Dense(4096),
                              keras.layers.Dense(4096)])
    model.load_weights(str(path))  # whole: a cut file would not load
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith(".")] == [path.name]
    assert killed_save.exists()  # the partial file of the save cut short
    assert saving.remove_stale_temporaries(str(path)) == [str(killed_save)]


def test_a_save_removes_the_temporary_files_of_earlier_saves_that_were_killed(spec_path,
                                                                            tmp_path):
    path = tmp_path / "model.weights.h5"
    finished = subprocess.Popen([sys.executable, "-c", "pass"])
    finished.wait()  # its id stands for a process killed in the middle of a save

    def left_by(pid, host=socket.gethostname()):
        name = f".model.autodist-{host}-{pid}.weights.h5"  # as the README names them
        (tmp_path / name).write_bytes(b"part of a save")
        return name

    killed = left_by(finished.pid)
    running = left_by(os.getppid())  # a live process: perhaps still writing
    other_host = left_by(finished.pid, host="another-host")
    ad = AutoDist(spec_path)
    with ad.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        model.compile(optimizer="sgd", loss="mse")
    model.save_weights(str(path))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [path.name, running, other_host])
    assert killed not in os.listdir(tmp_path)


SIGNALLED_IN_SAVE = """
import os, signal, sys, time
import keras
import numpy as np
from autodist import AutoDist

class SignalsInSave(keras.layers.Dense):
    signum = None  # sent to this process in the middle of the layer's save

    def save_own_variables(self, store):
        if SignalsInSave.signum is not None:
            os.kill(os.getpid(), SignalsInSave.signum)
            time.sleep(float(sys.argv[4]))  # the handler has run; the writes are to come
        super().save_own_variables(store)

ad = AutoDist(sys.argv[1])
with ad.scope():
    model = keras.Sequential([keras.Input((3,)), SignalsInSave(2)])
    model.compile(optimizer="sgd", loss="mse")
model.set_weights([np.zeros((3, 2)), np.zeros(2)])
model.save_weights(sys.argv[2])
model.set_weights([np.ones((3, 2)), np.ones(2)])
SignalsInSave.signum = getattr(signal, sys.argv[3])
print("saving", flush=True)
model.save_weights(sys.argv[2])
print("went on after the save", flush=True)
"""


def _signalled_in_save(spec_path, path, signum: str, save_seconds: float, grace: str = ""):
    """Runs SIGNALLED_IN_SAVE; returns (the process's result, the saved weights)."""
    # A process started in the background by a non-interactive shell ignores SIGINT, and
    # its children inherit that: the job restores the default, so that Python raises
    # KeyboardInterrupt as it does in a terminal.
    done = subprocess.run([sys.executable, "-c", SIGNALLED_IN_SAVE, spec_path, str(path),
                           signum, str(save_seconds)], capture_output=True, text=True,
                          timeout=90, env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path),
                                               AUTODIST_SAVE_GRACE_S=grace),
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    # Keras files a layer's weights under its class's name.
    layer = type("SignalsInSave", (keras.layers.Dense,), {})(2)
    model = keras.Sequential([keras.Input((3,)), layer])
    model.load_weights(str(path))  # whole, whichever save it holds
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary left
    return done, model.get_weights()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("signum, code, says", [
    ("SIGTERM", -signal.SIGTERM, ""),  # no handler: SIGTERM ends the process, after the save
    ("SIGINT", -signal.SIGINT, "KeyboardInterrupt"),  # Ctrl-C: raised once the save is done
])
def test_a_stop_during_a_save_lets_it_finish_first(spec_path, tmp_path, signum, code, says):
    path = tmp_path / "model.weights.h5"
    done, weights = _signalled_in_save(spec_path, path, signum, save_seconds=0.5)
    assert done.returncode == code, done.stderr[-2000:]
    assert done.stdout.split() == ["saving"]  # stopped right after the save
    assert (f"AutoDist: {signum} arrived during the save of '{path}'; the save finishes "
            "first (at most 20 s" in done.stderr), done.stderr[-2000:]
    assert says in done.stderr
    assert all((w == 1).all() for w in weights)  # the save in progress, whole


@pytest.mark.timeout(120)
def test_a_save_that_outlasts_its_grace_is_abandoned_keeping_the_previous_file(spec_path,
                                                                             tmp_path):
    import time
    path = tmp_path / "model.weights.h5"
    started = time.monotonic()
    done, weights = _signalled_in_save(spec_path, path, "SIGTERM", save_seconds=60, grace="1")
    assert time.monotonic() - started < 40  # not the save's 60 s
    assert done.returncode == -signal.SIGTERM, done.stderr[-2000:]
    assert (f"the save of '{path}' did not finish within 1 s of SIGTERM; stopping without "
            "it (the previous file is kept)" in done.stderr), done.stderr[-2000:]
    assert all((w == 0).all() for w in weights)  # the previous save


@pytest.mark.parametrize("value", ["soon", "-1", "nan", "inf", "1e300"])
def test_a_bad_save_grace_is_named_at_start(spec_path, monkeypatch, value):
    monkeypatch.setenv("AUTODIST_SAVE_GRACE_S", value)
    with pytest.raises(ValueError, match=rf"AUTODIST_SAVE_GRACE_S='{value}' is not a number "
                                         rf"of seconds from 0 to 86400"):
        AutoDist(spec_path)
