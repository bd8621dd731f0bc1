"""ShardedUpdateAR: each replica updates its own shard, and training equals one device.

Equivalence on one node with 2 and 4 replicas and on a 3-node emulated cluster;
proof that the work really is sharded (each replica's shard and slots, nothing
else); checkpoints in the single-device layout, slots stitched; the fallbacks
and refusals.
"""
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import clusters
import cluster_job
import models
from autodist import AutoDist
from autodist.checkpoint import Saver
from autodist.graph_item import VariableInfo
from autodist.resource_spec import ResourceSpec
from autodist.simulator import CostModel
from autodist.strategy import AllReduce, ShardedUpdateAR, Strategy, StrategyError, common
from autodist.strategy.compiler import compile_strategy
from test_checkpoint import assert_restores_like_single_device, checkpoint_values, single_device
from test_equivalence import OPTIMIZERS, assert_equivalent

tf1 = tf.compat.v1
KIND = "ShardedUpdateSynchronizer"


def kinds(strategy: Strategy) -> dict:
    """Unit name -> its synchronizer kind."""
    units = {}
    for node in strategy.node_config:
        for unit in node.part_config if node.partitioner else [node]:
            units[unit.var_name] = unit.WhichOneof("synchronizer")
    return units


@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "adam"])
@pytest.mark.parametrize("model", ["dense", "partitionable", "two_dtypes"])
@pytest.mark.parametrize("replicas", [2, 4])
def test_sharded_update_equals_single_device(spec_path, spec_path_4cpu, replicas, model,
                                             optimizer):
    spec = spec_path if replicas == 2 else spec_path_4cpu
    strategy = assert_equivalent(spec, ShardedUpdateAR(), model, optimizer)
    assert KIND in kinds(strategy).values()


def test_sparse_and_too_small_variables_fall_back_to_all_reduce_and_the_strategy_says_so():
    spec = ResourceSpec.from_dict({"nodes": [{"address": "localhost", "cpus": [0, 1, 2, 3],
                                              "chief": True}]})
    item = type("Item", (), {"trainable_variables": [
        VariableInfo("table", (100, 8), "float32", has_grad=True, sparse_grad=True),
        VariableInfo("kernel", (8, 5), "float32", has_grad=True),
        VariableInfo("scale", (3,), "float32", has_grad=True),      # fewer elements than replicas
        VariableInfo("frozen", (4,), "float32", has_grad=False)]})()
    strategy = ShardedUpdateAR(chunk_size=1).build(item, spec)
    assert kinds(strategy) == {"table": "AllReduceSynchronizer", "kernel": KIND,
                               "scale": "AllReduceSynchronizer", "frozen": "PSSynchronizer"}


def test_the_compiler_refuses_a_sparse_or_too_small_sharded_variable(spec_path_4cpu):
    spec = ResourceSpec(spec_path_4cpu)
    replicas = [d.name_string() for d in spec.replica_devices]
    for info, message in [
            (VariableInfo("table", (100, 8), "float32", has_grad=True, sparse_grad=True),
             "'table' has a sparse gradient"),
            (VariableInfo("scale", (3,), "float32", has_grad=True),
             "'scale' has 3 elements, fewer than the 4 replicas")]:
        strategy = common.new_strategy(spec)
        strategy.node_config.add(var_name=info.name).ShardedUpdateSynchronizer.group = 0
        item = type("Item", (), {"trainable_variables": [info]})()
        with pytest.raises(StrategyError, match=message):
            compile_strategy(strategy, item, spec)
    assert len(replicas) == 4


def _slot_bytes_per_device(sess) -> dict:
    """Device -> bytes of the optimizer slots placed there."""
    graph = sess.distributed.graph
    per_device = {}
    for variable in graph.get_collection(tf1.GraphKeys.GLOBAL_VARIABLES):
        if variable.op.name.rsplit("/", 1)[-1] in ("Adam", "Adam_1"):
            size = variable.shape.num_elements() * variable.dtype.size
            per_device[variable.device] = per_device.get(variable.device, 0) + size
    return per_device


