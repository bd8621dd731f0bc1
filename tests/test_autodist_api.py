"""The user-facing contract of the AutoDist front class and its session."""
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import models
from autodist import AutoDist
from autodist.resource_spec import DeviceSpec, ResourceSpecError
from autodist.strategy import (PS, AllReduce, PartitionedPS, RandomAxisPartitionAR, Strategy,
                               StrategyError)

tf1 = tf.compat.v1

pytestmark = pytest.mark.timeout(120)

SGD = lambda: tf1.train.GradientDescentOptimizer(0.1)  # noqa: E731


def _train(ad: AutoDist, model=models.partitionable, steps: int = 3):
    """Trains ``model`` under ``ad``; returns (losses, final variable values)."""
    with tf.Graph().as_default(), ad.scope():
        built = model(SGD)
        with ad.create_distributed_session() as sess:
            losses = [sess.run([built.loss, built.train_op], built.feeds)[0]
                      for _ in range(steps)]
            return losses, sess.run(built.variables)


# ----------------------------------------------------------------------------- strategies

def test_saved_strategy_reloads_and_trains_identically(spec_path, tmp_path):
    first = AutoDist(spec_path, RandomAxisPartitionAR(seed=1))
    losses, values = _train(first)
    path = first.strategy.save(tmp_path / "s.strategy")

    loaded = Strategy.load(path)
    assert loaded.proto == first.strategy.proto
    second = AutoDist(spec_path, strategy_builder=loaded)
    losses_again, values_again = _train(second)

    assert second.strategy.id == first.strategy.id
    np.testing.assert_array_equal(losses_again, losses)
    for again, value in zip(values_again, values):
        np.testing.assert_array_equal(again, value)


def _model_with_variables(names):
    tf1.set_random_seed(0)
    x = tf1.placeholder(tf.float32, [None, 3], name="x")
    out = x
    for name in names:
        w = tf1.get_variable(name, [3, 3], use_resource=True,
                             initializer=tf1.random_normal_initializer(seed=1))
        out = tf.matmul(out, w)
    loss = tf.reduce_mean(tf.square(out))
    return x, SGD().minimize(loss)


@pytest.mark.parametrize("names, missing, extra", [
    (["w1", "w2_renamed"], "w2_renamed", "w2"),
    (["w1", "w2", "w3"], "w3", None),
], ids=["renamed", "extra"])
def test_reused_strategy_on_other_graph_names_the_variables(spec_path, names, missing, extra):
    first = AutoDist(spec_path, PS())
    with tf.Graph().as_default(), first.scope():
        _model_with_variables(["w1", "w2"])
        first.create_distributed_session().close()

    reuse = AutoDist(spec_path, first.strategy)
    with tf.Graph().as_default(), reuse.scope():
        _model_with_variables(names)
        with pytest.raises(StrategyError) as caught:
            reuse.create_distributed_session()
    message = str(caught.value)
    assert repr(missing) in message
    if extra:
        assert repr(extra) in message
    assert repr("w1") not in message  # only the variables that do not fit are named


# ----------------------------------------------------------------------------- construction

def test_missing_spec_file_raises_resource_spec_error(tmp_path):
    missing = tmp_path / "nowhere.yml"
    with pytest.raises(ResourceSpecError, match="nowhere.yml"):
        AutoDist(str(missing), PS())


@pytest.mark.parametrize("wrong", [PS, "PS", {"builder": "PS"}],
                         ids=["builder-class", "name", "dict"])
def test_wrong_strategy_builder_type_raises_type_error(spec_path, wrong):
    with pytest.raises(TypeError, match="strategy_builder"):
        AutoDist(spec_path, wrong)


def test_without_a_builder_every_variable_is_all_reduced(spec_path):
    ad = AutoDist(spec_path)
    with tf.Graph().as_default(), ad.scope():
        built = models.dense_mlp(SGD)
        sess = ad.create_distributed_session()
        sess.run(built.train_op, built.feeds)
    kinds = {node.WhichOneof("synchronizer") for node in ad.strategy.proto.node_config}
    assert kinds == {"AllReduceSynchronizer"}


