"""Checkpoints in the single-device layout: AutoDist <-> plain TensorFlow, and resuming.

A checkpoint written under any strategy must hold exactly what a plain
``tf.compat.v1.train.Saver`` of the single-device model would (same names, full
shapes, optimizer slots), and restore in either direction.
"""
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import tensorflow as tf

import models
from autodist import AutoDist
from autodist.checkpoint import SavedModelBuilder, Saver, latest_checkpoint
from autodist.strategy import AllReduce, PartitionedPS, Strategy, common
from test_equivalence import BUILDERS, OPTIMIZERS, axis_one_strategy

tf1 = tf.compat.v1

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

MODEL = "partitionable"  # odd shapes, a sparse table, several partitionable axes
ATOL = RTOL = 1e-5


def adam():
    return OPTIMIZERS["adam"]()


def single_device(steps: int, restore_from: str = None, save_to: str = None,
                  restore_slots: bool = True) -> dict:
    """Plain TF on the global batch: every global variable after ``steps`` steps."""
    with tf.Graph().as_default():
        built = models.MODELS[MODEL](adam)
        saver = tf1.train.Saver()
        with tf1.Session() as sess:
            sess.run(tf1.global_variables_initializer())
            if restore_from:
                restored = (saver if restore_slots else tf1.train.Saver(
                    tf1.trainable_variables() + [tf1.train.get_global_step()]))
                restored.restore(sess, restore_from)
            for _ in range(steps):
                sess.run(built.train_op, built.feeds)
            if save_to:
                saver.save(sess, save_to)
            return {v.op.name: sess.run(v) for v in tf1.global_variables()}


def autodist_job(spec: str, builder, steps: int, restore_from: str = None,
                 save_to: str = None, model: str = MODEL):
    """One AutoDist job: (its variables as fetched after training, the saved path)."""
    ad = AutoDist(spec, builder)
    with tf.Graph().as_default(), ad.scope():
        built = models.MODELS[model](adam)
        saver = Saver()
        with ad.create_distributed_session() as sess:
            if restore_from:
                saver.restore(sess, restore_from)
            for _ in range(steps):
                sess.run(built.train_op, built.feeds)
            names = [models.as_tf_variable(v).op.name for v in built.variables]
            values = dict(zip(names, sess.run(built.variables)))
            path = saver.save(sess, save_to) if save_to else None
    return values, path


def checkpoint_values(path: str) -> dict:
    reader = tf.train.load_checkpoint(path)
    return {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()}


def plain_restore(path: str) -> dict:
    """Restores ``path`` into the plain single-device graph with TF's own Saver."""
    with tf.Graph().as_default():
        models.MODELS[MODEL](adam)
        with tf1.Session() as sess:
            tf1.train.Saver().restore(sess, path)
            return {v.op.name: sess.run(v) for v in tf1.global_variables()}


def ps_axis_one_strategy(replicas) -> Strategy:
    """Every matrix cut "1,2" with both parts on the PS; vectors whole on the PS."""
    strategy = axis_one_strategy(MODEL, replicas)
    for node in strategy.node_config:
        if node.part_config:
            for i, part in enumerate(node.part_config):
                part.CopyFrom(common.ps_node_config(common.part_name(node.var_name, i),
                                                    replicas[0]))
        else:
            node.CopyFrom(common.ps_node_config(node.var_name, replicas[0]))
    return strategy


REPLICAS = ["localhost:CPU:0", "localhost:CPU:1"]
STRATEGIES = dict(BUILDERS, **{
    "PS-axis-1": lambda: ps_axis_one_strategy(REPLICAS),
    "PS-and-AllReduce-axis-1": lambda: axis_one_strategy(MODEL, REPLICAS),
})


@pytest.mark.parametrize("builder", sorted(STRATEGIES))
def test_a_strategy_checkpoint_restores_in_plain_tensorflow(spec_path, tmp_path, builder):
    trained, path = autodist_job(spec_path, STRATEGIES[builder](), 3,
                                 save_to=str(tmp_path / "model"))
    restored = plain_restore(path)
    # The variables come back bit for bit as the AutoDist session had them ...
    for name, value in trained.items():
        np.testing.assert_array_equal(restored[name], value, err_msg=name)
    # ... and every entry, slots and Adam's powers included, is what single-device
    # training holds under the same name and shape.
    want = single_device(3)
    saved = checkpoint_values(path)
    assert sorted(saved) == sorted(want)
    for name, value in want.items():
        np.testing.assert_allclose(saved[name], value, rtol=RTOL, atol=ATOL, err_msg=name)


