"""Gradient accumulation: ``AutoDist(..., accumulation_steps=k)``.

Each case trains for two cycles of ``k`` runs, every run on another global
batch, and compares against single-device training whose every step trains on
the concatenation of one cycle's ``k`` batches. The 2-node cluster cases are in
``test_multinode.py``.
"""
import keras
import numpy as np
import pytest
import tensorflow as tf

import models
from autodist import AutoDist
from autodist.strategy import AllReduce, PartitionedPS
from test_equivalence import WITH_SHARDED_UPDATE as BUILDERS

tf1 = tf.compat.v1

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

CYCLES = 2
ATOL = RTOL = 1e-5


def adam():
    return tf1.train.AdamOptimizer(0.1)


def run_feeds(feeds: dict, run: int) -> dict:
    """The global batch of run ``run``: the model's own, shifted so that runs differ."""
    return {placeholder: (np.roll(value, run, axis=0) if value.dtype.kind == "i"
                          else value * (1.0 + 0.5 * run))
            for placeholder, value in feeds.items()}


def train_single(model: str, steps: int):
    """Single-device reference: every step on one cycle's batches, concatenated."""
    with tf.Graph().as_default():
        built = models.MODELS[model](adam)
        variables = [models.as_tf_variable(v) for v in built.variables]
        with tf1.Session() as sess:
            sess.run(tf1.global_variables_initializer())
            for cycle in range(CYCLES):
                runs = [run_feeds(built.feeds, cycle * steps + j) for j in range(steps)]
                sess.run(built.train_op, {p: np.concatenate([r[p] for r in runs])
                                          for p in built.feeds})
            return sess.run(variables + [tf1.train.get_global_step()])


def train_autodist(spec: str, builder, model: str, steps: int, check_run=None):
    """AutoDist with ``steps`` accumulation steps, one run per batch; optionally checks runs.

    Args:
        check_run: called as ``check_run(run, sess, built)`` after each run.
    """
    ad = AutoDist(spec, builder, accumulation_steps=steps)
    with tf.Graph().as_default(), ad.scope():
        built = models.MODELS[model](adam)
        with ad.create_distributed_session() as sess:
            for run in range(CYCLES * steps):
                sess.run(built.train_op, run_feeds(built.feeds, run))
                if check_run is not None:
                    check_run(run, sess, built)
            return sess.run(built.variables + [tf1.train.get_global_step()])


@pytest.mark.parametrize("steps", [1, 2, 4])
@pytest.mark.parametrize("model", ["dense", "embedding"])
@pytest.mark.parametrize("builder", sorted(BUILDERS))
def test_accumulation_equals_one_device_on_the_concatenated_batches(spec_path, builder, model,
                                                                    steps):
    want = train_single(model, steps)
    got = train_autodist(spec_path, BUILDERS[builder](), model, steps)
    for index, (g, w) in enumerate(zip(got, want)):
        np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL, err_msg=f"variable #{index}")
    assert got[-1] == CYCLES  # one update (global step) per cycle


def test_updating_at_every_run_would_differ(spec_path):
    # The cases above could not pass with accumulation ignored.
    want = train_single("dense", 2)
    updating_every_run = train_single("dense", 1)
    assert not np.allclose(want[0], updating_every_run[0], atol=1e-3)


@pytest.mark.parametrize("builder", [AllReduce, PartitionedPS])
def test_runs_that_accumulate_leave_the_variables_and_communicate_nothing(spec_path, builder):
    seen = []

    def check_run(run, sess, built):
        seen.append(sess.run(built.variables[0]))

    train_autodist(spec_path, builder(), "embedding", 4, check_run)
    initial = train_single("embedding", 4)  # only for the shape; values differ
    assert seen[0].shape == initial[0].shape
    # Runs 0-2 keep gradients, run 3 updates; likewise in the second cycle.
    for run in (1, 2):
        np.testing.assert_array_equal(seen[run], seen[0])
    assert not np.array_equal(seen[3], seen[2])
    for run in (5, 6):
        np.testing.assert_array_equal(seen[run], seen[4])


def _ops_run_by(op: tf.Operation) -> set:
    """Every op that running ``op`` runs (data and control inputs, transitively)."""
    seen, stack = set(), [op]
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        stack.extend(t.op for t in current.inputs)
        stack.extend(current.control_inputs)
    return seen


