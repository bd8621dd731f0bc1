"""The ssh launch path end to end: a real sshd in an emulated host, a key made here.

The chief (in the first namespace) reaches the second node through ssh, as it
would a remote machine, with the spec's ``ssh:`` entry; the worker trains and
the job equals single-device training. A key the node does not accept is an
error naming the node and what ssh said, not a hang.
"""
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest
import yaml

import cluster_job
import clusters

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"
pytestmark = [pytest.mark.multinode, clusters.needs_root,
              pytest.mark.skipif(not os.path.exists(SSHD) or not shutil.which("ssh"),
                                 reason="needs openssh-server and openssh-client")]

JOB = os.path.join(os.path.dirname(__file__), "cluster_job.py")
PORT = 2222
STEPS = 3


def _keygen(path) -> None:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)


@pytest.fixture(scope="module")
def ssh_cluster(tmp_path_factory):
    """(cluster, directory with keys) with sshd listening on the second host."""
    directory = tmp_path_factory.mktemp("ssh")
    for name in ("host_key", "client_key", "other_key"):
        _keygen(directory / name)
    (directory / "authorized_keys").write_text((directory / "client_key.pub").read_text())
    os.chmod(directory / "authorized_keys", 0o600)
    os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege-separation directory
    # One pass: the cluster is removed when the loop resumes the generator.
    for cluster, _ in clusters.emulated(tmp_path_factory, "adssh", [1, 1]):
        config = directory / "sshd_config"
        config.write_text("\n".join([
            f"Port {PORT}", f"ListenAddress {cluster.hosts[1].address}",
            f"HostKey {directory / 'host_key'}",
            f"AuthorizedKeysFile {directory / 'authorized_keys'}",
            "PermitRootLogin prohibit-password", "PasswordAuthentication no",
            "KbdInteractiveAuthentication no", "UsePAM no", "StrictModes no",
            f"PidFile {directory / 'sshd.pid'}", ""]))
        sshd = subprocess.Popen(["ip", "netns", "exec", cluster.hosts[1].namespace, SSHD, "-D",
                                 "-e", "-f", str(config)], stderr=subprocess.PIPE, text=True)
        try:
            _wait_for_port(cluster.hosts[0].namespace, cluster.hosts[1].address, sshd)
            yield cluster, directory
        finally:
            sshd.terminate()
            sshd.wait(timeout=10)


def _wait_for_port(namespace: str, address: str, sshd) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        probe = subprocess.run(["ip", "netns", "exec", namespace, "bash", "-c",
                                f"exec 3<>/dev/tcp/{address}/{PORT}"], capture_output=True)
        if probe.returncode == 0:
            return
        assert sshd.poll() is None, sshd.stderr.read()
        time.sleep(0.2)
    raise AssertionError("sshd did not start listening")


def _spec(tmp_path, cluster, key) -> str:
    chief, worker = cluster.hosts
    spec = {"nodes": [{"address": chief.address, "chief": True, "cpus": [0],
                       "launch_prefix": ["ip", "netns", "exec", chief.namespace]},
                      {"address": worker.address, "cpus": [0], "ssh_config": "test"}],
            "ssh": {"test": {"username": "root", "key_file": str(key), "port": PORT,
                             # A non-interactive ssh session has a bare PATH.
                             "python_venv": f"export PATH={os.path.dirname(sys.executable)}:$PATH",
                             "shared_envs": {"PYTHONPATH": os.pathsep.join(sys.path)}}}}
    path = tmp_path / "spec.yml"
    path.write_text(yaml.safe_dump(spec))
    return str(path)


def _run(cluster, spec: str, out) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    return subprocess.run([*cluster.hosts[0].launch_prefix, sys.executable, JOB, spec, "AllReduce",
                           str(out), "--steps", str(STEPS)],
                          capture_output=True, text=True, timeout=180, env=env)


@pytest.mark.timeout(240)
def test_a_job_whose_worker_is_reached_over_ssh_trains_like_one_device(ssh_cluster, tmp_path):
    cluster, keys = ssh_cluster
    out = tmp_path / "variables.npz"
    done = _run(cluster, _spec(tmp_path, cluster, keys / "client_key"), out)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"node 1 step {STEPS - 1} loss" in done.stdout
    got = np.load(out)
    for i, expected in enumerate(cluster_job.reference(2, STEPS)):
        np.testing.assert_allclose(got[f"arr_{i}"], expected, rtol=1e-5, atol=1e-5)
    clusters.assert_no_process_left(JOB)


@pytest.mark.timeout(240)
def test_a_key_the_node_refuses_is_named(ssh_cluster, tmp_path):
    cluster, keys = ssh_cluster
    start = time.monotonic()
    done = _run(cluster, _spec(tmp_path, cluster, keys / "other_key"), tmp_path / "v.npz")
    assert done.returncode != 0
    assert time.monotonic() - start < 90
    error = done.stderr.strip().splitlines()[-1]  # the error, after its traceback
    assert error.startswith("autodist.cluster.service.WorkerFailedError: Worker node "
                            f"'{cluster.hosts[1].address}' failed"), done.stderr[-3000:]
    assert "ssh could not run its process" in error and "Permission denied (publickey)" in error
    clusters.assert_no_process_left(JOB)