@pytest.mark.parametrize("builder", ["PS", "PartitionedPS", "AllReduce", "PartitionedAR",
                                     "RandomAxisPartitionAR", "Parallax-local_proxy",
                                     "PS-and-AllReduce-axis-1"])
def test_a_plain_checkpoint_restores_under_a_strategy(spec_path, tmp_path, builder):
    start = str(tmp_path / "plain")
    single_device(2, save_to=start)
    trained, _ = autodist_job(spec_path, STRATEGIES[builder](), 2, restore_from=start)
    want = single_device(4)
    for name, value in trained.items():
        np.testing.assert_allclose(value, want[name], rtol=RTOL, atol=ATOL, err_msg=name)


def test_resuming_under_another_strategy_and_replica_count(spec_path, spec_path_4cpu, tmp_path):
    """2 steps with PartitionedPS on 2 replicas, then 2 with AllReduce on 4 = 4 steps."""
    _, path = autodist_job(spec_path, PartitionedPS(), 2, save_to=str(tmp_path / "first"))
    resumed, _ = autodist_job(spec_path_4cpu, AllReduce(), 2, restore_from=path)
    want = single_device(4)
    for name, value in resumed.items():
        np.testing.assert_allclose(value, want[name], rtol=RTOL, atol=ATOL, err_msg=name)
    # The slots matter: resuming from the variables alone ends elsewhere.
    without_slots = single_device(2, restore_from=path, restore_slots=False)
    assert not np.allclose(without_slots["odd"], want["odd"], rtol=RTOL, atol=1e-3)


def test_max_to_keep_latest_checkpoint_and_meta_graph(spec_path, tmp_path):
    ad = AutoDist(spec_path, PartitionedPS())
    prefix = str(tmp_path / "run" / "model")
    with tf.Graph().as_default(), ad.scope():
        built = models.MODELS[MODEL](adam)
        saver = Saver(max_to_keep=2)
        with ad.create_distributed_session() as sess:
            paths = []
            for _ in range(3):
                sess.run(built.train_op, built.feeds)
                paths.append(saver.save(sess, prefix, global_step=tf1.train.get_global_step()))
            odd = sess.run(built.variables[0])
    assert paths == [f"{prefix}-{step}" for step in (1, 2, 3)]
    assert latest_checkpoint(str(tmp_path / "run")) == paths[-1]
    assert saver.last_checkpoints == paths[1:]
    assert not tf.io.gfile.glob(paths[0] + ".*")
    # The .meta file is the single-device graph: import it anywhere and restore.
    with tf.Graph().as_default():
        plain_saver = tf1.train.import_meta_graph(paths[-1] + ".meta")
        assert not [op for op in tf1.get_default_graph().get_operations()
                    if "AutoDist" in op.name]
        with tf1.Session() as sess:
            plain_saver.restore(sess, paths[-1])
            variables = {v.op.name: v for v in tf1.global_variables()}
            np.testing.assert_array_equal(sess.run(variables["odd"]), odd)


def test_restore_errors_name_the_problem(spec_path, tmp_path):
    ad = AutoDist(spec_path, AllReduce())
    with tf.Graph().as_default(), ad.scope():
        built = models.MODELS["dense"](adam)
        saver = Saver()
        with ad.create_distributed_session() as sess:
            with pytest.raises(ValueError, match="no readable checkpoint at .*nowhere"):
                saver.restore(sess, str(tmp_path / "nowhere"))
            other = str(tmp_path / "other")
            single_device(1, save_to=other)  # the partitionable model: other variables
            with pytest.raises(ValueError, match=r"missing \[.*'w1'"):
                saver.restore(sess, other)
            with tf1.Session(graph=tf.Graph()) as plain:
                with pytest.raises(TypeError, match="create_distributed_session"):
                    saver.save(plain, str(tmp_path / "x"))
            sess.run(built.train_op, built.feeds)


