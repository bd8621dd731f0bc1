"""Mixed precision: a ``LossScaleOptimizer``'s dynamic loss scale under AutoDist.

Every case trains on a single device and through AutoDist on the same global
batches, and compares, after every batch, the loss scale, its growth counter
and the iteration count, which must be equal, and at the end the weights, the
optimizer's variables and the logs. The data holds batches whose gradients
overflow, so that a step is skipped and the scale halved, and enough finite
steps for the scale to grow.

Under the ``float32`` policy (a ``LossScaleOptimizer`` wrapped by hand) every
value must match to 1e-5. Under ``mixed_float16`` each replica sums its own
rows' float16 gradient terms, where a single device sums the whole batch's:
the two roundings differ by float16's precision, so values are compared to
FLOAT16_TOLERANCE; the scale's course must still be the same.
"""
from __future__ import annotations

import contextlib

import keras
import numpy as np
import pytest
import tensorflow as tf

from autodist import AutoDist
from autodist.kernel_context import KernelContext
from autodist.kernels.transformer import transform
from autodist.keras import step
from autodist.resource_spec import ResourceSpec
from autodist.strategy import PS, AllReduce, Parallax, PartitionedPS, ShardedUpdateAR
from autodist.strategy.compiler import compile_strategy

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

ROWS, BATCH = 48, 8        # six steps per epoch
OVERFLOWING = 2            # the batch of every epoch whose gradients overflow
EXACT = 1e-5
FLOAT16_TOLERANCE = 5e-3
BUILDERS = {"AllReduce": AllReduce, "PartitionedPS": PartitionedPS, "Parallax": Parallax}


def data():
    """Regression rows; the targets of the overflowing batch are 1e5 times larger, so
    that its scaled gradient overflows in float16 at any scale above 2**-4."""
    rng = np.random.default_rng(7)
    x = rng.normal(size=(ROWS, 4)).astype(np.float32)
    y = (x.sum(axis=1, keepdims=True) + 0.1 * rng.normal(size=(ROWS, 1))).astype(np.float32)
    y[OVERFLOWING * BATCH:(OVERFLOWING + 1) * BATCH] *= 1e5
    return x, y


@contextlib.contextmanager
def policy(name: str):
    keras.mixed_precision.set_global_policy(name)
    try:
        yield
    finally:
        keras.mixed_precision.set_global_policy("float32")


def regression_model(optimizer) -> keras.Model:
    keras.utils.set_random_seed(5)
    model = keras.Sequential([
        keras.Input((4,)), keras.layers.Dense(8, activation="relu", name="hidden"),
        keras.layers.Dense(1, name="out"),
        # The output in float32, as the Keras mixed precision guide recommends.
        keras.layers.Activation("linear", dtype="float32", name="output")], name="regression")
    model.compile(optimizer=optimizer, loss="mse", metrics=["mae"])
    return model


def loss_scaled(initial_scale: float, growth_steps: int = 3):
    return lambda: keras.optimizers.LossScaleOptimizer(
        keras.optimizers.Adam(0.01), initial_scale=initial_scale,
        dynamic_growth_steps=growth_steps)


class ScaleLog(keras.callbacks.Callback):
    """The loss scale, its counter and the iteration count after every batch."""

    def __init__(self):
        super().__init__()
        self.rows = []

    def on_train_batch_end(self, batch, logs=None):
        optimizer = self.model.optimizer
        if not isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            return
        self.rows.append((float(optimizer.dynamic_scale.numpy()),
                          int(optimizer.step_counter.numpy()), int(optimizer.iterations.numpy())))


def fit(spec, builder, policy_name: str, optimizer, epochs: int = 2):
    """(the model, its History, the per-batch scale log) of one run; ``builder`` None
    trains on a single device."""
    x, y = data()
    log = ScaleLog()
    with policy(policy_name):
        if builder is None:
            model = regression_model(optimizer())
        else:
            ad = AutoDist(resource_spec_file=spec, strategy_builder=builder)
            with ad.scope():
                model = regression_model(optimizer())
        history = model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0,
                            callbacks=[log])
    return model, history.history, log.rows


