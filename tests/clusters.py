"""Emulated clusters for the multi-node tests (root, network namespaces)."""
import os
import shutil
import subprocess

import pytest
import yaml

from autodist.cluster import emulate

needs_root = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None,
                                reason="emulated clusters need root and iproute2")


def emulated(tmp_path_factory, name: str, cpus: list):
    """Yields (cluster, spec path) of a 1 Gbit/s cluster with ``cpus[i]`` replicas on node i."""
    emulate.down(name)
    with emulate.emulated_cluster(len(cpus), "1gbit", name=name, cpus_per_node=cpus) as cluster:
        spec = tmp_path_factory.mktemp(name) / "spec.yml"
        spec.write_text(yaml.safe_dump(emulate.spec_dict(cluster)))
        yield cluster, str(spec)


def processes_running(script: str) -> list:
    """The ids of the processes whose command line contains ``script``."""
    return subprocess.run(["pgrep", "-f", script], capture_output=True, text=True).stdout.split()


def assert_no_process_left(script: str) -> None:
    left = processes_running(script)
    assert not left, f"job processes left behind: {left}"
