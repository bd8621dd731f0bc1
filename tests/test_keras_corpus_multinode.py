"""Four scripts of the Keras corpus and six of the library corpus on a 2-node emulated
cluster, one replica per node: a KerasHub task training through its own ``fit``, a
KerasRS DCN, a KerasRS DLRM with ``DistributedEmbedding``, and three whose step sums
over the whole global batch (a masked loss's count of real tokens, synchronized batch
normalization, in-batch candidates gathered with ``autodist.gather_batch``).

Each node runs the script on its half of every global batch; the trained
weights of every node and the chief's optimizer variables must equal
single-device training on the whole batches, and the nodes' logged losses,
each over its own rows, must average to the single-device loss. For the last
three, the halves differ (long and short rows, bright and dark images), so
equal weights show the sums went across the nodes: each node alone would
divide, normalize and score with its own half.
"""
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest

import clusters
import keras_corpus as kc
import test_library_corpus
from test_keras_corpus import EXACT, TOLERANCE, _assert_close, single

pytestmark = [pytest.mark.multinode, pytest.mark.slow, clusters.needs_root]

JOB = os.path.join(os.path.dirname(__file__), "keras_corpus_cluster_job.py")


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    yield from clusters.emulated(tmp_path_factory, "adc2", [1, 1])


@pytest.mark.timeout(240)
@pytest.mark.parametrize("script, builder", [
    ("lr_scheduler", "AllReduce"),  # a learning rate set by a callback on every node
    ("custom_train_step_loss_tracker", "PartitionedPS"),  # a Mean fed one loss per step
    ("transformer_position_embedding", "Parallax"),  # a position table, Adam
    ("mixed_precision", "AllReduce"),  # each node's loss scale, in step with the others
    ("gpt2_causal_lm", "AllReduce"),
    ("dcn_feature_cross", "PartitionedPS"),
    ("dlrm_dot_interaction", "Parallax"),
    # Sums over every node's rows: a masked loss's count of real tokens (a PS step,
    # split in two runs for the collective), batch statistics, in-batch candidates.
    ("seq2seq_transformer", "PartitionedPS"),
    ("synchronized_bn_classifier", "AllReduce"),
    ("two_tower_retrieval_gathered", "Parallax"),
])
def test_corpus_script_on_two_nodes_equals_single_device(two_nodes, tmp_path, script, builder):
    cluster, spec = two_nodes
    out = tmp_path / "result"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run([*cluster.hosts[0].launch_prefix, sys.executable, JOB, spec, script,
                           builder, str(out)], capture_output=True, text=True, timeout=200,
                          env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    want = single(script) if script in kc.SCRIPTS else test_library_corpus.single(script)
    tolerance = TOLERANCE.get(script, EXACT)
    nodes = [pickle.loads((tmp_path / f"result.node-{k}.pkl").read_bytes()) for k in range(2)]
    for k, got in enumerate(nodes):
        _assert_close(got["weights"], want.weights, f"{script} under {builder}, node {k}",
                      tolerance)
    # The chief reads the whole optimizer state (a worker, not the servers' slots); under
    # AllReduce every node holds it.
    for k in range(len(nodes) if builder == "AllReduce" else 1):
        _assert_close(nodes[k]["optimizer_variables"], want.optimizer_variables,
                      f"{script} under {builder}: node {k}'s optimizer variables", tolerance)
    for key, values in want.history.items():
        if key.startswith("val_") or key == "learning_rate":  # the same on every node
            for got in nodes:
                _assert_close(got["history"][key], values, f"{script}: History[{key!r}]",
                              tolerance)
        elif key == "loss":  # each node logs its own rows': they average to the batch's
            mean = np.mean([got["history"][key] for got in nodes], axis=0)
            np.testing.assert_allclose(mean, values, atol=tolerance, rtol=tolerance,
                                       err_msg=f"{script}: the nodes' mean loss")
    clusters.assert_no_process_left(JOB)