@pytest.mark.parametrize("replicas", [2, 4])
def test_each_replica_holds_its_shard_and_its_shards_slots_only(spec_path, spec_path_4cpu,
                                                              replicas):
    spec = spec_path if replicas == 2 else spec_path_4cpu
    per_builder = {}
    for builder in (ShardedUpdateAR(), AllReduce()):
        ad = AutoDist(spec, builder)
        with tf.Graph().as_default(), ad.scope():
            built = models.MODELS["dense"](OPTIMIZERS["adam"])
            with ad.create_distributed_session() as sess:
                sess.run(built.train_op, built.feeds)
                per_builder[type(builder).__name__] = _slot_bytes_per_device(sess)
                if isinstance(builder, ShardedUpdateAR):
                    shards = [v for v in sess.distributed.graph.get_collection(
                        tf1.GraphKeys.GLOBAL_VARIABLES) if "/shard_" in v.op.name]
                    sizes = {v.name: v.shape.num_elements() for v in built.variables}
                    devices = {v.device for v in shards}
    dense_bytes = sum(sizes.values()) * 4
    sharded, whole = per_builder["ShardedUpdateAR"], per_builder["AllReduce"]
    # AllReduce: one copy of the slots on the node, 2 x the variables (Adam's m and v).
    assert list(whole.values()) == [2 * dense_bytes]
    # Sharded: a shard of every variable on each replica's own device, with its slots.
    assert len(devices) == replicas and set(sharded) == devices
    for device, slot_bytes in sharded.items():
        shard_elements = sum(math.ceil(n / replicas) for n in sizes.values())
        assert slot_bytes == 2 * 4 * shard_elements
        assert slot_bytes <= 2 * dense_bytes / replicas + 2 * 4 * len(sizes)


@pytest.mark.parametrize("replicas", [2, 4])
def test_a_sharded_checkpoint_has_the_single_device_layout_and_restores_bit_exactly(
        spec_path, spec_path_4cpu, tmp_path, replicas):
    spec = spec_path if replicas == 2 else spec_path_4cpu
    ad = AutoDist(spec, ShardedUpdateAR())
    with tf.Graph().as_default(), ad.scope():
        built = models.MODELS["partitionable"](OPTIMIZERS["adam"])
        saver = Saver()
        with ad.create_distributed_session() as sess:
            for _ in range(3):
                sess.run(built.train_op, built.feeds)
            names = [models.as_tf_variable(v).op.name for v in built.variables]
            trained = dict(zip(names, sess.run(built.variables)))
            slots = sess.run({v.op.name: v for v in tf1.global_variables()
                              if v.op.name.endswith("/Adam")})
            path = saver.save(sess, str(tmp_path / "model"))
    saved = assert_restores_like_single_device(path, trained, 3)
    # Fetching a slot stitches the shards too.
    for name, value in slots.items():
        np.testing.assert_array_equal(value, saved[name], err_msg=name)


def test_a_plain_checkpoint_restores_into_the_shards(spec_path_4cpu, tmp_path):
    from test_checkpoint import autodist_job
    start = str(tmp_path / "plain")
    single_device(2, save_to=start)
    trained, _ = autodist_job(spec_path_4cpu, ShardedUpdateAR(), 2, restore_from=start)
    want = single_device(4)
    for name, value in trained.items():
        np.testing.assert_allclose(value, want[name], rtol=1e-5, atol=1e-5, err_msg=name)


def test_the_cost_model_charges_the_gather_and_a_share_of_the_update_per_node():
    spec = ResourceSpec.from_dict({"nodes": [
        {"address": f"10.0.0.{i}", "cpus": [0], "chief": i == 1, "network_bandwidth": 1.0}
        for i in range(1, 5)]})
    variables = [VariableInfo("w", (1000, 1000), "float32", has_grad=True)]
    item = type("Item", (), {"trainable_variables": variables})()
    model = CostModel()
    sharded = model.breakdown(ShardedUpdateAR().build(item, spec), variables, spec, batch_size=8)
    whole = model.breakdown(AllReduce().build(item, spec), variables, spec, batch_size=8)
    assert sharded.features["ring_all_reduce"] == whole.features["ring_all_reduce"]
    assert sharded.features["all_gather"] == pytest.approx(0.75 * 4e6 * 8 / 1e9)
    assert sharded.features["optimizer_update"] == pytest.approx(whole.features[
        "optimizer_update"] / 4)
    # Two variables' gradients in two buckets, the last layer's first: its reduction
    # overlaps the other half of the backward pass, as it would under AllReduce.
    layers = [VariableInfo(n, (1000, 1000), "float32", ready_rank=r)
              for n, r in (("first", 1), ("last", 0))]
    item = type("Item", (), {"trainable_variables": layers})()
    two = model.breakdown(ShardedUpdateAR(bucket_bytes=4_000_000).build(item, spec), layers, spec,
                          batch_size=8)
    assert two.features["overlap"] == pytest.approx(
        two.features["ring_all_reduce"] / 2 * 0.5)
    assert {r.variable for r in two.rows if r.component == "overlap"} == {"last"}


