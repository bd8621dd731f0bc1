"""Numerical equivalence of AutoDist training with single-device training.

Every case trains a model from ``tests/models.py`` for a few steps on one global
batch, once in a plain ``tf.compat.v1.Session`` and once through AutoDist, and
compares every variable and every step's fetched loss.
"""
import functools
import pathlib
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf

import models
from autodist import _tf_compat, partition
from autodist import AutoDist
from autodist.graph_item import GraphItem
from autodist.kernel_context import KernelContext
from autodist.kernels.transformer import transform
from autodist.resource_spec import ResourceSpec
from autodist.strategy.compiler import compile_strategy
from autodist.strategy import (PS, AllReduce, Parallax, PartitionedAR, PartitionedPS,
                               PSLoadBalancing, RandomAxisPartitionAR, ShardedUpdateAR,
                               Strategy, UnevenPartitionedPS)
from autodist.strategy import common

tf1 = tf.compat.v1

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

STEPS = 3
ATOL = RTOL = 1e-5
# float16 on the wire keeps ~3 significant digits; every checked variable moves
# by more than ten times this during the run (asserted), so it still tells a
# working all-reduce from a broken one.
FP16_TOL = 1e-2

OPTIMIZERS = {
    "sgd": lambda: tf1.train.GradientDescentOptimizer(0.1),
    "momentum": lambda: tf1.train.MomentumOptimizer(0.1, momentum=0.9),
    "adam": lambda: tf1.train.AdamOptimizer(0.1),
    "adagrad": lambda: tf1.train.AdagradOptimizer(0.2),
    "ftrl": lambda: tf1.train.FtrlOptimizer(0.2),
}

# Factories, so no two tests share a builder object.
BUILDERS = {
    "PS": PS,
    "PSLoadBalancing": PSLoadBalancing,
    "PartitionedPS": PartitionedPS,
    "UnevenPartitionedPS": UnevenPartitionedPS,
    "AllReduce": AllReduce,
    "PartitionedAR": PartitionedAR,
    "RandomAxisPartitionAR": lambda: RandomAxisPartitionAR(seed=0),
    "Parallax": Parallax,
    "PS-local_proxy": lambda: PS(local_proxy_variable=True),
    "AllReduce-chunk_size_1": lambda: AllReduce(chunk_size=1),
    "Parallax-local_proxy": lambda: Parallax(local_proxy_variable=True),
    # One node's default is SCATTER_GATHER: the collective, named.
    "AllReduce-collective": lambda: AllReduce(all_reduce_spec="AUTO"),
    "PartitionedAR-collective": lambda: PartitionedAR(all_reduce_spec="AUTO"),
}
MODELS = {**models.MODELS, **models.LOOP_VARIANTS}
# With the sharded update too (its own equivalence matrix is test_sharded_update's),
# for the features every kind must support.
WITH_SHARDED_UPDATE = dict(BUILDERS, ShardedUpdateAR=ShardedUpdateAR)


# ----------------------------------------------------------------------------- harness

@functools.lru_cache(maxsize=None)
def train_single(model: str, optimizer: str, steps: int = STEPS):
    """Single-device reference: (losses per step, initial values, final values)."""
    with tf.Graph().as_default():
        built = MODELS[model](OPTIMIZERS[optimizer])
        variables = [models.as_tf_variable(v) for v in built.variables]
        with tf1.Session() as sess:
            sess.run(tf1.global_variables_initializer())
            initial = sess.run(variables)
            losses = [sess.run([built.loss, built.train_op], built.feeds)[0]
                      for _ in range(steps)]
            return losses, initial, sess.run(variables)


def train_autodist(spec: str, builder, model: str, optimizer: str, steps: int = STEPS):
    """AutoDist run: (losses per step, final values, the strategy used, the distributed graph)."""
    ad = AutoDist(resource_spec_file=spec, strategy_builder=builder)
    with tf.Graph().as_default(), ad.scope():
        built = MODELS[model](OPTIMIZERS[optimizer])
        # Fetched as the user holds them: Keras variables for the Keras model.
        with ad.create_distributed_session() as sess:
            losses = [sess.run([built.loss, built.train_op], built.feeds)[0]
                      for _ in range(steps)]
            return losses, sess.run(built.variables), ad.strategy, sess.distributed


