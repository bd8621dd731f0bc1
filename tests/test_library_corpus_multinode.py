"""Three models of the library corpus on a 2-node emulated cluster, one replica per node.

A KerasHub task (GPT2CausalLM, which trains through its own override of
``fit``), a KerasRS DCN and a KerasRS DLRM with ``DistributedEmbedding``: each
node fits on its half of every global batch, and every node's trained weights
must equal single-device training on the whole batches, with the nodes'
logged losses (each over its own rows) averaging to the single-device loss.
"""
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest

import clusters
from test_keras_corpus import EXACT, _assert_close
from test_library_corpus import single

pytestmark = [pytest.mark.multinode, pytest.mark.slow, clusters.needs_root]

JOB = os.path.join(os.path.dirname(__file__), "keras_corpus_cluster_job.py")


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    yield from clusters.emulated(tmp_path_factory, "adl2", [1, 1])


@pytest.mark.timeout(240)
@pytest.mark.parametrize("script, builder", [
    ("gpt2_causal_lm", "AllReduce"),
    ("dcn_feature_cross", "PartitionedPS"),
    ("dlrm_dot_interaction", "Parallax"),
])
def test_library_model_on_two_nodes_equals_single_device(two_nodes, tmp_path, script, builder):
    cluster, spec = two_nodes
    out = tmp_path / "result"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run([*cluster.hosts[0].launch_prefix, sys.executable, JOB, spec, script,
                           builder, str(out)], capture_output=True, text=True, timeout=200,
                          env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    want = single(script)
    nodes = [pickle.loads((tmp_path / f"result.node-{k}.pkl").read_bytes()) for k in range(2)]
    for k, got in enumerate(nodes):
        _assert_close(got["weights"], want.weights, f"{script} under {builder}, node {k}")
    _assert_close(nodes[0]["optimizer_variables"], want.optimizer_variables,
                  f"{script} under {builder}: the chief's optimizer variables")
    mean = np.mean([got["history"]["loss"] for got in nodes], axis=0)
    np.testing.assert_allclose(mean, want.history["loss"], atol=EXACT, rtol=EXACT,
                               err_msg=f"{script}: the nodes' mean loss")
    clusters.assert_no_process_left(JOB)