def assert_same_training(got, want, tolerance: float) -> None:
    (model, history, scales), (single, single_history, single_scales) = got, want
    assert scales == single_scales, "the loss scale's course"
    for index, (g, w) in enumerate(zip(model.get_weights(), single.get_weights())):
        np.testing.assert_allclose(g, w, rtol=tolerance, atol=tolerance,
                                   err_msg=f"model weight #{index}")
    names = [v.path.rsplit("/", 1)[-1] for v in model.optimizer.variables]
    assert names == [v.path.rsplit("/", 1)[-1] for v in single.optimizer.variables]
    for name, g, w in zip(names, model.optimizer.variables, single.optimizer.variables):
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=tolerance, atol=tolerance,
                                   err_msg=f"optimizer variable {name}")
    assert sorted(history) == sorted(single_history)
    for key in single_history:
        np.testing.assert_allclose(history[key], single_history[key], rtol=tolerance,
                                   atol=tolerance, err_msg=f"History[{key!r}]")


def assert_skips_and_grows(scales: list) -> None:
    """The data exercised the scale both ways: the overflowing batch's steps were
    skipped (the iteration count stood still), and the scale also grew."""
    changes = [after[0] / before[0] for before, after in zip(scales, scales[1:])]
    assert 0.5 in changes and 2.0 in changes, changes
    skipped = {i + 1 for i, (before, after) in enumerate(zip(scales, scales[1:]))
               if after[2] == before[2]}
    assert {OVERFLOWING, OVERFLOWING + ROWS // BATCH} <= skipped, skipped


@pytest.fixture(scope="module")
def float32_single():
    return fit(None, None, "float32", loss_scaled(2.0 ** 118))


@pytest.mark.parametrize("builder", BUILDERS)
def test_a_loss_scale_skips_and_grows_as_on_one_device(spec_path, float32_single, builder):
    """Float32 values near overflow: every value equals the single device's."""
    got = fit(spec_path, BUILDERS[builder](), "float32", loss_scaled(2.0 ** 118))
    assert_skips_and_grows(float32_single[2])
    assert_same_training(got, float32_single, EXACT)


@pytest.mark.parametrize("builder", ["AllReduce", "PartitionedPS"])
def test_mixed_float16_fit_keeps_the_single_device_loss_scale(spec_path, builder):
    single = fit(None, None, "mixed_float16", loss_scaled(2.0 ** 5))
    got = fit(spec_path, BUILDERS[builder](), "mixed_float16", loss_scaled(2.0 ** 5))
    assert_skips_and_grows(single[2])
    assert_same_training(got, single, FLOAT16_TOLERANCE)
    # The replicas computed in float16, each reading the scale times its share of the rows.
    distributed = got[0]._autodist_fit.step.session.distributed
    graph = distributed.graph
    for replica in range(2):
        matmuls = [op for op in graph.get_operations()
                   if op.name.startswith(f"AutoDist-Replica-{replica}/") and op.type == "MatMul"]
        assert matmuls and all(op.get_attr("T") == tf.float16 for op in matmuls)
    scale_reads = {f"{name}:0" for name in distributed.item.loss_scale_reads}
    shares = [op.inputs[1] for op in graph.get_operations() if op.name.startswith(
        "autodist_contribution_shares/") and op.type == "Mul"
        and op.inputs[0].name in scale_reads]
    inputs = [graph.get_tensor_by_name(f"{name}:0") for name in distributed.item.batched_inputs]
    batch = {t: np.zeros([BATCH] + t.shape.as_list()[1:], np.float32) for t in inputs}
    with tf.compat.v1.Session(graph=graph) as session:
        assert session.run(shares, batch) == [0.5, 0.5]


def test_mixed_float16_policy_wraps_the_optimizer_as_keras_does(spec_path):
    """``compile`` under ``mixed_float16`` wraps a plain optimizer in a LossScaleOptimizer."""
    single = fit(None, None, "mixed_float16", lambda: keras.optimizers.Adam(0.01), epochs=1)
    got = fit(spec_path, AllReduce(), "mixed_float16", lambda: keras.optimizers.Adam(0.01),
              epochs=1)
    assert isinstance(got[0].optimizer, keras.optimizers.LossScaleOptimizer)
    # Keras's default scale, 2**15, overflows at the first step too.
    assert [iterations for _, _, iterations in single[2]] == [0, 1, 1, 2, 3, 4]
    assert_same_training(got, single, FLOAT16_TOLERANCE)


def custom_loop(scope, function, epochs: int = 2):
    """A ``GradientTape`` loop scaling its loss, as the mixed precision guide writes it."""
    x, y = data()
    with policy("mixed_float16"):
        with scope():
            model = regression_model(loss_scaled(2.0 ** 5)())
            optimizer = model.optimizer

        @function
        def train_step(features, targets):
            with tf.GradientTape() as tape:
                loss = keras.ops.mean(keras.ops.square(model(features, training=True) - targets))
                scaled = optimizer.scale_loss(loss)
            gradients = tape.gradient(scaled, model.trainable_variables)
            optimizer.apply(gradients, model.trainable_variables)
            return loss

        losses, scales = [], []
        for _ in range(epochs):
            for start in range(0, ROWS, BATCH):
                losses.append(float(train_step(x[start:start + BATCH], y[start:start + BATCH])))
                scales.append((float(optimizer.dynamic_scale.numpy()),
                               int(optimizer.step_counter.numpy()),
                               int(optimizer.iterations.numpy())))
    return model, {"loss": losses}, scales


def test_a_custom_loop_under_ad_function_keeps_the_single_device_loss_scale(spec_path):
    single = custom_loop(contextlib.nullcontext, tf.function)
    ad = AutoDist(resource_spec_file=spec_path, strategy_builder=AllReduce())
    got = custom_loop(ad.scope, ad.function)
    assert_skips_and_grows(single[2])
    assert_same_training(got, single, FLOAT16_TOLERANCE)


def test_mixed_bfloat16_fit_matches_one_device(spec_path):
    """No loss scale: bfloat16 has float32's range."""
    adam = lambda: keras.optimizers.Adam(0.01)  # noqa: E731
    single = fit(None, None, "mixed_bfloat16", adam, epochs=1)
    got = fit(spec_path, Parallax(), "mixed_bfloat16", adam, epochs=1)
    assert not isinstance(got[0].optimizer, keras.optimizers.LossScaleOptimizer)
    for index, (g, w) in enumerate(zip(got[0].get_weights(), single[0].get_weights())):
        # bfloat16 keeps 8 bits of mantissa: the replicas' partial sums round apart more.
        np.testing.assert_allclose(g, w, rtol=2e-2, atol=2e-2, err_msg=f"weight #{index}")


def test_a_strategy_that_shards_the_update_is_refused_by_name(spec_path):
    """The finite check reads every gradient; a sharded update holds a shard of each."""
    with pytest.raises(NotImplementedError, match=r"LossScaleOptimizer's finite check.*"
                                                  r"sharded across replicas"):
        fit(spec_path, ShardedUpdateAR(), "mixed_float16", loss_scaled(2.0 ** 5), epochs=1)


CHIEF, WORKER = "/job:worker/task:0/device:CPU:0", "/job:worker/task:1/device:CPU:0"
CLUSTER = {"nodes": [{"address": "10.0.0.1", "cpus": [0], "chief": True},
                     {"address": "10.0.0.2", "cpus": [0]}]}


def cluster_context(compiled) -> KernelContext:
    """The chief's view of a two-node cluster, one replica each."""
    return KernelContext(
        replica_devices=("10.0.0.1:CPU:0",),
        tf_devices={"10.0.0.1:CPU:0": CHIEF, "10.0.0.2:CPU:0": WORKER},
        shared_device=CHIEF, chief_device=CHIEF, num_nodes=2, group_size=2,
        all_replicas=("10.0.0.1:CPU:0", "10.0.0.2:CPU:0"), node_devices=(CHIEF, WORKER),
        has_collectives=compiled.has_collectives, has_remote_ops=compiled.has_remote_ops,
        state_per_node=True, updates_on_every_node=all(p.kind.updates_on_every_node
                                                       for p in compiled.synchronized_parts))


@pytest.mark.parametrize("builder, refused", [(PS, True), (PartitionedPS, True),
                                              (AllReduce, False)])
def test_on_a_cluster_every_node_must_apply_the_whole_update(builder, refused):
    """Each node keeps its own loss scale: a parameter server's update, which only the
    chief applies, would leave the workers' scale behind."""
    x, y = data()
    with policy("mixed_float16"):
        model = regression_model(loss_scaled(2.0 ** 5)())
        model.fit(x[:BATCH], y[:BATCH], batch_size=BATCH, verbose=0)  # builds the optimizer
        lifted = step.lift_step(step.trace_step(model.train_step, ((x, y),), autograph=False))
    item, spec = lifted.item, ResourceSpec.from_dict(CLUSTER)
    compiled = compile_strategy(builder().build(item, spec), item, spec)
    if not refused:
        transform(item, compiled, cluster_context(compiled))
        return
    with pytest.raises(NotImplementedError, match=r"cannot keep \['loss_scale_optimizer(_\d+)?/"
                                                  r"dynamic_scale'\] in step on every node.*"
                                                  r"Use AllReduce"):
        transform(item, compiled, cluster_context(compiled))
