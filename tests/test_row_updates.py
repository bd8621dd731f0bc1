"""A table's optimizer update runs on the rows the step touched where that is exact.

Keras 3 updates a table densely even when its gradient names few rows (Adagrad's
square root of the whole accumulator, FTRL's and Adam's dense gradient). Where the
traced update leaves a row without gradient, and its slots, as they are, AutoDist
runs the same update on the touched rows alone (``kernels/row_updates.py``); which
variables qualify is decided from the traced update run on sample rows
(``keras/update.py``, ``_SampleRowsCheck``), never from the optimizer's name. Each
case checks the decision, that training equals single-device Keras on weights,
every slot and the logged loss, with ids repeated within and across replicas, and
that the ops writing the table received the step's distinct rows, no more.
"""
from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from autodist import AutoDist
from autodist.graph_item import (UPDATE_BY_ROWS, UPDATE_BY_ROWS_AFTER_FIRST, UPDATE_BY_ROWS_LAZY,
                                 UPDATE_DENSE, GraphItem)
from autodist.keras import step
from autodist.simulator import format_rows_touched
from autodist.resource_spec import ResourceSpec
from autodist.session import DistributedSession
from autodist.simulator.traffic import sync_parts
from autodist.strategy import AllReduce, LazyRowUpdates, PartitionedPS, StrategyError
from autodist.strategy.compiler import compile_strategy
from test_equivalence import train_autodist, train_single
from test_keras import BUILDERS, assert_same
from test_keras_patterns import fit_both

tf1 = tf.compat.v1

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

VOCABULARY, IDS_PER_EXAMPLE, EXAMPLES, BATCH = 60, 4, 32, 8
TABLE = "table/embeddings"


class SignSGD(keras.optimizers.Optimizer):
    """A user's optimizer: steps by the gradient's sign, dense like Keras's own. A row
    without gradient has sign 0 and stays: it qualifies by what it computes."""

    def update_step(self, gradient, variable, learning_rate):
        gradient = tf.convert_to_tensor(gradient)  # dense, every row
        variable.assign_sub(tf.cast(learning_rate, variable.dtype) * tf.sign(gradient))


def table_model(optimizer) -> keras.Model:
    keras.utils.set_random_seed(3)
    ids = keras.Input((IDS_PER_EXAMPLE,), dtype="int32")
    hidden = keras.layers.Embedding(VOCABULARY, 8, name="table")(ids)
    hidden = keras.layers.GlobalAveragePooling1D()(hidden)
    model = keras.Model(ids, keras.layers.Dense(1, name="out")(hidden), name="ranker")
    model.compile(optimizer=optimizer, loss="mse")
    return model


def table_data(seed: int = 0):
    """Ids from rows 20 to 39 of 60 (in both halves): every batch repeats ids within each replica's
    rows and across the replicas."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(20, 40, (EXAMPLES, IDS_PER_EXAMPLE)).astype(np.int32)
    return ids, rng.normal(size=(EXAMPLES, 1)).astype(np.float32)


def table_item(optimizer) -> GraphItem:
    """The ``GraphItem`` of ``table_model(optimizer)``'s traced training step."""
    model = table_model(optimizer)
    model.optimizer.build(model.trainable_variables)
    x, y = table_data()
    return step.lift_step(step.trace_step(model.train_step, ((x, y),), autograph=False)).item


def update_mode(optimizer) -> tuple:
    """The table's (update mode, note) as AutoDist decides it from the traced step."""
    info = {v.name: v for v in table_item(optimizer).trainable_variables}[TABLE]
    return info.update_mode, info.update_note


O = keras.optimizers