def test_runs_of_arrays_share_one_callable_and_other_feeds_go_through_session_run(spec_path):
    """A run fed arrays of its placeholders' dtypes goes through a C++ callable made
    once per list of fetches and feeds; a list, another dtype or a wrong shape goes
    through ``Session.run``, which converts it or names the mismatch."""
    ad = AutoDist(spec_path, AllReduce())
    with tf.Graph().as_default(), ad.scope():
        built = models.dense_mlp(SGD)
        sess = ad.create_distributed_session()
        (x, xs), (y, ys) = built.feeds.items()
        fed = sess.run([built.loss], {x: xs, y: ys})
        made = dict(sess._callables)  # pylint: disable=protected-access
        assert len(made) == 1
        assert sess.run([built.loss], {x: xs, y: ys}) == fed
        assert sess._callables == made  # pylint: disable=protected-access
        as_lists = sess.run([built.loss], {x: xs.tolist(), y: ys.astype(np.float64)})
        np.testing.assert_allclose(as_lists, fed, rtol=1e-6)
        assert sess._callables == made  # pylint: disable=protected-access
        with pytest.raises(ValueError, match=r"Cannot feed value of shape \(8, 5\)"):
            sess.run([built.loss], {x: np.zeros((8, 5), np.float32), y: ys})
        trained = sess.run([built.loss, built.train_op], {x: xs, y: ys})
        assert trained[0] == fed[0] and trained[1] is None
        assert len(sess._callables) == 2  # pylint: disable=protected-access
        assert sess.run([built.loss], {x: xs, y: ys})[0] < fed[0]


def test_strategy_is_none_until_the_session_exists(spec_path):
    ad = AutoDist(spec_path, PartitionedPS())
    assert ad.strategy is None
    with tf.Graph().as_default(), ad.scope():
        built = models.dense_mlp(SGD)
        assert ad.strategy is None
        with ad.create_distributed_session():
            strategy = ad.strategy
    assert isinstance(strategy, Strategy)
    assert strategy.replicas == ["localhost:CPU:0", "localhost:CPU:1"]
    assert [n.var_name for n in strategy.node_config] == [v.op.name for v in built.variables]


def test_graph_without_optimizer_is_refused(spec_path):
    ad = AutoDist(spec_path, PS())
    with tf.Graph().as_default(), ad.scope():
        tf1.get_variable("w", [2], use_resource=True)
        with pytest.raises(ValueError, match="optimizer"):
            ad.create_distributed_session()


def test_one_autodist_builds_two_graphs_in_turn(spec_path):
    ad = AutoDist(spec_path, PS())
    first_losses, _ = _train(ad, models.dense_mlp)
    second_losses, _ = _train(ad, models.dense_mlp)
    np.testing.assert_array_equal(second_losses, first_losses)


# ----------------------------------------------------------------------------- session.run

@pytest.mark.parametrize("builder", [PS, AllReduce])
def test_full_trace_shows_both_replicas_running(spec_path, builder):
    ad = AutoDist(spec_path, builder())
    with tf.Graph().as_default(), ad.scope():
        built = models.dense_mlp(SGD)
        with ad.create_distributed_session() as sess:
            metadata = tf1.RunMetadata()
            sess.run(built.train_op, built.feeds,
                     options=tf1.RunOptions(trace_level=tf1.RunOptions.FULL_TRACE),
                     run_metadata=metadata)
    nodes_by_device = {stats.device: {n.node_name for n in stats.node_stats}
                       for stats in metadata.step_stats.dev_stats}
    for replica in (0, 1):
        devices = [d for d in nodes_by_device if d.endswith(f"CPU:{replica}")]
        assert devices, f"no ops ran on CPU:{replica}: {sorted(nodes_by_device)}"
        ran = set().union(*(nodes_by_device[d] for d in devices))
        # The replica's copy of the model (its forward matmul) ran on its device.
        assert any(n.startswith(f"AutoDist-Replica-{replica}/") and "MatMul" in n
                   for n in ran), sorted(ran)


def _linear_predictions():
    tf1.set_random_seed(0)
    x = tf1.placeholder(tf.float32, [None, 6], name="x")
    w = tf1.get_variable("w", [6, 3], use_resource=True,
                         initializer=tf1.random_normal_initializer(seed=1))
    predictions = tf.matmul(x, w)
    SGD().minimize(tf.reduce_mean(tf.square(predictions)))
    return x, predictions