def assert_equivalent(spec, builder, model, optimizer, atol=ATOL, rtol=RTOL):
    """Trains both ways and compares; returns the AutoDist strategy."""
    losses, got, strategy, _ = train_autodist(spec, builder, model, optimizer)
    assert_matches_single(model, optimizer, losses, got, atol, rtol)
    return strategy


def assert_matches_single(model, optimizer, losses, got, atol=ATOL, rtol=RTOL):
    """AutoDist's per-step losses and final values equal single-device training's."""
    want_losses, _, want = train_single(model, optimizer)
    np.testing.assert_allclose(losses, want_losses, rtol=rtol, atol=atol,
                               err_msg="per-step loss (mean over replicas)")
    assert len(got) == len(want)
    for index, (g, w) in enumerate(zip(got, want)):
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol,
                                   err_msg=f"variable #{index} of model {model!r}")


def partitioners(strategy: Strategy) -> dict:
    return {node.var_name: node.partitioner for node in strategy.node_config}


def splits_axis(partitioner: str, axis: int) -> bool:
    counts = partitioner.split(",") if partitioner else []
    return axis < len(counts) and int(counts[axis]) > 1


# ----------------------------------------------------------------------------- the matrix

@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
@pytest.mark.parametrize("model", sorted(models.MODELS))
@pytest.mark.parametrize("builder", sorted(BUILDERS))
def test_builder_matches_single_device(spec_path, builder, model, optimizer):
    assert_equivalent(spec_path, BUILDERS[builder](), model, optimizer)


@pytest.mark.parametrize("optimizer", ["momentum", "adagrad"])
@pytest.mark.parametrize("builder", ["PS", "PartitionedPS", "UnevenPartitionedPS", "AllReduce",
                                     "PartitionedAR", "Parallax", "PS-local_proxy"])
def test_optimizers_on_dense_model(spec_path, builder, optimizer):
    assert_equivalent(spec_path, BUILDERS[builder](), "dense", optimizer)


@pytest.mark.parametrize("optimizer", ["momentum", "adagrad"])
@pytest.mark.parametrize("builder", ["PS", "PartitionedPS", "AllReduce", "PartitionedAR",
                                     "Parallax"])
def test_optimizers_with_sparse_gradient(spec_path, builder, optimizer):
    """Slot updates of IndexedSlices gradients with duplicate ids across replicas."""
    assert_equivalent(spec_path, BUILDERS[builder](), "embedding", optimizer)


# ----------------------------------------------------------------------------- partitioning

def test_partitioners_split_axis_zero_evenly_and_unevenly(spec_path):
    strategy = assert_equivalent(spec_path, UnevenPartitionedPS(), "partitionable", "adam")
    cut = partitioners(strategy)
    assert cut["odd"] == "2,1"   # 7 rows -> parts of 4 and 3
    assert cut["table"] == "2,1" and cut["bias"] == "2"


@pytest.mark.parametrize("seed, axis_one_variables", [
    (0, {"odd", "wide", "proj"}),   # dense variables cut along axis 1
    (1, {"table"}),                 # the sparse table cut along axis 1
])
def test_random_axis_partition_along_axis_one(spec_path, seed, axis_one_variables):
    strategy = assert_equivalent(spec_path, RandomAxisPartitionAR(seed=seed),
                                 "partitionable", "adam")
    cut = partitioners(strategy)
    assert {name for name, p in cut.items() if splits_axis(p, 1)} == axis_one_variables


def axis_one_strategy(model: str, replicas) -> Strategy:
    """Hand-made: every matrix cut "1,2", part 0 on the PS and part 1 all-reduced."""
    with tf.Graph().as_default():
        models.MODELS[model](OPTIMIZERS["sgd"])
        variables = [(models.as_tf_variable(v).op.name, v.shape.rank)
                     for v in tf1.trainable_variables()]
    strategy = Strategy()
    strategy.proto.graph_config.replicas.extend(replicas)
    for name, rank in variables:
        if rank == 2:
            parts = [common.ps_node_config(partition.part_name(name, 0), replicas[0]),
                     common.ar_node_config(partition.part_name(name, 1), group=0)]
            strategy.node_config.append(common.partitioned_node_config(name, 1, 2, parts))
        else:
            strategy.node_config.append(common.ar_node_config(name, group=1))
    return strategy


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
@pytest.mark.parametrize("model", ["partitionable", "embedding", "rnn"])
def test_hand_made_axis_one_strategy_mixing_ps_and_all_reduce(spec_path, model, optimizer):
    strategy = axis_one_strategy(model, ["localhost:CPU:0", "localhost:CPU:1"])
    assert "1,2" in partitioners(strategy).values()
    assert_equivalent(spec_path, strategy, model, optimizer)