@pytest.mark.parametrize("optimizer, mode", [
    (lambda: O.SGD(0.1), UPDATE_BY_ROWS),
    (lambda: O.Adagrad(0.1), UPDATE_BY_ROWS),
    (lambda: O.Adagrad(O.schedules.ExponentialDecay(0.1, 10, 0.5)), UPDATE_BY_ROWS),
    (lambda: O.Adagrad(0.1, clipnorm=1.0), UPDATE_BY_ROWS),
    (lambda: O.Adagrad(0.1, global_clipnorm=1.0), UPDATE_BY_ROWS),
    (lambda: O.LossScaleOptimizer(O.Adagrad(0.1)), UPDATE_BY_ROWS),
    (lambda: SignSGD(0.1), UPDATE_BY_ROWS),
    (lambda: O.Ftrl(0.1), UPDATE_BY_ROWS_AFTER_FIRST),
    (lambda: O.Ftrl(0.1, l2_shrinkage_regularization_strength=0.1), UPDATE_DENSE),
    (lambda: O.Adagrad(0.1, weight_decay=0.01), UPDATE_DENSE),
    (lambda: O.SGD(0.1, momentum=0.9), UPDATE_DENSE),
    (lambda: O.Adam(0.1), UPDATE_DENSE),
    (lambda: O.RMSprop(0.1), UPDATE_DENSE),
], ids=["SGD", "Adagrad", "Adagrad-schedule", "Adagrad-clipnorm", "Adagrad-global_clipnorm",
        "LossScale-Adagrad", "user-SignSGD", "Ftrl", "Ftrl-shrinkage", "Adagrad-weight_decay",
        "SGD-momentum", "Adam", "RMSprop"])
def test_the_update_mode_follows_from_what_the_update_computes(optimizer, mode):
    got, note = update_mode(optimizer())
    assert got == mode, note
    if mode == UPDATE_DENSE:  # Adam's moments decay on every row: said, with the optimizer
        assert "update changes rows that have no gradient" in note, note
    else:
        assert note == ""


def _traced(session) -> "tf1.RunMetadata":
    """The metadata that ``session``'s later runs fill, fully traced."""
    metadata = tf1.RunMetadata()
    run = session.run
    session.run = lambda *args, **kwargs: run(
        *args, **kwargs, options=tf1.RunOptions(trace_level=tf1.RunOptions.FULL_TRACE),
        run_metadata=metadata)
    return metadata


def _rows_gathered_to_update(graph: tf.Graph, metadata) -> dict:
    """Stored variable (a table's part or its slot) -> the rows the traced step gathered
    for its update by rows (and wrote back), from the shapes the ops gave."""
    shapes = {node.node_name: [d.size for d in node.output[0].tensor_description.shape.dim]
              for device in metadata.step_stats.dev_stats for node in device.node_stats
              if node.output}
    rows = {}
    for op in graph.get_operations():
        if op.type == "ResourceGather" and "/update_rows" in op.name:
            source = op.inputs[0].op
            while source.type == "Identity":
                source = source.inputs[0].op
            rows[source.name] = shapes[op.name][0]
    return rows


