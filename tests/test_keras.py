"""The Keras 3 front end: ``model.fit`` under ``ad.scope()`` and ``ad.function``.

Every equivalence case builds the same model twice from a fixed seed
(``tests/keras_models.py``), trains it once on a single device and once
through AutoDist on the same global batches, and compares the model's weights,
the optimizer's variables and what training reported. Forward-pass state
(metrics, batch normalization, dropout seeds) is checked against the policy
AutoDist documents rather than against single-device training where the two
differ by design.
"""
from __future__ import annotations

import dataclasses
import functools
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import autodist
import keras_models as km
from autodist import AutoDist
from autodist._tf_compat import EagerVariables, eager_snapshot
from autodist.keras.function import DistributedStep
from autodist.keras.update import RESOURCE_WRITES
from autodist.kernels import partitioner
from autodist.partition import PartitionPlan
from autodist.strategy import (PS, AllReduce, Parallax, PartitionedAR, PartitionedPS,
                               PSLoadBalancing, RandomAxisPartitionAR, ShardedUpdateAR,
                               Strategy, UnevenPartitionedPS)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

ATOL = RTOL = 1e-5
EPOCHS = 2

# Factories, so no two tests share a builder object.
BUILDERS = {
    "PS": PS,
    "PS-local_proxy": lambda: PS(local_proxy_variable=True),
    "PSLoadBalancing": PSLoadBalancing,
    "PartitionedPS": PartitionedPS,
    "UnevenPartitionedPS": UnevenPartitionedPS,
    "AllReduce": AllReduce,
    "PartitionedAR": lambda: PartitionedAR(num_partitions=2),
    "RandomAxisPartitionAR": lambda: RandomAxisPartitionAR(num_partitions=2, seed=3),
    "Parallax": Parallax,
    "ShardedUpdateAR": ShardedUpdateAR,
}
SUBSET = ("AllReduce", "PartitionedPS", "Parallax")

OPTIMIZERS = {
    "adam": lambda: keras.optimizers.Adam(0.01),
    "sgd-clipped": lambda: keras.optimizers.SGD(0.05, momentum=0.9, global_clipnorm=0.1),
    "sgd": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
    "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1),
    "rmsprop": lambda: keras.optimizers.RMSprop(0.01, momentum=0.5, centered=True),
    "adagrad": lambda: keras.optimizers.Adagrad(0.1),
    "adam-decayed": lambda: keras.optimizers.Adam(
        keras.optimizers.schedules.ExponentialDecay(0.02, decay_steps=2, decay_rate=0.5)),
    "sgd-clipnorm": lambda: keras.optimizers.SGD(0.05, momentum=0.9, clipnorm=0.1),
}


# ----------------------------------------------------------------------------- harness

@dataclasses.dataclass(frozen=True)
class Trained:
    """What a training run left: values in the model's and optimizer's own order."""

    weights: tuple
    optimizer_variables: tuple
    optimizer_names: tuple
    history: dict
    losses: tuple = ()


def snapshot(model: keras.Model, optimizer, history=None, losses=()) -> Trained:
    return Trained(
        weights=tuple(w.numpy() for w in model.weights),
        optimizer_variables=tuple(v.numpy() for v in optimizer.variables),
        # Without the optimizer's own (uniquified) name: "adam_3/out_kernel_momentum".
        optimizer_names=tuple(v.path.split("/", 1)[-1] for v in optimizer.variables),
        history=dict(history or {}),
        losses=tuple(float(v) for v in losses))


def assert_same(got: Trained, want: Trained, what: str = "") -> None:
    assert len(got.weights) == len(want.weights)
    for index, (g, w) in enumerate(zip(got.weights, want.weights)):
        np.testing.assert_allclose(g, w, atol=ATOL, rtol=RTOL,
                                   err_msg=f"{what}: model weight #{index}")
    assert got.optimizer_names == want.optimizer_names
    for name, g, w in zip(got.optimizer_names, got.optimizer_variables,
                          want.optimizer_variables):
        np.testing.assert_allclose(g, w, atol=ATOL, rtol=RTOL,
                                   err_msg=f"{what}: optimizer variable {name}")
    assert sorted(got.history) == sorted(want.history)
    for key in want.history:
        np.testing.assert_allclose(got.history[key], want.history[key], atol=ATOL, rtol=RTOL,
                                   err_msg=f"{what}: History[{key!r}]")
    np.testing.assert_allclose(got.losses, want.losses, atol=ATOL, rtol=RTOL,
                               err_msg=f"{what}: per-step loss")


def fit_kwargs(**extra) -> dict:
    return {"epochs": EPOCHS, "batch_size": km.BATCH_SIZE, "shuffle": False, "verbose": 0,
            **extra}


@functools.lru_cache(maxsize=None)
def fit_single(model_name: str, optimizer: str) -> Trained:
    model = km.compiled(model_name, OPTIMIZERS[optimizer]())
    history = model.fit(*km.data(model_name), **fit_kwargs())
    return snapshot(model, model.optimizer, history.history)


def fit_autodist(spec: str, builder, model_name: str, optimizer: str):
    """Returns (what training left, the model, the AutoDist instance)."""
    ad = AutoDist(resource_spec_file=spec, strategy_builder=builder)
    with ad.scope():
        model = km.compiled(model_name, OPTIMIZERS[optimizer]())
    history = model.fit(*km.data(model_name), **fit_kwargs())
    return snapshot(model, model.optimizer, history.history), model, ad


@functools.lru_cache(maxsize=None)
def function_single(model_name: str, optimizer: str = "adam") -> Trained:
    model = km.build(model_name)
    optimizer = OPTIMIZERS[optimizer]()
    step = tf.function(km.make_train_step(model, optimizer, km.loss(model_name)))
    losses = [step(x, y).numpy() for x, y in km.batches(*km.data(model_name))]
    return snapshot(model, optimizer, losses=losses)


def function_autodist(spec: str, builder, model_name: str, optimizer: str = "adam"):
    """Returns (what training left, the AutoDist instance, the distributed function)."""
    ad = AutoDist(resource_spec_file=spec, strategy_builder=builder)
    with ad.scope():
        model = km.build(model_name)
        optimizer = OPTIMIZERS[optimizer]()
        step = ad.function(km.make_train_step(model, optimizer, km.loss(model_name)))
    losses = []
    for x, y in km.batches(*km.data(model_name)):
        loss = step(x, y)
        assert np.ndim(loss) == 0
        losses.append(loss)
    return snapshot(model, optimizer, losses=losses), ad, step


def replica_ops(graph: tf.Graph, pattern: str) -> dict:
    """Replica index -> the ops of that replica whose name (after the scope) matches."""
    found = {}
    for op in graph.get_operations():
        match = re.match(r"AutoDist-Replica-(\d+)/(.*)$", op.name)
        if match and re.search(pattern, match.group(2)):
            found.setdefault(int(match.group(1)), []).append(op)
    return found


def forward_products(graph: tf.Graph, layer: str) -> dict:
    """Replica index -> the op computing ``layer``'s product with its kernel: its
    MatMul, or, for a partitioned kernel multiplied part by part, the op adding up
    (or joining) the parts' products."""
    found = replica_ops(graph, rf"(^|/){layer}[^/]*/MatMul(/where_stored/(AddN|concat))?$")
    return {r: [op for op in ops if "where_stored" in op.name] or ops
            for r, ops in found.items()}


# ----------------------------------------------------------------------------- 1. fit

FIT_CASES = ([("mlp", b) for b in BUILDERS]
             + [(m, b) for m in ("embedding", "cnn", "transformer") for b in SUBSET])


