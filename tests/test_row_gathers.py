"""Gathers of a partitioned table read the rows they name from the parts owning them.

A replica's ``tf.gather`` / ``embedding_lookup`` / Keras ``Embedding`` of a
partitioned variable routes its ids to the parts and stitches the rows back;
only a variable something reads whole gets a stitched copy. Each case checks
the rewrite happened (which ops read which parts, what a step's tensors
weigh) and that training equals single-device training.
"""
from __future__ import annotations

import re

import keras
import numpy as np
import pytest
import tensorflow as tf

from autodist import AutoDist, _tf_compat
from autodist.graph_item import GraphItem
from autodist.simulator import format_rows_touched
from autodist.strategy import PS, PartitionedPS, UnevenPartitionedPS
from autodist.strategy.ps_builders import sharded_ps_node_configs
from test_equivalence import train_autodist, train_single
from test_keras import assert_same
from test_keras_patterns import ROWS, fit_both

tf1 = tf.compat.v1

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

STEPS = 3


class ThreePartPS(UnevenPartitionedPS):
    """Every variable of 3 rows or more in 3 parts, on one node's PS device."""

    def _node_configs(self, variables, ps_devices):
        return list(sharded_ps_node_configs(
            variables, ps_devices, self._ps,
            lambda shape, num_ps: 3 if len(shape) and shape[0] >= 3 else 1).values())


def gathers_by_variable(graph: tf.Graph) -> dict:
    """Variable op name -> names of the ResourceGather ops reading it (through any Identity)."""
    found = {}
    for op in graph.get_operations():
        if op.type == "ResourceGather":
            found.setdefault(_source(op.inputs[0]).name, []).append(op.name)
    return found


def products_by_variable(graph: tf.Graph) -> dict:
    """Variable op name -> names of the matrix products multiplying by its value
    (as either factor)."""
    found = {}
    for op in graph.get_operations():
        if op.type in ("MatMul", "BatchMatMulV2"):
            for source in {_source(factor).name for factor in op.inputs[:2]}:
                found.setdefault(source, []).append(op.name)
    return found


def _source(tensor: tf.Tensor) -> tf.Operation:
    """The op a tensor comes from, through reads of a variable and identities."""
    source = tensor.op
    while source.type in ("Identity", "ReadVariableOp"):
        source = source.inputs[0].op
    return source


def variable_names(graph: tf.Graph) -> set:
    return {op.name for op in graph.get_operations() if op.type == "VarHandleOp"}


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam"])
@pytest.mark.parametrize("builder, parts", [(UnevenPartitionedPS, 2), (ThreePartPS, 3)],
                         ids=["UnevenPartitionedPS", "3 parts"])
def test_gathers_read_the_parts_and_train_as_on_one_device(spec_path, builder, parts, optimizer):
    want_losses, _, want = train_single("gathered", optimizer, STEPS)
    losses, got, _, distributed = train_autodist(spec_path, builder(), "gathered", optimizer, STEPS)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5, atol=1e-5)
    for name, g, w in zip(["table", "tied", "out"], got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5, err_msg=name)

    graph = distributed.graph
    stored = variable_names(graph)
    table_parts = sorted(n for n in stored if re.fullmatch(r"table/part_\d+", n))
    assert len(table_parts) == parts
    gathers = gathers_by_variable(graph)
    for part in table_parts:
        # One gather per replica reads each part where it is stored.
        readers = [g for g in gathers.get(part, []) if "where_stored" in g]
        assert sorted(r.split("/")[0] for r in readers) == [
            "AutoDist-Replica-0", "AutoDist-Replica-1"], (part, gathers)
        assert graph.get_operation_by_name(readers[0]).device == \
            graph.get_operation_by_name(part).device
    # Only the variable something reads whole as one tensor (the penalty on ``out``)
    # has a full-size (stitched) copy. One, which both CPU replicas read: they share
    # the host's memory.
    stitched = [n for n in stored if n.endswith("/stitched")]
    assert len(stitched) == 1 and stitched[0].endswith("/out/stitched"), stitched
    assert any("tied/part_" in p for p in gathers)
    # Each replica multiplies by every part of ``tied``, read where it is stored.
    products = products_by_variable(graph)
    tied_parts = sorted(n for n in stored if re.fullmatch(r"tied/part_\d+", n))
    assert len(tied_parts) == parts
    for part in tied_parts:
        assert {p.split("/")[0] for p in products[part]} == {
            "AutoDist-Replica-0", "AutoDist-Replica-1"}, (part, products)