@pytest.mark.parametrize("builder", ["PartitionedPS", "Parallax", "AllReduce"])
@pytest.mark.parametrize("optimizer", ["Adagrad", "Ftrl"])
def test_a_table_updated_by_rows_trains_as_on_one_device(spec_path, builder, optimizer):
    x, y = table_data()
    build = lambda: table_model(O.get({"class_name": optimizer,
                                       "config": {"learning_rate": 0.1}}))
    (want, _), (got, model) = fit_both(spec_path, BUILDERS[builder](), build, x, y, epochs=2)
    assert_same(got, want, f"{optimizer} under {builder}")
    # One more step, traced.
    session = model._autodist_fit.step.session
    metadata = _traced(session)
    model.fit(x[:BATCH], y[:BATCH], batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    graph = session.distributed.graph
    _assert_updated_rows_are_the_batch_ids(graph, _rows_gathered_to_update(graph, metadata),
                                           x[:BATCH], builder, {"Adagrad": 1, "Ftrl": 2}[optimizer])


def test_the_first_ftrl_step_runs_on_every_row_without_a_copy_of_the_part(spec_path, monkeypatch):
    """FTRL's first step moves rows without gradient (to 0): it runs on the batch's rows
    (the step's gathers take those only), then on the others in chunks, with no copy of
    the whole part, and leaves every untouched row where one device's first step does."""
    x, y = table_data()
    traces, run = [], DistributedSession.run

    def traced_run(self, fetches, feed_dict=None, options=None, run_metadata=None):
        traces.append(tf1.RunMetadata())
        return run(self, fetches, feed_dict,
                   options=tf1.RunOptions(trace_level=tf1.RunOptions.FULL_TRACE),
                   run_metadata=traces[-1])

    monkeypatch.setattr(DistributedSession, "run", traced_run)
    (want, _), (got, model) = fit_both(spec_path, PartitionedPS(), lambda: table_model(O.Ftrl(0.1)),
                                       x[:BATCH], y[:BATCH], epochs=1)
    assert_same(got, want, "Ftrl's first step")
    table = model.get_layer("table").embeddings.numpy()
    untouched = np.setdiff1d(np.arange(VOCABULARY), x[:BATCH])
    assert np.all(table[untouched] == 0) and np.any(table_model(O.Ftrl(0.1)).get_layer(
        "table").embeddings.numpy()[untouched] != 0)
    graph = model._autodist_fit.step.session.distributed.graph
    steps = [_rows_gathered_to_update(graph, metadata) for metadata in traces]
    steps = [rows for rows in steps if rows]
    assert len(steps) == 1, steps
    _assert_updated_rows_are_the_batch_ids(graph, steps[0], x[:BATCH], "PartitionedPS", 2)


def _assert_updated_rows_are_the_batch_ids(graph: tf.Graph, rows: dict, ids: np.ndarray,
                                           builder: str, slots: int) -> None:
    """Every write of the table (and of each of its ``slots`` slots) took as many rows as
    ``ids`` names distinct ids, each once, over the table's parts."""
    parts = sorted((name for name in rows if name == TABLE or name.startswith(f"{TABLE}/part_")
                    and "/" not in name[len(TABLE) + 1:]), key=lambda n: n.rsplit("_", 1)[-1])
    assert len(parts) == (1 if builder == "AllReduce" else 2), rows
    ids, offset = np.unique(ids), 0
    for part in parts:
        size = graph.get_operation_by_name(part).get_attr("shape").dim[0].size
        assert rows[part] == np.count_nonzero((ids >= offset) & (ids < offset + size)), rows
        offset += size
        part_slots = {name: count for name, count in rows.items() if name.startswith(part + "/")}
        assert len(part_slots) == slots, rows
        assert set(part_slots.values()) == {rows[part]}, rows  # Adagrad's accumulator, ...
    assert 0 < sum(rows[part] for part in parts) == len(ids) < VOCABULARY


@pytest.mark.parametrize("optimizer", ["Adagrad", "Ftrl"])
def test_a_table_updated_by_rows_accumulates_and_resumes_from_a_save_as_on_one_device(
        spec_path, tmp_path, optimizer):
    """Accumulated sparse gradients (two runs per update) go by rows too, and a model saved
    whole after an epoch, reloaded in another job, trains on by rows from its restored state
    (FTRL's iteration count says its first step is behind it): one device's two epochs on
    twice the batch, in every weight and slot."""
    x, y = table_data()
    build = lambda: table_model(O.get({"class_name": optimizer, "config": {"learning_rate": 0.1}}))
    single = build()
    single.fit(x, y, batch_size=2 * BATCH, epochs=2, shuffle=False, verbose=0)
    path = str(tmp_path / "model.keras")
    for epoch in range(2):
        ad = AutoDist(spec_path, PartitionedPS(), accumulation_steps=2)
        with ad.scope():
            model = build() if epoch == 0 else keras.models.load_model(path)
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        infos = model._autodist_fit.step.session.distributed.item.trainable_variables
        assert {v.name: v.update_mode for v in infos if v.update_mode} == {
            TABLE: {"Adagrad": UPDATE_BY_ROWS, "Ftrl": UPDATE_BY_ROWS_AFTER_FIRST}[optimizer]}
        model.save(path)
    assert int(model.optimizer.iterations.numpy()) == int(single.optimizer.iterations.numpy()) == 4
    for got, want in zip(model.get_weights(), single.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert len(model.optimizer.variables) == len(single.optimizer.variables)
    for got, want in zip(model.optimizer.variables, single.optimizer.variables):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6,
                                   err_msg=want.path)


@pytest.mark.parametrize("optimizer, mode", [("adagrad", UPDATE_BY_ROWS), ("ftrl", UPDATE_BY_ROWS),
                                             ("adam", UPDATE_DENSE)])
def test_tf_compat_v1_optimizers_keep_their_own_sparse_kernels(spec_path, optimizer, mode):
    """``tf.compat.v1``'s Adagrad and FTRL write the gradient's rows alone on one device
    too (``ResourceSparseApply*``): their update is by rows as it stands. Its Adam
    assigns both moments whole."""
    want_losses, _, want = train_single("gathered", optimizer, 3)
    losses, got, _, distributed = train_autodist(spec_path, PartitionedPS(), "gathered",
                                                 optimizer, 3)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5, atol=1e-5)
    for name, g, w in zip(["table", "tied", "out"], got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5, err_msg=name)
    info = {v.name: v for v in distributed.item.trainable_variables}["table"]
    assert info.update_mode == mode
    assert info.updates_rows == (mode == UPDATE_BY_ROWS)