@pytest.mark.parametrize("model_name, builder", FIT_CASES)
def test_fit_matches_single_device(spec_path, model_name, builder):
    got, model, ad = fit_autodist(spec_path, BUILDERS[builder](), model_name, "adam")
    want = fit_single(model_name, "adam")
    assert_same(got, want, f"{model_name} under {builder}")
    assert len(want.history["loss"]) == EPOCHS
    assert want.history["loss"][-1] < want.history["loss"][0]
    assert len(ad.strategy.proto.node_config) == len(model.trainable_weights)
    if model_name == "embedding":
        infos = model._autodist_fit.step.session.distributed.item.trainable_variables
        assert [i.name for i in infos if i.sparse_grad] == ["embedding/table/embeddings"]


def fit_with_batches(spec: str, builder, model_name: str, batch_size: int):
    """(single-device run, AutoDist run) of Adam ``fit`` with ``batch_size`` rows a step."""
    single = km.compiled(model_name, OPTIMIZERS["adam"]())
    history = single.fit(*km.data(model_name), **fit_kwargs(batch_size=batch_size))
    want = snapshot(single, single.optimizer, history.history)
    ad = AutoDist(resource_spec_file=spec, strategy_builder=builder)
    with ad.scope():
        model = km.compiled(model_name, OPTIMIZERS["adam"]())
    history = model.fit(*km.data(model_name), **fit_kwargs(batch_size=batch_size))
    return want, snapshot(model, model.optimizer, history.history)


@pytest.mark.parametrize("builder", ["AllReduce", "PartitionedAR", "PS"])
def test_fit_with_a_short_last_batch_matches_single_device(spec_path, builder):
    # 32 rows in batches of 12, 12 and 8: the embedding's sparse gradient has
    # fewer rows in the last step, which all-gathers of another shape carry.
    want, got = fit_with_batches(spec_path, BUILDERS[builder](), "embedding", 12)
    assert_same(got, want, f"embedding under {builder}, batches of 12")


def test_fit_with_batches_that_do_not_split_evenly(spec_path_4cpu):
    # Batches of 11, 11 and 10 rows on 4 replicas: 2, 3, 3, 3 and 2, 3, 2, 3 rows
    # each; the replicas' gradients weigh by their rows.
    want, got = fit_with_batches(spec_path_4cpu, AllReduce(), "mlp", 11)
    assert_same(got, want, "mlp on 4 replicas, batches of 11")


def test_a_batch_with_fewer_rows_than_replicas_is_refused(spec_path_4cpu):
    ad = AutoDist(resource_spec_file=spec_path_4cpu, strategy_builder=AllReduce())
    with ad.scope():
        model = km.compiled("mlp", OPTIMIZERS["adam"]())
    # 32 rows in batches of 10: the last has 2 rows for 4 replicas.
    with pytest.raises(ValueError, match="4 replicas, but it has 2 rows"):
        model.fit(*km.data("mlp"), **fit_kwargs(batch_size=10))


# ----------------------------------------------------------------------------- 2. clipping

# Models and builders that clipped SGD runs on beyond the MLP's builders.
CLIPPED_MODELS = ("mlp", "embedding", "transformer")
CLIPPED_BUILDERS = ("AllReduce", "PartitionedPS")


@pytest.mark.parametrize("model_name", CLIPPED_MODELS)
def test_global_clipnorm_binds_on_the_model_s_data(model_name):
    """Without this, the clipped cases below could not tell a clip from no clip."""
    model = km.build(model_name)
    x, y = km.data(model_name)
    with tf.GradientTape() as tape:
        value = km.loss(model_name)(y[:km.BATCH_SIZE], model(x[:km.BATCH_SIZE], training=True))
    norm = tf.linalg.global_norm(tape.gradient(value, model.trainable_variables))
    assert float(norm) > 10 * 0.1
    clipped, unclipped = fit_single(model_name, "sgd-clipped"), fit_single(model_name, "sgd")
    assert max(np.abs(a - b).max() for a, b in zip(clipped.weights, unclipped.weights)) > 1e-2


@pytest.mark.parametrize("model_name, builder", (
    [("mlp", b) for b in ["AllReduce", "PS", "PartitionedPS", "Parallax"]]
    + [(m, b) for m in CLIPPED_MODELS[1:] for b in CLIPPED_BUILDERS]))
def test_fit_with_global_clipnorm_matches_single_device(spec_path, model_name, builder):
    got, _, _ = fit_autodist(spec_path, BUILDERS[builder](), model_name, "sgd-clipped")
    assert_same(got, fit_single(model_name, "sgd-clipped"),
                f"clipped SGD on {model_name} under {builder}")


@pytest.mark.parametrize("axis", [0, 1])
def test_a_split_sparse_gradient_stitches_back_row_for_row(axis):
    """What a global norm over a partitioned Embedding reads: its rows, duplicates apart."""
    plan = PartitionPlan(axis=axis, sizes=(3, 2) if axis == 0 else (1, 1), shape=(5, 2))
    grad = tf.IndexedSlices(tf.constant([[1., 2.], [3., 4.], [5., 6.], [7., 8.]]),
                            tf.constant([4, 0, 4, 2]), tf.constant([5, 2]))
    whole = partitioner.stitch_gradient(partitioner.split_gradient(grad, plan), plan)
    assert isinstance(whole, tf.IndexedSlices)
    rows = sorted(zip(whole.indices.numpy().tolist(), whole.values.numpy().tolist()))
    assert rows == sorted(zip(grad.indices.numpy().tolist(), grad.values.numpy().tolist()))
    assert whole.dense_shape.numpy().tolist() == [5, 2]


# ----------------------------------------------------------------------------- more optimizers

# Each optimizer's setting that the plain one lacks: weight decay, a schedule, a clip.
VARIANTS = {"adamw": "adam", "adam-decayed": "adam", "sgd-clipnorm": "sgd"}


@pytest.mark.parametrize("optimizer", VARIANTS)
def test_the_optimizer_s_setting_changes_single_device_training(optimizer):
    """Without this, matching single-device could not tell the setting apart from none."""
    got, plain = fit_single("mlp", optimizer), fit_single("mlp", VARIANTS[optimizer])
    assert max(np.abs(a - b).max() for a, b in zip(got.weights, plain.weights)) > 1e-3


def ancestors(op: tf.Operation) -> set:
    """Names of the ops ``op`` waits for, through data and control edges."""
    seen, todo = set(), [op]
    while todo:
        op = todo.pop()
        if op.name not in seen:
            seen.add(op.name)
            todo.extend([t.op for t in op.inputs] + list(op.control_inputs))
    return seen


@pytest.mark.parametrize("optimizer, builder", [
    (o, b) for o in ("adamw", "rmsprop", "adagrad", "adam-decayed", "sgd-clipnorm")
    for b in ("AllReduce", "PartitionedPS") if (o, b) != ("sgd-clipnorm", "PartitionedPS")])
def test_fit_with_more_keras_optimizers_matches_single_device(spec_path, optimizer, builder):
    got, model, _ = fit_autodist(spec_path, BUILDERS[builder](), "mlp", optimizer)
    assert_same(got, fit_single("mlp", optimizer), f"{optimizer} under {builder}")
    # Every write of the update (AdamW's decay too, which reads no gradient) waits
    # for the forward pass, as in the traced step: else it races the replicas' reads.
    # (An all-reduce joins the other replicas at run time, not by graph edges.)
    graph = model._autodist_fit.step.session.distributed.graph
    forward = {ops[0].name for ops in forward_products(graph, "hidden").values()}
    writes = [op for op in graph.get_operations()
              if op.name.startswith("keras_update/") and op.type in RESOURCE_WRITES]
    assert len(forward) == 2 and writes
    for write in writes:
        assert forward & ancestors(write), f"{write.name} may run before the forward pass"


def test_clipnorm_on_a_partitioned_variable_is_refused_by_name(spec_path):
    # clipnorm divides by the norm of the whole variable, which no part holds.
    with pytest.raises(NotImplementedError, match=(
            r"cannot cut 'mlp/hidden/kernel' under SGD: its update is not elementwise "
            r"\(it uses Sum\); use a strategy that keeps the variable whole")):
        fit_autodist(spec_path, PartitionedPS(), "mlp", "sgd-clipnorm")


