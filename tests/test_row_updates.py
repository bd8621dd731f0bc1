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

from autodist.graph_item import UPDATE_BY_ROWS, UPDATE_BY_ROWS_AFTER_FIRST, UPDATE_DENSE
from autodist.keras import step
from autodist.simulator import format_rows_touched
from autodist.strategy import PartitionedPS
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


def update_mode(optimizer) -> tuple:
    """The table's (update mode, note) as AutoDist decides it from the traced step."""
    model = table_model(optimizer)
    model.optimizer.build(model.trainable_variables)
    x, y = table_data()
    item = step.lift_step(step.trace_step(model.train_step, ((x, y),), autograph=False)).item
    info = {v.name: v for v in item.trainable_variables}[TABLE]
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
    # One more step, traced: every write of the table (and of each slot) took as many
    # rows as the batch names distinct ids, each once, over the table's parts.
    session = model._autodist_fit.step.session
    metadata = tf1.RunMetadata()
    run = session.run
    session.run = lambda *args, **kwargs: run(
        *args, **kwargs, options=tf1.RunOptions(trace_level=tf1.RunOptions.FULL_TRACE),
        run_metadata=metadata)
    model.fit(x[:BATCH], y[:BATCH], batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    graph = session.distributed.graph
    rows = _rows_gathered_to_update(graph, metadata)
    parts = sorted((name for name in rows if name == TABLE or name.startswith(f"{TABLE}/part_")
                    and "/" not in name[len(TABLE) + 1:]), key=lambda n: n.rsplit("_", 1)[-1])
    assert len(parts) == (1 if builder == "AllReduce" else 2), rows
    ids, offset = np.unique(x[:BATCH]), 0
    for part in parts:
        size = graph.get_operation_by_name(part).get_attr("shape").dim[0].size
        assert rows[part] == np.count_nonzero((ids >= offset) & (ids < offset + size)), rows
        offset += size
        slots = {name: count for name, count in rows.items() if name.startswith(part + "/")}
        assert len(slots) == {"Adagrad": 1, "Ftrl": 2}[optimizer], rows
        assert set(slots.values()) == {rows[part]}, rows  # its accumulator, FTRL's linear
    assert 0 < sum(rows[part] for part in parts) == len(ids) < VOCABULARY


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
        model = table_model(optimizer)
        model.optimizer.build(model.trainable_variables)
        x, y = table_data()
        item = step.lift_step(step.trace_step(model.train_step, ((x, y),), autograph=False)).item
        text = format_rows_touched(item.trainable_variables, 32)
        assert said in text, text