def test_explain_says_how_each_table_is_updated():
    """``autodist explain`` prints each sparse variable's update mode, and why it is dense."""
    for optimizer, said in ((O.Adagrad(0.1), "updated by rows"),
                            (O.Adam(0.1), "updated dense (Adam's update changes rows that "
                                          "have no gradient: moments that decay")):
        text = format_rows_touched(table_item(optimizer).trainable_variables, 32)
        assert said in text, text


# ----------------------------------------------------------------------------- lazy, on request

def lazy_data():
    """Two batches: the first looks up rows 20 to 39, the second rows 20 to 29 only."""
    rng = np.random.default_rng(5)
    ids = np.concatenate([rng.integers(20, 40, (BATCH, IDS_PER_EXAMPLE)),
                          rng.integers(20, 30, (BATCH, IDS_PER_EXAMPLE))]).astype(np.int32)
    return ids, rng.normal(size=(2 * BATCH, 1)).astype(np.float32)


def _state(model) -> dict:
    """Path -> value of every model and optimizer variable (without the optimizer's own,
    uniquified, name: "adam_2/iteration")."""
    return {**{v.path: v.numpy() for v in model.weights},
            **{v.path.split("/", 1)[-1]: v.numpy() for v in model.optimizer.variables}}


@pytest.mark.parametrize("builder", ["PartitionedPS", "AllReduce"])
def test_lazy_adam_differs_from_single_device_exactly_on_the_rows_a_step_left_out(spec_path,
                                                                                  builder):
    """``LazyRowUpdates``: Adam updates the table by the rows each step looked up. Step 1
    looks up rows A and B, step 2 rows A only. Single-device Adam moves rows B at step 2
    too (their moments decay, not to zero); lazily they, and their moments, stay as step
    1 left them. Everything else, and the logged loss, is the single-device value."""
    x, y = lazy_data()
    looked_up = [np.unique(x[:BATCH]), np.unique(x[BATCH:])]
    rows_b = np.setdiff1d(*looked_up)
    assert len(rows_b) >= 3 and len(looked_up[1]) >= 5
    single = table_model(O.Adam(0.1))
    want_loss = single.fit(x[:BATCH], y[:BATCH], batch_size=BATCH, shuffle=False,
                           verbose=0).history["loss"]
    after_one = _state(single)
    want_loss += single.fit(x[BATCH:], y[BATCH:], batch_size=BATCH, shuffle=False,
                            verbose=0).history["loss"]
    want = _state(single)
    ad = AutoDist(resource_spec_file=spec_path, strategy_builder=LazyRowUpdates(BUILDERS[builder]()))
    with ad.scope():
        lazy = table_model(O.Adam(0.1))
    got_loss = [lazy.fit(x[s:s + BATCH], y[s:s + BATCH], batch_size=BATCH, shuffle=False,
                         verbose=0).history["loss"][0] for s in (0, BATCH)]
    assert [n.lazy_row_update for n in ad.strategy.node_config] == [True, False, False]
    got = _state(lazy)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5, atol=1e-6)
    table_state = [path for path in want if path.endswith(("table/embeddings",
                                                           "table_embeddings_momentum",
                                                           "table_embeddings_velocity"))]
    assert len(table_state) == 3, sorted(want)
    for path, value in want.items():
        if path not in table_state:
            np.testing.assert_allclose(got[path], value, rtol=1e-5, atol=1e-6, err_msg=path)
            continue
        rest = np.setdiff1d(np.arange(VOCABULARY), rows_b)
        np.testing.assert_allclose(got[path][rest], value[rest], rtol=1e-5, atol=1e-6,
                                   err_msg=path)
        np.testing.assert_allclose(got[path][rows_b], after_one[path][rows_b], rtol=1e-5,
                                   atol=1e-6, err_msg=f"{path}: rows step 2 left out")
        # ... where single-device Adam moved every one of them (the velocity by 1e-3 of
        # itself: beta_2 is 0.999), by far more than the tolerance.
        before = after_one[path][rows_b]
        assert np.all(np.abs(value[rows_b] - before).max(axis=1)
                      > 1e-4 * np.abs(before).max(axis=1)), path
    # Step 2's writes of the table and its two moments took its distinct ids alone.
    metadata = _traced(lazy._autodist_fit.step.session)
    lazy.fit(x[BATCH:], y[BATCH:], batch_size=BATCH, shuffle=False, verbose=0)
    graph = lazy._autodist_fit.step.session.distributed.graph
    _assert_updated_rows_are_the_batch_ids(graph, _rows_gathered_to_update(graph, metadata),
                                           x[BATCH:], builder, 2)