# ----------------------------------------------------------------------------- four replicas

@pytest.mark.parametrize("builder, model", [
    ("PS", "dense"),
    ("AllReduce", "dense"),
    ("PartitionedAR", "dense"),
    ("Parallax", "keras"),
    ("PartitionedPS", "partitionable"),
    ("UnevenPartitionedPS", "partitionable"),
    ("RandomAxisPartitionAR", "partitionable"),
    ("Parallax", "embedding"),
    ("AllReduce", "embedding"),
    ("AllReduce-collective", "dense"),
    ("AllReduce-collective", "embedding"),
])
def test_four_replicas_match_single_device(spec_path_4cpu, builder, model):
    strategy = assert_equivalent(spec_path_4cpu, BUILDERS[builder](), model, "adam")
    assert len(strategy.replicas) == 4


def _run_isolated(script: str) -> subprocess.CompletedProcess:
    """Runs ``script`` in a fresh interpreter (a crash there cannot end the test run)."""
    tests_dir = pathlib.Path(models.__file__).resolve().parent
    prelude = textwrap.dedent(f"""
        import sys
        sys.path[:0] = [{str(tests_dir.parent)!r}, {str(tests_dir)!r}]
    """)
    return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(script)],
                          capture_output=True, text=True, timeout=110)


def test_four_replicas_partitioned_all_reduce_with_unused_partition(spec_path_4cpu):
    # The embedding's ids touch none of rows 13..37, i.e. parts 1 and 2 of 4.
    result = _run_isolated(f"""
        import numpy as np
        import test_equivalence as t
        from autodist.strategy import PartitionedAR
        t.assert_equivalent({spec_path_4cpu!r}, PartitionedAR(), "embedding", "sgd")
        print("EQUIVALENT")
    """)
    assert result.returncode == 0, f"exit code {result.returncode}: {result.stderr[-2000:]}"
    assert "EQUIVALENT" in result.stdout


# ----------------------------------------------------------------------------- compression

@pytest.mark.parametrize("compressor", ["HorovodCompressor", "HorovodCompressorEF"])
@pytest.mark.parametrize("model, optimizer", [
    ("dense", "sgd"), ("dense", "adam"), ("keras", "sgd"), ("embedding", "adam"),
    ("rnn", "sgd")])
def test_fp16_compressors_stay_close_to_single_device(spec_path, compressor, model, optimizer):
    _, initial, want = train_single(model, optimizer)
    moved = max(np.abs(w - i).max() for w, i in zip(want, initial))
    assert moved > 10 * FP16_TOL, "the check would be vacuous: variables barely move"
    _, got, strategy, _ = train_autodist(spec_path, AllReduce(compressor=compressor), model,
                                      optimizer)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=FP16_TOL, atol=FP16_TOL)
    # float16 rounding must be visible, or the compressor was not applied.
    assert max(np.abs(g - w).max() for g, w in zip(got, want)) > 0
    assert all(n.AllReduceSynchronizer.compressor != 0 for n in strategy.node_config)


def test_a_sparse_part_does_not_lend_its_compressor_to_the_dense_ones(spec_path):
    """The embedding (sparse, gathered as is) leads a group whose dense part is uncompressed."""
    strategy = Strategy()
    strategy.proto.graph_config.replicas.extend(["localhost:CPU:0", "localhost:CPU:1"])
    strategy.node_config.extend([
        common.ar_node_config("embedding", group=0, compressor="HorovodCompressor"),
        common.ar_node_config("w", group=0)])
    assert_equivalent(spec_path, strategy, "embedding", "adam")