# ----------------------------------------------------------------------------- 3. ad.function

def saved_strategy_file(spec: str, model_name: str, directory) -> str:
    """Trains once under Parallax and saves the strategy it built."""
    _, ad, _ = function_autodist(spec, Parallax(), model_name)
    return ad.strategy.save(directory / f"{model_name}.strategy")


FUNCTION_CASES = ([("mlp", b, "adam") for b in [*BUILDERS, "saved"]]
                  + [("embedding", b, "adam") for b in [*SUBSET, "PS", "saved"]]
                  + [(m, b, "adam") for m in ("cnn", "transformer") for b in [*SUBSET, "saved"]]
                  + [("mlp", "PS", "sgd-clipped")]
                  + [(m, b, "sgd-clipped") for m in CLIPPED_MODELS for b in CLIPPED_BUILDERS])


@pytest.mark.parametrize("model_name, builder, optimizer", FUNCTION_CASES)
def test_function_matches_tf_function(spec_path, tmp_path, model_name, builder, optimizer):
    if builder == "saved":
        path = saved_strategy_file(spec_path, model_name, tmp_path)
        strategy = Strategy.load(path)
        got, ad, _ = function_autodist(spec_path, strategy, model_name, optimizer)
        assert ad.strategy is strategy
    else:
        got, ad, _ = function_autodist(spec_path, BUILDERS[builder](), model_name, optimizer)
    want = function_single(model_name, optimizer)
    assert len(want.losses) == km.SAMPLES // km.BATCH_SIZE
    assert_same(got, want, f"ad.function on {model_name} under {builder} with {optimizer}")


def test_fit_under_a_saved_strategy_matches_single_device(spec_path, tmp_path):
    _, _, ad = fit_autodist(spec_path, PartitionedPS(), "embedding", "adam")
    strategy = Strategy.load(ad.strategy.save(tmp_path / "fit.strategy"))
    got, _, again = fit_autodist(spec_path, strategy, "embedding", "adam")
    assert again.strategy is strategy
    assert_same(got, fit_single("embedding", "adam"), "fit under a saved PartitionedPS strategy")


def test_function_accepts_a_tf_function_and_tensors(spec_path):
    ad = AutoDist(resource_spec_file=spec_path, strategy_builder=AllReduce())
    with ad.scope():
        model = km.build("mlp")
        optimizer = OPTIMIZERS["adam"]()
        step = ad.function(tf.function(km.make_train_step(model, optimizer, km.loss("mlp"))))
    losses = [step(tf.constant(x), tf.constant(y)) for x, y in km.batches(*km.data("mlp"))]
    assert_same(snapshot(model, optimizer, losses=losses), function_single("mlp"))


@pytest.mark.parametrize("builder", [AllReduce, PartitionedPS])
def test_function_copying_back_on_request_leaves_the_model_until_asked(spec_path, builder):
    """``copy_back="on_request"``: the weights and slots stay in AutoDist's session
    (the eager model keeps its starting values) while the optimizer's iteration count
    follows every call; ``copy_to_model()`` then brings exactly what every-call copying
    gives. A weight set between calls is still picked up."""
    ad = AutoDist(resource_spec_file=spec_path, strategy_builder=builder())
    with ad.scope():
        model = km.build("mlp")
        optimizer = OPTIMIZERS["adam"]()

        @ad.function(copy_back="on_request")
        def step(x, y):
            return km.make_train_step(model, optimizer, km.loss("mlp"))(x, y)

    start = [w.copy() for w in model.get_weights()]
    losses = []
    for x, y in km.batches(*km.data("mlp")):
        losses.append(step(x, y))
        assert int(optimizer.iterations.numpy()) == len(losses)
        for now, then in zip(model.get_weights(), start):
            np.testing.assert_array_equal(now, then)
        assert not any(np.any(np.asarray(v)) for v in optimizer.variables
                       if len(v.shape) > 0)  # the slots: still zero
    step.copy_to_model()
    assert_same(snapshot(model, optimizer, losses=losses), function_single("mlp"))

    x, y = next(iter(km.batches(*km.data("mlp"))))
    layer = model.layers[-1]
    layer.kernel.assign(np.zeros(layer.kernel.shape, "float32"))
    step(x, y)
    step.copy_to_model()
    assert np.abs(layer.kernel.numpy()).max() < 0.05  # one Adam step from zero, not onwards


def test_a_step_brings_its_small_state_back_in_its_own_session_run(spec_path, monkeypatch):
    """The optimizer's iteration count (small state, copied after every call) comes back
    in the step's own run: with the weights left in AutoDist, a call is one session run."""
    ad = AutoDist(resource_spec_file=spec_path, strategy_builder=AllReduce())
    with ad.scope():
        model = km.build("mlp")
        optimizer = keras.optimizers.SGD(0.05)
        step = ad.function(km.make_train_step(model, optimizer, km.loss("mlp")),
                           copy_back="on_request")
    batches = list(km.batches(*km.data("mlp")))
    step(*batches[0])
    # The step's own run goes through AutoDist's session; any other run would go
    # straight to the plain session.
    distributed, steps_runs, other_runs = step.step.session, [], []
    for session, runs in ((distributed, steps_runs), (distributed.tf_session, other_runs)):
        monkeypatch.setattr(session, "run", functools.partial(
            lambda run, runs, *args, **kwargs: runs.append(args) or run(*args, **kwargs),
            session.run, runs))
    for calls, batch in enumerate(batches[1:], start=2):
        step(*batch)
        assert (len(steps_runs), len(other_runs)) == (calls - 1, 0)
        assert int(optimizer.iterations.numpy()) == calls


def test_function_refuses_an_unknown_copy_back(spec_path):
    ad = AutoDist(resource_spec_file=spec_path)
    with pytest.raises(ValueError, match=r"copy_back must be one of \['every_call', "
                                         r"'on_request'\], not 'sometimes'"):
        ad.function(lambda x: x, copy_back="sometimes")


# ----------------------------------------------------------------------------- 4. batch split

def trained_session(spec: str, builder, way: str, x: np.ndarray, y: np.ndarray):
    """One MLP step on (x, y) through ``fit`` or ``ad.function``.

    Returns:
        (AutoDist's session, the model, the AutoDist instance)
    """
    ad = AutoDist(resource_spec_file=spec, strategy_builder=builder)
    with ad.scope():
        if way == "fit":
            model = km.compiled("mlp", OPTIMIZERS["adam"]())
        else:
            model = km.build("mlp")
            step = ad.function(km.make_train_step(model, OPTIMIZERS["adam"](), km.loss("mlp")))
    if way == "fit":
        model.fit(x, y, epochs=1, batch_size=len(x), verbose=0)
        return model._autodist_fit.step.session, model, ad
    step(x, y)
    return step.step.session, model, ad


@pytest.mark.parametrize("way, builder, spec_fixture, replicas", [
    ("fit", "AllReduce", "spec_path", 2), ("fit", "AllReduce", "spec_path_4cpu", 4),
    ("fit", "PartitionedPS", "spec_path", 2), ("function", "AllReduce", "spec_path", 2),
    ("function", "PartitionedPS", "spec_path_4cpu", 4)])