@pytest.mark.parametrize("builder, model", [(AllReduce, "embedding"), (PartitionedPS, "dense")])
def test_accumulating_runs_have_no_collective_and_no_update(spec_path, builder, model):
    ad = AutoDist(spec_path, builder(), accumulation_steps=3)
    with tf.Graph().as_default(), ad.scope():
        models.MODELS[model](adam)
        with ad.create_distributed_session() as sess:
            update, = sess.distributed.updates
            assert len(update.accumulate_ops) == 2
            for accumulate in update.accumulate_ops:
                types = {op.type for op in _ops_run_by(accumulate)}
                assert not any(t.startswith("Collective") for t in types), types
                assert not any(t.startswith("ResourceApply") for t in types), types
                # Each replica keeps its gradients on its own device.
                kept = [op for op in _ops_run_by(accumulate) if "/accumulate/Assign" in op.name]
                assert {op.name.split("/")[0] for op in kept} == {
                    "AutoDist-Replica-0", "AutoDist-Replica-1"}
                for op in kept:
                    replica = op.name.split("/")[0].rsplit("-", 1)[1]
                    assert op.device.endswith(f"CPU:{replica}"), (op.name, op.device)
            train_types = {op.type for op in _ops_run_by(update.train_op)}
            assert any(t.startswith("ResourceApply") for t in train_types)


def test_a_sparse_gradient_is_kept_sparse(spec_path):
    ad = AutoDist(spec_path, AllReduce(), accumulation_steps=2)
    with tf.Graph().as_default(), ad.scope():
        models.MODELS["embedding"](adam)
        with ad.create_distributed_session() as sess:
            names = [v.op.name for v in sess.graph.get_collection(
                tf1.GraphKeys.LOCAL_VARIABLES)]
    # The table's rows are stashed as rows; the dense layer is summed in place.
    assert any(n.endswith("/embedding/accumulate/stash_0_values") for n in names), names
    assert not any(n.endswith("/embedding/accumulate/accumulator") for n in names), names
    assert any(n.endswith("/w/accumulate/accumulator") for n in names), names


@pytest.mark.parametrize("value", [0, -1, 2.0, True, np.bool_(True), "2", 1025, np.int64(0)])
def test_a_bad_accumulation_steps_is_named(spec_path, value):
    with pytest.raises(ValueError, match="accumulation_steps must be an int from 1 to 1024"):
        AutoDist(spec_path, AllReduce(), accumulation_steps=value)


@pytest.mark.parametrize("value", [np.int64(2), np.int32(2)])
def test_a_numpy_integer_is_an_accumulation_count(spec_path, value):
    ad = AutoDist(spec_path, AllReduce(), accumulation_steps=value)
    assert ad._accumulation_steps == 2 and type(ad._accumulation_steps) is int


# ----------------------------------------------------------------------------- Keras

def _keras_data():
    rng = np.random.RandomState(0)
    return rng.randn(64, 6).astype(np.float32), rng.randn(64, 2).astype(np.float32)


def _keras_model():
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
                              keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return model


@pytest.mark.parametrize("builder", [AllReduce, PartitionedPS])
def test_keras_fit_accumulates_like_one_device_on_twice_the_batch(spec_path, builder):
    x, y = _keras_data()
    single = _keras_model()
    single.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    ad = AutoDist(spec_path, builder(), accumulation_steps=2)
    with ad.scope():
        model = _keras_model()
    history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    for got, want in zip(model.get_weights(), single.get_weights()):
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
    # One optimizer step per two batches, as on one device with twice the batch.
    assert int(model.optimizer.iterations.numpy()) == int(single.optimizer.iterations.numpy()) == 8
    for got, want in zip(model.optimizer.variables, single.optimizer.variables):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=RTOL, atol=ATOL)
    assert len(history.history["loss"]) == 2


def test_keras_function_accumulates_like_one_device_on_twice_the_batch(spec_path):
    """The step's returned loss must not pull the update into the runs that accumulate."""
    x, y = _keras_data()

    def train_step_of(model):
        def train_step(xs, ys):
            with tf.GradientTape() as tape:
                loss = keras.ops.mean(keras.losses.mean_squared_error(ys, model(xs)))
            gradients = tape.gradient(loss, model.trainable_variables)
            model.optimizer.apply_gradients(zip(gradients, model.trainable_variables))
            return loss
        return train_step

    single = _keras_model()
    step = tf.function(train_step_of(single))
    for start in range(0, 64, 16):
        step(x[start:start + 16], y[start:start + 16])
    ad = AutoDist(spec_path, AllReduce(), accumulation_steps=2)
    with ad.scope():
        model = _keras_model()
        step = ad.function(train_step_of(model))
    losses = [float(step(x[start:start + 8], y[start:start + 8])) for start in range(0, 64, 8)]
    assert all(np.isfinite(losses))
    assert int(model.optimizer.iterations.numpy()) == int(single.optimizer.iterations.numpy()) == 4
    for got, want in zip(model.get_weights(), single.get_weights()):
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