@pytest.mark.parametrize("builder", [PS, AllReduce])
def test_batch_major_fetch_is_concatenated_in_batch_order(spec_path, builder):
    features, _ = _data()
    batch = features[:8]
    with tf.Graph().as_default():
        x, predictions = _linear_predictions()
        with tf1.Session() as sess:
            sess.run(tf1.global_variables_initializer())
            want = sess.run(predictions, {x: batch})
    ad = AutoDist(spec_path, builder())
    with tf.Graph().as_default(), ad.scope():
        x, predictions = _linear_predictions()
        with ad.create_distributed_session() as sess:
            got = sess.run(predictions, {x: batch})
    assert got.shape == (8, 3)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


DATA_ROWS = 16


def _data():
    rng = np.random.RandomState(5)
    return (rng.randn(DATA_ROWS, 6).astype(np.float32),
            rng.randn(DATA_ROWS, 3).astype(np.float32))


def _dataset_model(iterator_kind: str):
    """A linear model fed by ``from_tensor_slices(...).batch(4).repeat()``."""
    tf1.set_random_seed(0)
    features, labels = _data()
    dataset = tf.data.Dataset.from_tensor_slices((features, labels)).batch(4).repeat()
    if iterator_kind == "one_shot":
        iterator = tf1.data.make_one_shot_iterator(dataset)
    else:
        iterator = tf1.data.make_initializable_iterator(dataset)
    x, y = iterator.get_next()
    w = tf1.get_variable("w", [6, 3], use_resource=True,
                         initializer=tf1.random_normal_initializer(seed=1))
    loss = tf.reduce_mean(tf.square(tf.matmul(x, w) - y))
    train_op = SGD().minimize(loss, global_step=tf1.train.get_or_create_global_step())
    return iterator, x, loss, train_op, w


def _single_device_on_consecutive_batches(steps: int, batch: int):
    features, labels = _data()
    with tf.Graph().as_default():
        tf1.set_random_seed(0)
        x = tf1.placeholder(tf.float32, [None, 6])
        y = tf1.placeholder(tf.float32, [None, 3])
        w = tf1.get_variable("w", [6, 3], use_resource=True,
                             initializer=tf1.random_normal_initializer(seed=1))
        loss = tf.reduce_mean(tf.square(tf.matmul(x, w) - y))
        train_op = SGD().minimize(loss)
        with tf1.Session() as sess:
            sess.run(tf1.global_variables_initializer())
            losses = []
            for step in range(steps):
                rows = np.arange(step * batch, (step + 1) * batch) % DATA_ROWS
                losses.append(sess.run([loss, train_op], {x: features[rows],
                                                          y: labels[rows]})[0])
            return losses, sess.run(w)