# ----------------------------------------------------------------------------- loops

def _loops(distributed) -> dict:
    """Each replica's functional loop in the distributed graph -> whether it runs on one thread."""
    return {op.name: op.node_def.attr["body"].func.attr["_executor"].s
            == b"SINGLE_THREADED_EXECUTOR" == op.node_def.attr["cond"].func.attr["_executor"].s
            for op in distributed.graph.get_operations() if op.type in ("While", "StatelessWhile")}


def _loop_products(distributed) -> dict:
    """Each replica's functional loop -> the op types of its body's matrix products."""
    library = {f.signature.name: f for f in distributed.graph.as_graph_def().library.function}
    return {op.name: sorted(node.op for node in library[op.node_def.attr["body"].func.name].node_def
                            if node.op.endswith("MatMul"))
            for op in distributed.graph.get_operations() if op.type in ("While", "StatelessWhile")}


@pytest.mark.parametrize("model, single_threaded", [
    ("rnn", {"AutoDist-Replica-0": True, "AutoDist-Replica-1": True}),
    # The single-threaded executor cannot run the body's cond once lowered.
    ("rnn_with_cond", {"AutoDist-Replica-0": False, "AutoDist-Replica-1": False}),
])
def test_a_replica_runs_its_loops_on_one_thread_where_it_can(spec_path, model, single_threaded):
    losses, got, _, distributed = train_autodist(spec_path, AllReduce(), model, "adam")
    assert_matches_single(model, "adam", losses, got)
    loops = _loops(distributed)
    # Per replica: the forward loop and its gradient's.
    assert sorted(name.split("/")[0] for name in loops) == sorted(list(single_threaded) * 2)
    for name, runs_alone in loops.items():
        assert runs_alone == single_threaded[name.split("/")[0]], name
    if _tf_compat.onednn_matmuls():
        # TensorFlow's oneDNN pass does not reach a loop's functions: AutoDist swaps
        # oneDNN's product in (the forward cell's two, and their four gradients).
        assert sorted(map(len, _loop_products(distributed).values())) == [2, 2, 4, 4]
        for name, products in _loop_products(distributed).items():
            assert set(products) == {"_MklMatMul"}, name


def _transformed_rnn(nodes: list):
    """The rnn model's graph, built (not run) for the replicas of ``nodes`` (a spec's)."""
    calls = []
    with tf.Graph().as_default() as graph, _tf_compat.capture_apply_gradients(calls.append):
        models.rnn(OPTIMIZERS["sgd"])
    item = GraphItem(graph, calls)
    spec = ResourceSpec.from_dict({"nodes": nodes})
    compiled = compile_strategy(AllReduce().build(item, spec), item, spec)
    replicas = tuple(compiled.strategy.replicas)
    devices = {name: "/device:" + name.split(":", 1)[1]
               for name in replicas + ("localhost:CPU:0",)}
    ctx = KernelContext(replica_devices=replicas, tf_devices=devices,
                        shared_device="/device:CPU:0")
    return replicas, transform(item, compiled, ctx)


def test_the_loops_of_gpu_replicas_keep_the_default_executor_and_products():
    # The single-threaded executor supports no device context but the CPU's, and
    # oneDNN's product is a CPU kernel. The graph is only built: this machine has no
    # GPU to run it.
    replicas, distributed = _transformed_rnn(
        [{"address": "localhost", "cpus": [0], "gpus": [0, 1]}])
    assert replicas == ("localhost:GPU:0", "localhost:GPU:1")
    loops = _loops(distributed)
    assert len(loops) == 4 and not any(loops.values())
    assert all(set(products) == {"MatMul"} for products in _loop_products(distributed).values())


def test_cpu_replicas_keep_tensorflows_products_without_onednn(monkeypatch):
    # TF_ENABLE_ONEDNN_OPTS=0, or a build without oneDNN: TensorFlow's own kernel.
    monkeypatch.setattr(_tf_compat, "onednn_matmuls", lambda: False)
    _, distributed = _transformed_rnn([{"address": "localhost", "cpus": [0, 1]}])
    products = _loop_products(distributed)
    assert len(products) == 4
    assert all(set(p) == {"MatMul"} for p in products.values())
    assert all(_loops(distributed).values())  # still on one thread each


