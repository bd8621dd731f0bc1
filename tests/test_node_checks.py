"""What AutoDist(...) refuses about this node and its environment, before anything starts."""
import time

import pytest
import yaml

from autodist import AutoDist
from autodist.cluster import runtime
from autodist.resource_spec import ResourceSpecError
from autodist.strategy import AllReduce

pytestmark = pytest.mark.timeout(60)


def _spec(tmp_path, nodes, ssh=None) -> str:
    path = tmp_path / "spec.yml"
    path.write_text(yaml.safe_dump({"nodes": nodes, **({"ssh": ssh} if ssh else {})}))
    return str(path)


def _refusal(spec: str, exception=ResourceSpecError) -> str:
    start = time.monotonic()
    with pytest.raises(exception) as info:
        AutoDist(spec, AllReduce())
    assert time.monotonic() - start < 10
    return str(info.value)


def test_gpus_this_machine_lacks_are_refused(tmp_path):
    message = _refusal(_spec(tmp_path, [{"address": "localhost", "gpus": [0, 1]}]))
    assert "node 'localhost' lists gpus [0, 1], but this machine has 0 GPU(s)" in message


def test_a_chief_that_is_another_machine_is_refused(tmp_path):
    message = _refusal(_spec(tmp_path, [{"address": "10.123.0.1", "chief": True},
                                        {"address": "10.123.0.2"}]))
    assert "the chief is '10.123.0.1', which is not an address of this machine" in message


def test_two_addresses_of_this_machine_are_refused(tmp_path):
    message = _refusal(_spec(tmp_path, [{"address": "localhost", "chief": True},
                                        {"address": "127.0.0.1"}]))
    assert "nodes ['localhost', '127.0.0.1'] are all this machine" in message


def test_a_missing_ssh_key_is_refused(tmp_path):
    missing = str(tmp_path / "no_such_key")
    message = _refusal(_spec(tmp_path, [{"address": "localhost", "chief": True},
                                        {"address": "10.123.0.9", "ssh_config": "c"}],
                             ssh={"c": {"username": "root", "key_file": missing}}))
    assert f"has key_file {missing!r}, which does not exist on the chief" in message


@pytest.mark.parametrize("value", ["abc", "70000", "0", "-5"])
def test_a_bad_tf_port_is_named(tmp_path, monkeypatch, value):
    monkeypatch.setenv(runtime.TF_PORT_ENV, value)
    message = _refusal(_spec(tmp_path, [{"address": "localhost", "chief": True},
                                        {"address": "10.123.0.9"}]), ValueError)
    assert f"AUTODIST_TF_PORT={value!r} is not a port" in message


@pytest.mark.parametrize("value", ["two", "0", "99999"])
def test_a_bad_thread_count_is_named(spec_path, monkeypatch, value):
    import tensorflow as tf
    monkeypatch.setenv("AUTODIST_INTRA_OP_THREADS", value)
    ad = AutoDist(spec_path, AllReduce())
    with tf.Graph().as_default(), ad.scope():
        x = tf.compat.v1.placeholder(tf.float32, [None, 2])
        w = tf.Variable(tf.ones([2, 1]))
        tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(tf.reduce_mean(tf.matmul(x, w)))
        with pytest.raises(ValueError, match=f"AUTODIST_INTRA_OP_THREADS={value!r} is not a "
                                             "thread count"):
            ad.create_distributed_session()


def test_a_nodes_process_wide_handlers_are_restored_after_its_job():
    import signal
    import sys
    hooks = runtime.ProcessHooks()
    before = sys.excepthook, signal.getsignal(signal.SIGTERM)
    hooks.install(lambda error: None, stop_on_sigterm=True)
    assert sys.excepthook is not before[0]
    assert signal.getsignal(signal.SIGTERM) is runtime._raise_terminated
    hooks.restore()
    hooks.restore()  # a second call, e.g. at exit after an error's shutdown, changes nothing
    assert (sys.excepthook, signal.getsignal(signal.SIGTERM)) == before