@pytest.mark.parametrize("iterator_kind", ["one_shot", "initializable"])
@pytest.mark.parametrize("builder", [PS, AllReduce])
def test_tf_data_iterator_feeds_each_replica_its_own_batch(spec_path, builder, iterator_kind):
    steps = 4
    features, _ = _data()
    ad = AutoDist(spec_path, builder())
    with tf.Graph().as_default(), ad.scope():
        iterator, x, loss, train_op, w = _dataset_model(iterator_kind)
        with ad.create_distributed_session() as sess:
            if iterator_kind == "initializable":
                sess.run(iterator.initializer)
            losses, seen = [], []
            for _ in range(steps):
                step_loss, _, rows = sess.run([loss, train_op, x])
                losses.append(step_loss)
                seen.append(rows)
            final = sess.run(w)

    # Two replicas pull two batches of 4 per step: 8 distinct consecutive rows,
    # in either replica order.
    for step, rows in enumerate(seen):
        expected = features[np.arange(step * 8, step * 8 + 8) % DATA_ROWS]
        assert rows.shape == (8, 6)
        np.testing.assert_array_equal(np.sort(rows, axis=0), np.sort(expected, axis=0))
    want_losses, want = _single_device_on_consecutive_batches(steps, batch=8)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(final, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("builder", [PS, AllReduce])
def test_fetching_the_global_step_counts_the_steps(spec_path, builder):
    ad = AutoDist(spec_path, builder())
    with tf.Graph().as_default(), ad.scope():
        built = models.dense_mlp(SGD)
        global_step = tf1.train.get_global_step()
        with ad.create_distributed_session() as sess:
            for _ in range(3):
                sess.run(built.train_op, built.feeds)
            value = sess.run(global_step)
    assert np.asarray(value).dtype == np.int64
    assert value == 3


# ----------------------------------------------------------------------------- large constants

def test_a_variable_built_from_a_large_array_is_named_with_the_way_out(spec_path):
    """``tf.Variable(numpy_array)`` keeps 64 MB inside the graph: AutoDist says so once,
    naming the constant, and still trains."""
    ad = AutoDist(spec_path)
    with tf.Graph().as_default(), ad.scope():
        x = tf1.placeholder(tf.float32, [None, 4096])
        w = tf1.Variable(np.full((4096, 4096), 1e-3, np.float32), name="big")
        train_op = SGD().minimize(tf.reduce_mean(tf.matmul(x, w)))
        with pytest.warns(UserWarning, match=r"the graph holds 64 MB of constants "
                                             r"\('big/Initializer/initial_value' 64\.0 MB\).*"
                                             r"Create it with an initializer"):
            sess = ad.create_distributed_session()
        with sess:
            sess.run(train_op, {x: np.ones((2, 4096), np.float32)})


def test_a_graph_over_protobufs_limit_is_refused_by_name():
    from autodist.graph_item import _graph_def
    with tf.Graph().as_default() as graph:
        for name in ("a", "b"):  # two 1.1 GB constants: each may be built, not both read
            tf1.Variable(np.zeros((1100, 2 ** 18), np.float32), name=name)
        with pytest.raises(ValueError, match=r"cannot read the graph: it is larger than "
                                             r"protobuf's 2 GB limit, its constants holding "
                                             r"2\.15 GB \('a/Initializer/initial_value' 1100\.0 MB, "
                                             r"'b/Initializer/initial_value' 1100\.0 MB\)"):
            _graph_def(graph)


# ----------------------------------------------------------------------------- thread pools

_THREADS_OF_A_SESSION = """
import os, sys
import tensorflow as tf
from autodist import AutoDist
tf.constant(1.0) + 1  # the eager context makes its devices first, as in a user's script
ad = AutoDist(sys.argv[1])
with tf.Graph().as_default(), ad.scope():
    v = tf.compat.v1.get_variable("v", [4], initializer=tf.compat.v1.ones_initializer())
    train = tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(tf.reduce_sum(v * v))
    before = len(os.listdir("/proc/self/task"))
    with ad.create_distributed_session() as sess:
        sess.run(train)
        print("THREADS", len(os.listdir("/proc/self/task")) - before)
"""


def _threads_a_session_adds(spec: str, **env) -> int:
    environment = {k: v for k, v in os.environ.items() if k != "AUTODIST_INTRA_OP_THREADS"}
    done = subprocess.run([sys.executable, "-c", _THREADS_OF_A_SESSION, spec],
                          capture_output=True, text=True, timeout=120,
                          env={**environment, **env})
    assert done.returncode == 0, done.stderr[-2000:]
    return int(done.stdout.split("THREADS")[-1])


def test_cpu_replicas_split_the_cores_each_in_a_pool_of_its_own(spec_path):
    """Two CPU replicas each get an intra-op pool of half the cores. TensorFlow's default,
    one pool that the eager context makes and every device shares, is what
    ``TF_OVERRIDE_GLOBAL_THREADPOOL=0`` keeps: the session then adds no such threads."""
    per_replica = max(1, len(os.sched_getaffinity(0)) // 2)
    own = _threads_a_session_adds(spec_path)
    shared = _threads_a_session_adds(spec_path, TF_OVERRIDE_GLOBAL_THREADPOOL="0")
    assert own - shared >= 2 * per_replica


def test_the_intra_op_threads_split_a_nodes_cores_between_its_cpu_replicas():
    from autodist.autodist import _intra_op_threads
    cores = len(os.sched_getaffinity(0))
    cpus = [DeviceSpec("localhost", "CPU", i) for i in range(4)]
    assert _intra_op_threads(cpus[:2]) == max(1, cores // 2)
    assert _intra_op_threads(cpus) == max(1, cores // 4)
    assert _intra_op_threads(cpus[:1]) is None  # one replica: every core, as TensorFlow's
    assert _intra_op_threads([DeviceSpec("localhost", "GPU", 0),
                              DeviceSpec("localhost", "GPU", 1)]) is None
