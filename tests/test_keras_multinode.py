"""Keras ``model.fit`` on emulated clusters: real processes, namespaces, TF gRPC servers.

Each job runs tests/keras_cluster_job.py as the chief inside the first
namespace; the chief launches the same script on the other nodes, each of
which fits its own rows.
"""
import json
import os
import pathlib
import re
import subprocess
import sys
import time

import numpy as np
import pytest

import clusters
import keras_cluster_job

pytestmark = [pytest.mark.multinode, clusters.needs_root]

JOB = os.path.join(os.path.dirname(__file__), "keras_cluster_job.py")
EPOCHS = 2


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    yield from clusters.emulated(tmp_path_factory, "adk2", [1, 1])


@pytest.fixture(scope="module")
def three_nodes(tmp_path_factory):
    yield from clusters.emulated(tmp_path_factory, "adk3", [1, 1, 2])


def _run_job(cluster, spec, builder, out, *extra, timeout=150):
    chief = cluster.hosts[0].launch_prefix
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    return subprocess.run([*chief, sys.executable, JOB, spec, builder, str(out),
                           "--epochs", str(EPOCHS), *extra],
                          capture_output=True, text=True, timeout=timeout, env=env)


def _assert_no_job_left():
    clusters.assert_no_process_left(JOB)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("builder", ["PS", "AllReduce", "Parallax"])
@pytest.mark.parametrize("cluster_name", ["two_nodes", "three_nodes"])
def test_fit_on_a_cluster_equals_single_device_fit(request, tmp_path, cluster_name, builder):
    cluster, spec = request.getfixturevalue(cluster_name)
    out = tmp_path / "weights.npz"
    done = _run_job(cluster, spec, builder, out)
    assert done.returncode == 0, done.stderr[-3000:]
    num_replicas = sum(h.num_cpus for h in cluster.hosts)
    want, history = keras_cluster_job.reference(num_replicas, EPOCHS)
    got = np.load(out)
    assert len([name for name in got.files if name.startswith("arr_")]) == len(want)
    for i, expected in enumerate(want):
        np.testing.assert_allclose(got[f"arr_{i}"], expected, rtol=1e-5, atol=1e-5)
    # Every node fitted; each logs the loss of its own rows, which average to
    # single-device training's (equal rows per replica, one replica per node here
    # but the last node's two).
    losses = {node: json.loads(pathlib.Path(f"{out}.history-{node}.json").read_text())["loss"]
              for node in range(len(cluster.hosts))}
    weights = [h.num_cpus for h in cluster.hosts]
    mean_first_epoch = np.average([losses[n][0] for n in sorted(losses)], weights=weights)
    np.testing.assert_allclose(mean_first_epoch, history["loss"][0], rtol=1e-5)
    _assert_no_job_left()


@pytest.mark.timeout(240)
def test_no_node_holds_a_whole_copy_of_a_table_kept_in_parts(three_nodes, tmp_path):
    """The embedding and its Adam moments, partitioned over the three nodes, never get an
    eager value on any node during fit: each server computes its part's initial rows.
    Reading the weights afterwards (the chief's get_weights) fetches the trained ones."""
    cluster, spec = three_nodes
    out = tmp_path / "weights.npz"
    table_bytes = 12 * 4 * 4  # the first dense kernel (9 x 6) is deferred too
    done = _run_job(cluster, spec, "PartitionedPS", out, "--defer-bytes", str(table_bytes))
    assert done.returncode == 0, done.stderr[-3000:]
    deferred = ["dense/kernel", "dense_kernel_momentum", "dense_kernel_velocity",
                "embedding/embeddings", "embedding_embeddings_momentum",
                "embedding_embeddings_velocity"]
    for node in range(3):
        assert f"node {node} holds no value of {deferred}" in done.stdout, done.stdout
    want, _ = keras_cluster_job.reference(sum(h.num_cpus for h in cluster.hosts), EPOCHS)
    got = np.load(out)
    for i, expected in enumerate(want):
        np.testing.assert_allclose(got[f"arr_{i}"], expected, rtol=1e-5, atol=1e-5)
    _assert_no_job_left()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("builder, optimizer, mode", [
    ("PartitionedPS", "Adagrad", "by rows"), ("AllReduce", "Ftrl", "by rows after the first step"),
    ("PartitionedPS", "Ftrl", "by rows after the first step")])
def test_a_table_updated_by_rows_on_a_cluster_equals_single_device_fit(
        three_nodes, tmp_path, builder, optimizer, mode):
    """Every node decides alike to update the table by the rows the step touched (the
    ids repeat within and across the nodes' rows); training equals single-device fit."""
    cluster, spec = three_nodes
    out = tmp_path / "weights.npz"
    done = _run_job(cluster, spec, builder, out, "--optimizer", optimizer)
    assert done.returncode == 0, done.stderr[-3000:]
    for node in range(3):
        assert f"node {node} updates {{'embedding/embeddings': '{mode}'}}" in done.stdout, \
            done.stdout
    want, _ = keras_cluster_job.reference_model(sum(h.num_cpus for h in cluster.hosts),
                                                EPOCHS, optimizer=optimizer)
    got = np.load(out)
    for i, expected in enumerate(want.get_weights()):
        np.testing.assert_allclose(got[f"arr_{i}"], expected, rtol=1e-5, atol=1e-5)
    slots = want.optimizer.variables  # the iteration count and a slot or two per variable
    assert len(slots) == len([name for name in got.files if name.startswith("optimizer_")]) > 4
    for i, expected in enumerate(slots):
        np.testing.assert_allclose(got[f"optimizer_{i}"], expected.numpy(), rtol=1e-5, atol=1e-5,
                                   err_msg=expected.path)
    _assert_no_job_left()


