"""Large Keras weights made in ``ad.scope()`` get no eager value until something reads them.

The lifted step computes their initial value where each copy is stored (each
part of a partitioned table on its own device, ``initial_rows``); after
training, the eager variable takes AutoDist's value at its first use. So a node
never holds a whole table unless the user's own code reads it. Here the
threshold is lowered so that a small embedding is deferred.
"""
from __future__ import annotations

import keras
import numpy as np
import pytest

from autodist import AutoDist, _keras_compat
from autodist.keras import function as keras_function
from autodist.keras import step as keras_step
from autodist.kernels import partitioner
from autodist.partition import PartitionPlan
from autodist.strategy import AllReduce, PartitionedPS, StrategyError
from test_keras import assert_same, snapshot
from test_row_gathers import VOCABULARY, keras_data

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

BUILDERS = {"PartitionedPS": PartitionedPS, "AllReduce": AllReduce}


@pytest.fixture
def table_bytes(monkeypatch):
    """Defers the embedding (VOCABULARY x 6 float32s) and its slots, not the dense layers."""
    monkeypatch.setattr(keras_step, "DEFERRED_VARIABLE_BYTES", VOCABULARY * 6 * 4)


def embedding_model(optimizer: str) -> keras.Model:
    keras.utils.set_random_seed(3)
    ids = keras.Input((5,), dtype="int32")
    hidden = keras.layers.GlobalAveragePooling1D()(
        keras.layers.Embedding(VOCABULARY, 6, name="tokens")(ids))
    model = keras.Model(ids, keras.layers.Dense(1, name="out")(
        keras.layers.Dense(4, activation="tanh", name="hidden")(hidden)))
    model.compile(optimizer=keras.optimizers.get({"class_name": optimizer,
                                                  "config": {"learning_rate": 0.05}}),
                  loss="mse", metrics=["mae"])
    return model


def deferred(model: keras.Model) -> list:
    """Paths of the model's and its optimizer's variables still without a value."""
    # Without the optimizer's own (uniquified) name: "adam_3/tokens_embeddings_momentum".
    return sorted([v.path for v in model.variables if getattr(v.value, "deferred", False)]
                  + [v.path.split("/", 1)[-1] for v in model.optimizer.variables
                     if getattr(v.value, "deferred", False)])


@pytest.mark.parametrize("optimizer", ["SGD", "Adam"])
@pytest.mark.parametrize("builder", sorted(BUILDERS))
def test_a_deferred_table_trains_as_on_one_device_and_is_fetched_when_read(
        spec_path, table_bytes, builder, optimizer):
    x, y = keras_data()
    want_model = embedding_model(optimizer)
    history = want_model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    want = snapshot(want_model, want_model.optimizer, history.history)

    ad = AutoDist(resource_spec_file=spec_path, strategy_builder=BUILDERS[builder]())
    with ad.scope():
        model = embedding_model(optimizer)
    assert deferred(model) == ["tokens/embeddings"]
    history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    # Still without a value after fit, and so are Adam's moments of the table
    # (made at the step's first trace): only reading them brings AutoDist's values.
    slots = (["tokens_embeddings_momentum", "tokens_embeddings_velocity"]
             if optimizer == "Adam" else [])
    assert deferred(model) == sorted(["tokens/embeddings"] + slots)
    got = snapshot(model, model.optimizer, history.history)
    assert deferred(model) == []
    assert_same(got, want, f"{builder}, {optimizer}")


@pytest.mark.parametrize("optimizer", ["SGD", "Adam"])
def test_save_weights_writes_a_deferred_table_part_by_part_without_giving_it_a_value(
        spec_path, table_bytes, tmp_path, monkeypatch, optimizer):
    """The file loads into a plain Keras model with the weights and optimizer state of
    single-device training; the table and its moments stay without a value here."""
    monkeypatch.setattr(keras_function, "PIECE_BYTES", 3 * 6 * 4)  # 3 rows a fetch
    x, y = keras_data()
    want_model = embedding_model(optimizer)
    want_model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)

    ad = AutoDist(resource_spec_file=spec_path, strategy_builder=PartitionedPS())
    with ad.scope():
        model = embedding_model(optimizer)
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    still = deferred(model)
    path = str(tmp_path / "trained.weights.h5")
    model.save_weights(path)
    assert deferred(model) == still and "tokens/embeddings" in still

    plain = embedding_model(optimizer)
    plain.optimizer.build(plain.trainable_variables)
    plain.load_weights(path)
    for got, want in zip(plain.variables + plain.optimizer.variables,
                         want_model.variables + want_model.optimizer.variables):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-6,
                                   err_msg=want.path)


