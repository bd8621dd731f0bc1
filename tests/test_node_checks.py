"""What AutoDist(...) refuses about this node and its environment, before anything starts."""
import socket
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


@pytest.mark.parametrize("value", ["two", "0", "99999", "\u00b2",
                                   pytest.param("9" * 5000, id="long")])
@pytest.mark.parametrize("name", ["AUTODIST_INTRA_OP_THREADS", "AUTODIST_INTER_OP_THREADS"])
def test_a_bad_thread_count_is_named(spec_path, monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    message = _refusal(spec_path, ValueError)
    assert f"{name}={value[:40]!r} is not a thread count" in message
    assert len(message) < 300


# The environment a chief gives the worker it launches on node 10.123.0.9.
WORKER_ENV = {"AUTODIST_WORKER": "10.123.0.9", "AUTODIST_CHIEF": "localhost",
              "AUTODIST_SERVICE_PORT": "4321"}


def _two_nodes(tmp_path) -> str:
    return _spec(tmp_path, [{"address": "localhost", "chief": True}, {"address": "10.123.0.9"}])


def _set_env(monkeypatch, env: dict) -> None:
    for name, value in env.items():
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)


def test_a_worker_started_by_its_chief_knows_where_the_chief_serves(tmp_path, monkeypatch):
    _set_env(monkeypatch, WORKER_ENV)
    spec = _two_nodes(tmp_path)
    ad = AutoDist(spec, AllReduce())
    assert (ad.is_chief, ad.node_index) == (False, 1)
    assert runtime.current_role(ad.resource_spec).service == ("localhost", 4321)


@pytest.mark.parametrize("changed, named", [
    ({"AUTODIST_WORKER": "10.9.9.9"}, "AUTODIST_WORKER='10.9.9.9' is not a node of the resource"),
    ({"AUTODIST_WORKER": "h" * 5000}, f"AUTODIST_WORKER='{'h' * 100}' is not a node"),
    ({"AUTODIST_CHIEF": None}, "AUTODIST_CHIEF is not set"),
    ({"AUTODIST_CHIEF": "10.9.9.9"}, "AUTODIST_CHIEF='10.9.9.9' is not the chief of the resource"),
    ({"AUTODIST_CHIEF": "c" * 5000}, f"AUTODIST_CHIEF='{'c' * 100}' is not the chief"),
    ({"AUTODIST_SERVICE_PORT": None}, "AUTODIST_SERVICE_PORT is not set"),
    ({"AUTODIST_SERVICE_PORT": "abc"}, "AUTODIST_SERVICE_PORT='abc' is not a port"),
    ({"AUTODIST_SERVICE_PORT": "70000"}, "AUTODIST_SERVICE_PORT='70000' is not a port"),
    ({"AUTODIST_SERVICE_PORT": "9" * 5000}, f"AUTODIST_SERVICE_PORT='{'9' * 40}' is not a port"),
])
def test_a_bad_worker_environment_is_named(tmp_path, monkeypatch, changed, named):
    _set_env(monkeypatch, {**WORKER_ENV, **changed})
    message = _refusal(_two_nodes(tmp_path), ValueError)
    assert named in message, message
    assert len(message) < 1000


def test_a_bad_secrets_flag_is_named(monkeypatch):
    from autodist.cluster import launcher
    monkeypatch.setenv(launcher.SECRETS_ON_STDIN_ENV, "yes")
    with pytest.raises(launcher.LaunchError, match="AUTODIST_SECRETS_ON_STDIN='yes' is not 1"):
        launcher.read_secrets(timeout=0.1)


@pytest.mark.parametrize("value", ["yes", "true", "2"])
def test_a_bad_tf_logs_switch_is_named(monkeypatch, value):
    from autodist import _startup
    monkeypatch.setenv(_startup.LOGS_ENV, value)
    with pytest.raises(ValueError, match=f"AUTODIST_TF_LOGS={value!r} is neither 0 nor 1"):
        _startup.install()


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


