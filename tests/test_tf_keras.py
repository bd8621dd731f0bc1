"""tf_keras (Keras 2) under AutoDist: refused by name, never trained on one device silently.

``TF_USE_LEGACY_KERAS=1`` (what TensorFlow Recommenders, TF-Ranking and the Model
Garden set) makes ``tf.keras`` tf_keras, and it is read when TensorFlow is
imported; this process has imported TensorFlow already. So each group of
scenarios runs in a process of its own (``tf_keras_job.py``), one with the
variable set and one with a plain ``import tf_keras``, started together.
"""
import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.timeout(300)

JOB = pathlib.Path(__file__).resolve().parent / "tf_keras_job.py"
OLD_ADVICE = "apply the gradients with a Keras optimizer"


def _require(package: str) -> None:
    # Not importorskip: tensorflow_recommenders refuses to import in this process,
    # whose tf.keras is Keras 3, and tf_keras is kept out of it.
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"{package} is not installed")


@pytest.fixture(scope="module")
def outcomes(request) -> dict:
    """mode ("legacy", "plain") -> a function waiting for that job's scenario outcomes."""
    _require("tf_keras")
    spec = str(pathlib.Path(__file__).resolve().parent.parent / "configs" / "local_2cpu.yml")
    base = {k: v for k, v in os.environ.items() if k != "TF_USE_LEGACY_KERAS"}
    base["CUDA_VISIBLE_DEVICES"] = ""
    envs = {"legacy": {**base, "TF_USE_LEGACY_KERAS": "1"}, "plain": base}
    jobs = {mode: subprocess.Popen([sys.executable, str(JOB), spec, mode], env=env,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for mode, env in envs.items()}
    request.addfinalizer(lambda: [job.kill() for job in jobs.values() if job.poll() is None])
    done = {}

    def wait(mode: str) -> dict:
        if mode not in done:
            out, err = jobs[mode].communicate(timeout=240)
            assert jobs[mode].returncode == 0, err[-3000:]
            for line in out.splitlines():
                if line.startswith("UNAVAILABLE "):
                    pytest.skip(line[len("UNAVAILABLE "):])
            results = [line for line in out.splitlines() if line.startswith("RESULT ")]
            assert results, (out + err)[-3000:]
            done[mode] = json.loads(results[-1][len("RESULT "):])
        return done[mode]
    return wait


def _refused(outcome: dict, *names: str) -> str:
    """Checks that a scenario did not train on one device silently and was refused with
    a NotImplementedError naming ``names``; returns the message."""
    assert not outcome.get("silent"), "tf_keras trained on one device without a word"
    assert outcome["error"] == "NotImplementedError", outcome
    message = outcome["message"]
    for name in names:
        assert name in message, (name, message)
    return message


def test_legacy_keras_model_compiled_in_scope_is_refused_naming_the_ways_out(outcomes):
    """Under TF_USE_LEGACY_KERAS=1 a tf.keras model compiled in ad.scope() is refused
    at compile, naming tf_keras, the setting, the model and both ways out; and the
    tf.compat.v1-graph way out does train tf_keras layers as a single device does."""
    results = outcomes("legacy")
    _refused(results["fit"], "tf_keras", "Keras 2", "TF_USE_LEGACY_KERAS=1", "Sequential",
             "import keras", "tf.compat.v1 graph", "ad.create_distributed_session()")
    graph = results["keras2_graph"]
    assert graph["error"] is None, graph
    assert graph["distributed"]
    np.testing.assert_allclose(graph["losses"], graph["single"], rtol=1e-5)


def test_legacy_keras_optimizer_in_a_traced_step_is_named(outcomes):
    """A custom step through ad.function applying a tf_keras optimizer (a global SGD; a
    legacy Adam a trainer holds) is refused naming the optimizer, not told to use a
    Keras optimizer it already uses."""
    results = outcomes("legacy")
    for scenario, optimizer in (("function", "SGD"), ("function_legacy", "Adam")):
        message = _refused(results[scenario], f"optimizer {optimizer}", "tf_keras",
                           "Keras 3 optimizers", "tf.compat.v1.train optimizers",
                           "TF_USE_LEGACY_KERAS=1")
        assert OLD_ADVICE not in message


def test_recommenders_model_is_refused_by_name(outcomes):
    """A TensorFlow Recommenders two-tower model compiled in ad.scope() is refused by
    its class name; its loss in a tf.compat.v1 graph trains through AutoDist."""
    _require("tensorflow_recommenders")
    results = outcomes("legacy")
    _refused(results["tfrs_fit"], "TwoTower", "tf_keras", "ad.create_distributed_session()")
    graph = results["tfrs_graph"]
    assert graph["error"] is None, graph
    assert graph["distributed"]
    assert np.all(np.isfinite(graph["losses"])) and graph["losses"][-1] < graph["losses"][0]


def test_plain_tf_keras_is_refused_and_never_imported_by_autodist(outcomes):
    """Without the variable, a model of ``import tf_keras`` is refused at compile and its
    optimizer named in a traced step; a Keras 3 model in ad.scope() is distributed
    without AutoDist importing tf_keras."""
    results = outcomes("plain")
    assert results["keras3"] == {"tf_keras_loaded": False, "distributed": True}
    message = _refused(results["fit"], "tf_keras", "Sequential", "import keras")
    assert "TF_USE_LEGACY_KERAS" not in message
    assert OLD_ADVICE not in _refused(results["function"], "optimizer SGD", "tf_keras")