def test_a_lazy_update_is_refused_where_it_cannot_run(spec_path):
    """Named: a variable with a dense gradient, a part's config, a name the model lacks,
    and a ``tf.compat.v1`` optimizer, whose own sparse kernels AutoDist keeps."""
    item = table_item(O.Adam(0.1))
    spec = ResourceSpec(spec_path)
    with pytest.raises(StrategyError, match="variable 'out/kernel' sets lazy_row_update, but "
                                            "its gradient is not sparse"):
        compile_strategy(LazyRowUpdates(AllReduce(), ["out/kernel"]).build(item, spec), item,
                         spec)
    strategy = PartitionedPS().build(item, spec)
    table = strategy.node_config_by_name()[TABLE]
    table.part_config[1].lazy_row_update = True
    with pytest.raises(StrategyError, match=f"set it on the config of variable '{TABLE}'"):
        compile_strategy(strategy, item, spec)
    with pytest.raises(StrategyError, match=r"names \['tabel/embeddings'\], which the model"):
        LazyRowUpdates(AllReduce(), ["tabel/embeddings"]).build(item, spec)
    with pytest.raises(StrategyError, match="variable 'table' sets lazy_row_update, but its "
                                            "optimizer is a tf.compat.v1 one"):
        train_autodist(spec_path, LazyRowUpdates(PartitionedPS()), "gathered", "adam", 1)


def test_explain_and_the_cost_model_take_a_lazy_table_as_updated_by_rows(spec_path):
    item = table_item(O.Adam(0.1))
    spec = ResourceSpec(spec_path)
    charged = {}
    for builder in (PartitionedPS(), LazyRowUpdates(PartitionedPS())):
        compiled = compile_strategy(builder.build(item, spec), item, spec)
        infos = [v.info for v in compiled.variables.values()]
        text = format_rows_touched(infos, 32)
        parts, _ = sync_parts(compiled, infos, BATCH, {})
        charged[type(builder).__name__] = parts.updated_by_rows[parts.sparse].tolist()
        if isinstance(builder, LazyRowUpdates):
            assert ("updated by rows, lazy (lazy_row_update: rows without gradient keep their "
                    "value and slots, unlike on one device; exact: dense, as Adam's update "
                    "changes rows that have no gradient") in text, text
            assert {v.info.name: v.info.update_mode for v in compiled.variables.values()
                    if v.info.update_mode} == {TABLE: UPDATE_BY_ROWS_LAZY}
    assert charged == {"PartitionedPS": [False, False], "LazyRowUpdates": [True, True]}