def test_saved_model_serves_the_trained_predictions(spec_path, tmp_path):
    import keras
    rng = np.random.RandomState(0)
    features = rng.randn(8, 6).astype(np.float32)
    targets = rng.randn(8, 2).astype(np.float32)
    ad = AutoDist(spec_path, AllReduce())
    export = str(tmp_path / "served")
    with tf.Graph().as_default(), ad.scope():
        x = tf1.placeholder(tf.float32, [None, 6], name="x")
        y = tf1.placeholder(tf.float32, [None, 2], name="y")
        prediction = keras.layers.Dense(2, name="out")(keras.layers.Dense(5, "tanh")(x))
        loss = tf.reduce_mean(tf.square(prediction - y))
        train_op = tf1.train.AdamOptimizer(0.05).minimize(loss)
        with ad.create_distributed_session() as sess:
            initial_prediction = sess.run(prediction, {x: features})
            for _ in range(3):
                sess.run(train_op, {x: features, y: targets})
            trained_prediction = sess.run(prediction, {x: features})
            builder = SavedModelBuilder(export)
            builder.add_meta_graph_and_variables(
                sess, [tf.saved_model.SERVING],
                signature_def_map={"predict": tf1.saved_model.predict_signature_def(
                    inputs={"x": x}, outputs={"y": prediction})})
            builder.save()
    with tf.Graph().as_default(), tf1.Session() as served:
        meta = tf1.saved_model.load(served, [tf.saved_model.SERVING], export)
        signature = meta.signature_def["predict"]
        assert not [op for op in served.graph.get_operations() if "AutoDist" in op.name]
        got = served.run(signature.outputs["y"].name, {signature.inputs["x"].name: features})
    np.testing.assert_allclose(got, trained_prediction, rtol=1e-6, atol=1e-6)
    # It is the trained model, not the initial one.
    assert np.abs(got - initial_prediction).max() > 1e-3


SAVE_AND_DIE = textwrap.dedent("""
    import os, sys, time
    import numpy as np, tensorflow as tf
    from autodist import AutoDist
    from autodist.checkpoint import Saver
    from autodist.strategy import PartitionedPS
    tf1 = tf.compat.v1
    ad = AutoDist(sys.argv[1], PartitionedPS())
    with tf.Graph().as_default(), ad.scope():
        # Large enough that writing it takes a while: the kill lands mid-save.
        big = tf1.get_variable("big", [8192, 8192], initializer=tf1.ones_initializer(),
                               use_resource=True)
        loss = tf.reduce_sum(big[:2, :2])
        train_op = tf1.train.GradientDescentOptimizer(1.0).minimize(
            loss, global_step=tf1.train.get_or_create_global_step())
        saver = Saver()
        sess = ad.create_distributed_session()
        sess.run(train_op)
        saver.save(sess, sys.argv[2], global_step=1)
        sess.run(train_op)
        print("second save starts", flush=True)
        saver.save(sess, sys.argv[2], global_step=2)
        print("second save done", flush=True)
""")


@pytest.mark.timeout(180)
def test_a_save_killed_midway_leaves_the_previous_checkpoint(spec_path, tmp_path):
    script = tmp_path / "save_and_die.py"
    script.write_text(SAVE_AND_DIE)
    prefix = str(tmp_path / "ckpt" / "model")
    process = subprocess.Popen([sys.executable, str(script), spec_path, prefix],
                               stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().strip() == "second save starts"
        # Wait until the second save is writing its files, then kill it.
        deadline = time.monotonic() + 60
        while not [f for f in os.listdir(tmp_path / "ckpt") if "-2" in f]:
            assert time.monotonic() < deadline, "the second save never started writing"
            time.sleep(0.005)
        process.send_signal(signal.SIGKILL)
        assert "second save done" not in process.stdout.read()
    finally:
        process.kill()
        process.wait()
    written = sorted(os.listdir(tmp_path / "ckpt"))
    assert "model-2.index" not in written, written  # the kill did land mid-save
    assert latest_checkpoint(str(tmp_path / "ckpt")) == f"{prefix}-1"
    reader = tf.train.load_checkpoint(f"{prefix}-1")
    assert reader.get_tensor("global_step") == 1
    big = reader.get_tensor("big")
    assert big[0, 0] == 0.0 and big[5, 5] == 1.0  # one SGD step of lr 1 on the corner