# ----------------------------------------------------------------------------- fetches, staleness

@pytest.mark.parametrize("builder", ["PS", "AllReduce", "PartitionedAR"])
@pytest.mark.parametrize("model", ["dense", "embedding"])
def test_fetched_loss_is_mean_over_replicas_equal_to_global_loss(spec_path, builder, model):
    with tf.Graph().as_default():
        built = models.MODELS[model](OPTIMIZERS["sgd"])
        with tf1.Session() as sess:
            sess.run(tf1.global_variables_initializer())
            want = sess.run(built.loss, built.feeds)
            halves = [sess.run(built.loss, {k: v[i * 4:(i + 1) * 4]
                                            for k, v in built.feeds.items()})
                      for i in range(2)]
    # The halves differ, so only their mean can match the global loss.
    assert abs(halves[0] - halves[1]) > 1e-2
    np.testing.assert_allclose(np.mean(halves), want, rtol=1e-6)

    ad = AutoDist(spec_path, BUILDERS[builder]())
    with tf.Graph().as_default(), ad.scope():
        built = models.MODELS[model](OPTIMIZERS["sgd"])
        with ad.create_distributed_session() as sess:
            got = sess.run(built.loss, built.feeds)
    assert np.ndim(got) == 0
    np.testing.assert_allclose(got, want, rtol=1e-6)


@pytest.mark.parametrize("builder, model", [
    (lambda: PS(sync=False, staleness=2), "dense"),
    (lambda: PartitionedPS(sync=False, staleness=2), "embedding"),
    (lambda: PS(local_proxy_variable=True, sync=False, staleness=2), "rnn"),
], ids=["PS-dense", "PartitionedPS-embedding", "PS-proxy-rnn"])
def test_bounded_staleness_trains(spec_path, builder, model):
    ad = AutoDist(spec_path, builder())
    with tf.Graph().as_default(), ad.scope():
        built = models.MODELS[model](OPTIMIZERS["sgd"])
        first = built.variables[0]
        with ad.create_distributed_session() as sess:
            losses, values = [], [sess.run(first)]
            for _ in range(30):
                losses.append(sess.run([built.loss, built.train_op], built.feeds)[0])
                values.append(sess.run(first))
            final = sess.run(built.loss, built.feeds)
    assert final < 0.6 * losses[0], f"loss {losses[0]:.4f} -> {final:.4f}"
    assert np.all(np.diff(losses[::3]) < 0), losses
    # The shared copy is updated every step, whatever the staleness of the reads.
    assert all(np.abs(b - a).max() > 0 for a, b in zip(values, values[1:]))
    # Reads are at most 2 updates old: no loss repeats more than 3 steps in a row.
    run = longest = 1
    for previous, current in zip(losses, losses[1:]):
        run = run + 1 if current == previous else 1
        longest = max(longest, run)
    assert longest <= 3, losses


# ----------------------------------------------------------------------------- fetching state

@pytest.mark.parametrize("builder", sorted(BUILDERS))
def test_every_global_variable_fetches_its_single_device_value(spec_path, builder):
    """Slots and Adam's powers come back stitched and synchronized, as on one device."""
    model = "partitionable"
    with tf.Graph().as_default():
        built = models.MODELS[model](OPTIMIZERS["adam"])
        with tf1.Session() as sess:
            sess.run(tf1.global_variables_initializer())
            for _ in range(STEPS):
                sess.run(built.train_op, built.feeds)
            want = {v.op.name: sess.run(v) for v in tf1.global_variables()}
    ad = AutoDist(resource_spec_file=spec_path, strategy_builder=BUILDERS[builder]())
    with tf.Graph().as_default(), ad.scope():
        built = models.MODELS[model](OPTIMIZERS["adam"])
        with ad.create_distributed_session() as sess:
            for _ in range(STEPS):
                sess.run(built.train_op, built.feeds)
            variables = tf1.global_variables()
            got = dict(zip((v.op.name for v in variables), sess.run(variables)))
    assert sorted(got) == sorted(want)
    assert any("Adam" in name for name in got) and "beta1_power" in got
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=RTOL, atol=ATOL, err_msg=name)