def step_tensor_bytes(spec: str, builder, rows: int) -> tuple:
    """(all tensors a traced step produced, its largest one), in bytes, for a table of ``rows``."""
    ad = AutoDist(resource_spec_file=spec, strategy_builder=builder)
    with tf.Graph().as_default(), ad.scope():
        ids = tf1.placeholder(tf.int32, [None], name="ids")
        table = tf1.get_variable("table", [rows, 32], use_resource=True,
                                 initializer=tf1.random_normal_initializer(seed=1))
        loss = tf.reduce_mean(tf.square(tf.nn.embedding_lookup(table, ids)))
        train_op = tf1.train.GradientDescentOptimizer(0.1).minimize(loss)
        feeds = {ids: np.arange(0, rows, rows // 64, dtype=np.int32)[:64]}
        with ad.create_distributed_session() as sess:
            sess.run(train_op, feeds)
            metadata = tf1.RunMetadata()
            sess.run(train_op, feeds, options=tf1.RunOptions(trace_level=tf1.RunOptions.FULL_TRACE),
                     run_metadata=metadata)
    sizes = [out.tensor_description.allocation_description.requested_bytes
             for device in metadata.step_stats.dev_stats for node in device.node_stats
             for out in node.output]
    return sum(sizes), max(sizes)


@pytest.mark.parametrize("builder", [PartitionedPS, lambda: PS(local_proxy_variable=True)],
                         ids=["PartitionedPS", "PS with proxies"])
def test_a_step_moves_the_rows_it_touches_not_the_table(spec_path, builder):
    """64 rows of 128 bytes are read and updated per step, whatever the table's size; with
    proxies, SGD's scatter into those rows is all a proxy's refresh copies."""
    small_total, _ = step_tensor_bytes(spec_path, builder(), 4096)
    large_total, large_largest = step_tensor_bytes(spec_path, builder(), 65536)
    table_bytes = 65536 * 32 * 4
    assert large_largest < 64 * 32 * 4 * 2, large_largest
    assert large_total < table_bytes / 20, (large_total, table_bytes)
    assert large_total < 1.5 * small_total, (small_total, large_total)


def test_the_rows_a_step_touches_are_read_from_the_gathers_ids():
    """The cost model's estimate: 8 ids per example for the token table, the 8 positions
    whatever the batch."""
    calls = []
    with tf.Graph().as_default() as graph, _tf_compat.capture_apply_gradients(calls.append):
        ids = tf1.placeholder(tf.int32, [None, 8])
        tokens = tf1.get_variable("tokens", [1000, 4], use_resource=True)
        positions = tf1.get_variable("positions", [8, 4], use_resource=True)
        hidden = tf.nn.embedding_lookup(tokens, ids) + tf.gather(positions, tf.range(8))
        loss = tf.reduce_sum(hidden)
        tf1.train.GradientDescentOptimizer(0.1).minimize(loss)
    infos = {v.name: v for v in GraphItem(graph, calls).trainable_variables}
    assert (infos["tokens"].rows_gathered, infos["tokens"].rows_gathered_per_example) == (0, 8)
    assert (infos["positions"].rows_gathered,
            infos["positions"].rows_gathered_per_example) == (8, 0)
    assert infos["tokens"].rows_touched(32) == 256
    assert infos["tokens"].rows_touched(500) == 1000  # at most every row
    assert infos["positions"].rows_touched(32) == 8
    text = format_rows_touched(infos.values(), 32)
    assert "tokens: 256 of 1,000 rows (8 per example x batch 32); read by rows" in text
    # Every replica gathers the same positions: their gradients are summed dense.
    assert "positions" not in text and not infos["positions"].sparse_grad


# ----------------------------------------------------------------------------- Keras

VOCABULARY = 40


def tied_model(optimizer: str, tied: bool) -> keras.Model:
    """An embedding, pooled, then a dense head; ``tied``: the head also multiplies the table."""
    keras.utils.set_random_seed(3)
    ids = keras.Input((5,), dtype="int32")
    embedding = keras.layers.Embedding(VOCABULARY, 6, name="tokens")
    hidden = keras.layers.GlobalAveragePooling1D()(embedding(ids))
    if tied:
        hidden = keras.layers.Lambda(
            lambda h: tf.concat([h, tf.matmul(h, embedding.embeddings, transpose_b=True)], 1))(
                hidden)
    model = keras.Model(ids, keras.layers.Dense(1, name="out")(hidden))
    model.compile(optimizer=keras.optimizers.get({"class_name": optimizer,
                                                  "config": {"learning_rate": 0.05}}),
                  loss="mse", metrics=["mae"])
    return model


def keras_data():
    rng = np.random.default_rng(4)
    # Low ids are frequent: every batch repeats some within and across replicas.
    ids = np.minimum(rng.geometric(0.15, (ROWS, 5)), VOCABULARY - 1).astype(np.int32)
    return ids, rng.normal(size=(ROWS, 1)).astype(np.float32)


@pytest.mark.parametrize("optimizer", ["SGD", "Adagrad", "Adam"])
@pytest.mark.parametrize("tied", [False, True], ids=["gathered", "tied"])
def test_keras_embedding_of_a_partitioned_table_fits_as_on_one_device(spec_path, optimizer, tied):
    x, y = keras_data()
    (want, _), (got, model) = fit_both(spec_path, PartitionedPS(),
                                       lambda: tied_model(optimizer, tied), x, y, epochs=2)
    assert_same(got, want, f"{optimizer}, tied={tied}")

    graph = model._autodist_fit.step.session.distributed.graph  # pylint: disable=protected-access
    stored = variable_names(graph)
    gathers = gathers_by_variable(graph)
    assert {"tokens/embeddings/part_0", "tokens/embeddings/part_1"} <= stored
    assert all(len([g for g in gathers.get(f"tokens/embeddings/part_{i}", [])
                    if "where_stored" in g]) == 2 for i in (0, 1)), gathers
    # Multiplied by (tied), the table is read part by part: no stitched copy.
    assert not [n for n in stored if n.endswith("/stitched")]
    products = products_by_variable(graph)
    assert all({p.split("/")[0] for p in products.get(f"tokens/embeddings/part_{i}", [])}
               == ({"AutoDist-Replica-0", "AutoDist-Replica-1"} if tied else set())
               for i in (0, 1)), products