def test_pieces_cut_a_value_within_its_parts():
    value = np.arange(27).reshape(9, 3)
    plan = PartitionPlan(axis=0, sizes=(5, 4), shape=(9, 3))
    pieces = partitioner.pieces(plan, [9, 3], 2)
    assert [(part, rows) for part, rows, _ in pieces] == [
        (0, (0, 2)), (0, (2, 4)), (0, (4, 5)), (1, (0, 2)), (1, (2, 4))]
    parts = np.split(value, [5])
    for part, (begin, end), index in pieces:
        np.testing.assert_array_equal(value[index], parts[part][begin:end])
    assert [(part, rows) for part, rows, _ in partitioner.pieces(None, [9, 3], 4)] == [
        (0, (0, 4)), (0, (4, 8)), (0, (8, 9))]
    by_columns = partitioner.pieces(PartitionPlan(axis=1, sizes=(2, 1), shape=(9, 3)), [9, 3], 2)
    assert [(part, rows) for part, rows, _ in by_columns] == [(0, None), (1, None)]
    np.testing.assert_array_equal(value[by_columns[1][2]], value[:, 2:])
    assert partitioner.pieces(None, [], 2) == [(0, None, ())]


def test_fit_refuses_a_strategy_the_node_cannot_hold_before_training(tmp_path):
    """A node's ``memory`` bounds what a strategy may store there: a table of 32 MiB
    with Adam's two moments does not fit a node of 64 MiB, and ``fit`` says so by name
    before any step."""
    spec = tmp_path / "small_node.yml"
    spec.write_text("nodes:\n  - address: localhost\n    cpus: [0, 1]\n    memory: 64m\n")
    ad = AutoDist(resource_spec_file=str(spec), strategy_builder=PartitionedPS())
    with ad.scope():
        ids = keras.Input((2,), dtype="int32")
        table = keras.layers.Embedding(2 ** 20, 8, name="tokens")
        model = keras.Model(ids, keras.layers.Dense(1)(
            keras.layers.GlobalAveragePooling1D()(table(ids))))
        model.compile(optimizer="adam", loss="mse")
    with pytest.raises(StrategyError) as refused:
        model.fit(np.zeros((8, 2), np.int32), np.zeros((8, 1), np.float32), batch_size=8,
                  verbose=0)
    message = str(refused.value)
    assert "does not fit node 'localhost'" in message and "at least 0.09 GiB" in message
    assert "memory 0.06 GiB" in message and "embeddings' 0.09 GiB (PSSynchronizer)" in message
    assert int(model.optimizer.iterations.numpy()) == 0


def test_a_table_read_before_fit_starts_from_its_initial_value(spec_path, table_bytes):
    """``predict`` before ``fit`` gives the table its value eagerly; fit then feeds it."""
    x, y = keras_data()
    want_model = embedding_model("Adam")
    want_predictions = want_model.predict(x[:8], verbose=0)
    history = want_model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    want = snapshot(want_model, want_model.optimizer, history.history)

    ad = AutoDist(resource_spec_file=spec_path, strategy_builder=PartitionedPS())
    with ad.scope():
        model = embedding_model("Adam")
    np.testing.assert_allclose(model.predict(x[:8], verbose=0), want_predictions, rtol=1e-6)
    assert deferred(model) == []
    history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert_same(snapshot(model, model.optimizer, history.history), want, "read before fit")


def test_a_second_step_starts_from_the_trained_table_not_its_initial_value(
        spec_path, table_bytes):
    """``train_on_batch`` after ``fit`` traces another step (other arguments): it starts
    from the values fit trained, which the deferred table fetches."""
    x, y = keras_data()
    want_model = embedding_model("SGD")
    want_model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    want_logs = want_model.train_on_batch(x[:16], y[:16], return_dict=True)

    ad = AutoDist(resource_spec_file=spec_path, strategy_builder=PartitionedPS())
    with ad.scope():
        model = embedding_model("SGD")
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    logs = model.train_on_batch(x[:16], y[:16], return_dict=True)
    assert logs == pytest.approx(want_logs, rel=1e-5)
    np.testing.assert_allclose(model.get_layer("tokens").embeddings.numpy(),
                               want_model.get_layer("tokens").embeddings.numpy(), atol=1e-5)


def test_only_weights_of_a_deterministic_keras_initializer_are_deferred():
    with _keras_compat.defer_large_variables(VOCABULARY * 6 * 4):
        layers = {
            "seeded": keras.layers.Embedding(VOCABULARY, 6),
            "own function": keras.layers.Embedding(
                VOCABULARY, 6, embeddings_initializer=lambda shape, dtype=None: np.ones(shape)),
            "seed generator": keras.layers.Embedding(
                VOCABULARY, 6, embeddings_initializer=keras.initializers.RandomUniform(
                    seed=keras.random.SeedGenerator(1))),
            "too small": keras.layers.Embedding(VOCABULARY - 1, 6),
        }
        for layer in layers.values():
            layer.build((None, 5))
    kinds = {name: type(layer.embeddings.value).__name__ for name, layer in layers.items()}
    assert kinds == {"seeded": "DeferredVariable", "own function": "ResourceVariable",
                     "seed generator": "ResourceVariable", "too small": "ResourceVariable"}