def test_each_replica_computes_its_share_of_the_batch(request, way, builder, spec_fixture,
                                                      replicas):
    spec = request.getfixturevalue(spec_fixture)
    x, y = km.data("mlp")
    session, model, ad = trained_session(spec, BUILDERS[builder](), way, x[:8], y[:8])
    graph, item = session.distributed.graph, session.distributed.item
    assert len(ad.strategy.replicas) == replicas

    # The model's input: the batched placeholder shaped like x's rows.
    (x_name,) = [n for n in item.batched_inputs
                 if graph.get_tensor_by_name(f"{n}:0").shape[1:] == x.shape[1:]]
    matmuls = forward_products(graph, "hidden")
    assert sorted(matmuls) == list(range(replicas))
    assert all(len(ops) == 1 for ops in matmuls.values()), matmuls
    ops = [matmuls[r][0] for r in range(replicas)]
    for r, op in enumerate(ops):
        assert op.device.endswith(f"CPU:{r}"), (op.name, op.device)
    assert len({op.device for op in ops}) == replicas

    outputs = session.run([op.outputs[0] for op in ops], feed_dict={f"{x_name}:0": x[:8]})
    assert [o.shape for o in outputs] == [(8 // replicas, 8)] * replicas
    # In order: replica r holds rows [r*B/n, (r+1)*B/n) of the global batch.
    kernel = model.get_layer("hidden").kernel.numpy()
    np.testing.assert_allclose(np.concatenate(outputs), x[:8] @ kernel, atol=ATOL, rtol=RTOL)


# ----------------------------------------------------------------------------- masked losses

def _padded_tokens(rows: int = 32, length: int = 6, vocabulary: int = 20):
    """Token ids and targets where the first half of every 8-row batch is padded far
    more than the second, so the two replicas' halves hold different token counts."""
    rng = np.random.default_rng(0)
    x = rng.integers(1, vocabulary, (rows, length)).astype("int32")
    for row in range(rows):
        x[row, (1 if row % 8 < 4 else 5):] = 0
    return x, rng.integers(0, vocabulary, (rows, length))


def _token_tagger() -> keras.Model:
    keras.utils.set_random_seed(1)
    inputs = keras.Input((6,), dtype="int32")
    tokens = keras.layers.Embedding(20, 8, mask_zero=True, name="tokens")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(20, name="out")(tokens))
    model.compile(optimizer=keras.optimizers.Adam(0.01), metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


@pytest.mark.parametrize("builder", SUBSET)
def test_a_masked_loss_is_divided_by_the_whole_batch_s_unmasked_count(spec_path, builder):
    x, y = _padded_tokens()
    single = _token_tagger()
    want = single.fit(x, y, **fit_kwargs())
    ad = AutoDist(spec_path, BUILDERS[builder]())
    with ad.scope():
        model = _token_tagger()
    got = model.fit(x, y, **fit_kwargs())
    assert_same(snapshot(model, model.optimizer, got.history),
                snapshot(single, single.optimizer, want.history), builder)

    # Each replica counts its own rows' tokens on its device; both divide by the sum.
    session = model._autodist_fit.step.session
    item, graph = session.distributed.item, session.distributed.graph
    (total,) = item.batch_totals
    counts = [graph.get_tensor_by_name(f"autodist_batch_totals/AutoDist-Replica-{r}/{total}:0")
              for r in range(2)]
    assert [c.device[-5:] for c in counts] == ["CPU:0", "CPU:1"]
    (x_name,) = [n for n in item.batched_inputs
                 if graph.get_tensor_by_name(f"{n}:0").dtype == tf.int32]
    assert session.run(counts, feed_dict={f"{x_name}:0": x[:8]}) == [4.0, 20.0]


def test_a_loss_divided_by_the_sum_of_its_sample_weights_matches_single_device(spec_path):
    x, y = km.data("mlp")
    weights = np.where(np.arange(len(x)) % 8 < 4, 0.1, 2.0).astype("float32")

    def compiled():
        model = _functional(keras.Model)
        model.compile(optimizer=keras.optimizers.Adam(0.01), metrics=["mae"],
                      loss=keras.losses.MeanSquaredError(reduction="mean_with_sample_weight"))
        return model

    single = compiled()
    want = single.fit(x, y, sample_weight=weights, **fit_kwargs())
    ad = AutoDist(spec_path, PartitionedPS())
    with ad.scope():
        model = compiled()
    got = model.fit(x, y, sample_weight=weights, **fit_kwargs())
    assert_same(snapshot(model, model.optimizer, got.history),
                snapshot(single, single.optimizer, want.history))
    assert len(model._autodist_fit.step.session.distributed.item.batch_totals) == 1


# ----------------------------------------------------------------------------- in-batch negatives

class TwoTowerRetrieval(keras.Model):
    """Queries scored against every candidate of the batch, softmax over the batch."""

    def __init__(self, gather: bool):
        super().__init__(name="two_tower")
        self.gather = gather
        self.users = keras.layers.Embedding(30, 8, name="users")
        self.items = keras.layers.Embedding(40, 8, name="items")
        self.query = keras.layers.Dense(8, name="query")

    def call(self, inputs):
        return self.query(self.users(inputs["user"])), self.items(inputs["item"])

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        queries, candidates = y_pred
        first = 0
        if self.gather:
            candidates, first = autodist.gather_batch(candidates)
        logits = keras.ops.matmul(queries, keras.ops.transpose(candidates))
        labels = first + keras.ops.arange(keras.ops.shape(queries)[0])
        return keras.ops.mean(keras.losses.sparse_categorical_crossentropy(
            labels, logits, from_logits=True))


def _retrieval(gather: bool) -> keras.Model:
    keras.utils.set_random_seed(1)
    model = TwoTowerRetrieval(gather)
    model.compile(optimizer=keras.optimizers.Adam(0.05))
    return model


def _pairs() -> dict:
    rng = np.random.default_rng(0)
    return {"user": rng.integers(0, 30, 48), "item": rng.integers(0, 40, 48)}


@functools.lru_cache(maxsize=None)
def _retrieval_single(batch_size: int) -> Trained:
    model = _retrieval(gather=True)
    history = model.fit(_pairs(), **fit_kwargs(batch_size=batch_size))
    return snapshot(model, model.optimizer, history.history)


@pytest.mark.parametrize("builder, spec_fixture, batch_size", [
    ("AllReduce", "spec_path", 16), ("PartitionedPS", "spec_path", 16),
    ("Parallax", "spec_path", 16), ("AllReduce", "spec_path_4cpu", 10)])
def test_in_batch_negatives_gathered_over_the_replicas_match_single_device(
        request, builder, spec_fixture, batch_size):
    ad = AutoDist(request.getfixturevalue(spec_fixture), BUILDERS[builder]())
    with ad.scope():
        model = _retrieval(gather=True)
    history = model.fit(_pairs(), **fit_kwargs(batch_size=batch_size))
    # Batches of 10 split 2/3/2/3 rows over four replicas.
    assert_same(snapshot(model, model.optimizer, history.history),
                _retrieval_single(batch_size), builder)

    # Every replica scores its queries against the whole batch's candidates.
    session = model._autodist_fit.step.session
    graph, item = session.distributed.graph, session.distributed.item
    replicas = len(ad.strategy.replicas)
    logits = [ops[0].outputs[0] for _, ops in sorted(replica_ops(graph, r"^step/MatMul$").items())]
    assert [t.device[-5:] for t in logits] == [f"CPU:{r}" for r in range(replicas)]
    feeds = {f"{name}:0": np.arange(batch_size) for name in item.batched_inputs}
    shapes = [v.shape for v in session.run(logits, feed_dict=feeds)]
    rows = [batch_size * (r + 1) // replicas - batch_size * r // replicas for r in range(replicas)]
    assert shapes == [(n, batch_size) for n in rows]


def test_in_batch_negatives_left_per_replica_are_named_once(spec_path):
    ad = AutoDist(spec_path, AllReduce())
    with ad.scope():
        model = _retrieval(gather=False)
    with pytest.warns(UserWarning, match=r"multiplies two tensors of the batch's rows "
                                         r"\('step/MatMul'.*autodist.gather_batch"):
        history = model.fit(_pairs(), **fit_kwargs(batch_size=16))
    # As the warning says: each replica's softmax runs over its 8 rows, not the 16.
    assert history.history["loss"][0] < _retrieval_single(16).history["loss"][0] - 0.3


# ----------------------------------------------------------------------------- 5. metrics

def metric_step(spec: str, make_metric, calls: int = 3) -> tuple:
    """Trains the MLP ``calls`` steps under AllReduce, each step also updating a metric
    (made by ``make_metric`` inside ``ad.scope()``) with 8 values.

    Returns:
        (the metric, every value it was given, in order)
    """
    ad = AutoDist(resource_spec_file=spec, strategy_builder=AllReduce())
    with ad.scope():
        model = km.build("mlp")
        train = km.make_train_step(model, OPTIMIZERS["adam"](), km.loss("mlp"))
        metric = make_metric()

        def step(x, y, observed):
            metric.update_state(observed)
            return train(x, y)

        step = ad.function(step)
    rng = np.random.default_rng(5)
    # Halves with different means, so a per-replica mean would show.
    seen = [np.concatenate([rng.normal(0, 1, 4), rng.normal(10, 3, 4)]).astype(np.float32)
            for _ in range(calls)]
    for (x, y), observed in zip(km.batches(*km.data("mlp")), seen):
        step(x, y, observed)
    return metric, np.concatenate(seen)


def test_mean_metric_updated_in_a_step_is_exact(spec_path):
    metric, everything = metric_step(spec_path, lambda: keras.metrics.Mean(name="observed"))
    np.testing.assert_allclose(metric.result(), everything.mean(), rtol=RTOL, atol=ATOL)


def test_metric_variables_add_up_over_replicas(spec_path):
    metric, everything = metric_step(spec_path, lambda: keras.metrics.Mean(name="observed"))
    total, count = (v.numpy() for v in metric.variables)
    np.testing.assert_allclose(count, everything.size, err_msg="Mean's count")
    np.testing.assert_allclose(total, everything.sum(), rtol=RTOL, atol=ATOL,
                               err_msg="Mean's total")
    metric, everything = metric_step(spec_path, lambda: keras.metrics.Sum(name="summed"))
    np.testing.assert_allclose(metric.result(), everything.sum(), rtol=RTOL, atol=ATOL,
                               err_msg="Sum's result")


# ----------------------------------------------------------------------------- 6. batch norm

def batch_norm_model(hidden: bool = False) -> keras.Model:
    keras.utils.set_random_seed(0)
    layers = [keras.Input((4,))]
    if hidden:
        layers += [keras.layers.Dense(8, name="hidden")]
    layers += [keras.layers.BatchNormalization(momentum=0.9, name="bn")]
    if hidden:
        layers += [keras.layers.ReLU(name="relu")]
    layers += [keras.layers.Dense(1, name="out")]
    return keras.Sequential(layers, name="bn_model")


@pytest.mark.parametrize("builder", ["AllReduce", "PS"])
def test_batch_norm_statistics_after_one_step(spec_path, builder):
    rng = np.random.default_rng(7)
    halves = [rng.normal(0, scale, (4, 4)) for scale in (0.5, 2.0)]
    # Halves centred on 0 and 3: the whole batch's variance exceeds the mean of the
    # halves' by (3 / 2) ** 2 in every feature, so the check tells the two apart.
    x = np.concatenate([h - h.mean(axis=0) + shift
                        for h, shift in zip(halves, (0.0, 3.0))]).astype(np.float32)
    y = rng.normal(size=(8, 1)).astype(np.float32)
    half_variance = (x[:4].var(axis=0) + x[4:].var(axis=0)) / 2
    np.testing.assert_allclose(x.var(axis=0) - half_variance, 2.25, rtol=1e-4)

    ad = AutoDist(resource_spec_file=spec_path, strategy_builder=BUILDERS[builder]())
    with ad.scope():
        model = batch_norm_model()
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    model.fit(x, y, epochs=1, batch_size=8, shuffle=False, verbose=0)
    bn = model.get_layer("bn")
    assert int(model.optimizer.iterations.numpy()) == 1
    np.testing.assert_allclose(bn.moving_mean.numpy(), 0.1 * x.mean(axis=0),
                               atol=ATOL, rtol=RTOL)
    np.testing.assert_allclose(bn.moving_variance.numpy(), 0.9 + 0.1 * half_variance,
                               atol=ATOL, rtol=RTOL)


def test_batch_norm_model_trains(spec_path):
    x, y = km.data("mlp")
    ad = AutoDist(resource_spec_file=spec_path, strategy_builder=AllReduce())
    with ad.scope():
        model = batch_norm_model(hidden=True)
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    losses = model.fit(x[:, :4], y[:, :1], **fit_kwargs(epochs=5)).history["loss"]
    assert np.all(np.isfinite(losses))
    assert losses[-1] < losses[0], losses


# ----------------------------------------------------------------------------- 7. dropout

def dropout_model(hidden: int = 16, ones: bool = False) -> keras.Model:
    keras.utils.set_random_seed(0)
    return keras.Sequential([
        keras.Input((hidden,)),
        keras.layers.Dropout(0.5, name="drop"),
        keras.layers.Dense(1, use_bias=not ones, name="out",
                           kernel_initializer="ones" if ones else "glorot_uniform"),
    ], name="dropout_model")


def seed_state(model: keras.Model) -> np.ndarray:
    return model.get_layer("drop").seed_generator.state.numpy()


def test_dropout_model_trains(spec_path):
    rng = np.random.default_rng(8)
    x = rng.normal(size=(km.SAMPLES, 16)).astype(np.float32)
    y = (x[:, :3].sum(axis=1, keepdims=True)).astype(np.float32)
    ad = AutoDist(resource_spec_file=spec_path, strategy_builder=AllReduce())
    with ad.scope():
        model = dropout_model()
        model.compile(optimizer=keras.optimizers.Adam(0.02), loss="mse")
    losses = model.fit(x, y, **fit_kwargs(epochs=5)).history["loss"]
    assert np.all(np.isfinite(losses)), losses
    assert losses[-1] < losses[0], losses
    assert np.all(np.isfinite(np.concatenate([w.ravel() for w in model.get_weights()])))


def test_replicas_draw_different_dropout_masks(spec_path):
    ad = AutoDist(resource_spec_file=spec_path, strategy_builder=AllReduce())
    with ad.scope():
        model = dropout_model(ones=True)
        optimizer = keras.optimizers.SGD(0.0)

        def step(x):
            with tf.GradientTape() as tape:
                out = model(x, training=True)
                value = tf.reduce_mean(out)
            grads = tape.gradient(value, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return out

        step = ad.function(step)
    x = np.ones((8, 16), np.float32)
    before = seed_state(model)
    outputs = []
    for calls in range(1, 4):
        out = step(x)
        assert out.shape == (8, 1)
        # Kept units count 1 / (1 - 0.5) = 2 each.
        assert np.all(np.mod(out, 2) == 0) and np.all((out >= 0) & (out <= 32)), out
        assert not np.array_equal(out[:4], out[4:]), f"both replicas drew one mask: {out.T}"
        outputs.append(out)
        state = seed_state(model)
        assert state[0] == before[0] and state[1] == before[1] + calls, (before, state)
    assert not np.array_equal(outputs[0], outputs[1]), "the mask did not change between steps"
    np.testing.assert_array_equal(model.get_layer("out").kernel.numpy(), np.ones((16, 1)))


def test_dropout_seed_advances_once_per_fit_step(spec_path):
    rng = np.random.default_rng(9)
    x = rng.normal(size=(24, 16)).astype(np.float32)
    y = rng.normal(size=(24, 1)).astype(np.float32)
    single = dropout_model()
    single.compile(optimizer="sgd", loss="mse")
    start = seed_state(single)
    single.fit(x, y, epochs=1, batch_size=8, verbose=0)

    ad = AutoDist(resource_spec_file=spec_path, strategy_builder=PS())
    with ad.scope():
        model = dropout_model()
        model.compile(optimizer="sgd", loss="mse")
    np.testing.assert_array_equal(seed_state(model), start)
    model.fit(x, y, epochs=1, batch_size=8, verbose=0)
    np.testing.assert_array_equal(seed_state(model), start + [0, 3])
    np.testing.assert_array_equal(seed_state(model), seed_state(single))


# ----------------------------------------------------------------------------- 8. Keras around fit

def test_evaluate_predict_and_saved_weights_match_single_device(spec_path, tmp_path):
    x, y = km.data("mlp")
    single = km.compiled("mlp", OPTIMIZERS["adam"]())
    single.fit(x, y, **fit_kwargs())
    _, model, _ = fit_autodist(spec_path, AllReduce(), "mlp", "adam")

    np.testing.assert_allclose(model.evaluate(x, y, batch_size=8, verbose=0),
                               single.evaluate(x, y, batch_size=8, verbose=0),
                               atol=ATOL, rtol=RTOL)
    predicted = model.predict(x, batch_size=8, verbose=0)
    np.testing.assert_allclose(predicted, single.predict(x, batch_size=8, verbose=0),
                               atol=ATOL, rtol=RTOL)

    path = str(tmp_path / "w.weights.h5")
    model.save_weights(path)
    fresh = km.build("mlp", seed=1)
    assert not np.allclose(fresh.predict(x, verbose=0), predicted, atol=1e-3)
    fresh.load_weights(path)
    np.testing.assert_allclose(fresh.predict(x, batch_size=8, verbose=0), predicted,
                               atol=ATOL, rtol=RTOL)


def test_a_model_saved_whole_after_fit_reloads_with_the_trained_weights(spec_path, tmp_path):
    x, y = km.data("mlp")
    _, model, _ = fit_autodist(spec_path, PartitionedPS(), "mlp", "adam")
    path = str(tmp_path / "model.keras")
    model.save(path)
    reloaded = keras.models.load_model(path)
    np.testing.assert_allclose(reloaded.predict(x, batch_size=8, verbose=0),
                               model.predict(x, batch_size=8, verbose=0), atol=ATOL, rtol=RTOL)
    # The optimizer's state travels too, in the single-device layout.
    for got, want in zip(reloaded.optimizer.variables, model.optimizer.variables):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=ATOL, rtol=RTOL)
    assert int(reloaded.optimizer.iterations.numpy()) > 0


def test_a_model_loaded_in_the_scope_is_compiled_and_trains_distributed(spec_path, tmp_path):
    """``keras.models.load_model`` in ``ad.scope()`` compiles the model it loads, as outside
    it (AutoDist's hook on ``compile`` once made Keras take it for a custom one and skip
    the compile: no loss), and its ``fit`` resumes through AutoDist as plain Keras does."""
    x, y = km.data("mlp")
    _, model, _ = fit_autodist(spec_path, PartitionedPS(), "mlp", "adam")
    path = str(tmp_path / "model.keras")
    model.save(path)
    plain = keras.models.load_model(path)
    want = plain.fit(x, y, **fit_kwargs(epochs=1)).history
    with AutoDist(resource_spec_file=spec_path, strategy_builder=PartitionedPS()).scope():
        loaded = keras.models.load_model(path)
    assert loaded.loss is not None and loaded.get_compile_config() == plain.get_compile_config()
    got = loaded.fit(x, y, **fit_kwargs(epochs=1)).history
    assert loaded._autodist_fit.step.session.distributed.item.trainable_variables
    assert_same(snapshot(loaded, loaded.optimizer, got), snapshot(plain, plain.optimizer, want),
                "resumed from a .keras file")


class SubclassedMLP(keras.Model):
    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(8, activation="tanh",
                                         kernel_initializer=keras.initializers.GlorotUniform(1))
        self.out = keras.layers.Dense(2, kernel_initializer=keras.initializers.GlorotUniform(2))

    def call(self, inputs):
        return self.out(self.hidden(inputs))


def test_a_subclassed_model_fits_like_one_device(spec_path):
    rng = np.random.RandomState(0)
    x, y = rng.randn(32, 6).astype(np.float32), rng.randn(32, 2).astype(np.float32)

    def compiled():
        model = SubclassedMLP()
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        return model

    single = compiled()
    single.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    with AutoDist(spec_path, AllReduce()).scope():
        model = compiled()
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    for got, want in zip(model.get_weights(), single.get_weights()):
        np.testing.assert_allclose(got, want, atol=ATOL, rtol=RTOL)


class FitOverridingMLP(keras.Model):
    """Overrides ``fit`` as KerasHub's task models do: ``callbacks`` is in ``**kwargs``."""

    def fit(self, x=None, y=None, batch_size=None, **kwargs):
        return super().fit(x=x, y=y, batch_size=batch_size, **kwargs)


class CallbackDroppingMLP(keras.Model):
    """Overrides ``fit`` and does not pass its keyword arguments on."""

    def fit(self, x=None, y=None, **kwargs):
        return super().fit(x=x, y=y, batch_size=8, epochs=1, shuffle=False, verbose=0)


def _functional(cls, seed: int = 3) -> keras.Model:
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(8, activation="relu", name="hidden")(inputs)
    model = cls(inputs, keras.layers.Dense(3, name="out")(hidden))
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"])
    return model


def test_fit_through_an_override_of_fit_matches_single_device(spec_path):
    x, y = km.data("mlp")
    single = _functional(FitOverridingMLP)
    want = single.fit(x, y, **fit_kwargs(epochs=3))
    ad = AutoDist(spec_path, AllReduce())
    with ad.scope():
        model = _functional(FitOverridingMLP)
    got = model.fit(x, y, **fit_kwargs(epochs=3))
    assert ad.strategy is not None
    # Without AutoDist's callback the model kept its initial weights, and the logs of
    # the later epochs were running means over every epoch (metrics never reset).
    assert_same(snapshot(model, model.optimizer, got.history),
                snapshot(single, single.optimizer, want.history))


def test_an_override_of_fit_that_drops_the_callbacks_is_refused_by_name(spec_path):
    x, y = km.data("mlp")
    with AutoDist(spec_path, AllReduce()).scope():
        model = _functional(CallbackDroppingMLP)
    with pytest.raises(NotImplementedError,
                       match=r"CallbackDroppingMLP.fit does not pass its callbacks on"):
        model.fit(x, y)


def test_callbacks_and_validation_run_during_fit(spec_path, tmp_path):
    x, y = km.data("mlp")

    def callbacks(directory):
        return [keras.callbacks.ModelCheckpoint(str(directory / "best.weights.h5"),
                                                monitor="val_loss", save_weights_only=True),
                keras.callbacks.EarlyStopping(monitor="loss", patience=1)]

    kwargs = fit_kwargs(epochs=3, validation_data=(x[:16], y[:16]))
    (tmp_path / "single").mkdir()
    single = km.compiled("mlp", OPTIMIZERS["adam"]())
    want = single.fit(x, y, callbacks=callbacks(tmp_path / "single"), **kwargs)

    (tmp_path / "ad").mkdir()
    ad = AutoDist(resource_spec_file=spec_path, strategy_builder=Parallax())
    with ad.scope():
        model = km.compiled("mlp", OPTIMIZERS["adam"]())
    got = model.fit(x, y, callbacks=callbacks(tmp_path / "ad"), **kwargs)

    assert sorted(got.history) == ["loss", "mae", "val_loss", "val_mae"]
    assert_same(snapshot(model, model.optimizer, got.history),
                snapshot(single, single.optimizer, want.history))
    saved = km.build("mlp", seed=1)
    saved.load_weights(str(tmp_path / "ad" / "best.weights.h5"))
    expected = km.build("mlp", seed=1)
    expected.load_weights(str(tmp_path / "single" / "best.weights.h5"))
    for g, w in zip(saved.get_weights(), expected.get_weights()):
        np.testing.assert_allclose(g, w, atol=ATOL, rtol=RTOL)


def test_set_weights_between_fits_restarts_from_them(spec_path):
    x, y = km.data("mlp")
    other = km.build("mlp", seed=2).get_weights()

    def train(model):
        model.fit(x, y, **fit_kwargs(epochs=1))
        model.set_weights(other)
        first = model.predict(x[:8], verbose=0)
        history = model.fit(x, y, **fit_kwargs(epochs=1))
        return first, snapshot(model, model.optimizer, history.history)

    single_first, want = train(km.compiled("mlp", OPTIMIZERS["adam"]()))
    ad = AutoDist(resource_spec_file=spec_path, strategy_builder=PartitionedPS())
    with ad.scope():
        model = km.compiled("mlp", OPTIMIZERS["adam"]())
    got_first, got = train(model)
    np.testing.assert_allclose(got_first, single_first, atol=ATOL, rtol=RTOL)
    assert_same(got, want, "second fit after set_weights")
    assert int(model.optimizer.iterations.numpy()) == 2 * km.SAMPLES // km.BATCH_SIZE


# ----------------------------------------------------------------------------- 9. refusals

@pytest.mark.parametrize("setting, kwargs", [
    ("steps_per_execution", {"steps_per_execution": 2}),
    ("jit_compile", {"jit_compile": True}),
    ("run_eagerly", {"run_eagerly": True}),
])
def test_compile_settings_are_refused(spec_path, setting, kwargs):
    ad = AutoDist(resource_spec_file=spec_path, strategy_builder=AllReduce())
    with ad.scope():
        with pytest.raises(NotImplementedError, match=setting):
            km.compiled("mlp", OPTIMIZERS["adam"](), **kwargs)


def _synchronized_batch_norm() -> keras.Model:
    keras.utils.set_random_seed(1)
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(8, use_bias=False, name="hidden")(inputs)
    hidden = keras.layers.BatchNormalization(synchronized=True, name="synced_bn")(hidden)
    outputs = keras.layers.Dense(3, name="out")(keras.layers.Activation("relu")(hidden))
    model = keras.Model(inputs, outputs)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"])
    return model


def _halves_apart():
    """Rows whose two halves of every batch have different means: per-replica
    statistics would differ from the batch's."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 6)).astype("float32")
    x[np.arange(32) % 8 < 4] += 3.0
    return x, rng.normal(size=(32, 3)).astype("float32")


@pytest.mark.parametrize("builder", ("AllReduce", "PartitionedPS"))
def test_synchronized_batch_norm_normalizes_with_the_whole_batch_s_statistics(spec_path,
                                                                              builder):
    x, y = _halves_apart()
    single = _synchronized_batch_norm()
    want = single.fit(x, y, **fit_kwargs())
    ad = AutoDist(spec_path, BUILDERS[builder]())
    with ad.scope():
        model = _synchronized_batch_norm()
    got = model.fit(x, y, **fit_kwargs())
    # The moving statistics are among the weights.
    assert_same(snapshot(model, model.optimizer, got.history),
                snapshot(single, single.optimizer, want.history), builder)
    # Each replica sums its statistics (and their gradients) with the other's.
    graph = model._autodist_fit.step.session.distributed.graph
    sums = {r: [op for op in ops if op.type == "CollectiveReduceV2"]
            for r, ops in replica_ops(graph, "synced_bn").items()}
    assert sorted(sums) == [0, 1] and len(sums[0]) == len(sums[1]) >= 3
    for replica, ops in sums.items():
        assert all(op.device.endswith(f"CPU:{replica}") for op in ops)


def test_two_optimizers_in_one_step_are_refused(spec_path):
    ad = AutoDist(resource_spec_file=spec_path, strategy_builder=AllReduce())
    with ad.scope():
        model = km.build("mlp")
        first, second = keras.optimizers.Adam(0.01), keras.optimizers.SGD(0.1)
        hidden, out = model.get_layer("hidden"), model.get_layer("out")

        def step(x, y):
            with tf.GradientTape() as tape:
                value = km.loss("mlp")(y, model(x, training=True))
            grads = tape.gradient(value, model.trainable_variables)
            first.apply_gradients(zip(grads[:2], hidden.trainable_variables))
            second.apply_gradients(zip(grads[2:], out.trainable_variables))
            return value

        step = ad.function(step)
    x, y = km.data("mlp")
    with pytest.raises(NotImplementedError, match=r"one optimizer update.*Adam, SGD"):
        step(x[:8], y[:8])


def test_step_without_optimizer_update_is_refused(spec_path):
    ad = AutoDist(resource_spec_file=spec_path, strategy_builder=AllReduce())
    with ad.scope():
        model = km.build("mlp")

        def forward_only(x, y):
            return km.loss("mlp")(y, model(x, training=False))

        step = ad.function(forward_only)
    x, y = km.data("mlp")
    with pytest.raises(ValueError, match=r"no optimizer update in forward_only"):
        step(x[:8], y[:8])


# ----------------------------------------------------------------------------- other ways in

def test_a_dataset_with_sample_weights_then_train_on_batch_match_single_device(spec_path):
    # fit traces a step for (x, y, sample_weight); train_on_batch passes (x, y,
    # None), another structure, which gets a step of its own from the values so far.
    x, y = km.data("mlp")
    weights = np.linspace(0.5, 1.5, len(x)).astype(np.float32)

    def train(model):
        dataset = tf.data.Dataset.from_tensor_slices((x, y, weights)).batch(km.BATCH_SIZE)
        history = model.fit(dataset, epochs=EPOCHS, verbose=0)
        logs = model.train_on_batch(x[:8], y[:8])
        return snapshot(model, model.optimizer, history.history), logs

    want, want_logs = train(km.compiled("mlp", OPTIMIZERS["adam"]()))
    ad = AutoDist(resource_spec_file=spec_path, strategy_builder=AllReduce())
    with ad.scope():
        model = km.compiled("mlp", OPTIMIZERS["adam"]())
    got, got_logs = train(model)
    assert_same(got, want, "fit on a weighted dataset, then train_on_batch")
    np.testing.assert_allclose(got_logs, want_logs, rtol=RTOL, atol=ATOL)



class _WeightsPerBatch(keras.callbacks.Callback):
    """Records the model's weights and the optimizer's iteration count after every batch."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def on_train_batch_end(self, batch, logs=None):
        self.seen.append(([w.numpy() for w in self.model.weights],
                          int(self.model.optimizer.iterations.numpy())))


def test_a_callback_acting_per_batch_sees_each_batch_s_weights(spec_path):
    def train(model):
        recorder = _WeightsPerBatch()
        model.fit(*km.data("mlp"), callbacks=[recorder], **fit_kwargs())
        return recorder.seen, snapshot(model, model.optimizer)

    want_seen, want = train(km.compiled("mlp", OPTIMIZERS["adam"]()))
    ad = AutoDist(resource_spec_file=spec_path, strategy_builder=PartitionedPS())
    with ad.scope():
        model = km.compiled("mlp", OPTIMIZERS["adam"]())
    got_seen, got = train(model)
    assert len(got_seen) == len(want_seen) == EPOCHS * km.SAMPLES // km.BATCH_SIZE
    for (got_weights, got_step), (want_weights, want_step) in zip(got_seen, want_seen):
        assert got_step == want_step
        for g, w in zip(got_weights, want_weights):
            np.testing.assert_allclose(g, w, atol=ATOL, rtol=RTOL)
    assert_same(got, want, "after fit with a per-batch callback")  # slots copied at the end


class _TimerReadingNoWeights(_WeightsPerBatch):
    """Per-batch hooks that say they read no weights: what they see is the weights
    as of the last copy (the start of the epoch), not each batch's."""

    autodist_reads_weights = False


def test_a_per_batch_callback_reading_no_weights_costs_no_copy_per_batch(spec_path):
    ad = AutoDist(resource_spec_file=spec_path, strategy_builder=PartitionedPS())
    with ad.scope():
        model = km.compiled("mlp", OPTIMIZERS["adam"]())
    start = [w.numpy() for w in model.weights]
    timer = _TimerReadingNoWeights()
    model.fit(*km.data("mlp"), callbacks=[timer], **fit_kwargs(epochs=1))
    batches = km.SAMPLES // km.BATCH_SIZE
    assert len(timer.seen) == batches > 1
    for weights, _ in timer.seen:  # no copy after a batch: the model kept its start
        for got, want in zip(weights, start):
            np.testing.assert_array_equal(got, want)
    want = km.compiled("mlp", OPTIMIZERS["adam"]())
    want.fit(*km.data("mlp"), **fit_kwargs(epochs=1))
    # The copy at the end of fit still happens.
    for got, expected in zip(model.weights, want.weights):
        np.testing.assert_allclose(got.numpy(), expected.numpy(), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("batch_hooks", (False, True))
def test_the_small_state_is_copied_per_step_only_for_a_callback_with_batch_hooks(
        spec_path, monkeypatch, batch_hooks):
    """Without batch hooks no Keras code reads the metrics between two batches: the logs
    come from the step's own run, and the small state is copied when Keras reads it
    (an epoch's end), yet every log, epoch value and variable equals single-device
    Keras's."""
    copies = []
    original = DistributedStep.copy_small_state

    def counted(step):
        copies.append(step._pending_small is not None)
        return original(step)

    monkeypatch.setattr(DistributedStep, "copy_small_state", counted)

    class EpochLogs(keras.callbacks.Callback):
        logs = ()

    class BatchLogs(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.logs = []

        def on_train_batch_end(self, batch, logs=None):
            self.logs.append(logs)

    def train(model, hooks):
        logs = BatchLogs() if hooks else EpochLogs()
        history = model.fit(*km.data("mlp"), callbacks=[logs], **fit_kwargs())
        return logs.logs, snapshot(model, model.optimizer, history.history)

    ad = AutoDist(resource_spec_file=spec_path, strategy_builder=AllReduce())
    with ad.scope():
        model = km.compiled("mlp", OPTIMIZERS["adam"]())
    got_logs, got = train(model, batch_hooks)
    want_logs, want = train(km.compiled("mlp", OPTIMIZERS["adam"]()), batch_hooks)
    assert_same(got, want, f"batch hooks {batch_hooks}")
    steps = EPOCHS * km.SAMPLES // km.BATCH_SIZE
    assert sum(copies) == (steps if batch_hooks else EPOCHS)
    assert len(got_logs) == len(want_logs) == (steps if batch_hooks else 0)
    for got_batch, want_batch in zip(got_logs, want_logs):
        assert got_batch.keys() == want_batch.keys()
        for key in want_batch:
            np.testing.assert_allclose(got_batch[key], want_batch[key], atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("builder", [AllReduce, PartitionedPS])
def test_a_steps_graph_holds_no_weight_values_which_initialization_feeds(spec_path, builder):
    """A 4 MB kernel: the lifted and the distributed GraphDefs stay small, and the
    session's variables start from the eager values, fed (then train as on one device)."""
    def build():
        keras.utils.set_random_seed(3)
        model = keras.Sequential([keras.Input((1024,)), keras.layers.Dense(1024),
                                  keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
        return model

    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 1024)).astype("float32")
    y = rng.normal(size=(16, 1)).astype("float32")
    single = build()
    initial = [w.copy() for w in single.get_weights()]
    single.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    ad = AutoDist(spec_path, builder())
    with ad.scope():
        model = build()
    model.fit(x, y, batch_size=8, shuffle=False, verbose=0)

    distributed = model._autodist_fit.step.session.distributed  # pylint: disable=protected-access
    kernel_bytes = 1024 * 1024 * 4
    assert distributed.item.graph_def.ByteSize() < kernel_bytes / 100
    assert distributed.graph.as_graph_def().ByteSize() < kernel_bytes / 16
    fed = sorted((value_of() for value_of in distributed.item.initial_values.values()),
                 key=np.size)
    assert [v.shape for v in fed] == [(1024, 1), (1024, 1024)]  # the zero biases: tf.zeros
    # The optimizer's non-zero state (SGD's learning rate) is fed too.
    assert len(distributed.initial_values) == len(fed) + 1
    # Read from the eager variable when needed (now: the trained kernel), not kept.
    np.testing.assert_array_equal(fed[-1], model.get_weights()[0])
    assert not np.allclose(fed[-1], initial[0])
    # What AutoDist keeps to notice Keras code's writes is the eager kernel's own buffer.
    kernel = model.layers[0].kernel.value
    synced = model._autodist_fit.step._synced[id(kernel)]  # pylint: disable=protected-access
    assert np.shares_memory(synced, eager_snapshot(kernel))
    for got, want in zip(model.get_weights(), single.get_weights()):
        np.testing.assert_allclose(got, want, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("packed", [False, True], ids=["one op each", "one traced call"])
def test_variables_of_few_bytes_are_read_and_assigned_together(packed, monkeypatch):
    """The small state AutoDist copies at every step (metrics, the optimizer's
    scalars) goes through one raw eager op per variable, or, for more than a
    few variables, through one traced call each way, its values packed one flat
    tensor per dtype; both also where a graph is the default."""
    if packed:
        monkeypatch.setattr(EagerVariables, "PER_OP_LIMIT", 3)
    rate, counts, label = tf.Variable(0.1), tf.Variable([1, 2], dtype=tf.int64), tf.Variable(b"a")
    matrix = tf.Variable(np.zeros((2, 3), np.float32))
    together = EagerVariables([rate, counts, label, matrix])
    assert together.packed == packed
    grid = np.arange(6, dtype=np.float32).reshape(2, 3)
    with tf.Graph().as_default():
        together.assign([np.float32(0.5), np.array([3, 4]), np.array(b"b", dtype=object), grid])
        values = together.read()
    assert (rate.numpy(), counts.numpy().tolist(), label.numpy()) == (0.5, [3, 4], b"b")
    assert counts.dtype == tf.int64 and matrix.shape == (2, 3)
    np.testing.assert_array_equal(matrix.numpy(), grid)
    np.testing.assert_array_equal(values[3], grid)
    rate.assign(0.7)
    matrix.assign(grid + 1)
    assert values[0] == 0.5  # arrays of their own
    np.testing.assert_array_equal(values[3], grid)
    together.assign([np.float32(0.25), np.array([5, 6]), np.array(b"c", dtype=object), -grid])
    assert together.read()[0] == 0.25
    np.testing.assert_array_equal(matrix.numpy(), -grid)
    with pytest.raises((ValueError, tf.errors.InvalidArgumentError)):
        together.assign([np.float32(0.5), np.array([3, 4, 5]), np.array(b"b", dtype=object), grid])
    if packed:  # float32, int64, string: three packed arguments for four variables
        assign = together._assign_traced  # pylint: disable=protected-access
        assert len(assign.structured_input_signature[0]) == 3


def test_a_step_restores_only_the_small_state_keras_code_changed(spec_path, monkeypatch):
    ad = AutoDist(resource_spec_file=spec_path, strategy_builder=AllReduce())
    with ad.scope():
        model = km.build("mlp")
        optimizer = keras.optimizers.SGD(0.05)
        step = ad.function(km.make_train_step(model, optimizer, km.loss("mlp")))
    batches = list(km.batches(*km.data("mlp")))
    step(*batches[0])
    distributed, runs = step.step, []
    session = distributed.session.tf_session
    run = session.run
    monkeypatch.setattr(session, "run", lambda *args, **kwargs: runs.append(args) or run(
        *args, **kwargs))
    distributed.copy_from_eager_if_changed(weights=False, slots=False)
    assert runs == []  # nothing changed: compared, not restored
    optimizer.learning_rate.assign(float("nan"))
    distributed.copy_from_eager_if_changed(weights=False, slots=False)
    assert len(runs) == 1
    step(*batches[1])  # copies the small state back: the NaN
    runs.clear()
    distributed.copy_from_eager_if_changed(weights=False, slots=False)
    assert runs == []  # a NaN equals the NaN copied
    assert np.isnan(float(optimizer.learning_rate))