@pytest.mark.timeout(240)
def test_a_worker_killed_mid_fit_is_reported_by_name(two_nodes, tmp_path):
    cluster, spec = two_nodes
    done = _run_job(cluster, spec, "AllReduce", tmp_path / "w.npz", "--die-at", "1")
    assert done.returncode != 0
    worker = cluster.hosts[1].address
    assert f"Worker node '{worker}' failed" in done.stderr, done.stderr[-3000:]
    _assert_no_job_left()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("stopping", [0, 1], ids=["chief", "worker"])
def test_a_node_whose_callback_alone_stops_training_is_named_on_every_node(
        two_nodes, tmp_path, stopping):
    """A callback sets ``model.stop_training`` after the second batch on one node only; the
    other goes on into step 3, which needs both. Within seconds, not after the 30 s of
    a lost chief: every node fails with an error naming the node that stopped and the
    step; the one that stopped says it waited for the other, which says it went on."""
    cluster, spec = two_nodes
    done = _run_job(cluster, spec, "AllReduce", tmp_path / "w.npz",
                    "--stop-on", str(stopping), "--stop-at", "1")
    ended = time.time()
    stopped = float(re.search(rf"node {stopping} stops training at ([0-9.]+)",
                              done.stdout).group(1))
    assert ended - stopped < 20, (f"the job ended {ended - stopped:.1f} s after the early stop",
                                  done.returncode, done.stderr[-3000:])
    assert done.returncode != 0
    node, other = cluster.hosts[stopping].address, cluster.hosts[1 - stopping].address
    named = (rf"^\S*StoppedEarlyError: AutoDist: node '{re.escape(node)}' stopped training "
             r"early after 2 training steps \(a callback set model.stop_training there\)")
    # Each node's own error, each at the start of its line: the one that went on ...
    assert re.search(rf"{named}, while node '{re.escape(other)}' went on into step 3",
                     done.stderr, re.MULTILINE), done.stderr[-3000:]
    # ... and the one that stopped, which waited for the other.
    waited = (rf"{named}; it waited for the other nodes to stop there too, but node "
              rf"'{re.escape(other)}' failed")
    assert re.search(waited, done.stderr, re.MULTILINE), done.stderr[-3000:]
    assert "has not answered" not in done.stderr and "StuckStepError" not in done.stderr
    _assert_no_job_left()


@pytest.mark.timeout(240)
def test_nodes_whose_callbacks_all_stop_at_one_batch_end_together(two_nodes, tmp_path):
    """Every node's callback stops training after the second batch: the job ends at once
    and cleanly, trained as single-device fit stopped there."""
    cluster, spec = two_nodes
    out = tmp_path / "w.npz"
    done = _run_job(cluster, spec, "AllReduce", out, "--stop-on", "0,1", "--stop-at", "1")
    ended = time.time()
    assert done.returncode == 0, done.stderr[-3000:]
    stopped = max(float(t) for t in re.findall(r"stops training at ([0-9.]+)", done.stdout))
    assert ended - stopped < 20, f"the job ended {ended - stopped:.1f} s after the stop"
    want, history = keras_cluster_job.reference(sum(h.num_cpus for h in cluster.hosts),
                                                EPOCHS, stop_at=1)
    got = np.load(out)
    for i, expected in enumerate(want):
        np.testing.assert_allclose(got[f"arr_{i}"], expected, rtol=1e-5, atol=1e-5)
    assert len(history["loss"]) == 1
    _assert_no_job_left()


@pytest.mark.timeout(240)
def test_sigterm_during_the_chiefs_checkpoint_lets_it_finish_and_workers_leave_it_to_it(
        two_nodes, tmp_path):
    """Every node runs ``ModelCheckpoint`` on one shared path; the chief gets SIGTERM in
    the middle of its second save. The save finishes, holding epoch 2's weights; then
    the job stops as SIGTERM stops it. The worker wrote nothing there."""
    cluster, spec = two_nodes
    checkpoint = tmp_path / "shared" / "ckpt.weights.h5"
    checkpoint.parent.mkdir()
    done = _run_job(cluster, spec, "AllReduce", tmp_path / "w.npz", "--epochs", "3",
                    "--checkpoint", str(checkpoint), "--stop-in-save", "2")
    assert done.returncode == 128 + 15, done.stderr[-3000:]
    assert (f"SIGTERM arrived during the save of '{checkpoint}'; the save finishes first"
            in done.stderr), done.stderr[-3000:]
    assert "the chief received SIGTERM; stopped the job" in done.stderr
    assert (f"AutoDist worker: model.save_weights('{checkpoint}') writes nothing on this "
            "node" in done.stderr), done.stderr[-3000:]
    assert [p.name for p in checkpoint.parent.iterdir()] == [checkpoint.name]
    num_replicas = sum(h.num_cpus for h in cluster.hosts)
    want, _ = keras_cluster_job.reference(num_replicas, epochs=2)
    saved = keras_cluster_job.build_model()
    saved.load_weights(str(checkpoint))
    for got, expected in zip(saved.get_weights(), want):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    _assert_no_job_left()