# ------------------------------------------------------------------------ a cluster

JOB = os.path.join(os.path.dirname(__file__), "cluster_job.py")
STEPS = 3


@pytest.fixture(scope="module")
def three_nodes(tmp_path_factory):
    yield from clusters.emulated(tmp_path_factory, "ads3", [1, 1, 2])


@pytest.mark.multinode
@clusters.needs_root
@pytest.mark.timeout(300)
@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "adam"])
def test_a_three_node_cluster_trains_and_saves_like_one_device(three_nodes, tmp_path, optimizer):
    cluster, spec = three_nodes
    checkpoint = str(tmp_path / "ckpt" / "model")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run([*cluster.hosts[0].launch_prefix, sys.executable, JOB, spec,
                           "ShardedUpdateAR", str(tmp_path / "v.npz"), "--steps", str(STEPS),
                           "--save", checkpoint, "--optimizer", optimizer],
                          capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    for node in range(3):
        assert f"node {node} step {STEPS - 1} loss" in done.stdout
    want = cluster_job.single_device_state(4, STEPS, optimizer)
    saved = checkpoint_values(checkpoint)
    assert sorted(saved) == sorted(want)
    for name, value in want.items():  # the variables, the slots (stitched), Adam's powers
        np.testing.assert_allclose(saved[name], value, rtol=1e-5, atol=1e-5, err_msg=name)
    trained = np.load(tmp_path / "v.npz")
    for i, name in enumerate(["embedding", "w1", "w2"]):
        np.testing.assert_array_equal(saved[name], trained[f"arr_{i}"])
    clusters.assert_no_process_left(JOB)


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
@pytest.mark.parametrize("model_name", ["mlp", "embedding", "cnn"])
def test_keras_fit_matches_single_device(spec_path_4cpu, model_name, optimizer):
    from test_keras import assert_same, fit_autodist, fit_single
    got, _, ad = fit_autodist(spec_path_4cpu, ShardedUpdateAR(), model_name, optimizer)
    assert_same(got, fit_single(model_name, optimizer), f"{model_name} under ShardedUpdateAR")
    assert KIND in kinds(ad.strategy).values()


def test_keras_global_clipnorm_over_sharded_gradients_is_refused(spec_path):
    from test_keras import fit_autodist
    with pytest.raises(NotImplementedError, match="is sharded across replicas"):
        fit_autodist(spec_path, ShardedUpdateAR(), "mlp", "sgd-clipped")


def test_running_a_variables_initializer_resets_its_shards_too(spec_path):
    """Then the next step starts from the initial value, as on one device."""
    def train(ad=None):
        def steps(sess, built):
            for _ in range(2):
                sess.run(built.train_op, built.feeds)
            sess.run(models.as_tf_variable(built.variables[0]).initializer)
            sess.run(built.train_op, built.feeds)
            return sess.run(built.variables[0])

        with tf.Graph().as_default():
            if ad is None:
                built = models.MODELS["dense"](OPTIMIZERS["sgd"])
                with tf1.Session() as sess:
                    sess.run(tf1.global_variables_initializer())
                    return steps(sess, built)
            with ad.scope():
                built = models.MODELS["dense"](OPTIMIZERS["sgd"])
                with ad.create_distributed_session() as sess:
                    return steps(sess, built)

    np.testing.assert_allclose(train(AutoDist(spec_path, ShardedUpdateAR())), train(),
                               rtol=1e-5, atol=1e-5)