def test_a_second_job_in_the_process_that_runs_a_server_is_named(monkeypatch):
    """A TensorFlow server lives as long as its process: the message says so, and not
    that another program holds the port."""
    import tensorflow as tf
    from autodist.resource_spec import ResourceSpec
    with socket.socket() as probe:
        probe.bind(("localhost", 0))
        port = probe.getsockname()[1]
    server = tf.distribute.Server(tf.train.ClusterSpec({"probe": [f"localhost:{port}"]}),
                                  job_name="probe", task_index=0, start=True)
    monkeypatch.setenv(runtime.TF_PORT_ENV, str(port))
    spec = ResourceSpec.from_dict({"nodes": [{"address": "localhost", "chief": True},
                                             {"address": "10.123.0.9"}]})
    with pytest.raises(RuntimeError, match=rf"this process already runs one on port {port}.*"
                                           r"start the next job in a new process"):
        runtime.start_tf_server(spec, runtime.NodeRole(address="localhost", is_chief=True, task_index=0),
                                tf.compat.v1.ConfigProto())
    del server


LISTENS = """
import socket, sys, time
listener = socket.socket()
listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
listener.bind(("", 0))
listener.listen()
print(listener.getsockname()[1], flush=True)
time.sleep(60)
"""


def test_a_port_taken_by_another_job_names_its_process(monkeypatch, tmp_path):
    """A second job on a node already in use is refused naming the process that holds it."""
    import subprocess
    import sys
    import tensorflow as tf
    from autodist.resource_spec import ResourceSpec
    script = tmp_path / "first_job.py"
    script.write_text(LISTENS)
    holder = subprocess.Popen([sys.executable, str(script), "--job", "first"],
                              stdout=subprocess.PIPE, text=True)
    try:
        port = int(holder.stdout.readline())
        monkeypatch.setenv(runtime.TF_PORT_ENV, str(port))
        spec = ResourceSpec.from_dict({"nodes": [{"address": "localhost", "chief": True},
                                                 {"address": "10.123.0.9"}]})
        with pytest.raises(RuntimeError, match=rf"port {port} is held by process {holder.pid} "
                                               r"\(.*first_job.py --job first\): another job "
                                               r"runs on this "
                                               r"node"):
            runtime.start_tf_server(spec, runtime.NodeRole(address="localhost", is_chief=True,
                                                           task_index=0),
                                    tf.compat.v1.ConfigProto())
    finally:
        holder.kill()
        holder.wait()


SECOND_JOB = r"this process already joined a multi-node job \(as node 'localhost', the chief\)"


def test_an_autodist_made_after_a_cluster_job_is_refused(tmp_path, monkeypatch, spec_path):
    """A process runs one multi-node job (its TensorFlow server lives as long as it)."""
    monkeypatch.setattr(runtime, "_joined_as", runtime.NodeRole("localhost", True, 0))
    message = _refusal(_two_nodes(tmp_path), RuntimeError)
    assert "AutoDist: " + SECOND_JOB.replace("\\", "") in message
    assert "Start each multi-node job in a new process" in message
    AutoDist(spec_path, AllReduce())  # one node: no server, nothing to refuse


def test_an_autodist_made_before_a_cluster_job_is_refused_before_it_launches(tmp_path,
                                                                            monkeypatch):
    """Made before the first job started, the second is refused at its session, before it
    builds a strategy (a search would run trials) or launches a worker."""
    import tensorflow as tf
    from autodist.cluster import launcher

    class Builder(AllReduce):
        def build(self, *args):
            raise AssertionError("the second job built a strategy")

    def launch(*args, **kwargs):
        raise AssertionError("the second job launched a worker")

    monkeypatch.setattr(launcher, "launch", launch)
    ad = AutoDist(_two_nodes(tmp_path), Builder())
    monkeypatch.setattr(runtime, "_joined_as", runtime.NodeRole("localhost", True, 0))
    with tf.Graph().as_default(), ad.scope():
        w = tf.compat.v1.get_variable("w", [2], use_resource=True)
        tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(tf.reduce_sum(w * w))
        with pytest.raises(RuntimeError, match=SECOND_JOB):
            ad.create_distributed_session()
